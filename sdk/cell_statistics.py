"""Per-(Voronoi cell, model) statistics of sparse evaluations, their merge and their means.

Paper 002, "Federated hierarchical clustering": each client maps its samples to the nearest global
centroid and reports, per (cell k, model m), the count ``n`` and the sums of accuracy and cost; the
server merges with count weights::

    A_k^m = sum_i n_ik^m abar_ik^m / sum_i n_ik^m        C_k^m likewise

Sums (not means) travel, so the merge is an exact element-wise addition and the merged statistics
equal those of the pooled data. :meth:`CellStatistics.means` adds optional empirical-Bayes shrinkage
of each cell mean toward the model's mean over all cells (``prior_strength`` pseudo-observations):
with ~200 observations per model spread over K cells, raw cell means are noisy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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
        On construction, if shapes differ or are not 2-D, values are not finite, counts are negative,
        ``sum_accuracy`` is outside ``[0, count]`` or ``sum_cost`` is negative.
    """

    count: np.ndarray
    sum_accuracy: np.ndarray
    sum_cost: np.ndarray

    def __post_init__(self) -> None:
        arrays = {}
        for name in ("count", "sum_accuracy", "sum_cost"):
            arr = np.asarray(getattr(self, name), dtype=np.float64)
            if arr.ndim != 2:
                raise ShapeError(f"{name} must have shape (n_cells, n_models), got {arr.shape}")
            if not np.isfinite(arr).all():
                raise ShapeError(f"{name} must be finite")
            arrays[name] = arr
            object.__setattr__(self, name, arr)
        shapes = {name: a.shape for name, a in arrays.items()}
        if len(set(shapes.values())) != 1:
            raise ShapeError(f"count, sum_accuracy and sum_cost must have one shape, got {shapes}")
        tol = 1e-9 * np.maximum(1.0, arrays["count"])
        if (arrays["count"] < 0).any():
            raise ShapeError("count must be >= 0")
        if (arrays["sum_accuracy"] < -tol).any() or (arrays["sum_accuracy"] > arrays["count"] + tol).any():
            raise ShapeError("sum_accuracy must lie in [0, count] (accuracy in [0, 1])")
        if (arrays["sum_cost"] < 0).any():
            raise ShapeError("sum_cost must be >= 0 (USD)")

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

    def model_means(self, prior_strength: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Mean accuracy and mean cost (USD) per model over all cells.

        With ``prior_strength = kappa0 > 0`` the accuracy mean is shrunk toward the count-weighted
        mean accuracy of all models: ``(S^m + kappa0 * Abar) / (n^m + kappa0)``, so that a model
        seen a few times cannot outrank a well-measured one by luck. Costs are never shrunk across
        models (their prices differ by orders of magnitude).

        Returns
        -------
        (accuracy, cost) : ndarrays of shape (n_models,), float64; NaN for a model never observed.
        """
        kappa0 = _check_strength(prior_strength)
        n = self.count.sum(axis=0)
        s_acc = self.sum_accuracy.sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            grand = s_acc.sum() / n.sum() if n.sum() > 0 else 0.0
            acc = (s_acc + kappa0 * grand) / (n + kappa0)
            cost = self.sum_cost.sum(axis=0) / n
        acc[n == 0] = np.nan
        return acc, cost

    def additive_effects(self) -> tuple[np.ndarray, np.ndarray]:
        """Two-way additive fit ``abar_k^m ~ a^m + b_k`` by count-weighted least squares.

        Minimises ``sum_km n_k^m (abar_k^m - a^m - b_k)^2`` exactly (a least-squares solve over the
        observed (cell, model) entries). The model effect ``a^m`` is compared *within* cells, so it is
        not confounded by which cells a model happened to be logged in (in sparse logs a model's
        plain mean mixes its quality with its clients' task mix); the cell effect ``b_k`` is the
        cell's difficulty for all models, centred so that ``sum_k n_k b_k = 0`` (``a^m`` is then the
        model's accuracy on an average cell).

        Returns
        -------
        (a, b) : ndarrays of shape (n_models,) and (n_cells,), float64; ``a`` is NaN for a model
        never observed, ``b`` is 0 for an empty cell.
        """
        k_idx, m_idx = np.nonzero(self.count > 0)
        a = np.full(self.n_models, np.nan)
        b = np.zeros(self.n_cells)
        if k_idx.size == 0:
            return a, b
        n = self.count[k_idx, m_idx]
        mean = self.sum_accuracy[k_idx, m_idx] / n
        design = np.zeros((k_idx.size, self.n_models + self.n_cells))
        design[np.arange(k_idx.size), m_idx] = 1.0
        design[np.arange(k_idx.size), self.n_models + k_idx] = 1.0
        w = np.sqrt(n)
        coef, *_ = np.linalg.lstsq(design * w[:, None], mean * w, rcond=None)
        a_fit, b_fit = coef[: self.n_models], coef[self.n_models :]
        n_k = self.count.sum(axis=1)
        shift = float(n_k @ b_fit / n_k.sum())
        seen_m = self.count.sum(axis=0) > 0
        a[seen_m] = a_fit[seen_m] + shift
        b = np.where(n_k > 0, b_fit - shift, 0.0)
        return a, b

    def means(
        self, prior_strength: float = 0.0, model_prior_strength: float = 0.0, prior: str = "additive"
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per-(cell, model) mean accuracy and cost, shrunk toward a prior (empirical Bayes).

        ``A_k^m = (S_k^m + kappa * P_k^m) / (n_k^m + kappa)`` with ``kappa = prior_strength``.
        The prior ``P`` is, for ``prior="model"``, the model's mean over all cells and, for
        ``prior="additive"``, ``clip(a^m + b_k, 0, 1)`` from :meth:`additive_effects`. The model
        part is itself shrunk toward the all-model mean with ``model_prior_strength`` pseudo-counts.
        Costs shrink toward the model's mean cost (never across models). ``kappa = 0`` gives the
        plain merged means of paper 002 (NaN in empty cells).

        Returns
        -------
        (accuracy, cost) : ndarrays of shape (n_cells, n_models), float64, cost in USD; NaN where
        the model was never observed at all (or, with ``kappa = 0``, in the cell).

        Raises
        ------
        ShapeError
            A prior strength is negative or not finite, or ``prior`` is unknown.
        """
        kappa = _check_strength(prior_strength)
        kappa0 = _check_strength(model_prior_strength)
        model_acc, cost_prior = self.model_means(0.0)
        n_m = self.count.sum(axis=0)
        if prior == "model":
            effect, cell = model_acc, np.zeros(self.n_cells)
        elif prior == "additive":
            effect, cell = self.additive_effects()
        else:
            raise ShapeError(f"prior must be 'model' or 'additive', got {prior!r}")
        grand = self.sum_accuracy.sum() / n_m.sum() if n_m.sum() > 0 else 0.0
        with np.errstate(invalid="ignore", divide="ignore"):
            effect = (n_m * effect + kappa0 * grand) / (n_m + kappa0)
            acc_prior = np.clip(effect[None, :] + cell[:, None], 0.0, 1.0)
            denom = self.count + kappa
            acc = (self.sum_accuracy + kappa * acc_prior) / denom
            cost = (self.sum_cost + kappa * cost_prior[None, :]) / denom
        unseen = n_m == 0
        acc[:, unseen] = np.nan
        cost[:, unseen] = np.nan
        if kappa == 0.0:
            empty = self.count == 0
            acc[empty] = np.nan
            cost[empty] = np.nan
        return acc, cost


def _check_strength(value: float) -> float:
    kappa = float(value)
    if not np.isfinite(kappa) or kappa < 0:
        raise ShapeError(f"prior strengths must be finite and >= 0, got {value!r}")
    return kappa
