"""Validation of the arrays (float arrays, ``.npz`` bytes) that cross the SDK's public boundary."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from sdk.errors import ShapeError


def finite_rows(x: Any, width: int, name: str, rows: str = "n") -> npt.NDArray[np.float32]:
    """``x`` as a C-contiguous float32 array of shape (n >= 1, width), finite.

    Raises ShapeError (naming ``name``) for values that do not convert to float32 (ragged rows, strings,
    None, complex numbers), another shape, no rows, or a non-finite value.
    """
    try:
        if np.iscomplexobj(x):  # numpy would drop the imaginary part with a warning only (as real_array)
            raise TypeError("complex numbers")
        given = np.asarray(x)
        # numpy reads None as NaN and "1.5" as 1.5: neither is a feature value (strings: a CSV read as text?)
        if x is None or given.dtype.kind in "USV":
            raise TypeError("None" if x is None else f"text, dtype {given.dtype}")
        with np.errstate(over="ignore"):  # a float64 beyond float32 becomes inf: refused below as not finite
            out = np.ascontiguousarray(given, dtype=np.float32)
    except (TypeError, ValueError) as exc:  # ragged lists, strings, dicts, complex numbers, None
        raise ShapeError(f"{name} must be a ({rows}, {width}) array of real numbers, got {type(x).__name__} "
                         f"that does not convert to float32 ({exc})") from exc
    if given.ndim != 2 or out.shape[1] != width or len(out) == 0:  # given: ascontiguousarray makes a scalar (1,)
        raise ShapeError(f"{name} must have shape ({rows} >= 1, {width}), got {given.shape}")
    if not np.isfinite(out).all():
        raise ShapeError(f"{name} must be finite")
    return out


def real_array(x: Any, name: str) -> npt.NDArray[np.float64]:
    """``x`` as a float64 array of any shape (NaN and inf kept); ShapeError naming ``name`` when it
    does not convert (ragged rows, non-numeric strings, complex numbers)."""
    try:
        if np.iscomplexobj(x):  # numpy would drop the imaginary part of a complex array with a warning only
            raise TypeError("complex numbers")
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ShapeError(f"{name} must be an array of real numbers, got {type(x).__name__} values that do not "
                         f"convert to float64 ({exc})") from exc


#: First bytes of a zip archive (non-empty or empty): how ``np.load`` tells an ``.npz`` from other bytes.
NPZ_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")


def is_npz(data: bytes) -> bool:
    """True when ``np.load`` would open ``data`` as an ``.npz`` archive (it may still be corrupt)."""
    return bytes(data[:4]) in NPZ_MAGIC
