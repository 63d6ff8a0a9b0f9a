"""Non-parametric K-means router and its federated protocol (paper 002, "Federated hierarchical
clustering"; ARCHITECTURE.md §4).

Inference: nearest global centroid (Voronoi cell), then the per-(cell, model) table of mean accuracy
and mean cost. Federated training, no gradients:

1. *Centroid rounds*: each participating client runs Lloyd on its embeddings and uploads
   ``K_local`` centroids with their weights (cluster sizes); the server keeps each client's latest
   upload and runs weighted K-means over all of them to ``K_global`` centroids, then broadcasts.
2. *Statistics rounds*: each participating client maps its samples to the nearest global centroid
   and uploads per-(cell, model) counts and sums of accuracy and cost; the server keeps each
   client's latest upload and merges them with count weights (:meth:`sdk.CellStatistics.merge`).

Clients that miss a round are not lost: their latest upload stays in use. With every client's
statistics in, the merged table equals the table of the pooled data for the same centroids.
Cell means are shrunk toward each model's overall mean (``prior_strength`` pseudo-observations).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from sdk.atomic_write import write_atomic
from sdk.cell_statistics import CellStatistics
from sdk.errors import InvalidInputError
from sdk.voronoi import nearest_cell
from trainer.config_fields import check_int, check_real
from trainer.data.client_data import ClientData
from trainer.routers.base import Router, read_meta
from trainer.routers.shrinkage import priced_model_costs, shrunk_means

KMEANS_FILE = "kmeans.npz"


@dataclass
class KMeansRouterConfig:
    """Settings of the K-means router and its federated protocol.

    n_clusters : K_global, cells of the global router.
    n_local_clusters : K_local, centroids each client uploads.
    prior_strength : kappa >= 0, pseudo-observations of the model mean in each cell mean.
    model_prior_strength : kappa0 >= 0, pseudo-observations of the all-model mean accuracy in each
        model mean (see :func:`trainer.routers.shrinkage.model_means`).
    prior : what the cell means shrink toward (:func:`trainer.routers.shrinkage.shrunk_means`).
    centroid_rounds, statistics_rounds : rounds of each phase.
    participation : share of clients taking part in a round, in (0, 1].
    min_count : (cell, model) entries with fewer samples are not reported by a client (privacy).
    """

    n_clusters: int = 6
    n_local_clusters: int = 8
    prior_strength: float = 16.0
    model_prior_strength: float = 10.0
    prior: Literal["model", "additive"] = "additive"
    centroid_rounds: int = 3
    statistics_rounds: int = 5
    participation: float = 0.6
    min_count: int = 1

    def __post_init__(self) -> None:
        for name in ("n_clusters", "n_local_clusters", "min_count", "centroid_rounds", "statistics_rounds"):
            check_int(self, name, 1)
        check_real(self, "prior_strength", 0)
        check_real(self, "model_prior_strength", 0)
        check_real(self, "participation", 0, 1, low_open=True)
        if self.prior not in ("model", "additive"):  # trainer.routers.shrinkage.shrunk_means's priors
            raise InvalidInputError(f"KMeansRouterConfig.prior must be 'model' or 'additive', got {self.prior!r}")


class KMeansRouter(Router):
    """Voronoi cells + per-(cell, model) statistics.

    Attributes
    ----------
    centroids_ : ndarray of shape (n_cells, d_emb), float32.
    statistics_ : CellStatistics of shape (n_cells, n_models).
    accuracy_, cost_ : ndarray of shape (n_cells, n_models), float64, the shrunk cell means
        (cost in USD); NaN for a model with no observation at all (and no price prior).
    price_prior_ : ndarray of shape (n_models,), float64, USD per query: the price of a model added
        with ``fedroute add-model`` (its prior, see :func:`trainer.routers.shrinkage.shrunk_means`),
        NaN for the others.

    Raises
    ------
    InvalidInputError
        Centroids that are not a (n_cells >= 1, d_emb) array or hold NaN or inf (the message names
        the first such cell), or statistics of another shape than centroids x models.
    """

    kind = "kmeans"

    def __init__(
        self,
        centroids: np.ndarray,
        statistics: CellStatistics,
        models: Sequence[str],
        prior_strength: float,
        model_prior_strength: float = 0.0,
        prior: str = "additive",
        price_prior: np.ndarray | None = None,
    ) -> None:
        centroids = np.asarray(centroids, dtype=np.float32)
        if centroids.ndim != 2 or centroids.shape[0] < 1:
            raise InvalidInputError(f"centroids must have shape (n_cells >= 1, d_emb), got {centroids.shape}")
        bad = np.flatnonzero(~np.isfinite(centroids).all(axis=1))
        if bad.size:  # a corrupt kmeans.npz: every query would fail later, far from the file
            raise InvalidInputError(f"centroids: cell {int(bad[0])} holds NaN or inf ({bad.size} of {centroids.shape[0]} cells)")
        if statistics.n_cells != centroids.shape[0] or statistics.n_models != len(models):
            raise InvalidInputError(
                f"statistics shape {statistics.count.shape} does not match "
                f"{centroids.shape[0]} centroids x {len(models)} models"
            )
        self.centroids_ = centroids
        self.statistics_ = statistics
        self.models = tuple(models)
        self.d_emb = int(centroids.shape[1])
        self.prior_strength = float(prior_strength)
        self.model_prior_strength = float(model_prior_strength)
        self.prior = prior
        self.price_prior_ = (np.full(len(self.models), np.nan) if price_prior is None
                             else np.asarray(price_prior, dtype=np.float64).reshape(len(self.models)))
        self.accuracy_, self.cost_ = shrunk_means(statistics, self.prior_strength, self.model_prior_strength, self.prior,
                                                  self.price_prior_ if np.isfinite(self.price_prior_).any() else None)

    def model_costs(self) -> np.ndarray:
        """Mean cost per model, USD per query, (n_models,) float64 (a price prior shrunk toward the
        observations for an added model, see :func:`trainer.routers.shrinkage.priced_model_costs`);
        NaN for a model never observed and without a price."""
        return priced_model_costs(self.statistics_, self.price_prior_, self.model_prior_strength)

    def _predict(self, embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cells = nearest_cell(embeddings, self.centroids_)
        return self.accuracy_[cells], self.cost_[cells]

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        np.savez(
            buf,
            centroids=self.centroids_,
            count=self.statistics_.count,
            sum_accuracy=self.statistics_.sum_accuracy,
            sum_cost=self.statistics_.sum_cost,
            accuracy=self.accuracy_,
            cost=self.cost_,
        )
        write_atomic(directory / KMEANS_FILE, buf.getvalue())
        self._write_meta(directory, {
            "prior_strength": self.prior_strength,
            "model_prior_strength": self.model_prior_strength,
            "prior": self.prior,
            "n_cells": int(self.centroids_.shape[0]),
            **({"price_prior_usd": [float(p) if np.isfinite(p) else None for p in self.price_prior_]}
               if np.isfinite(self.price_prior_).any() else {}),
        })

    @classmethod
    def load(cls, directory: Path) -> KMeansRouter:
        meta = read_meta(directory)
        with np.load(Path(directory) / KMEANS_FILE) as z:
            stats = CellStatistics(z["count"], z["sum_accuracy"], z["sum_cost"])
            price = meta.get("price_prior_usd")
            return cls(z["centroids"], stats, meta["models"], meta["prior_strength"],
                       meta["model_prior_strength"], meta["prior"],
                       None if price is None else np.array([np.nan if p is None else p for p in price], dtype=np.float64))


def lloyd(
    embeddings: np.ndarray, n_clusters: int, seed: int, sample_weight: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(Weighted) Lloyd's K-means with k-means++ init (scikit-learn).

    Parameters
    ----------
    embeddings : ndarray of shape (n_samples, d_emb), float.
    n_clusters : int; reduced to the number of distinct points if there are fewer.
    seed : int, random state.
    sample_weight : ndarray of shape (n_samples,), float >= 0, or None.

    Returns
    -------
    (centroids, weights) : ndarrays of shape (k, d_emb) float32 and (k,) float64, the weight of a
    centroid being the (weighted) number of samples in its cell.
    """
    from sklearn.cluster import KMeans  # trainer extra (scikit-learn), imported on use

    x = np.asarray(embeddings, dtype=np.float64)
    w = np.ones(x.shape[0]) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
    k = int(min(n_clusters, np.unique(x, axis=0).shape[0]))
    km = KMeans(n_clusters=k, n_init=3, random_state=seed).fit(x, sample_weight=w)
    weights = np.bincount(km.labels_, weights=w, minlength=k)
    return km.cluster_centers_.astype(np.float32), weights


