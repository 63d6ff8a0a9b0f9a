"""Checks of one device's update against the round it answers (ARCHITECTURE.md §6).

Each check is one function, used by both transports: the built-in HTTPS server
(:mod:`trainer.server.validation`, which answers 422 with the message) and the Flower strategies
(which drop the reply and list it in ``rejected_``): K-means updates (:func:`check_kmeans_update`,
:mod:`trainer.federated.flower_app`) and the privacy threshold on the samples behind a parameter
update (:func:`check_sample_count`: MLP uploads on the server, :mod:`trainer.rewards.flower_router`
and, per expert, :mod:`trainer.experts.flower_strategy` on Flower). Pure.
"""

from __future__ import annotations

import numpy as np

from sdk.errors import InvalidInputError, PrivacyError, ShapeError
from sdk.eval_log import MAX_COST_PER_QUERY_USD
from sdk.local_update import KMeansUpdate, centroid_threshold
from sdk.protocol import DIFFERENCE_REFUSAL_PHRASE

#: Relative slack of the cost bound (:func:`cost_limit`): a device sums its clipped costs in float64,
#: and n costs each equal to the bound can sum above ``n * bound`` by rounding (10 queries clipped to
#: 0.03 USD sum to 0.03 * 10 + 5.6e-17), which an exact comparison refused.
COST_BOUND_RTOL = 1e-9

#: The privacy threshold of a round when its operator sets none (samples): ``fedroute server rounds open
#: --min-count`` (trainer/server/cli.py), the Flower strategies' ``min_count``
#: (:class:`trainer.rewards.flower_router.RouterFedAvg`, :class:`trainer.experts.flower_strategy.FedPrismStrategy`,
#: :class:`trainer.federated.flower_app.FederatedKMeansStrategy`), and the devices' ``min_count_floor``
#: (sdk/sync.py, also 5).
DEFAULT_MIN_COUNT = 5

#: The key of the privacy threshold in a Flower round's train config, sent by every Flower strategy.
MIN_COUNT_KEY = "min-count"


def round_min_count(config) -> int:
    """The privacy threshold a Flower node applies: the round config's ``min-count`` (int >= 1), or
    :data:`DEFAULT_MIN_COUNT` when the strategy sent none (e.g. a plain Flower FedAvg server).

    Raises
    ------
    InvalidInputError
        ``min-count`` is not an int >= 1.
    """
    min_count = config[MIN_COUNT_KEY] if MIN_COUNT_KEY in config else DEFAULT_MIN_COUNT
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
        raise InvalidInputError(f"round config {MIN_COUNT_KEY} must be an int >= 1, got {min_count!r}")
    return min_count


def check_sample_count(n_samples: float, min_count: int, log_size: float | None = None) -> None:
    """Refuse a parameter update trained on fewer than ``min_count`` samples (the privacy threshold:
    an update over a handful of evaluations reveals them; docs/protocol.md, ARCHITECTURE.md §6), or on
    more than ``log_size`` (the evaluations the device holds) when given. The HTTPS server's check of
    an MLP upload's ``n_samples`` (:func:`trainer.server.validation.validate_mlp_update`, 422) and the
    Flower router strategy's check of a reply's ``num-examples`` (dropped). Pure.

    Parameters
    ----------
    n_samples : int or float, samples (evaluations, or preference pairs) the update was trained on.
    min_count : int >= 1, the round's privacy threshold (samples).
    log_size : int or None, the device's log size (samples); None: no upper bound.

    Raises
    ------
    PrivacyError
        ``n_samples < min_count`` (NaN included): ``need min_count={m} <= n_samples={n}`` (with
        ``<= log_size={l}`` when ``log_size`` is given).
    ShapeError
        ``n_samples > log_size``, same message.
    """
    def show(x: float | None) -> str:
        return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)

    need = f"need min_count={min_count} <= n_samples={show(n_samples)}"
    if log_size is not None:
        need += f" <= log_size={show(log_size)}"
    if not n_samples >= min_count:
        raise PrivacyError(need)
    if log_size is not None and n_samples > log_size:
        raise ShapeError(need)


