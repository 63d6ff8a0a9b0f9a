"""The MoR router's FedAvg on Flower (message API, ``flwr >= 1.21``): :class:`RouterFedAvg` and
:func:`make_router_client_app`. The maths is not repeated: nodes run
:func:`trainer.rewards.client_router.local_router_update`, the strategy aggregates with the pure
:func:`trainer.rewards.client_router.aggregate_routers`.

Design notes: docs/mor.md (Module notes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from sdk.errors import InvalidInputError
from trainer.federated.rejected_reply import REPLY_ERRORS, RejectedReply, reject, reply_reason
from trainer.federated.update_checks import (
    DEFAULT_MIN_COUNT,
    MIN_COUNT_KEY,
    check_min_count,
    check_sample_count,
    round_min_count,
)
from trainer.rewards.client_router import (
    ClientRouter,
    ClientRouterData,
    RouterConfig,
    aggregate_routers,
    local_rng,
    local_router_update,
)
from trainer.routers.fedavg import validate_updates

ARRAYS_KEY = "arrays"
NUM_EXAMPLES = "num-examples"


def _record(params: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in params.items()})


def arrays_to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    """name -> ndarray of an ArrayRecord."""
    return {k: v.numpy() for k, v in record.items()}


class RouterFedAvg(FedAvg):
    """Flower FedAvg whose aggregation is :func:`aggregate_routers` with ``weighting`` (``"samples"``
    or ``"equal"``). ``last_updates_`` holds the (parameters, n) of the last aggregated round;
    ``rejected_`` the replies dropped (:class:`trainer.federated.rejected_reply.RejectedReply`).

    Each reply is checked against the broadcast parameters (:func:`trainer.routers.fedavg.validate_updates`)
    and the privacy threshold (:func:`trainer.federated.update_checks.check_sample_count`, the HTTPS server's
    check of an MLP upload); one that fails is dropped, logged and listed in ``rejected_`` with the check's
    message, and the others are averaged. The round config tells the nodes the threshold (``min-count``): a
    node of :func:`make_router_client_app` below it sends no parameters (listed as ``no update: ...``).

    Parameters
    ----------
    weighting : ``"samples"`` or ``"equal"``.
    min_count : int >= 1, the privacy threshold: smallest ``num-examples`` (preference pairs) of a
        reply that is averaged; default :data:`trainer.federated.update_checks.DEFAULT_MIN_COUNT` (5).
    **kwargs : passed to :class:`flwr.serverapp.strategy.FedAvg`.

    Raises
    ------
    InvalidInputError
        An unknown ``weighting``, or a ``min_count`` that is not an int >= 1 (the message names it);
        from :meth:`configure_train`, a round config that sets ``min-count`` itself."""

    def __init__(self, weighting: str = "equal", min_count: int = DEFAULT_MIN_COUNT, **kwargs) -> None:
        if weighting not in ("samples", "equal"):
            raise InvalidInputError(f"weighting must be 'samples' or 'equal', got {weighting!r}")
        self.min_count = check_min_count(min_count)
        super().__init__(**kwargs)
        self.weighting = weighting
        self.last_updates_: list[tuple[dict[str, np.ndarray], float]] = []
        self.rejected_: list[RejectedReply] = []
        self._broadcast: dict[str, np.ndarray] | None = None

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """FedAvg's messages, their config with ``min-count`` (the privacy threshold the nodes apply);
        keeps ``arrays`` (the parameters the replies must match).

        Raises
        ------
        InvalidInputError
            ``config`` sets ``min-count`` (the strategy's ``min_count`` is the round's threshold).
        """
        if MIN_COUNT_KEY in config:
            raise InvalidInputError(f"train config key {MIN_COUNT_KEY!r} is set by the strategy (min_count="
                                    f"{self.min_count}), got {config[MIN_COUNT_KEY]!r}")
        config = ConfigRecord(dict(config))
        config[MIN_COUNT_KEY] = int(self.min_count)
        self._broadcast = arrays_to_numpy(arrays)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """:func:`aggregate_routers` of the replies that pass the checks (class docstring: names,
        shapes, finite values, ``min_count <= num-examples``); ``(None, None)`` when none does."""
        if self._broadcast is None:
            raise InvalidInputError("aggregate_train called before configure_train")
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)  # checked one by one below
        updates = []
        for m in sorted(valid, key=lambda m: int(m.metadata.src_node_id)):
            try:
                update = (arrays_to_numpy(m.content[ARRAYS_KEY]), float(m.content["metrics"][NUM_EXAMPLES]))
                if not update[0] and update[1] == 0:  # a node below the threshold (make_router_client_app)
                    raise InvalidInputError(f"no update: the node holds fewer than min_count={self.min_count} pairs")
                validate_updates([(self._broadcast, 1.0), update])
                check_sample_count(update[1], self.min_count)  # the HTTPS server's check (PrivacyError)
            except REPLY_ERRORS as exc:  # ShapeError, PrivacyError included; "update 1" is this reply
                reason = reply_reason(exc).removeprefix("update 1: ").replace("update 0", "the round's parameters")
                reject(self.rejected_, server_round, m.metadata.src_node_id, reason)
                continue
            updates.append(update)
        if not updates:
            return None, None
        self.last_updates_ = updates
        agg = aggregate_routers(updates, self.weighting)
        n = sum(u[1] for u in updates)
        return _record(agg), MetricRecord({NUM_EXAMPLES: n})


def make_router_server_app(strategy: RouterFedAvg, initial: ClientRouter, num_rounds: int, result: dict) -> ServerApp:
    """A ServerApp running ``strategy`` for ``num_rounds`` from ``initial``'s parameters; the final
    parameters are stored in ``result["parameters"]`` (name -> ndarray)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        arrays = _record(initial.get_parameters())
        out = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=num_rounds)
        result["parameters"] = arrays_to_numpy(out.arrays)

    return app


