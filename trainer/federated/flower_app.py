"""Federated K-means (paper 002) on Flower: a message-API ``Strategy``, a ``ClientApp`` and their wire format.

The protocol of the built-in HTTPS server (ARCHITECTURE.md §6) carried by Flower (``flwr >= 1.21``); one
round's messages are in docs/sync-protocol-and-operations.md (One Flower round). The device side is
:func:`sdk.local_update.kmeans_update`, the server side :func:`trainer.federated.kmeans_aggregation.aggregate_kmeans`,
replies are checked by :func:`trainer.federated.update_checks.check_kmeans_update`. Clients are Flower node ids.

Simulation (needs ``flwr[simulation]``, i.e. Ray)::

    strategy = FederatedKMeansStrategy(models, "all-MiniLM-L6-v2", centroid_rounds=1)
    run_simulation(make_server_app(strategy, centroids, num_rounds=2),
                   make_client_app({0: "a.sqlite", 1: "b.sqlite"}), num_supernodes=2)
    router = strategy.to_router(prior_strength=16.0)

Deployment: each SuperNode is started with ``--node-config 'eval-log="/path/to/log.sqlite"'`` and
runs :func:`make_client_app` ``()``; the ServerApp calls :meth:`FederatedKMeansStrategy.start`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from sdk.cell_statistics import CellStatistics
from sdk.errors import EvalLogError, InvalidInputError, ShapeError
from sdk.eval_log import EvalLog
from sdk.local_update import kmeans_update
from sdk.protocol import (
    UPDATE_ARRAYS,
    KMeansUpdate,
    RoundSpec,
    centroids_hash,
    kmeans_update_from_arrays,
    kmeans_update_to_arrays,
)
from trainer.federated.gaussian_privacy import gaussian_epsilon
from trainer.federated.kmeans_aggregation import AggregationConfig, aggregate_kmeans
from trainer.federated.rejected_reply import RejectedReply, reject  # RejectedReply re-exported
from trainer.federated.update_checks import DEFAULT_MIN_COUNT, MIN_COUNT_KEY, check_kmeans_update, check_min_count
from trainer.routers.kmeans_router import KMeansRouter

#: Record keys of the messages (module docstring).
CENTROIDS_KEY = "centroids"
ARRAYS_KEY = "arrays"
UPDATE_KEY = "update"
CONFIG_KEY = "config"
METRICS_KEY = "metrics"

#: Node-config key holding the EvalLog path of a deployed SuperNode.
EVAL_LOG_NODE_CONFIG = "eval-log"

_ROUND_CONFIG_KEYS = ("round-id", "centroids-hash", "models", "embedder-name", MIN_COUNT_KEY, "max-cost-usd")


# --------------------------------------------------------------------------- wire format


#: The arrays of an update are :mod:`sdk.protocol`'s (the same named arrays the server store keeps).
update_to_ndarrays = kmeans_update_to_arrays
update_from_ndarrays = kmeans_update_from_arrays


def update_to_record(update: KMeansUpdate, partition_hash: str) -> RecordDict:
    """The content of a node's reply: ``update`` (ArrayRecord of :func:`update_to_ndarrays`),
    ``config`` (``centroids-hash``: the partition it was computed for) and ``metrics``
    (``num-examples``: the log size, Flower's conventional weight key)."""
    arrays = ArrayRecord({name: Array(a) for name, a in update_to_ndarrays(update).items()})
    return RecordDict({
        UPDATE_KEY: arrays,
        CONFIG_KEY: ConfigRecord({"centroids-hash": str(partition_hash)}),
        METRICS_KEY: MetricRecord({"num-examples": int(update.log_size)}),
    })


def update_from_record(content: RecordDict) -> tuple[KMeansUpdate, str]:
    """``(update, centroids hash)`` from a reply's content (:func:`update_to_record`).

    Raises
    ------
    ShapeError
        A record or key is missing or has the wrong type, or :func:`update_from_ndarrays` refuses
        the arrays.
    """
    try:
        arrays = content.array_records[UPDATE_KEY]
        partition_hash = content.config_records[CONFIG_KEY]["centroids-hash"]
    except KeyError as exc:
        raise ShapeError(f"a K-means reply needs the array record {UPDATE_KEY!r} and "
                         f"{CONFIG_KEY}['centroids-hash'], missing {exc}") from exc
    if not isinstance(partition_hash, str):
        raise ShapeError(f"centroids-hash must be a str, got {type(partition_hash).__name__}")
    try:
        ndarrays = {name: arrays[name].numpy() for name in arrays}
    except (TypeError, ValueError) as exc:
        raise ShapeError(f"update arrays are not numpy arrays: {exc}") from exc
    return update_from_ndarrays(ndarrays), partition_hash


def centroids_record(centroids: np.ndarray) -> ArrayRecord:
    """The broadcast ArrayRecord: ``{"centroids": ndarray of shape (n_cells, d_emb), float32}``.

    Raises
    ------
    ShapeError
        ``centroids`` is not 2-D with at least one cell, or holds non-finite values.
    """
    c = _check_centroids(centroids)
    return ArrayRecord({CENTROIDS_KEY: Array(c)})


def _check_centroids(centroids: np.ndarray) -> np.ndarray:
    c = np.asarray(centroids, dtype=np.float32)
    if c.ndim != 2 or c.shape[0] < 1 or c.shape[1] < 1:
        raise ShapeError(f"centroids must have shape (n_cells, d_emb) with n_cells, d_emb >= 1, got {c.shape}")
    if not np.isfinite(c).all():
        raise ShapeError("centroids must be finite")
    return c


# --------------------------------------------------------------------------- server


class FederatedKMeansStrategy(Strategy):
    """Flower strategy for the federated K-means router (paper 002; one round in docs/sync-protocol-and-operations.md).

    Parameters
    ----------
    models : sequence of str, the model ids, column order of the statistics.
    embedder_name : str, the embedder the centroids live in (sent to the nodes; a node whose log
        has another dimension refuses the round).
    min_count : int >= 1, privacy threshold: (cell, model) entries with fewer samples are not reported
        (sent to the nodes as ``min-count``; a reply that breaks it is refused). Default
        :data:`trainer.federated.update_checks.DEFAULT_MIN_COUNT` (5), the HTTPS server's default round
        ``min_count``.
    aggregation : :class:`AggregationConfig` or None (plain merge): clipping, trimmed merge, noise. Its
        ``max_cost_usd`` is also sent to the nodes (``max-cost-usd``), which clip each logged cost to it, and
        a reply whose cost sums exceed it is refused (listed in ``rejected_``).
    centroid_rounds : int >= 0 or None, rounds that end with a Lloyd step moving the centroids;
        later rounds keep them and only refresh the statistics. None: every round moves them.
    fraction_train : float in (0, 1], share of the connected nodes sampled each round.
    min_train_nodes : int >= 1, nodes sampled at least.
    min_available_nodes : int >= 1, nodes to wait for before sampling.
    rng : numpy Generator for node sampling and the Gaussian noise (None: seeded from the OS).

    Attributes
    ----------
    centroids_ : ndarray of shape (n_cells, d_emb), float32, the partition of the last aggregate.
    statistics_ : CellStatistics of shape (n_cells, n_models), merged statistics for ``centroids_``.
    next_centroids_ : ndarray of shape (n_cells, d_emb), float32, one Lloyd step from ``centroids_``.
    cell_weights_ : ndarray of shape (n_cells,), float64, queries behind each next centroid.
    clients_ : tuple of str, node ids in the last aggregate.
    epsilon_ : float, epsilon of the last aggregate at ``aggregation.delta`` (inf without noise).
    n_aggregates_ : int, aggregates published so far.
    latest_updates_ : dict str -> (centroids hash, KMeansUpdate), each node's latest valid update.
    rejected_ : list of :class:`RejectedReply` (:mod:`trainer.federated.rejected_reply`), the replies dropped.

    Raises
    ------
    InvalidInputError
        On construction, for values out of the ranges above or repeated / empty model ids.
    """

    def __init__(
        self,
        models: Sequence[str],
        embedder_name: str,
        min_count: int = DEFAULT_MIN_COUNT,
        aggregation: AggregationConfig | None = None,
        centroid_rounds: int | None = None,
        fraction_train: float = 1.0,
        min_train_nodes: int = 1,
        min_available_nodes: int = 1,
        rng: np.random.Generator | None = None,
    ) -> None:
        self.models = tuple(models)
        self.embedder_name = embedder_name
        self.min_count = min_count
        self.aggregation = aggregation
        self.centroid_rounds = centroid_rounds
        self.fraction_train = fraction_train
        self.min_train_nodes = min_train_nodes
        self.min_available_nodes = min_available_nodes
        self.rng = rng
        valid_ids = all(isinstance(m, str) and m for m in self.models)
        if not self.models or len(set(self.models)) != len(self.models) or not valid_ids:
            raise InvalidInputError(f"models must be distinct non-empty strings, got {list(self.models)}")
        if not isinstance(embedder_name, str) or not embedder_name:
            raise InvalidInputError(f"embedder_name must be a non-empty str, got {embedder_name!r}")
        for name in ("min_count", "min_train_nodes", "min_available_nodes"):
            check_min_count(getattr(self, name), name)
        if centroid_rounds is not None and (isinstance(centroid_rounds, bool) or not isinstance(centroid_rounds, int)
                                            or centroid_rounds < 0):
            raise InvalidInputError(f"centroid_rounds must be an int >= 0 or None, got {centroid_rounds!r}")
        if not (isinstance(fraction_train, (int, float)) and 0.0 < fraction_train <= 1.0):
            raise InvalidInputError(f"fraction_train must lie in (0, 1], got {fraction_train!r}")
        self._config = aggregation if aggregation is not None else AggregationConfig()
        self._rng = rng if rng is not None else np.random.default_rng()
        self._round_centroids: np.ndarray | None = None
        self._round_hash = ""
        self.centroids_: np.ndarray | None = None
        self.statistics_: CellStatistics | None = None
        self.next_centroids_: np.ndarray | None = None
        self.cell_weights_: np.ndarray | None = None
        self.clients_: tuple[str, ...] = ()
        self.epsilon_ = math.inf
        self.n_aggregates_ = 0
        self.latest_updates_: dict[str, tuple[str, KMeansUpdate]] = {}
        self.rejected_: list[RejectedReply] = []

    # -- Strategy API

    def summary(self) -> None:
        """Log the configuration (Flower calls this at :meth:`start`)."""
        log(INFO, "\t├──> Federated K-means (paper 002): %d models, embedder %s, min_count %d",
            len(self.models), self.embedder_name, self.min_count)
        log(INFO, "\t├──> Centroid rounds: %s", "all" if self.centroid_rounds is None else self.centroid_rounds)
        log(INFO, "\t└──> Sampling: fraction %.2f, min train nodes %d, min available %d; aggregation %s",
            self.fraction_train, self.min_train_nodes, self.min_available_nodes, self._config)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Messages broadcasting ``arrays["centroids"]`` and the round config to the sampled nodes.

        Raises
        ------
        ShapeError
            ``arrays`` holds no ``"centroids"`` of shape (n_cells, d_emb), finite.
        InvalidInputError
            ``config`` sets one of the keys this strategy writes (``round-id``, ``centroids-hash``,
            ``models``, ``embedder-name``, ``min-count``, ``max-cost-usd``).
        """
        if CENTROIDS_KEY not in arrays:
            raise ShapeError(f"the broadcast ArrayRecord must hold {CENTROIDS_KEY!r} (see centroids_record), "
                             f"got keys {list(arrays)}")
        clash = sorted(set(config) & set(_ROUND_CONFIG_KEYS))
        if clash:
            raise InvalidInputError(f"train config keys {clash} are set by the strategy; rename them")
        centroids = _check_centroids(arrays[CENTROIDS_KEY].numpy())
        self._round_centroids = centroids
        self._round_hash = centroids_hash(centroids)
        # Flower's helper waits until enough nodes are connected; the sample is drawn from self.rng.
        _, connected = sample_nodes(grid, max(self.min_available_nodes, self.min_train_nodes), 0)
        sample_size = min(len(connected), max(int(len(connected) * self.fraction_train), self.min_train_nodes))
        connected = sorted(connected)  # node ids are uint64: index them, never put them in a float array
        node_ids = [connected[i] for i in sorted(self._rng.choice(len(connected), size=sample_size, replace=False))]
        log(INFO, "configure_train: round %d, %d cells, sampled %d of %d nodes",
            server_round, centroids.shape[0], len(node_ids), len(connected))
        round_config = ConfigRecord(dict(config))
        round_config.update({
            "round-id": int(server_round),
            "centroids-hash": self._round_hash,
            "models": list(self.models),
            "embedder-name": self.embedder_name,
            MIN_COUNT_KEY: int(self.min_count),
        })
        if self._config.max_cost_usd is not None:  # the nodes clip each cost to it (sdk.local_update.kmeans_update)
            round_config["max-cost-usd"] = float(self._config.max_cost_usd)
        content = RecordDict({ARRAYS_KEY: ArrayRecord({CENTROIDS_KEY: Array(centroids)}), CONFIG_KEY: round_config})
        return [Message(content=content, dst_node_id=node_id, message_type=MessageType.TRAIN) for node_id in node_ids]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate and keep the replies, aggregate every node's latest update for this round's
        centroids, and return the next broadcast centroids and summary metrics.

        Returns ``(None, None)`` (the centroids stay) when no update for this round's centroids is kept.
        """
        if self._round_centroids is None:
            raise InvalidInputError("aggregate_train called before configure_train")
        for msg in replies:
            self._keep(server_round, msg)
        current = {cid: u for cid, (h, u) in self.latest_updates_.items() if h == self._round_hash}
        if not current:
            log(WARNING, "aggregate_train: round %d has no valid update for its centroids", server_round)
            return None, None
        agg = aggregate_kmeans(self._round_centroids, current, self._config, self._rng)
        self.centroids_ = self._round_centroids
        self.statistics_ = agg.statistics
        self.next_centroids_ = agg.next_centroids
        self.cell_weights_ = agg.cell_weights
        self.clients_ = agg.clients
        self.epsilon_ = agg.epsilon
        self.n_aggregates_ += 1
        moves = self.centroid_rounds is None or server_round <= self.centroid_rounds
        broadcast = agg.next_centroids if moves else self._round_centroids
        metrics = {"clients": len(agg.clients), "count": float(agg.statistics.count.sum())}
        if math.isfinite(agg.epsilon):
            metrics["epsilon"] = float(agg.epsilon)
        return ArrayRecord({CENTROIDS_KEY: Array(np.asarray(broadcast, dtype=np.float32))}), MetricRecord(metrics)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No federated evaluation round: the K-means router is evaluated offline. Returns no message."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Nothing to aggregate (see :meth:`configure_evaluate`)."""
        return None

    # -- results

    def epsilon_spent(self) -> float:
        """Epsilon at ``aggregation.delta`` of all aggregates published so far (composition of
        :attr:`n_aggregates_` Gaussian mechanisms); inf without noise, 0 before any aggregate."""
        if self.n_aggregates_ == 0:
            return 0.0
        if self._config.noise_multiplier == 0:
            return math.inf
        return gaussian_epsilon(self._config.noise_multiplier, self._config.delta, self.n_aggregates_)

    def to_router(
        self,
        prior_strength: float,
        model_prior_strength: float = 0.0,
        prior: str = "additive",
        embedder: Mapping[str, object] | None = None,
    ) -> KMeansRouter:
        """A :class:`KMeansRouter` of ``centroids_`` and ``statistics_`` (the statistics belong to
        the centroids they were computed for, not to ``next_centroids_``).

        Parameters
        ----------
        prior_strength, model_prior_strength, prior : shrinkage, as in :class:`KMeansRouter`.
        embedder : the embedder identity recorded in the router (``name``, ``dim``, ``max_tokens``,
            ``truncation_side``, ``pooling``, ``normalised``) for ``export``; None leaves it unset.

        Raises
        ------
        InvalidInputError
            No aggregate yet.
        """
        if self.statistics_ is None or self.centroids_ is None:
            raise InvalidInputError("no aggregate yet: run at least one round with a valid update")
        router = KMeansRouter(self.centroids_, self.statistics_, self.models, prior_strength,
                              model_prior_strength, prior)
        if embedder is not None:
            router.embedder = dict(embedder)
        return router

    # -- internals

    def _keep(self, server_round: int, msg: Message) -> None:
        cid = str(msg.metadata.src_node_id)
        if msg.has_error():
            reject(self.rejected_, server_round, cid, f"node error {msg.error.code}: {msg.error.reason}")
            return
        try:
            update, partition_hash = update_from_record(msg.content)
            if partition_hash != self._round_hash:
                raise ShapeError(f"update is for centroids {partition_hash[:12]}..., "
                                 f"the round broadcast {self._round_hash[:12]}...")
            # the HTTPS server's validator, costs within the round's max_cost_usd included (our nodes clip to it)
            update = check_kmeans_update(update_to_ndarrays(update), update.log_size, self._round_centroids.shape,
                                         len(self.models), self.min_count, self._config.max_cost_usd)
        except InvalidInputError as exc:  # ShapeError included
            reject(self.rejected_, server_round, cid, str(exc))
            return
        self.latest_updates_[cid] = (partition_hash, update)


def make_server_app(
    strategy: FederatedKMeansStrategy, initial_centroids: np.ndarray, num_rounds: int, timeout: float = 3600.0
) -> ServerApp:
    """A Flower ``ServerApp`` running ``strategy`` for ``num_rounds`` rounds from ``initial_centroids``
    (ndarray of shape (n_cells, d_emb), float32); ``timeout`` : seconds to wait for replies per round.
    Results are read from ``strategy`` afterwards.

    Raises
    ------
    ShapeError
        ``initial_centroids`` is not (n_cells, d_emb) finite.
    InvalidInputError
        ``num_rounds < 1`` or ``timeout <= 0``.
    """
    initial = centroids_record(initial_centroids)
    if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 1:
        raise InvalidInputError(f"num_rounds must be an int >= 1, got {num_rounds!r}")
    if not (timeout > 0):
        raise InvalidInputError(f"timeout must be > 0 seconds, got {timeout!r}")
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=num_rounds, timeout=timeout)

    return app


