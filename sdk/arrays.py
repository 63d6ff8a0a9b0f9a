"""Validation of the 2-D float arrays that cross the SDK's public boundary."""

from __future__ import annotations

import numpy as np

from sdk.errors import ShapeError


def finite_rows(x: object, width: int, name: str, rows: str = "n") -> np.ndarray:
    """``x`` as a C-contiguous float32 array of shape (n >= 1, width).

    Raises
    ------
    ShapeError
        Another shape, no rows, or a non-finite value (the message names ``name``).
    """
    out = np.ascontiguousarray(x, dtype=np.float32)
    if out.ndim != 2 or out.shape[1] != width or len(out) == 0:
        raise ShapeError(f"{name} must have shape ({rows} >= 1, {width}), got {out.shape}")
    if not np.isfinite(out).all():
        raise ShapeError(f"{name} must be finite")
    return out
