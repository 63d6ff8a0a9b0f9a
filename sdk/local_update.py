"""A device's contribution to a federated K-means round, computed from its :class:`sdk.EvalLog`.

Paper 002, "Federated hierarchical clustering" (ARCHITECTURE.md §4, §6). For the round's global
centroids ``c_1..c_K`` the device maps each logged query to its Voronoi cell and reports

- per (cell k, model m): the count ``n_k^m`` and the sums of score and cost
  (:class:`sdk.CellStatistics`), the sufficient statistics whose element-wise sum over devices is
  the statistics of the pooled logs;
- per cell k: the mean embedding of its queries and their number ``w_k`` (its *local centroid and
  weight*). The server's count-weighted mean of these is one exact Lloyd step of K-means over the
  pooled embeddings: the next round's centroids.

Privacy rule (ARCHITECTURE.md §6): no text and no per-query embedding leaves the device. Entries
with fewer than ``min_count`` samples are zeroed, and a cell's mean embedding is reported only if
at least ``max(min_count, 2)`` queries are averaged in it, so a single query's embedding is never
sent. Pure functions: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from sdk.cell_statistics import CellStatistics
from sdk.errors import ShapeError, SyncError
from sdk.eval_log import Evaluations
from sdk.voronoi import nearest_cell

#: Smallest number of queries a reported mean embedding averages (a mean of one is the embedding).
MIN_CENTROID_COUNT = 2


def centroids_hash(centroids: np.ndarray) -> str:
    """sha256 (hex) of the centroids as little-endian float32 with their shape: the identity of a
    cell partition. Updates are merged only with updates for the same partition."""
    c = np.ascontiguousarray(centroids, dtype="<f4")
    h = hashlib.sha256(f"{c.shape[0]}x{c.shape[1]}:".encode())
    h.update(c.tobytes())
    return h.hexdigest()


def centroid_threshold(min_count: int) -> int:
    """Queries a cell needs before its mean embedding is reported: ``max(min_count, 2)``."""
    return max(int(min_count), MIN_CENTROID_COUNT)


@dataclass(frozen=True)
class RoundSpec:
    """The open round as the server announces it (``GET /v1/rounds/current``).

    Attributes
    ----------
    round_id : int >= 1.
    kind : str, ``"kmeans"`` (the only kind a device computes without torch).
    centroids : ndarray of shape (n_cells, d_emb), float32, the global centroids.
    centroids_hash : str, :func:`centroids_hash` of ``centroids``.
    models : tuple of str, column order of the statistics.
    embedder_name : str; d_emb : int, the embedder the centroids live in.
    min_count : int >= 1, the privacy threshold of this round.
    deadline_utc : str, ISO-8601 UTC time at which the round closes.
    """

    round_id: int
    kind: str
    centroids: np.ndarray
    centroids_hash: str
    models: tuple[str, ...]
    embedder_name: str
    d_emb: int
    min_count: int
    deadline_utc: str

    @classmethod
    def from_json(cls, data: object) -> RoundSpec:
        """Parse the server's JSON answer.

        Raises
        ------
        SyncError
            A field is missing or has the wrong type or shape, or the centroids do not match
            their hash (a malformed or tampered answer).
        """
        try:
            if not isinstance(data, Mapping):
                raise TypeError("not a JSON object")
            centroids = np.asarray(data["centroids"], dtype=np.float64)
            spec = cls(
                round_id=_int(data["round_id"], 1),
                kind=str(data["kind"]),
                centroids=centroids.astype(np.float32),
                centroids_hash=str(data["centroids_hash"]),
                models=tuple(str(m) for m in data["models"]),
                embedder_name=str(data["embedder_name"]),
                d_emb=_int(data["d_emb"], 1),
                min_count=_int(data["min_count"], 1),
                deadline_utc=str(data["deadline_utc"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncError(f"malformed round description from the server: {exc!r}") from exc
        c = spec.centroids
        if c.ndim != 2 or c.shape[0] < 1 or c.shape[1] != spec.d_emb or not np.isfinite(c).all():
            raise SyncError(f"round {spec.round_id}: centroids of shape {c.shape} do not fit d_emb={spec.d_emb}")
        if centroids_hash(c) != spec.centroids_hash:
            raise SyncError(f"round {spec.round_id}: centroids do not match their hash")
        if not spec.models or len(set(spec.models)) != len(spec.models):
            raise SyncError(f"round {spec.round_id}: models must be distinct and non-empty, got {spec.models}")
        return spec


def _int(value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"expected an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class KMeansUpdate:
    """One device's statistics for one round.

    Attributes
    ----------
    statistics : CellStatistics of shape (n_cells, n_models), entries below ``min_count`` zeroed.
    centroid_cells : ndarray of shape (n_reported,), int64, cells whose mean embedding is reported.
    local_centroids : ndarray of shape (n_reported, d_emb), float64, mean embedding per reported cell.
    local_weights : ndarray of shape (n_reported,), float64, queries averaged per reported cell.
    log_size : int, evaluations summarised (logged rows with an embedding and a known model);
        ``statistics.count.sum() <= log_size``.
    """

    statistics: CellStatistics
    centroid_cells: np.ndarray
    local_centroids: np.ndarray
    local_weights: np.ndarray
    log_size: int

    def to_payload(self, client_id: str, spec: RoundSpec) -> dict:
        """The JSON body of ``POST /v1/rounds/{round_id}/updates`` (ARCHITECTURE.md §6).

        Holds aggregates only: counts and sums per (cell, model) and mean embeddings of cells with
        at least ``max(min_count, 2)`` queries. Floats are written exactly (JSON repr of float64).
        """
        return {
            "client_id": client_id,
            "round_id": spec.round_id,
            "kind": "kmeans",
            "centroids_hash": spec.centroids_hash,
            "models": list(spec.models),
            "log_size": int(self.log_size),
            "count": self.statistics.count.tolist(),
            "sum_accuracy": self.statistics.sum_accuracy.tolist(),
            "sum_cost": self.statistics.sum_cost.tolist(),
            "centroid_cells": self.centroid_cells.tolist(),
            "local_centroids": self.local_centroids.tolist(),
            "local_weights": self.local_weights.tolist(),
        }


def kmeans_update(evaluations: Evaluations, spec: RoundSpec) -> KMeansUpdate:
    """The device's :class:`KMeansUpdate` for ``spec`` from its logged evaluations.

    Rows without an embedding (NaN) or whose model is not in ``spec.models`` are skipped (they are
    not counted in ``log_size``).

    Parameters
    ----------
    evaluations : :class:`sdk.Evaluations` (``EvalLog.rows()``); embeddings ``(n, d_emb) float32``.
    spec : the round.

    Raises
    ------
    ShapeError
        The log's embeddings have another dimension than the round's centroids (the log was written
        with a different embedder).
    """
    emb = evaluations.embedding
    n = len(evaluations)
    if n and emb.shape[1] not in (0, spec.d_emb):
        raise ShapeError(
            f"the log's embeddings have dimension {emb.shape[1]}, round {spec.round_id} expects {spec.d_emb} "
            f"({spec.embedder_name})"
        )
    index = {m: i for i, m in enumerate(spec.models)}
    model_idx = np.array([index.get(m, -1) for m in evaluations.model], dtype=np.int64)
    has_emb = np.isfinite(emb).all(axis=1) if emb.shape[1] else np.zeros(n, dtype=bool)
    keep = has_emb & (model_idx >= 0)
    x = emb[keep].astype(np.float64)
    n_cells, n_models = spec.centroids.shape[0], len(spec.models)
    cells = nearest_cell(x, spec.centroids) if x.shape[0] else np.zeros(0, dtype=np.int64)
    stats = CellStatistics.from_samples(
        cells, model_idx[keep], evaluations.score[keep], evaluations.cost_usd[keep], n_cells, n_models
    )
    if spec.min_count > 1:
        stats = stats.suppress_below(spec.min_count)
    weights = np.bincount(cells, minlength=n_cells).astype(np.float64)
    sums = np.zeros((n_cells, spec.d_emb))
    np.add.at(sums, cells, x)
    reported = np.flatnonzero(weights >= centroid_threshold(spec.min_count))
    means = sums[reported] / weights[reported, None]
    return KMeansUpdate(stats, reported.astype(np.int64), means, weights[reported], int(keep.sum()))

