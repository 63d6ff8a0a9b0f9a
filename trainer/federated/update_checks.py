"""The one validator of a device's update against the round it answers (ARCHITECTURE.md §6).

Both transports call it: the built-in HTTPS server (:mod:`trainer.server.validation`, which answers
422 with the message) and the three Flower strategies (which drop the reply and list it in
``rejected_``): K-means updates (:func:`check_kmeans_update`, :mod:`trainer.federated.flower_app`),
the privacy threshold on the samples behind a parameter update (:func:`check_sample_count`: MLP
uploads on the server, :mod:`trainer.rewards.flower_router` and, per expert,
:mod:`trainer.experts.flower_strategy` on Flower), and the threshold itself (:func:`check_min_count`).
Every refusal of :func:`check_kmeans_update` starts with the name of the field it concerns
(``count: ...``). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from sdk.cell_statistics import CellStatistics
from sdk.errors import InvalidInputError, PrivacyError, ShapeError
from sdk.eval_log import MAX_COST_PER_QUERY_USD
from sdk.local_update import KMeansUpdate, centroid_threshold
from sdk.protocol import DIFFERENCE_REFUSAL_PHRASE

#: Largest count, weight, sample number or log size accepted (the SQLite/PostgreSQL INTEGER range,
#: far beyond any device's log).
MAX_COUNT = 2**31 - 1

#: Relative slack of the cost bound of :func:`check_kmeans_update`: a device sums its clipped costs in float64,
#: and n costs each equal to the bound can sum above ``n * bound`` by rounding (10 queries clipped to
#: 0.03 USD sum to 0.03 * 10 + 5.6e-17).
COST_BOUND_RTOL = 1e-9

#: Norm bound of a reported cell mean (a mean of unit vectors), with slack for float32 embeddings.
MAX_MEAN_NORM = 1.0 + 1e-4

#: The privacy threshold of a round when its operator sets none (samples): ``fedroute server rounds open
#: --min-count``, the Flower strategies' ``min_count`` and the devices' ``min_count_floor`` (sdk/sync.py).
DEFAULT_MIN_COUNT = 5

#: The key of the privacy threshold in a Flower round's train config, sent by every Flower strategy.
MIN_COUNT_KEY = "min-count"


def check_min_count(min_count: object, name: str = "min_count") -> int:
    """``min_count`` if it is an int >= 1 (a privacy threshold), else InvalidInputError naming ``name``."""
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
        raise InvalidInputError(f"{name} must be an int >= 1, got {min_count!r}")
    return min_count


def round_min_count(config) -> int:
    """The privacy threshold a Flower node applies: the round config's ``min-count`` (int >= 1), or
    :data:`DEFAULT_MIN_COUNT` when the strategy sent none (e.g. a plain Flower FedAvg server).

    Raises
    ------
    InvalidInputError
        ``min-count`` is not an int >= 1.
    """
    return check_min_count(config.get(MIN_COUNT_KEY, DEFAULT_MIN_COUNT), f"round config {MIN_COUNT_KEY}")


def check_sample_count(n_samples: float, min_count: int, log_size: float | None = None) -> None:
    """Refuse a parameter update trained on fewer than ``min_count`` samples (the privacy threshold:
    an update over a handful of evaluations reveals them; docs/protocol.md), or on more than
    ``log_size`` (the evaluations the device holds) when given.

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


#: Row-wise dot products of two (n, d) arrays: numpy 2's ``vecdot`` (a third of ``einsum``'s time), ``einsum`` on numpy 1.
_row_dot = getattr(np, "vecdot", None) or (lambda x, y: np.einsum("ij,ij->i", x, y))


def _check_shape(name: str, arr: np.ndarray, shape: tuple[int, ...]) -> None:
    if arr.shape != shape:
        raise ShapeError(f"{name}: must have shape {shape}, got {arr.shape}")