def make_router_client_app(clients: Mapping[int, ClientRouterData], config: RouterConfig, d_in: int, n_clients: int) -> ClientApp:
    """A ClientApp: partition ``p`` (``context.node_config["partition-id"]``) trains on ``clients[p]``
    and replies with its router parameters and ``num-examples`` = its pairs; when it holds fewer pairs
    than the round's ``min-count`` (:data:`trainer.federated.update_checks.DEFAULT_MIN_COUNT` when the
    round config has none) it does not train and replies with no array and ``num-examples`` 0, so no
    parameter trained on them leaves the node (design notes).

    Raises (as Flower's error reply)
    ------
    InvalidInputError
        No data for the partition, or a ``min-count`` that is not an int >= 1.
    """
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        if pid not in clients:
            raise InvalidInputError(f"no router data for partition {pid}; known {sorted(clients)}")
        data = clients[pid]
        cfg = msg.content["config"]
        min_count = round_min_count(cfg)
        if data.n_pairs < min_count:  # nothing to send: the privacy threshold is not met
            log(WARNING, "round %s: partition %d holds %d pairs, fewer than min_count=%d: no update sent",
                cfg["server-round"], pid, data.n_pairs, min_count)
            return Message(RecordDict({ARRAYS_KEY: ArrayRecord(), "metrics": MetricRecord({NUM_EXAMPLES: 0})}),
                           reply_to=msg)
        router = ClientRouter(d_in, n_clients, config.hidden, config.dropout)
        router.set_parameters(arrays_to_numpy(msg.content[ARRAYS_KEY]))
        r = int(cfg["server-round"])
        params, n = local_router_update(router, data, config, local_rng(config.seed, r, data.client_index))
        content = RecordDict({ARRAYS_KEY: _record(params),
                              "metrics": MetricRecord({NUM_EXAMPLES: n})})
        return Message(content, reply_to=msg)

    return app