def client_statistics(data: ClientData, centroids: np.ndarray, n_models: int, min_count: int = 1) -> CellStatistics:
    """A client's per-(cell, model) statistics for the broadcast centroids (entries with
    fewer than ``min_count`` samples are not reported)."""
    cells = nearest_cell(data.embeddings, centroids)
    stats = CellStatistics.from_samples(cells, data.model, data.accuracy, data.cost, centroids.shape[0], n_models)
    return stats.suppress_below(min_count) if min_count > 1 else stats


def fit_kmeans_router(data: ClientData, models: Sequence[str], config: KMeansRouterConfig, seed: int) -> KMeansRouter:
    """One party's router on its own data: the local setting (one client) or the centralised one
    (all clients' logs pooled)."""
    centroids, _ = lloyd(data.embeddings, config.n_clusters, seed)
    stats = client_statistics(data, centroids, len(models))
    return KMeansRouter(centroids, stats, models, config.prior_strength, config.model_prior_strength,
                        config.prior)


def federated_centroids(embeddings: Sequence[np.ndarray], config: KMeansRouterConfig,
                        rng: np.random.Generator) -> np.ndarray:
    """Phase 1 of the protocol (module docstring): ``K_global`` centroids from the clients' local
    Lloyd centroids, no labels needed. ``embeddings`` : one (n_i, d_emb) array per client (clients
    with none never upload). Returns ndarray of shape (K_global, d_emb), float32."""
    active = [i for i, e in enumerate(embeddings) if e.shape[0] > 0]
    n_part = max(1, int(round(config.participation * len(active))))
    latest_centroids: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for _ in range(config.centroid_rounds):
        for i in rng.choice(active, size=n_part, replace=False):
            latest_centroids[int(i)] = lloyd(embeddings[i], config.n_local_clusters, int(rng.integers(2**31)))
    local_c = np.concatenate([c for c, _ in latest_centroids.values()])
    local_w = np.concatenate([w for _, w in latest_centroids.values()])
    return lloyd(local_c, config.n_clusters, int(rng.integers(2**31)), sample_weight=local_w)[0]