# --------------------------------------------------------------------------- client


def round_spec_from_message(msg: Message) -> RoundSpec:
    """The :class:`sdk.local_update.RoundSpec` a train message announces (validated by
    :meth:`RoundSpec.from_json`: shapes, distinct models, centroids matching their hash, and a
    ``max-cost-usd``, when present, finite and > 0: it becomes ``spec.max_cost_usd``).

    Raises
    ------
    SyncError
        The message lacks a field or carries inconsistent values.
    """
    content = msg.content
    data: dict[str, object] = {"kind": "kmeans", "deadline_utc": ""}  # Flower's message TTL is the deadline
    arrays = content.array_records.get(ARRAYS_KEY)
    if arrays is not None and CENTROIDS_KEY in arrays:
        centroids = arrays[CENTROIDS_KEY].numpy()
        data["centroids"] = np.asarray(centroids, dtype=np.float64).tolist()
        data["d_emb"] = int(centroids.shape[-1]) if centroids.ndim else 0
    config = content.config_records.get(CONFIG_KEY, {})
    for key in _ROUND_CONFIG_KEYS:
        if key in config:
            data[key.replace("-", "_")] = config[key]
    return RoundSpec.from_json(data)


def client_update(log_path: str | os.PathLike[str], spec: RoundSpec) -> KMeansUpdate:
    """The update of the EvalLog at ``log_path`` for ``spec`` (:func:`sdk.local_update.kmeans_update`).

    Raises
    ------
    EvalLogError
        No file at ``log_path`` (a missing log is not silently created), or the file is unusable.
    ShapeError
        The log's embeddings do not have the round's dimension.
    """
    path = Path(log_path)
    if not path.is_file():
        raise EvalLogError(f"no evaluation log at {str(path)!r}")
    with EvalLog(path, spec.models) as log_:
        return kmeans_update(log_.rows(), spec)