def max_cost_per_query(max_cost_usd: float | None) -> float:
    """The bound (USD) on one query's cost that a round enforces: its ``max_cost_usd``, or
    :data:`sdk.eval_log.MAX_COST_PER_QUERY_USD` (1000) when it sets none."""
    return float(max_cost_usd) if max_cost_usd else MAX_COST_PER_QUERY_USD


def cost_limit(count: np.ndarray, max_cost_usd: float | None) -> np.ndarray:
    """The largest ``sum_cost`` (USD) accepted per entry, same shape as ``count`` (float64): ``count``
    queries at :func:`max_cost_per_query` each, with the relative slack :data:`COST_BOUND_RTOL`."""
    return np.asarray(count, dtype=np.float64) * (max_cost_per_query(max_cost_usd) * (1.0 + COST_BOUND_RTOL))


def check_kmeans_costs(count: np.ndarray, sum_cost: np.ndarray, max_cost_usd: float | None) -> None:
    """Refuse cost sums above the round's bound on one query's cost (:func:`cost_limit`): a node that
    clips each cost (:func:`sdk.local_update.kmeans_update`) never sends one. Used by the HTTPS server
    (:mod:`trainer.server.validation`) and the Flower strategy. Pure.

    Parameters
    ----------
    count, sum_cost : ndarrays of shape (n_cells, n_models), float64 (queries; USD).
    max_cost_usd : the round's bound (USD per query), or None (then 1000 USD).

    Raises
    ------
    ShapeError
        ``sum_cost: is above {bound} USD per query (entry [k, m]: {sum} USD for {count} queries)``,
        naming the first such entry (a NaN sum counts as above).
    """
    above = ~(np.asarray(sum_cost) <= cost_limit(count, max_cost_usd))
    if above.any():
        k, m = np.argwhere(above)[0]
        raise ShapeError(f"sum_cost: is above {max_cost_per_query(max_cost_usd):g} USD per query (entry [{k}, {m}]: "
                         f"{sum_cost[k, m]:g} USD for {count[k, m]:g} queries)")


