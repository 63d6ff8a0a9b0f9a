"""FedPrism's per-component aggregation as a Flower strategy (message API, ``flwr >= 1.21``).

The maths is :func:`trainer.experts.aggregation.aggregate_components` (each expert averaged over the
nodes that updated it, weighted by its samples) and :func:`trainer.routers.fedavg.fedavg` for the router.

Wire format
-----------
- Server -> node (``"train"``): ``arrays["arrays"]`` holds the router (``router/<name>``) and only the
  experts the node asked for (``expert-<k>/<name>``; every expert for a node not heard from yet):
  **sparse retrieval**. ``config["config"]``: ``round-id``, ``experts`` (the experts sent), ``pgpd``
  (bool: distil the router), ``min-count`` (the privacy threshold).
- Node -> server: ``arrays["arrays"]`` with the updated experts and, after PGPD, the router, leaving out
  any trained on ``0 < n < min-count`` samples; ``metrics["metrics"]``: ``n-expert-<k>``, ``n-router``
  (0 if none); ``config["config"]``: ``needs`` (the experts its samples route to, for the next round).

Deviation from paper 000 (Step 1 routes with the current round's router): a node's request is the
``needs`` it reported at the end of its previous round, which saves a round trip; ``local_step`` leaves
out samples routed to an expert it was not sent. ``local_step(experts, router, pgpd, partition_id) ->
(updates, router or None, n_router, needs)`` with ``{k: params}`` / ``{k: (params, n)}``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from logging import INFO

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from sdk.errors import InvalidInputError, PrivacyError, ShapeError
from trainer.experts.aggregation import aggregate_components, validate_component_update
from trainer.federated.rejected_reply import REPLY_ERRORS, RejectedReply, reject, reply_reason
from trainer.federated.update_checks import (
    DEFAULT_MIN_COUNT,
    MIN_COUNT_KEY,
    check_min_count,
    check_sample_count,
    round_min_count,
)
from trainer.routers.fedavg import fedavg, validate_updates

ARRAYS_KEY = "arrays"
CONFIG_KEY = "config"
METRICS_KEY = "metrics"

Params = dict[str, np.ndarray]
LocalStep = Callable[[dict[int, Params], Params, bool, int], tuple[dict[int, tuple[Params, float]], "Params | None", float, list[int]]]


def pack(experts: dict[int, Params], router: Params | None) -> ArrayRecord:
    """Experts and router as one ArrayRecord (``expert-<k>/<name>``, ``router/<name>``)."""
    out = {f"expert-{k}/{n}": Array(np.asarray(v, dtype=np.float32)) for k, p in experts.items() for n, v in p.items()}
    if router is not None:
        out.update({f"router/{n}": Array(np.asarray(v, dtype=np.float32)) for n, v in router.items()})
    return ArrayRecord(out)


def unpack(record: ArrayRecord) -> tuple[dict[int, Params], Params | None]:
    """Inverse of :func:`pack`.

    Raises
    ------
    ShapeError
        A key is neither ``expert-<k>/<name>`` nor ``router/<name>``.
    """
    experts: dict[int, Params] = {}
    router: Params = {}
    for key in record:
        head, _, name = key.partition("/")
        value = record[key].numpy()
        if head == "router" and name:
            router[name] = value
        elif head.startswith("expert-") and head[7:].isdigit() and name:
            experts.setdefault(int(head[7:]), {})[name] = value
        else:
            raise ShapeError(f"unexpected array key {key!r}; expected 'expert-<k>/<name>' or 'router/<name>'")
    return experts, (router or None)


class FedPrismStrategy(Strategy):
    """Per-component aggregation with sparse retrieval over Flower (module docstring).

    Parameters
    ----------
    experts : sequence of n_experts parameter dicts, the initial experts.
    router : parameter dict, the initial router.
    pgpd_rounds : set of round numbers in which nodes distil the router (PGPD).
    min_nodes : int >= 1, nodes sampled each round (all connected nodes when fewer).
    rng : numpy Generator for node sampling.
    min_count : int >= 1, the privacy threshold (samples): a component (one expert, or the PGPD
        router) trained on ``0 < n < min_count`` samples is dropped (:meth:`aggregate_train`);
        default :data:`trainer.federated.update_checks.DEFAULT_MIN_COUNT` (5, the HTTPS server's
        default round ``min_count``). The nodes are not told it: a node below it trains and the
        component is dropped here.

    Attributes
    ----------
    experts_ : list of parameter dicts; router_ : parameter dict; needs_ : dict node -> list of int;
    sent_ : list of (round, node, experts sent) -- the sparse retrieval log;
    rejected_ : list of :class:`trainer.federated.rejected_reply.RejectedReply`, the replies dropped
    (:meth:`aggregate_train`), one entry per dropped component.

    Raises
    ------
    InvalidInputError
        No expert, or a ``min_count`` that is not an int >= 1 (the message names it).
    """

    def __init__(self, experts: Sequence[Params], router: Params, pgpd_rounds: Iterable[int] = (),
                 min_nodes: int = 1, rng: np.random.Generator | None = None,
                 min_count: int = DEFAULT_MIN_COUNT) -> None:
        if not experts:
            raise InvalidInputError("FedPrismStrategy needs at least one expert")
        self.min_count = check_min_count(min_count)
        self.experts_ = [dict(e) for e in experts]
        self.router_ = dict(router)
        self.pgpd_rounds = frozenset(int(t) for t in pgpd_rounds)
        self.min_nodes = min_nodes
        self._rng = rng or np.random.default_rng()
        self.needs_: dict[int, list[int]] = {}
        self.sent_: list[tuple[int, int, list[int]]] = []
        self.rejected_: list[RejectedReply] = []

    def summary(self) -> None:
        log(INFO, "\t└──> FedPrism: %d experts, PGPD rounds %s", len(self.experts_), sorted(self.pgpd_rounds))

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """One message per sampled node with the router and the experts it needs."""
        _, connected = sample_nodes(grid, self.min_nodes, 0)
        connected = sorted(connected)
        size = min(len(connected), self.min_nodes)
        nodes = [connected[i] for i in sorted(self._rng.choice(len(connected), size=size, replace=False))]
        messages = []
        for node in nodes:
            want = self.needs_.get(node, list(range(len(self.experts_))))
            self.sent_.append((server_round, node, list(want)))
            cfg = ConfigRecord({"round-id": int(server_round), "experts": [int(k) for k in want],
                                "pgpd": server_round in self.pgpd_rounds, MIN_COUNT_KEY: int(self.min_count)})
            content = RecordDict({ARRAYS_KEY: pack({k: self.experts_[k] for k in want}, self.router_), CONFIG_KEY: cfg})
            messages.append(Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Per-component aggregation of the experts, FedAvg of the PGPD routers; records each node's needs.

        A malformed reply, or one that used no sample, is dropped and listed in :attr:`rejected_` (its
        ``needs`` are still recorded); the round goes on with the others. Then each expert (``n-expert-<k>``)
        and PGPD router (``n-router``) of a reply is checked on its own with
        :func:`trainer.federated.update_checks.check_sample_count` (each expert is a parameter set trained only
        on the samples routed to it): one of ``0 < n < min_count`` samples is left out and listed. A reply left
        with nothing to aggregate does not count as a node."""
        updates, routers = [], []
        for msg in replies:
            if msg.has_error():
                continue
            try:
                update, router, needs = self._read_reply(msg)
            except REPLY_ERRORS as exc:  # ShapeError included
                reject(self.rejected_, server_round, msg.metadata.src_node_id, reply_reason(exc))
                continue
            self.needs_[msg.metadata.src_node_id] = needs
            if router is None and not any(n > 0 for _, n in update.values()):
                reject(self.rejected_, server_round, msg.metadata.src_node_id,
                       "the reply used no sample (every n-expert-<k> and n-router is 0): nothing to aggregate")
                continue
            update, router = self._apply_min_count(server_round, msg, update, router)
            if router is None and not any(n > 0 for _, n in update.values()):
                continue  # every component it used was below min_count (each listed): not a node
            updates.append(update)
            if router is not None:
                routers.append(router)
        if not updates:
            return None, None
        self.experts_ = aggregate_components(self.experts_, updates)
        if routers:
            self.router_ = {k: v.astype(np.float32) for k, v in fedavg(routers).items()}
        return pack(dict(enumerate(self.experts_)), self.router_), MetricRecord({"nodes": len(updates)})

    def _apply_min_count(self, server_round: int, msg: Message, update: dict[int, tuple[Params, float]],
                         router: tuple[Params, float] | None
                         ) -> tuple[dict[int, tuple[Params, float]], tuple[Params, float] | None]:
        """``(update, router)`` without the components below ``min_count``, each listed in :attr:`rejected_`."""
        kept = {}
        for k, (params, n) in update.items():
            try:
                if n > 0:
                    check_sample_count(n, self.min_count)
            except PrivacyError as exc:
                reject(self.rejected_, server_round, msg.metadata.src_node_id, f"expert {k}: {exc}", "expert")
                continue
            kept[k] = (params, n)
        if router is not None:
            try:
                check_sample_count(router[1], self.min_count)  # n_router > 0 here (_read_reply)
            except PrivacyError as exc:
                reject(self.rejected_, server_round, msg.metadata.src_node_id, f"router: {exc}", "router")
                router = None
        return kept, router

    def _read_reply(self, msg: Message) -> tuple[dict[int, tuple[Params, float]], tuple[Params, float] | None,
                                                 list[int]]:
        """``(expert updates, (router, n_router) or None, needs)`` of a reply, checked against the
        current experts and router (:func:`validate_component_update`, :func:`validate_updates`).

        Raises
        ------
        InvalidInputError
            A bad expert index or count (negative, NaN), or a router sent with ``n-router`` < 0.
        ShapeError
            Names or shapes that differ from the current ones (empty arrays included), NaN/inf.
        KeyError, TypeError, ValueError
            A missing or non-numeric metric or ``needs``.
        """
        experts, router = unpack(msg.content[ARRAYS_KEY])
        metrics = msg.content[METRICS_KEY]
        update = {k: (p, float(metrics[f"n-expert-{k}"])) for k, p in experts.items()}
        validate_component_update(self.experts_, update, "reply")
        n_router = float(metrics["n-router"]) if router is not None else 0.0
        routed = None
        if router is not None and n_router != 0:
            try:  # n_router finite and > 0 too
                validate_updates([(self.router_, 1.0), (router, n_router)])
            except InvalidInputError as exc:
                detail = str(exc).removeprefix("update 1: ").replace("update 0", "the current router")
                raise type(exc)(f"router: {detail}") from exc
            routed = (router, n_router)
        needs = [int(k) for k in msg.content[CONFIG_KEY]["needs"]]
        return update, routed, needs

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """No federated evaluation (FedPrism is scored offline on held-out pairs)."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None


def make_server_app(strategy: FedPrismStrategy, num_rounds: int, timeout: float = 600.0) -> ServerApp:
    """A ``ServerApp`` running ``strategy`` for ``num_rounds`` rounds; results are read from ``strategy``."""
    if not isinstance(num_rounds, int) or num_rounds < 1:
        raise InvalidInputError(f"num_rounds must be an int >= 1, got {num_rounds!r}")
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, initial_arrays=pack(dict(enumerate(strategy.experts_)), strategy.router_),
                       num_rounds=num_rounds, timeout=timeout)

    return app


def make_client_app(local_step: LocalStep) -> ClientApp:
    """A ``ClientApp`` that runs ``local_step`` on the experts and router it receives (module docstring)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        experts, router = unpack(msg.content[ARRAYS_KEY])
        cfg = msg.content[CONFIG_KEY]
        pid = int(context.node_config["partition-id"])
        updates, new_router, n_router, needs = local_step(experts, router or {}, bool(cfg["pgpd"]), pid)
        unknown = sorted(set(updates) - set(experts))
        if unknown:
            raise InvalidInputError(f"local_step updated experts {unknown} it was not sent")
        # the round's privacy threshold: a component trained on 0 < n < min-count samples stays on the node
        min_count = round_min_count(cfg)
        updates = {k: (p, n) for k, (p, n) in updates.items() if not 0 < n < min_count}
        if new_router is not None and 0 < n_router < min_count:
            new_router = None
        metrics = {f"n-expert-{k}": float(n) for k, (_, n) in updates.items()}
        metrics["n-router"] = float(n_router if new_router is not None else 0.0)
        content = RecordDict({ARRAYS_KEY: pack({k: p for k, (p, _) in updates.items()}, new_router),
                              METRICS_KEY: MetricRecord(metrics),
                              CONFIG_KEY: ConfigRecord({"needs": [int(k) for k in needs]})})
        return Message(content, reply_to=msg)

    return app
