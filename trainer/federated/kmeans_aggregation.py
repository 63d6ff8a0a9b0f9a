"""Server-side aggregation of federated K-means updates: merge, Lloyd step, robustness, privacy.

Pure functions (no I/O, no clock; randomness only from a passed ``numpy.random.Generator``), used
unchanged by the built-in HTTPS server (:mod:`trainer.server`) and the Flower strategy
(:mod:`trainer.federated.flower_app`).

Design notes: docs/privacy-and-dp.md (Module notes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from sdk.cell_statistics import CellStatistics
from sdk.errors import InvalidInputError
from sdk.local_update import KMeansUpdate
from trainer.config_fields import check_real
from trainer.federated.gaussian_privacy import gaussian_epsilon

#: L2 sensitivity of one client's clipped, rescaled contribution (five parts of norm <= 1 each).
SENSITIVITY_SQRT = math.sqrt(5.0)


@dataclass(frozen=True)
class AggregationConfig:
    """Robustness and privacy options of the K-means aggregation.

    clip_count : C, the most queries one client may weigh (None: no clipping).
    max_cost_usd : c_max, bound on the cost of one query in USD, used with clipping of cost sums
        (None: cost sums are clipped only through C).
    trim_fraction : beta in [0, 0.5), share of clients trimmed at each end per entry.
    noise_multiplier : z >= 0; Gaussian noise of std ``z * sqrt(5) * C`` (needs clip_count and
        max_cost_usd, and no trimming). 0 disables noise.
    delta : the delta of the (epsilon, delta) guarantee, in (0, 1).

    Raises
    ------
    InvalidInputError
        Values out of range, or noise without clip_count and max_cost_usd.
    """

    clip_count: float | None = None
    max_cost_usd: float | None = None
    trim_fraction: float = 0.0
    noise_multiplier: float = 0.0
    delta: float = 1e-5

    def __post_init__(self) -> None:
        check_real(self, "clip_count", 0, low_open=True, optional=True)
        check_real(self, "max_cost_usd", 0, low_open=True, optional=True)  # USD per query
        check_real(self, "trim_fraction", 0, 0.5, high_open=True)
        check_real(self, "noise_multiplier", 0)
        check_real(self, "delta", 0, 1, low_open=True, high_open=True)
        if self.noise_multiplier > 0 and (self.clip_count is None or self.max_cost_usd is None):
            raise InvalidInputError("Gaussian noise needs clip_count and max_cost_usd (they bound the sensitivity)")
        if self.noise_multiplier > 0 and self.trim_fraction > 0:
            raise InvalidInputError("Gaussian noise needs trim_fraction=0: trimming lets one client change which "
                                    "others are kept, beyond the sensitivity bound")


@dataclass(frozen=True)
class KMeansAggregate:
    """Result of one aggregation.

    statistics : CellStatistics of shape (n_cells, n_models), the merged (clipped, trimmed, noised)
        statistics for the round's centroids.
    next_centroids : ndarray of shape (n_cells, d_emb), float32, after one Lloyd step.
    cell_weights : ndarray of shape (n_cells,), float64, queries behind each next centroid (noised
        when noise is on).
    clients : tuple of str, the client ids aggregated (sorted).
    epsilon : float, epsilon of this one aggregate at ``config.delta`` (inf without noise).
    """

    statistics: CellStatistics
    next_centroids: np.ndarray
    cell_weights: np.ndarray
    clients: tuple[str, ...]
    epsilon: float


def clip_update(update: KMeansUpdate, clip_count: float | None, max_cost_usd: float | None) -> KMeansUpdate:
    """``update`` scaled by ``s = min(1, C / max(N, W), C * c_max / S)`` (design notes). Pure."""
    if clip_count is None:
        return update
    s = update.statistics
    total = max(float(s.count.sum()), float(update.local_weights.sum()))
    scale = 1.0 if total <= clip_count else clip_count / total
    if max_cost_usd is not None:
        cost = float(s.sum_cost.sum())
        if cost * scale > clip_count * max_cost_usd:
            scale = clip_count * max_cost_usd / cost
    if scale >= 1.0:
        return update
    return replace(
        update,
        statistics=CellStatistics(s.count * scale, s.sum_accuracy * scale, s.sum_cost * scale),
        local_weights=update.local_weights * scale,
    )


def trimmed_merge(parts: list[CellStatistics], trim_fraction: float) -> CellStatistics:
    """Merge with, per (cell, model), the ``floor(beta * n)`` lowest- and highest-mean clients
    dropped (``n`` = clients with a positive count there). ``beta = 0`` is the plain merge.

    Raises
    ------
    ShapeError
        No parts, or shapes differ.
    """
    merged = CellStatistics.merge(parts)
    if trim_fraction <= 0 or len(parts) < 3:
        return merged
    count = np.stack([p.count for p in parts])  # (n_clients, K, M)
    acc = np.stack([p.sum_accuracy for p in parts])
    cost = np.stack([p.sum_cost for p in parts])
    present = count > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(present, acc / count, np.nan)
    n_present = present.sum(axis=0)
    n_trim = np.floor(trim_fraction * n_present).astype(np.int64)
    # Rank of each client's mean within its entry; NaN (absent) sorts last and is never kept twice.
    order = np.argsort(np.where(present, mean, np.inf), axis=0, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(len(parts))[:, None, None] * np.ones_like(order), axis=0)
    keep = present & (rank >= n_trim[None]) & (rank < (n_present - n_trim)[None])
    return CellStatistics((count * keep).sum(0), (acc * keep).sum(0), (cost * keep).sum(0))


def lloyd_step(
    centroids: np.ndarray, updates: list[KMeansUpdate]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sums behind one Lloyd step over the clients' reported cell means.

    Returns
    -------
    (weights, sums, next_centroids) : ndarrays of shape (n_cells,), (n_cells, d_emb) float64 and
    (n_cells, d_emb) float32; a cell with no reported weight keeps its centroid.
    Inputs validated by the caller (:func:`trainer.federated.update_checks.check_kmeans_update`).
    """
    c = np.asarray(centroids, dtype=np.float64)
    weights = np.zeros(c.shape[0])
    sums = np.zeros_like(c)
    for u in updates:
        cells = np.asarray(u.centroid_cells, dtype=np.int64)
        np.add.at(weights, cells, u.local_weights)
        np.add.at(sums, cells, u.local_centroids * u.local_weights[:, None])
    return weights, sums, _centroids_from_sums(c, weights, sums, noisy=False)


