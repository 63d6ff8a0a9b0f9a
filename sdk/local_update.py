"""A device's contribution to a federated K-means round, computed from its :class:`sdk.EvalLog`.

Paper 002, "Federated hierarchical clustering" (ARCHITECTURE.md §4, §6): for the round's centroids
the device reports, per (cell, model), the count and the sums of score and cost
(:class:`sdk.CellStatistics`), and per cell the mean embedding of its queries and their number (one
exact Lloyd step once the server takes the count-weighted mean). Entries under ``min_count`` samples
are zeroed, a cell mean needs ``max(min_count, 2)`` distinct embeddings (:func:`kmeans_update`), and
changes since the last sent update smaller than that are held back (:func:`hold_small_changes`), so
two uploads cannot be subtracted. What this guarantees and what not: docs/privacy-and-dp.md.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from sdk.cell_statistics import CellStatistics
from sdk.errors import ShapeError
from sdk.eval_log import Evaluations
from sdk.protocol import KMeansUpdate, RoundSpec, centroids_hash
from sdk.voronoi import nearest_cell

__all__ = ["KMeansUpdate", "RoundSpec", "centroid_threshold", "centroids_hash", "hold_small_changes", "kmeans_update"]

#: Smallest number of queries a reported mean embedding averages (a mean of one is the embedding).
MIN_CENTROID_COUNT = 2


def centroid_threshold(min_count: int) -> int:
    """Queries a cell needs before its mean embedding is reported: ``max(min_count, 2)``."""
    return max(int(min_count), MIN_CENTROID_COUNT)


def kmeans_update(evaluations: Evaluations, spec: RoundSpec) -> KMeansUpdate:
    """The device's :class:`KMeansUpdate` for ``spec`` from ``evaluations`` (``EvalLog.rows()``).

    Rows without an embedding or of a model not in ``spec.models`` are skipped (not in ``log_size``).
    Costs are clipped to ``spec.max_cost_usd`` if set; entries under ``spec.min_count`` are zeroed; a
    cell mean is reported when the cell holds ``max(spec.min_count, 2)`` distinct embeddings (its weight
    counts duplicates too). ShapeError when the log's embedding dimension is not the round's.
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
    x32 = emb[keep].reshape(-1, spec.d_emb)  # (0, 0) when the log never stored an embedding
    x = x32.astype(np.float64)
    n_cells, n_models = spec.centroids.shape[0], len(spec.models)
    cells = nearest_cell(x, spec.centroids) if x.shape[0] else np.zeros(0, dtype=np.int64)
    cost = evaluations.cost_usd[keep]
    if spec.max_cost_usd is not None:  # the round's bound on one query's cost: each cost clipped to it
        cost = np.minimum(cost, spec.max_cost_usd)
    stats = CellStatistics.from_samples(cells, model_idx[keep], evaluations.score[keep], cost, n_cells, n_models)
    if spec.min_count > 1:
        stats = stats.suppress_below(spec.min_count)
    weights = np.bincount(cells, minlength=n_cells).astype(np.float64)
    distinct = _distinct_per_cell(x32, cells, n_cells)
    sums = np.zeros((n_cells, spec.d_emb))
    np.add.at(sums, cells, x)
    reported = np.flatnonzero(distinct >= centroid_threshold(spec.min_count))
    means = sums[reported] / weights[reported, None]
    return KMeansUpdate(stats, reported.astype(np.int64), means, weights[reported], int(keep.sum()),
                        distinct[reported])


def _distinct_per_cell(x: npt.NDArray[np.float32], cells: npt.NDArray[np.int64], n_cells: int) -> npt.NDArray[np.int64]:
    """Bitwise-distinct rows of ``x`` (n, d) per cell, (n_cells,)."""
    if x.shape[0] == 0:
        return np.zeros(n_cells, dtype=np.int64)
    rows = np.ascontiguousarray(x + np.float32(0.0))  # -0.0 -> 0.0: equal values, equal bytes
    keys = rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1])))[:, 0]
    _, first = np.unique(keys, return_index=True)  # a distinct embedding lies in one cell
    return np.bincount(cells[first], minlength=n_cells).astype(np.int64)


def hold_small_changes(new: KMeansUpdate, sent: KMeansUpdate | None, min_count: int) -> KMeansUpdate:
    """``new`` with every change smaller than the privacy threshold replaced by what was ``sent`` (the
    last update sent for the same centroids and models, of the same shapes; None: ``new`` as it is).

    An entry whose count changed by fewer than ``min_count`` (>= 1) keeps its sent count and sums; a
    cell whose weight or distinct count changed by fewer than ``t = max(min_count, 2)`` keeps its sent
    mean, weight and distinct count (an unknown distinct count is the weight). Then entries under
    ``min_count`` are zeroed, only cells with weight and distinct count ``>= t`` are reported, and
    ``log_size`` is at least the counts' and the weights' sums.
    """
    if sent is None:
        return new
    s, p = new.statistics, sent.statistics
    hold = np.abs(s.count - p.count) < min_count
    count = np.where(hold, p.count, s.count)
    keep = count >= min_count
    stats = CellStatistics(count * keep, np.where(hold, p.sum_accuracy, s.sum_accuracy) * keep,
                           np.where(hold, p.sum_cost, s.sum_cost) * keep)

    t = centroid_threshold(min_count)
    (nw, nd, nm), (pw, pd, pm) = _dense_cells(new, s.n_cells), _dense_cells(sent, s.n_cells)
    hold_cell = (np.abs(nw - pw) < t) | (np.abs(nd - pd) < t)
    w, dist = np.where(hold_cell, pw, nw), np.where(hold_cell, pd, nd)
    means = np.where(hold_cell[:, None], pm, nm)
    reported = np.flatnonzero((w >= t) & (dist >= t))
    log_size = max(int(new.log_size), int(np.ceil(stats.count.sum())), int(np.ceil(w[reported].sum())))
    return KMeansUpdate(stats, reported.astype(np.int64), means[reported], w[reported], log_size,
                        dist[reported].astype(np.int64))


_Dense = tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]


def _dense_cells(u: KMeansUpdate, n_cells: int) -> _Dense:
    """(weights (n_cells,), distinct (n_cells,), means (n_cells, d)), zeros for unreported cells."""
    cells = np.asarray(u.centroid_cells, dtype=np.int64)
    weights, distinct = np.zeros(n_cells), np.zeros(n_cells)
    means = np.zeros((n_cells, u.local_centroids.shape[1]))
    weights[cells] = u.local_weights
    distinct[cells] = u.local_weights if u.local_distinct is None else u.local_distinct
    means[cells] = u.local_centroids
    return weights, distinct, means