def check_kmeans_update(update: KMeansUpdate, centroids: np.ndarray, n_models: int, min_count: int,
                        max_cost_usd: float | None = None) -> None:
    """Check a decoded update against the round it answers (ARCHITECTURE.md §6). Pure.

    Each field on its own first (shapes, whole numbers, ranges, costs within the round's bound:
    :func:`check_kmeans_costs`, as the HTTPS server), then the rules across fields
    (:func:`check_kmeans_totals`).

    Parameters
    ----------
    update : the node's update.
    centroids : ndarray of shape (n_cells, d_emb), the round's centroids.
    n_models : int, columns of the statistics.
    min_count : int, the round's privacy threshold.
    max_cost_usd : the round's bound on one query's cost (USD), or None (then 1000 USD, the bound of
        :data:`sdk.eval_log.MAX_COST_PER_QUERY_USD`).

    Raises
    ------
    PrivacyError
        The privacy rule is broken: an entry with ``0 < count < min_count``, or local weights below
        ``max(min_count, 2)``.
    ShapeError
        Statistics of another shape than (n_cells, n_models); non-integral counts; counts summing
        above ``log_size``; reported cells out of range or repeated; local centroids of the wrong
        shape or non-finite; local weights non-integral or summing above ``log_size``; a negative
        ``log_size``; mean embeddings of norm above 1 (means of unit vectors); cost sums above
        ``count * max_cost_usd``; sums where the count is 0. The message quotes the offending values. (Negative counts, sums of scores outside
        ``[0, count]``, negative costs and NaN/inf are refused earlier, by :class:`sdk.CellStatistics`.)
    """
    n_cells, d_emb = np.shape(centroids)
    s = update.statistics
    if s.count.shape != (n_cells, n_models):
        raise ShapeError(f"statistics have shape {s.count.shape}, the round expects ({n_cells}, {n_models})")
    if update.log_size < 0:
        raise ShapeError(f"log_size={update.log_size} must be >= 0")
    if not np.array_equal(s.count, np.round(s.count)):
        raise ShapeError("counts must be whole numbers (a device reports raw counts)")
    check_kmeans_costs(s.count, s.sum_cost, max_cost_usd)
    cells, means, weights = update.centroid_cells, update.local_centroids, update.local_weights
    n_rep = cells.shape[0]
    if cells.size and (cells.min() < 0 or cells.max() >= n_cells):
        raise ShapeError(f"centroid_cells must lie in [0, {n_cells}), got {cells.tolist()}")
    if np.unique(cells).size != n_rep:
        raise ShapeError(f"centroid_cells must not repeat, got {cells.tolist()}")
    if means.shape != (n_rep, d_emb) or weights.shape != (n_rep,):
        raise ShapeError(
            f"local_centroids {means.shape} and local_weights {weights.shape} must have shapes "
            f"({n_rep}, {d_emb}) and ({n_rep},) for {n_rep} reported cells"
        )
    if not (np.isfinite(means).all() and np.isfinite(weights).all()):
        raise ShapeError("local_centroids and local_weights must be finite")
    if not np.array_equal(weights, np.round(weights)):
        raise ShapeError("local_weights must be whole numbers (queries per cell)")
    if n_rep and (np.linalg.norm(means, axis=1) > 1.0 + 1e-4).any():
        raise ShapeError("local_centroids must be means of unit-norm embeddings (norm <= 1)")
    check_kmeans_totals(update, min_count)


def check_kmeans_totals(update: KMeansUpdate, min_count: int) -> None:
    """The rules across the fields of an update whose fields are each valid (shapes that fit one
    another, whole non-negative counts and weights, finite values; checked by
    :func:`check_kmeans_update` here and field by field by the server's
    :func:`trainer.server.validation.validate_update`), in this order: no entry with ``0 < count <
    min_count``, counts summing to at most ``log_size``, local weights at least ``max(min_count,
    2)`` and summing to at most ``log_size``, sums 0 where the count is 0. An update that reports
    nothing (every count 0 and no cell mean, :meth:`sdk.protocol.KMeansUpdate.is_empty`: a device
    does not send it) is refused first: merged, it would count as a client and, on Flower, replace
    the node's latest real update. Pure.

    Raises
    ------
    PrivacyError
        An entry below ``min_count`` or a cell mean of too few queries.
    ShapeError
        The update reports nothing, counts or weights summing above ``log_size``, or sums where the
        count is 0.
    """
    if update.is_empty():
        raise ShapeError("count: the update reports nothing (no evaluation above min_count): do not upload it")
    s = update.statistics
    small = (s.count > 0) & (s.count < min_count)
    if small.any():
        k, m = np.argwhere(small)[0]
        raise PrivacyError(
            f"count[{k}, {m}]={s.count[k, m]:g} is below min_count={min_count}: such entries are not reported"
        )
    total = float(s.count.sum())
    if total > update.log_size:
        raise ShapeError(f"counts sum to {total:g}, more than log_size={update.log_size}")
    weights = update.local_weights
    threshold = centroid_threshold(min_count)
    if weights.size and weights.min() < threshold:
        raise PrivacyError(f"local_weights must be >= {threshold} (a mean of fewer queries is not reported), "
                           f"got {weights.min():g}")
    if float(weights.sum()) > update.log_size:
        raise ShapeError(f"local_weights sum to {weights.sum():g}, more than log_size={update.log_size}")
    # Nonzero sum_accuracy or sum_cost where the count is 0.
    if (np.logical_or(s.sum_accuracy, s.sum_cost) & (s.count == 0)).any():
        raise ShapeError("sum_accuracy and sum_cost must be 0 where count is 0")


