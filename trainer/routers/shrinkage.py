"""Empirical-Bayes shrinkage of per-(cell, model) means: what the K-means router ships (trainer only).

The device reads the shrunk means from ``kmeans.npz``; it never computes them. Functions of
:class:`sdk.CellStatistics` (the merged sums of paper 002's federated K-means): with ~200
observations per model spread over K cells, raw cell means are noisy, so each cell mean is shrunk
toward a prior with ``prior_strength`` pseudo-observations (``prior_strength = 0``: the plain
merged means of paper 002).
"""

from __future__ import annotations

import numpy as np

from sdk.cell_statistics import CellStatistics
from sdk.errors import InvalidInputError


def model_means(stats: CellStatistics, prior_strength: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
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
    n = stats.count.sum(axis=0)
    s_acc = stats.sum_accuracy.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        grand = s_acc.sum() / n.sum() if n.sum() > 0 else 0.0
        acc = (s_acc + kappa0 * grand) / (n + kappa0)
        cost = stats.sum_cost.sum(axis=0) / n
    acc[n == 0] = np.nan
    return acc, cost


def shrink_toward(total: np.ndarray, count: np.ndarray, prior: np.ndarray, strength: float) -> np.ndarray:
    """``(total + strength * prior) / (count + strength)``: a mean of ``count`` observations summing
    to ``total``, shrunk toward ``prior`` with ``strength`` pseudo-observations (the empirical-Bayes
    form every mean of this module uses). Where ``count + strength == 0`` (no data, no prior weight)
    the result is ``prior`` itself (the limit of a prior with no data). Arrays broadcast; float64."""
    kappa = _check_strength(strength)
    total, count, prior = (np.asarray(a, dtype=np.float64) for a in (total, count, prior))
    denom = count + kappa
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (total + kappa * prior) / denom
    return np.where(denom > 0, out, prior)


def priced_model_costs(stats: CellStatistics, price_prior: np.ndarray | None, prior_strength: float) -> np.ndarray:
    """Mean cost (USD per query) per model; for a model with a price prior (a model added to the pool
    with ``fedroute add-model``, ARCHITECTURE.md §4 "Model pool changes") the mean is shrunk toward its
    price: ``(S_cost^m + kappa0 * price^m) / (n^m + kappa0)``, so it is the price with no observation
    and tends to the observed mean as observations arrive (:func:`shrink_toward`).

    Parameters
    ----------
    stats : CellStatistics of shape (n_cells, n_models).
    price_prior : ndarray of shape (n_models,), USD per query, NaN for a model without one; or None.
    prior_strength : kappa0 >= 0.

    Returns
    -------
    ndarray of shape (n_models,), float64, USD; NaN for a model never observed and without a price.
    """
    _, cost = model_means(stats, 0.0)
    if price_prior is None:
        return cost
    price = np.asarray(price_prior, dtype=np.float64)
    priced = np.isfinite(price)
    shrunk = shrink_toward(stats.sum_cost.sum(axis=0), stats.count.sum(axis=0), np.where(priced, price, 0.0),
                           prior_strength)
    return np.where(priced, shrunk, cost)


def additive_effects(stats: CellStatistics) -> tuple[np.ndarray, np.ndarray]:
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
    k_idx, m_idx = np.nonzero(stats.count > 0)
    a = np.full(stats.n_models, np.nan)
    b = np.zeros(stats.n_cells)
    if k_idx.size == 0:
        return a, b
    n = stats.count[k_idx, m_idx]
    mean = stats.sum_accuracy[k_idx, m_idx] / n
    design = np.zeros((k_idx.size, stats.n_models + stats.n_cells))
    design[np.arange(k_idx.size), m_idx] = 1.0
    design[np.arange(k_idx.size), stats.n_models + k_idx] = 1.0
    w = np.sqrt(n)
    coef, *_ = np.linalg.lstsq(design * w[:, None], mean * w, rcond=None)
    a_fit, b_fit = coef[: stats.n_models], coef[stats.n_models :]
    n_k = stats.count.sum(axis=1)
    shift = float(n_k @ b_fit / n_k.sum())
    seen_m = stats.count.sum(axis=0) > 0
    a[seen_m] = a_fit[seen_m] + shift
    b = np.where(n_k > 0, b_fit - shift, 0.0)
    return a, b

def _added_model_effects(stats: CellStatistics, priced: np.ndarray, effect_pool: np.ndarray,
                         cell: np.ndarray) -> np.ndarray:
    """Model effects (n_models,): the pool's ``effect_pool`` (from :func:`additive_effects` on the
    pool's columns) and, for each priced (added) model, the least-squares effect with the pool's
    cell effects ``cell`` held fixed: ``sum_k (S_k^m - n_k^m b_k) / n^m`` (NaN without observations)."""
    effect = np.full(stats.n_models, np.nan)
    effect[~priced] = effect_pool
    n = stats.count[:, priced].sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        added = (stats.sum_accuracy[:, priced] - stats.count[:, priced] * cell[:, None]).sum(axis=0) / n
    effect[priced] = np.where(n > 0, added, np.nan)
    return effect


def shrunk_means(
    stats: CellStatistics, prior_strength: float = 0.0, model_prior_strength: float = 0.0, prior: str = "additive",
    price_prior: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-(cell, model) mean accuracy and cost, shrunk toward a prior (empirical Bayes).

    ``A_k^m = (S_k^m + kappa * P_k^m) / (n_k^m + kappa)`` with ``kappa = prior_strength``.
    The prior ``P`` is, for ``prior="model"``, the model's mean over all cells, for
    ``prior="additive"``, ``clip(a^m + b_k, 0, 1)`` from :func:`additive_effects`. The model
    part is itself shrunk toward the all-model mean with ``model_prior_strength`` pseudo-counts.
    Costs shrink toward the model's mean cost (never across models). ``kappa = 0`` gives the
    plain merged means of paper 002 (NaN in empty cells).

    ``price_prior`` (shape (n_models,), USD per query, NaN = none) marks models added to the pool
    (``fedroute add-model``; ARCHITECTURE.md §4 "Model pool changes"): such a model is never
    "unseen", its model cost is :func:`priced_model_costs` (its price shrunk toward its observed
    mean) and, with no observation, its model accuracy is the all-model mean (the limit of the
    ``model_prior_strength`` shrinkage above with ``n^m = 0``). The all-model mean and the cell
    effects ``b_k`` come from the other (pool) models only, and an added model's effect is its
    count-weighted mean of ``abar_k^m - b_k``; so the pool's columns are exactly what they were
    without the added model.

    Returns
    -------
    (accuracy, cost) : ndarrays of shape (n_cells, n_models), float64, cost in USD; NaN where
    the model was never observed at all (or, with ``kappa = 0``, in the cell).

    Raises
    ------
    InvalidInputError
        A prior strength is negative or not finite, or ``prior`` is unknown.
    """
    kappa = _check_strength(prior_strength)
    kappa0 = _check_strength(model_prior_strength)
    model_acc, cost_prior = model_means(stats, 0.0)
    n_m = stats.count.sum(axis=0)
    priced = np.zeros(stats.n_models, dtype=bool) if price_prior is None else np.isfinite(price_prior)
    if priced.any():
        cost_prior = priced_model_costs(stats, price_prior, kappa0)
    # The pool's own columns fix the all-model mean and the cell effects; added (priced) models
    # are fitted against them, so adding a model leaves the pool's columns unchanged.
    pool = stats if not priced.any() else CellStatistics(
        stats.count[:, ~priced], stats.sum_accuracy[:, ~priced], stats.sum_cost[:, ~priced])
    n_pool = pool.count.sum()
    grand = pool.sum_accuracy.sum() / n_pool if n_pool > 0 else 0.0
    if prior == "model":
        effect, cell = model_acc, np.zeros(stats.n_cells)
    elif prior == "additive":
        effect, cell = additive_effects(pool)
        if priced.any():
            effect = _added_model_effects(stats, priced, effect, cell)
    else:
        raise InvalidInputError(f"prior must be 'model' or 'additive', got {prior!r}")
    with np.errstate(invalid="ignore", divide="ignore"):
        effect = (n_m * effect + kappa0 * grand) / (n_m + kappa0)
        if priced.any():  # a priced model never observed: the all-model mean (limit n^m = 0)
            effect = np.where(priced & (n_m == 0), grand, effect)
        acc_prior = np.clip(effect[None, :] + cell[:, None], 0.0, 1.0)
        denom = stats.count + kappa
        acc = (stats.sum_accuracy + kappa * acc_prior) / denom
        cost = (stats.sum_cost + kappa * cost_prior[None, :]) / denom
    unseen = (n_m == 0) & ~priced
    acc[:, unseen] = np.nan
    cost[:, unseen] = np.nan
    if kappa == 0.0:
        empty = stats.count == 0
        acc[empty] = np.nan
        cost[empty] = np.nan
    return acc, cost


def _check_strength(value: float) -> float:
    kappa = float(value)
    if not np.isfinite(kappa) or kappa < 0:
        raise InvalidInputError(f"prior strengths must be finite and >= 0, got {value!r}")
    return kappa