def fit_federated_kmeans_router(
    clients: Sequence[ClientData],
    models: Sequence[str],
    config: KMeansRouterConfig,
    rng: np.random.Generator,
) -> KMeansRouter:
    """Federated K-means router over the clients' logs (protocol in the module docstring).

    Clients without samples never upload. Randomness (participation, Lloyd seeds) comes from ``rng``.
    """
    active = [i for i, c in enumerate(clients) if c.n_samples > 0]
    if not active:
        raise InvalidInputError("no client holds any sample")
    n_part = max(1, int(round(config.participation * len(active))))
    global_centroids = federated_centroids([c.embeddings for c in clients], config, rng)

    latest_stats: dict[int, CellStatistics] = {}
    for _ in range(config.statistics_rounds):
        for i in rng.choice(active, size=n_part, replace=False):
            latest_stats[int(i)] = client_statistics(clients[i], global_centroids, len(models), config.min_count)
    merged = CellStatistics.merge(list(latest_stats.values()))
    return KMeansRouter(global_centroids, merged, models, config.prior_strength, config.model_prior_strength,
                        config.prior)




__all__ = [
    "KMeansRouter",
    "KMeansRouterConfig",
    "client_statistics",
    "federated_centroids",
    "fit_federated_kmeans_router",
    "fit_kmeans_router",
    "lloyd",
]