def make_client_app(log_paths: Mapping[int, str | os.PathLike[str]] | None = None) -> ClientApp:
    """A Flower ``ClientApp`` answering train messages with the node's K-means update.

    Parameters
    ----------
    log_paths : simulation: partition id (``context.node_config["partition-id"]``) -> EvalLog path.
        None (deployment): the path is the node config ``eval-log`` of the SuperNode.

    The reply holds :func:`update_to_record` of :func:`client_update` only: no query text, no
    per-query embedding. A failure (missing log, wrong dimension, malformed round) becomes Flower's
    error reply, which the strategy lists in ``rejected_``.
    """
    paths = None if log_paths is None else {int(k): str(v) for k, v in log_paths.items()}
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        spec = round_spec_from_message(msg)
        if paths is None:
            path = context.node_config.get(EVAL_LOG_NODE_CONFIG)
            if not isinstance(path, str):
                raise EvalLogError(f"node config {EVAL_LOG_NODE_CONFIG!r} (the EvalLog path) is not set")
        else:
            pid = int(context.node_config["partition-id"])
            if pid not in paths:
                raise EvalLogError(f"no EvalLog path for partition {pid}; known {sorted(paths)}")
            path = paths[pid]
        update = client_update(path, spec)
        return Message(update_to_record(update, spec.centroids_hash), reply_to=msg)

    return app


__all__ = [
    "UPDATE_ARRAYS",
    "FederatedKMeansStrategy",
    "RejectedReply",
    "centroids_record",
    "client_update",
    "make_client_app",
    "make_server_app",
    "round_spec_from_message",
    "update_from_ndarrays",
    "update_from_record",
    "update_to_ndarrays",
    "update_to_record",
]
