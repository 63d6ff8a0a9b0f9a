"""A device's contribution to a federated K-means round, computed from its :class:`sdk.EvalLog`.

Paper 002, "Federated hierarchical clustering" (ARCHITECTURE.md §4, §6). For the round's global
centroids ``c_1..c_K`` the device maps each logged query to its Voronoi cell and reports

- per (cell k, model m): the count ``n_k^m`` and the sums of score and cost
  (:class:`sdk.CellStatistics`), the sufficient statistics whose element-wise sum over devices is
  the statistics of the pooled logs;
- per cell k: the mean embedding of its queries and their number ``w_k`` (its *local centroid and
  weight*). The server's count-weighted mean of these is one exact Lloyd step of K-means over the
  pooled embeddings: the next round's centroids.

Privacy rule (ARCHITECTURE.md §6): no text and no per-query embedding leaves the device.

*One upload* (:func:`kmeans_update`). Entries with fewer than ``min_count`` samples are zeroed, and
a cell's mean embedding is reported only if it averages at least ``max(min_count, 2)`` *distinct*
embeddings (bitwise-distinct float32 vectors), so neither a single query nor one prompt logged many
times is sent as its own embedding.

*Two uploads* (:func:`hold_small_changes`). A device that syncs again after logging one more query
would otherwise let the server subtract its two uploads: a cell weight going ``n -> n + 1`` gives
``(n + 1) mu_2 - n mu_1``, the new query's embedding, and an entry's count going ``30 -> 31`` gives
its score and cost. Before each upload the device therefore compares its update with the last one
it *sent* for the same centroids (``sdk.SyncClient`` keeps it in its state file) and keeps the sent
values of every entry whose count changed by fewer than ``min_count`` samples, and the sent mean and
weight of every cell whose weight, or whose number of distinct embeddings, changed by fewer than
``max(min_count, 2)``.

What this guarantees, for one ``min_count``, one set of centroids and a log that only grows (no
retention deleting rows), as long as the device's sync state is kept: any two uploads of the
device, consecutive or not, never differ in a (cell, model) entry by fewer than ``min_count``
samples, nor in a cell mean by fewer than ``max(min_count, 2)`` queries (of which at least that
many are new distinct embeddings). The difference of two uploads is then itself an aggregate that
one upload would be allowed to carry.

What it does not guarantee:

- aggregates of at least ``min_count`` samples are still aggregates of *this* device's queries: the
  rule bounds how few samples an answer summarises, it is not differential privacy (the server's
  ``--noise-multiplier`` protects the published router, not the upload against the operator);
- a cell mean over several distinct embeddings, one of them repeated many times, lies close to
  that embedding (duplicates are weighted by their number, as the Lloyd step needs); near-duplicate
  embeddings count as distinct;
- ``log_size`` is sent as it is (it says how many queries were logged, not what they were);
- rows removed by the log's retention: a net change of ``min_count`` samples may combine removed
  and added rows, and the guarantee between non-consecutive uploads needs counts that only grow;
- a change of ``min_count`` (the server's or the device's floor) between uploads: held values are
  suppressed again under the new threshold, and the bound is the smaller of the two thresholds;
- uploads for different centroids (another partition) are not compared;
- a lost or deleted sync state: the next upload is compared with nothing on the device; the server,
  which keeps every upload, enforces the rule across such a reset (``check_difference``, 422) and
  refuses the device's uploads until every changed entry has moved by at least the threshold
  (``sdk.protocol.STATE_LOSS_ADVICE``).

Pure functions: no I/O, no clock.
"""

from __future__ import annotations

import numpy as np

