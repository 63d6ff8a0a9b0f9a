"""Per-(Voronoi cell, model) statistics of sparse evaluations, their merge and their means.

Paper 002, "Federated hierarchical clustering": each client maps its samples to the nearest global
centroid and reports, per (cell k, model m), the count ``n`` and the sums of accuracy and cost; the
server merges with count weights::

    A_k^m = sum_i n_ik^m abar_ik^m / sum_i n_ik^m        C_k^m likewise

Sums (not means) travel, so the merge is an exact element-wise addition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sdk.arrays import real_array
from sdk.errors import ShapeError


_Floats = npt.NDArray[np.float64]


def _problem(name: str, arr: _Floats, count: _Floats | None) -> str | None:
    """What is wrong with the field ``name`` of :class:`CellStatistics` (``count`` checked before it), or None."""
    if arr.ndim != 2 or (count is not None and arr.shape != count.shape):
        return f"must have shape {'(n_cells, n_models)' if count is None else f'{count.shape}, the shape of count'}" \
               f", got {arr.shape}"
    # A min and a max find NaN (it propagates into both) and infinity, and give the range.
    low, high = (float(arr.min()), float(arr.max())) if arr.size else (0.0, 0.0)
    if not (math.isfinite(low) and math.isfinite(high)):
        return "must be finite"
    if count is not None and name == "sum_accuracy":
        tol = 1e-9 * np.maximum(1.0, count)
        if (low < 0 and (arr < -tol).any()) or (high > 0 and (arr > count).any() and (arr > count + tol).any()):
            return "must lie in [0, count] (accuracy in [0, 1])"
    elif low < 0:
        return "must be >= 0" + (" (USD)" if name == "sum_cost" else "")
    return None


@dataclass(frozen=True)
class CellStatistics:
    """Sufficient statistics of sparse evaluations per (cell, model).

    ``count`` (>= 0; float so that noised counts fit), ``sum_accuracy`` (in [0, count], relative tolerance
    1e-9) and ``sum_cost`` (USD, >= 0): finite float64 arrays of one shape (n_cells, n_models).
    Raises ShapeError on construction otherwise; the message starts with the field (``count: must be >= 0``).
    """

    count: _Floats
    sum_accuracy: _Floats
    sum_cost: _Floats

    def __post_init__(self) -> None:
        count = None
        for name in ("count", "sum_accuracy", "sum_cost"):
            arr = real_array(getattr(self, name), name)
            problem = _problem(name, arr, count)
            if problem:
                raise ShapeError(f"{name}: {problem}")
            object.__setattr__(self, name, arr)
            count = arr if count is None else count

    @property
    def n_cells(self) -> int:
        return int(self.count.shape[0])

    @property
    def n_models(self) -> int:
        return int(self.count.shape[1])

    @classmethod
    def zeros(cls, n_cells: int, n_models: int) -> CellStatistics:
        """Empty statistics of shape (n_cells, n_models)."""
        z = np.zeros((n_cells, n_models))
        return cls(z, z.copy(), z.copy())

    @classmethod
    def from_samples(cls, cells: npt.ArrayLike, models: npt.ArrayLike, accuracy: npt.ArrayLike,
                     cost: npt.ArrayLike, n_cells: int, n_models: int) -> CellStatistics:
        """Statistics of one log: ``cells`` (n,) int in ``[0, n_cells)``, ``models`` (n,) int in
        ``[0, n_models)``, observed ``accuracy`` (n,) in [0, 1] and ``cost`` (n,) USD >= 0.
        Raises ShapeError when lengths differ or an index is out of range."""
        c, m = np.asarray(cells, dtype=np.int64), np.asarray(models, dtype=np.int64)
        a, usd = np.asarray(accuracy, dtype=np.float64), np.asarray(cost, dtype=np.float64)
        n = c.shape[0]
        if any(x.shape != (n,) for x in (m, a, usd)) or (n and not (0 <= c.min() <= c.max() < n_cells
                                                                   and 0 <= m.min() <= m.max() < n_models)):
            raise ShapeError(f"cells, models, accuracy and cost must be 1-D of one length with cell indices in "
                             f"[0, {n_cells}) and model indices in [0, {n_models}), got shapes {c.shape}, "
                             f"{m.shape}, {a.shape}, {usd.shape}")
        flat, size = c * n_models + m, n_cells * n_models
        return cls(*(np.bincount(flat, weights=w, minlength=size).astype(np.float64).reshape(n_cells, n_models)
                     for w in (None, a, usd)))

    @staticmethod
    def merge(parts: Sequence[CellStatistics]) -> CellStatistics:
        """Count-weighted merge (paper 002): element-wise sum of counts and sums. ShapeError when
        ``parts`` is empty or shapes differ."""
        if not parts or any(p.count.shape != parts[0].count.shape for p in parts):
            raise ShapeError(f"merge needs CellStatistics of one shape, got {[p.count.shape for p in parts]}")
        return CellStatistics(*(sum((getattr(p, f) for p in parts[1:]), getattr(parts[0], f))
                                for f in ("count", "sum_accuracy", "sum_cost")))

    def suppress_below(self, min_count: float) -> CellStatistics:
        """Statistics with every (cell, model) entry of count < ``min_count`` zeroed (privacy rule)."""
        keep = self.count >= min_count
        return CellStatistics(self.count * keep, self.sum_accuracy * keep, self.sum_cost * keep)
