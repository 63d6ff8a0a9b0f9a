"""Validation of the arrays (float arrays, ``.npz`` bytes) that cross the SDK's public boundary."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from sdk.errors import ShapeError


def _converted(x: Any, dtype: type[np.floating[Any]], text: bool) -> tuple[npt.NDArray[Any] | None, Any, str]:
    """(``x`` as ``dtype`` or None, ``np.asarray(x)``, why it does not convert); ``text``: numeric strings allowed."""
    given: Any = None
    try:
        if np.iscomplexobj(x):  # numpy would drop the imaginary part with a warning only
            return None, None, "complex numbers"
        given = np.asarray(x)
        # numpy reads None as NaN and "1.5" as 1.5: neither is a feature value (strings: a CSV read as text?)
        if not text and (x is None or given.dtype.kind in "USV"):
            return None, given, "None" if x is None else f"text, dtype {given.dtype}"
        with np.errstate(over="ignore"):  # a float64 beyond float32 becomes inf (not finite)
            return np.asarray(given, dtype=dtype), given, ""
    except (TypeError, ValueError) as exc:  # ragged lists, strings, dicts, None
        return None, given, str(exc)


def finite_rows(x: Any, width: int, name: str, rows: str = "n") -> npt.NDArray[np.float32]:
    """``x`` as a C-contiguous float32 array of shape (n >= 1, width), finite.

    Raises ShapeError (naming ``name``) for values that do not convert to float32 (ragged rows, strings,
    None, complex numbers), another shape, no rows, or a non-finite value.
    """
    out, given, why = _converted(x, np.float32, text=False)
    problem = (f"must be a ({rows}, {width}) array of real numbers, got {type(x).__name__} that does not convert "
               f"to float32 ({why})" if out is None
               else f"must have shape ({rows} >= 1, {width}), got {given.shape}"
               if out.ndim != 2 or out.shape[1] != width or len(out) == 0
               else "must be finite" if not np.isfinite(out).all() else None)
    if problem or out is None:
        raise ShapeError(f"{name} {problem}")
    return np.ascontiguousarray(out)


def real_array(x: Any, name: str) -> npt.NDArray[np.float64]:
    """``x`` as a float64 array of any shape (NaN and inf kept); ShapeError naming ``name`` when it
    does not convert (ragged rows, non-numeric strings, complex numbers)."""
    out, _, why = _converted(x, np.float64, text=True)
    if out is None:
        raise ShapeError(f"{name} must be an array of real numbers, got {type(x).__name__} values that do not "
                         f"convert to float64 ({why})")
    return out


#: First bytes of a zip archive (non-empty or empty): how ``np.load`` tells an ``.npz`` from other bytes.
NPZ_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")


def is_npz(data: bytes) -> bool:
    """True when ``np.load`` would open ``data`` as an ``.npz`` archive (it may still be corrupt)."""
    return bytes(data[:4]) in NPZ_MAGIC