def check_difference(update: KMeansUpdate, previous: KMeansUpdate | None, min_count: int) -> None:
    """Refuse an update that differs from the same client's previous update for the same centroids
    by fewer than the privacy threshold anywhere: subtracting the two would reveal a handful of
    queries (an entry whose count moved by ``0 < |d| < min_count``, or a cell mean whose weight moved
    by ``0 < |d| < max(min_count, 2)``). Devices hold such changes back (:func:`sdk.local_update.hold_small_changes`);
    this is the server's check of the same rule. Pure.

    Raises
    ------
    PrivacyError
        The update breaks the rule (the message names the first entry or cell).
    """
    if previous is None or previous.statistics.count.shape != update.statistics.count.shape:
        return
    if not _may_move_too_little(update, previous, min_count):
        return  # the common case (the server checks every upload): no small move anywhere
    # A move to zero (an entry no longer reported, e.g. after min_count went up) reveals nothing new.
    d = np.abs(update.statistics.count - previous.statistics.count)
    small = (d > 0) & (d < min_count) & (update.statistics.count > 0)
    if small.any():
        k, m = np.argwhere(small)[0]
        raise PrivacyError(f"count[{k}, {m}] moved by {d[k, m]:g} {DIFFERENCE_REFUSAL_PHRASE} for these centroids, fewer "
                           f"than min_count={min_count}: hold it back until it moves by at least that")
    n_cells = update.statistics.n_cells

    def dense(u: KMeansUpdate) -> np.ndarray:
        w = np.zeros(n_cells)
        w[np.asarray(u.centroid_cells, dtype=np.int64)] = u.local_weights
        return w

    now = dense(update)
    dw = np.abs(now - dense(previous))
    threshold = centroid_threshold(min_count)
    small = (dw > 0) & (dw < threshold) & (now > 0)
    if small.any():
        k = int(np.flatnonzero(small)[0])
        raise PrivacyError(f"the mean of cell {k} moved by {dw[k]:g} queries {DIFFERENCE_REFUSAL_PHRASE}, fewer than "
                           f"{threshold}: hold it back")


def _may_move_too_little(update: KMeansUpdate, previous: KMeansUpdate, min_count: int) -> bool:
    """False only if no entry and no reported cell moved by too little (the rule of
    :func:`check_difference`): the counts in three numpy calls, the cell weights (at most ``n_cells``
    of them) as Python numbers. True when one did, or when the cells are not plain distinct indices
    in ``[0, n_cells)`` (:func:`check_difference` then decides as before)."""
    count = update.statistics.count
    d = count - previous.statistics.count
    if np.count_nonzero((np.abs(d) < min_count) & (d != 0) & (count > 0)):
        return True
    n_cells = update.statistics.n_cells
    now = dict(zip(update.centroid_cells.tolist(), update.local_weights.tolist()))
    before = dict(zip(previous.centroid_cells.tolist(), previous.local_weights.tolist()))
    keys = (*now, *before)
    if (len(now) != len(update.centroid_cells) or len(before) != len(previous.centroid_cells)
            or (keys and (update.centroid_cells.dtype.kind != "i" or previous.centroid_cells.dtype.kind != "i"
                          or min(keys) < 0 or max(keys) >= n_cells))):
        return True
    threshold = centroid_threshold(min_count)
    # Cells no longer reported (now 0) reveal nothing; a NaN weight is never "small" in either version.
    return any(w > 0 and 0 < abs(w - before.get(k, 0.0)) < threshold for k, w in now.items())


__all__ = ["COST_BOUND_RTOL", "DEFAULT_MIN_COUNT", "MIN_COUNT_KEY", "round_min_count", "check_difference", "check_kmeans_costs", "check_kmeans_totals",
           "check_kmeans_update", "check_sample_count", "cost_limit", "max_cost_per_query"]
