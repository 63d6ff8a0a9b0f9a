"""Per-(Voronoi cell, model) statistics of sparse evaluations, their merge and their means.

Paper 002, "Federated hierarchical clustering": each client maps its samples to the nearest global
centroid and reports, per (cell k, model m), the count ``n`` and the sums of accuracy and cost; the
server merges with count weights::

    A_k^m = sum_i n_ik^m abar_ik^m / sum_i n_ik^m        C_k^m likewise

Sums (not means) travel, so the merge is an exact element-wise addition and the merged statistics
equal those of the pooled data. The shrunk cell means the K-means router ships are computed by the
trainer (:mod:`trainer.routers.shrinkage`); the device only reads them from the bundle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sdk.arrays import real_array
from sdk.errors import ShapeError


@dataclass(frozen=True)
class CellStatistics:
    """Sufficient statistics of sparse evaluations per (cell, model).

    Attributes
    ----------
    count : ndarray of shape (n_cells, n_models), float64, >= 0 (float so that noised counts fit).
    sum_accuracy : ndarray of shape (n_cells, n_models), float64, in [0, count].
    sum_cost : ndarray of shape (n_cells, n_models), float64, USD, >= 0.

    Raises
    ------
    ShapeError
        On construction, if values are not real numbers (strings, complex...), shapes differ or are not
        2-D, values are not finite, counts are negative,
        ``sum_accuracy`` is outside ``[0, count]`` (relative tolerance 1e-9) or ``sum_cost`` is
        negative; the message starts with the offending field's name (``count: must be >= 0``).
    """

    count: np.ndarray
    sum_accuracy: np.ndarray
    sum_cost: np.ndarray

    def __post_init__(self) -> None:
        # Each array in turn; a min and a max find NaN (it propagates into both) and infinity, and
        # give the range; the tolerant comparison of the scores runs only where the range needs it.
        count = None
        for name in ("count", "sum_accuracy", "sum_cost"):
            arr = real_array(getattr(self, name), name)
            if arr.ndim != 2 or (count is not None and arr.shape != count.shape):
                want = "(n_cells, n_models)" if count is None else f"{count.shape}, the shape of count"
                raise ShapeError(f"{name}: must have shape {want}, got {arr.shape}")
            low, high = (float(arr.min()), float(arr.max())) if arr.size else (0.0, 0.0)
            if not (math.isfinite(low) and math.isfinite(high)):
                raise ShapeError(f"{name}: must be finite")
            if name == "sum_accuracy":
                tol = 1e-9 * np.maximum(1.0, count)
                if (low < 0 and (arr < -tol).any()) or (high > 0 and (arr > count).any() and (arr > count + tol).any()):
                    raise ShapeError("sum_accuracy: must lie in [0, count] (accuracy in [0, 1])")
            elif low < 0:
                raise ShapeError(f"{name}: must be >= 0" + (" (USD)" if name == "sum_cost" else ""))
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
    def from_samples(
        cls,
        cells: np.ndarray,
        models: np.ndarray,
        accuracy: np.ndarray,
        cost: np.ndarray,
        n_cells: int,
        n_models: int,
    ) -> CellStatistics:
        """Statistics of one log of sparse evaluations.

        Parameters
        ----------
        cells : ndarray of shape (n_samples,), int, cell of each sample in ``[0, n_cells)``.
        models : ndarray of shape (n_samples,), int, the one model each sample was sent to.
        accuracy : ndarray of shape (n_samples,), float, observed score in [0, 1].
        cost : ndarray of shape (n_samples,), float, observed cost in USD, >= 0.
        n_cells, n_models : int, table size.

        Raises
        ------
        ShapeError
            Lengths differ, or an index is out of range.
        """
        cells = np.asarray(cells, dtype=np.int64)
        models = np.asarray(models, dtype=np.int64)
        accuracy = np.asarray(accuracy, dtype=np.float64)
        cost = np.asarray(cost, dtype=np.float64)
        n = cells.shape[0]
        if any(a.shape != (n,) for a in (models, accuracy, cost)):
            raise ShapeError(
                "cells, models, accuracy and cost must be 1-D of one length, got "
                f"{cells.shape}, {models.shape}, {accuracy.shape}, {cost.shape}"
            )
        if n and (cells.min() < 0 or cells.max() >= n_cells):
            raise ShapeError(f"cell indices must lie in [0, {n_cells}), got [{cells.min()}, {cells.max()}]")
        if n and (models.min() < 0 or models.max() >= n_models):
            raise ShapeError(f"model indices must lie in [0, {n_models}), got [{models.min()}, {models.max()}]")
        flat = cells * n_models + models
        size = n_cells * n_models
        count = np.bincount(flat, minlength=size).astype(np.float64).reshape(n_cells, n_models)
        sum_acc = np.bincount(flat, weights=accuracy, minlength=size).reshape(n_cells, n_models)
        sum_cost = np.bincount(flat, weights=cost, minlength=size).reshape(n_cells, n_models)
        return cls(count, sum_acc, sum_cost)

    @staticmethod
    def merge(parts: Sequence[CellStatistics]) -> CellStatistics:
        """Count-weighted merge (paper 002): element-wise sum of counts and sums. Pure.

        Raises
        ------
        ShapeError
            ``parts`` is empty or shapes differ.
        """
        if not parts:
            raise ShapeError("merge needs at least one CellStatistics, got 0")
        shape = parts[0].count.shape
        for i, p in enumerate(parts):
            if p.count.shape != shape:
                raise ShapeError(f"part {i} has shape {p.count.shape}, expected {shape}")
        return CellStatistics(
            sum(p.count for p in parts),
            sum(p.sum_accuracy for p in parts),
            sum(p.sum_cost for p in parts),
        )

    def suppress_below(self, min_count: float) -> CellStatistics:
        """Statistics with every (cell, model) entry of count < ``min_count`` zeroed (privacy rule)."""
        keep = self.count >= min_count
        return CellStatistics(self.count * keep, self.sum_accuracy * keep, self.sum_cost * keep)