def _centroids_from_sums(c: np.ndarray, weights: np.ndarray, sums: np.ndarray, noisy: bool = True) -> np.ndarray:
    # Under noise a tiny or negative weight would blow the mean up: such a cell (weight < 1) keeps its
    # centroid. Without noise any positive weight is exact (a convex combination of local centroids):
    # count clipping can scale a cell's weight below 1, and that cell must still move (noisy=False).
    ok = weights >= 1.0 if noisy else weights > 0.0
    out = c.copy()
    out[ok] = sums[ok] / weights[ok, None]
    return out.astype(np.float32)


def aggregate_kmeans(
    centroids: np.ndarray,
    updates: Mapping[str, KMeansUpdate],
    config: AggregationConfig,
    rng: np.random.Generator,
) -> KMeansAggregate:
    """Aggregate the clients' latest updates for one cell partition (design notes).

    Parameters
    ----------
    centroids : ndarray of shape (n_cells, d_emb), the partition the updates were computed for.
    updates : client id -> :class:`sdk.local_update.KMeansUpdate`, at least one, each checked against
        ``centroids`` by :func:`trainer.federated.update_checks.check_kmeans_update`.
    config : robustness and privacy options.
    rng : source of the Gaussian noise (unused without noise).
    """
    ids = tuple(sorted(updates))
    clipped = [clip_update(updates[i], config.clip_count, config.max_cost_usd) for i in ids]
    stats = trimmed_merge([u.statistics for u in clipped], config.trim_fraction)
    weights, sums, next_centroids = lloyd_step(centroids, clipped)
    epsilon = math.inf
    if config.noise_multiplier > 0:
        sigma = config.noise_multiplier * SENSITIVITY_SQRT * float(config.clip_count)
        count = np.maximum(stats.count + rng.normal(0.0, sigma, stats.count.shape), 0.0)
        acc = np.clip(stats.sum_accuracy + rng.normal(0.0, sigma, stats.count.shape), 0.0, count)
        cost = np.maximum(stats.sum_cost + rng.normal(0.0, sigma * config.max_cost_usd, stats.count.shape), 0.0)
        stats = CellStatistics(count, acc, cost)
        weights = weights + rng.normal(0.0, sigma, weights.shape)
        sums = sums + rng.normal(0.0, sigma, sums.shape)
        next_centroids = _centroids_from_sums(np.asarray(centroids, dtype=np.float64), weights, sums)
        weights = np.maximum(weights, 0.0)
        epsilon = gaussian_epsilon(config.noise_multiplier, config.delta)
    return KMeansAggregate(stats, next_centroids, weights, ids, epsilon)


__all__ = [
    "AggregationConfig",
    "KMeansAggregate",
    "aggregate_kmeans",
    "clip_update",
    "gaussian_epsilon",
    "lloyd_step",
    "trimmed_merge",
]