from sdk.cell_statistics import CellStatistics
from sdk.errors import InvalidInputError, ShapeError
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
    """The device's :class:`KMeansUpdate` for ``spec`` from its logged evaluations.

    Rows without an embedding (NaN) or whose model is not in ``spec.models`` are skipped (they are
    not counted in ``log_size``). A log with no usable row (empty, or only ``cell=`` rows) gives an
    update with every count zero and no cell mean (:meth:`KMeansUpdate.is_empty`).

    Each cost is clipped to ``spec.max_cost_usd`` when the round sets that bound (the server refuses
    an entry whose mean cost is above it; clipping each record is what its DP sensitivity assumes).
    Entries of fewer than ``spec.min_count`` samples are zeroed; a cell's mean embedding is
    reported only if the cell holds at least ``max(spec.min_count, 2)`` distinct embeddings (its
    weight counts every query, duplicates included).

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


def _distinct_per_cell(x: np.ndarray, cells: np.ndarray, n_cells: int) -> np.ndarray:
    """Bitwise-distinct rows of ``x`` (n, d) float32 per cell, (n_cells,) int64. Does not validate."""
    if x.shape[0] == 0:
        return np.zeros(n_cells, dtype=np.int64)
    rows = np.ascontiguousarray(x + np.float32(0.0))  # -0.0 -> 0.0: equal values, equal bytes
    keys = rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1])))[:, 0]
    _, first = np.unique(keys, return_index=True)  # a distinct embedding lies in one cell
    return np.bincount(cells[first], minlength=n_cells).astype(np.int64)


def hold_small_changes(new: KMeansUpdate, sent: KMeansUpdate | None, min_count: int) -> KMeansUpdate:
    """``new`` with every change smaller than the privacy threshold replaced by what was ``sent``. Pure.

    Compares the device's fresh update with the last one it sent for the same centroids and models
    (see the module docstring for what this guarantees and what it does not):

    - a (cell, model) entry whose count changed by fewer than ``min_count`` (including not at all)
      keeps its sent count, score sum and cost sum;
    - a cell whose weight, or whose number of distinct embeddings, changed by fewer than
      ``t = max(min_count, 2)`` keeps its sent mean, weight and distinct count (a cell sent before
      and absent now changed by its whole weight, >= t, and is dropped);
    - then entries below ``min_count`` are zeroed and only cells of weight and distinct count
      ``>= t`` are reported (a held value sent under a lower threshold is not re-sent);
    - ``log_size`` is ``max(new.log_size, counts sum, weights sum)`` (the server refuses counts above it).

    An unknown distinct count (``local_distinct is None``) is taken as the cell's weight.

    Parameters
    ----------
    new : the update of the log now (:func:`kmeans_update`).
    sent : the update sent last for the same centroids and models, or None (nothing sent: ``new``
        is returned as it is).
    min_count : int >= 1, the privacy threshold of this upload.

    Raises
    ------
    ShapeError
        ``new`` and ``sent`` have statistics of different shapes or mean embeddings of different
        dimensions.
    InvalidInputError
        ``min_count`` is not an int >= 1.
    """
    if isinstance(min_count, bool) or not isinstance(min_count, (int, np.integer)) or min_count < 1:
        raise InvalidInputError(f"min_count must be an int >= 1, got {min_count!r}")
    if sent is None:
        return new
    s, p = new.statistics, sent.statistics
    if s.count.shape != p.count.shape:
        raise ShapeError(f"statistics of shape {s.count.shape} cannot be compared with the sent {p.count.shape}")
    d_emb = new.local_centroids.shape[1]
    if sent.local_centroids.shape[1] != d_emb:
        raise ShapeError(f"mean embeddings of dimension {d_emb} cannot be compared with the sent "
                         f"{sent.local_centroids.shape[1]}")
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


def _dense_cells(u: KMeansUpdate, n_cells: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weights (n_cells,), distinct (n_cells,), means (n_cells, d)) with zeros for unreported cells.

    Raises ShapeError for reported cells out of range (a damaged sent update)."""
    cells = np.asarray(u.centroid_cells, dtype=np.int64)
    if cells.size and (cells.min() < 0 or cells.max() >= n_cells or np.unique(cells).size != cells.size):
        raise ShapeError(f"centroid_cells must be distinct and lie in [0, {n_cells}), got {cells.tolist()}")
    weights, distinct = np.zeros(n_cells), np.zeros(n_cells)
    means = np.zeros((n_cells, u.local_centroids.shape[1]))
    weights[cells] = u.local_weights
    distinct[cells] = u.local_weights if u.local_distinct is None else u.local_distinct
    means[cells] = u.local_centroids
    return weights, distinct, means