def check_kmeans_update(arrays: Mapping[str, np.ndarray], log_size: int, centroids_shape: tuple[int, int],
                        n_models: int, min_count: int, max_cost_usd: float | None = None) -> KMeansUpdate:
    """Check one K-means update against its round and return it; the first offending field raises.

    Fields in the wire order (:data:`sdk.protocol.UPDATE_FIELDS`), then the rules across fields:

    1. ``log_size`` an integer in [0, :data:`MAX_COUNT`];
    2. the statistics (:class:`sdk.CellStatistics`' own rules: finite, ``count >= 0``,
       ``sum_accuracy`` in [0, count] with a relative tolerance of 1e-9, ``sum_cost >= 0``) of shape
       (n_cells, n_models); ``count`` whole numbers <= MAX_COUNT; ``sum_accuracy`` 0 where the count
       is 0; ``sum_cost`` at most ``count`` queries at the round's bound on one query's cost
       (:func:`max_cost_per_query`, relative slack :data:`COST_BOUND_RTOL`);
    3. ``centroid_cells`` 1-D, distinct integers in [0, n_cells);
    4. ``local_centroids`` (n_reported, d_emb) (an empty array of any shape counts as (0, d_emb)),
       finite, norms <= :data:`MAX_MEAN_NORM` (means of unit-norm embeddings);
    5. ``local_weights`` (n_reported,), whole numbers in [0, MAX_COUNT];
    6. across fields: an update reporting nothing (every count 0, no cell mean; a device does not
       send one, and merged it would count as a client) is refused (``count``); then no entry with
       ``0 < count < min_count`` (``count``, PrivacyError); counts summing to at most ``log_size``
       (``count``); cell means of at least ``max(min_count, 2)`` queries (``local_weights``,
       PrivacyError) whose weights sum to at most ``log_size``.

    Parameters
    ----------
    arrays : name -> ndarray for ``count``, ``sum_accuracy``, ``sum_cost`` (float64),
        ``centroid_cells`` (int64), ``local_centroids``, ``local_weights`` (float64); other keys ignored.
    log_size : int, the evaluations the device summarised.
    centroids_shape : (n_cells, d_emb) of the round's centroids.
    n_models : int, columns of the statistics.
    min_count : int >= 1, the round's privacy threshold.
    max_cost_usd : the round's bound on one query's cost (USD), or None (then 1000 USD).

    Returns
    -------
    KMeansUpdate holding the given arrays (``local_centroids`` as float64, (0, d_emb) when empty).

    Raises
    ------
    PrivacyError
        The privacy threshold is broken (message starts with ``count:`` or ``local_weights:``).
    ShapeError
        Any other rule above; the message starts with the field's name.
    """
    n_cells, d_emb = centroids_shape
    shape = (n_cells, n_models)
    if isinstance(log_size, bool) or not isinstance(log_size, (int, np.integer)) or not 0 <= log_size <= MAX_COUNT:
        raise ShapeError(f"log_size: must be an integer in [0, {MAX_COUNT}], got {log_size!r}")
    count = arrays["count"]
    _check_shape("count", count, shape)
    stats = CellStatistics(count, arrays["sum_accuracy"], arrays["sum_cost"])  # finite, ranges, shapes
    count, s_acc, s_cost = stats.count, stats.sum_accuracy, stats.sum_cost
    if count.size and not (count.max() <= MAX_COUNT and (count == np.floor(count)).all()):
        raise ShapeError(f"count: entries must be whole numbers in [0, {MAX_COUNT}]")
    if ((s_acc != 0) & (count == 0)).any():
        raise ShapeError("sum_accuracy: must be 0 where count is 0")
    per_query = max_cost_per_query(max_cost_usd)
    above = s_cost > count * (per_query * (1.0 + COST_BOUND_RTOL))  # so 0 where the count is 0
    if above.any():
        k, m = np.argwhere(above)[0]
        raise ShapeError(f"sum_cost: is above {per_query:g} USD per query (entry [{k}, {m}]: "
                         f"{s_cost[k, m]:g} USD for {count[k, m]:g} queries)")
    cells = arrays["centroid_cells"]
    listed = cells.tolist() if cells.ndim == 1 and cells.dtype.kind in "iu" and cells.size <= n_cells else None
    if listed is None or (listed and (min(listed) < 0 or max(listed) >= n_cells or len(set(listed)) < len(listed))):
        raise ShapeError(f"centroid_cells: must be distinct cells in [0, {n_cells}), got {cells[:10].tolist()}")
    n_rep = len(listed)
    means = arrays["local_centroids"]
    means = np.asarray(means.reshape(0, d_emb) if means.size == 0 else means, dtype=np.float64)
    _check_shape("local_centroids", means, (n_rep, d_emb))
    if n_rep and not _row_dot(means, means).max() <= MAX_MEAN_NORM**2:  # NaN fails, inf is above
        raise ShapeError("local_centroids: must be finite means of unit-norm embeddings (norm <= 1)")
    weights = arrays["local_weights"]
    _check_shape("local_weights", weights, (n_rep,))
    if not ((weights >= 0) & (weights <= MAX_COUNT) & (weights == np.floor(weights))).all():  # NaN fails each
        raise ShapeError(f"local_weights: entries must be whole numbers in [0, {MAX_COUNT}]")
    w = weights.tolist()  # at most n_cells whole numbers: exact sums
    total = float(count.sum())  # whole numbers below 2**53: exact
    if total == 0 and n_rep == 0:
        raise ShapeError("count: the update reports nothing (no evaluation above min_count): do not upload it")
    small = (count > 0) & (count < min_count)
    if small.any():
        k, m = np.argwhere(small)[0]
        raise PrivacyError(f"count: entry [{k}, {m}]={count[k, m]:g} is below min_count={min_count}: "
                           "such entries are not reported")
    if total > log_size:
        raise ShapeError(f"count: sums to {total:g}, more than log_size={log_size}")
    threshold = centroid_threshold(min_count)
    if w and min(w) < threshold:
        raise PrivacyError(f"local_weights: must be >= {threshold} (a mean of fewer queries is not reported), "
                           f"got {min(w):g}")
    if sum(w) > log_size:
        raise ShapeError(f"local_weights: sum to {sum(w):g}, more than log_size={log_size}")
    return KMeansUpdate(stats, cells.astype(np.int64, copy=False), means,
                        np.asarray(weights, dtype=np.float64), int(log_size))


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


__all__ = ["COST_BOUND_RTOL", "DEFAULT_MIN_COUNT", "MAX_COUNT", "MAX_MEAN_NORM", "MIN_COUNT_KEY", "check_difference",
           "check_kmeans_update", "check_min_count", "check_sample_count", "max_cost_per_query", "round_min_count"]
