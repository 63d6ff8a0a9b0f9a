"""FedVPA-GP's round as a Flower strategy (message API, ``flwr >= 1.21``).

The maths is :func:`trainer.vpa.aggregation.aggregate_round` (FedAvg of encoder + reward head weighted by
users, prototypes weighted by soft-assignment mass); this module only carries it over Flower, as
:mod:`trainer.experts.flower_strategy` does for FedPrism.

Wire format
-----------
- Server -> node (``"train"``): ``arrays["arrays"]`` holds ``model/<name>`` (encoder + reward head) and, under
  the mixture prior, ``prototypes/mu``, ``prototypes/logvar`` (K, d_z) and ``prototypes/pi`` (K,);
  ``config["config"]``: ``round-id`` (int).
- Node -> server: ``arrays["arrays"]`` with ``model/<name>`` and, under the mixture prior, ``stats/mass`` (K,),
  ``stats/sum_mu``, ``stats/sum_sq`` (K, d_z); ``metrics["metrics"]``: ``n-examples`` (its training users).
  Nothing else: the node's context pairs, labels and latents stay on it.
- A reply that fails the checks (:func:`trainer.routers.fedavg.validate_updates`,
  :func:`trainer.vpa.aggregation.validate_prototype_stats`, or a missing key) is dropped, logged and listed
  in ``rejected_``; the round goes on with the others.

The node's work is a callable ``local_step(params, prototypes or None, partition_id, round_id) -> ClientUpdate``;
:meth:`trainer.vpa.trainer.VPATrainer.local_vpa_step` is the in-process equivalent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from sdk.errors import InvalidInputError
from trainer.federated.rejected_reply import REPLY_ERRORS, RejectedReply, reject, reply_reason
from trainer.routers.fedavg import fedavg, validate_updates
from trainer.vpa.aggregation import ClientUpdate, PrototypeStats, Prototypes, aggregate_prototypes, validate_prototype_stats

ARRAYS_KEY, CONFIG_KEY, METRICS_KEY = "arrays", "config", "metrics"
LocalStep = Callable[[dict[str, np.ndarray], "Prototypes | None", int, int], ClientUpdate]


def pack_global(params: dict[str, np.ndarray], protos: Prototypes | None) -> ArrayRecord:
    """Server -> node arrays (module docstring)."""
    out = {f"model/{k}": Array(np.asarray(v, dtype=np.float32)) for k, v in params.items()}
    if protos is not None:
        out.update({f"prototypes/{k}": Array(np.asarray(getattr(protos, k), dtype=np.float64)) for k in ("mu", "logvar", "pi")})
    return ArrayRecord(out)


def unpack_global(record: ArrayRecord) -> tuple[dict[str, np.ndarray], Prototypes | None]:
    """Inverse of :func:`pack_global`."""
    params = {k[6:]: record[k].numpy() for k in record if k.startswith("model/")}
    if "prototypes/mu" not in record:
        return params, None
    return params, Prototypes(**{k: record[f"prototypes/{k}"].numpy() for k in ("mu", "logvar", "pi")})


def pack_update(update: ClientUpdate) -> RecordDict:
    """Node -> server reply content (module docstring)."""
    arrays = {f"model/{k}": Array(np.asarray(v, dtype=np.float32)) for k, v in update.params.items()}
    if update.prototypes is not None:
        arrays.update({f"stats/{k}": Array(np.asarray(getattr(update.prototypes, k), dtype=np.float64))
                       for k in ("mass", "sum_mu", "sum_sq")})
    return RecordDict({ARRAYS_KEY: ArrayRecord(arrays), METRICS_KEY: MetricRecord({"n-examples": float(update.n_examples)})})


def unpack_update(content: RecordDict) -> ClientUpdate:
    """Inverse of :func:`pack_update`. Raises KeyError for a missing record or key."""
    record = content[ARRAYS_KEY]
    params = {k[6:]: record[k].numpy() for k in record if k.startswith("model/")}
    stats = None
    if "stats/mass" in record:
        stats = PrototypeStats(**{k: record[f"stats/{k}"].numpy() for k in ("mass", "sum_mu", "sum_sq")})
    return ClientUpdate(params=params, n_examples=float(content[METRICS_KEY]["n-examples"]), prototypes=stats)


class FedVPAStrategy(Strategy):
    """FedAvg of the encoder and reward head, mass-weighted prototypes (module docstring).

    Parameters
    ----------
    params : the initial encoder + reward-head parameters. prototypes : the initial mixture prior, or None (VPL).
    min_nodes : int >= 1, nodes sampled each round (all connected nodes when fewer). rng : numpy Generator for sampling.

    Attributes
    ----------
    params_, prototypes_ : the global model after the last round; rejected_ : list of RejectedReply.
    """

    def __init__(self, params: dict[str, np.ndarray], prototypes: Prototypes | None, min_nodes: int = 1,
                 rng: np.random.Generator | None = None) -> None:
        self.params_ = dict(params)
        self.prototypes_ = prototypes
        self.min_nodes = min_nodes
        self._rng = rng or np.random.default_rng()
        self.rejected_: list[RejectedReply] = []

    def summary(self) -> None:
        k = "none (VPL)" if self.prototypes_ is None else f"K = {len(self.prototypes_.pi)}"
        log(INFO, "\t└──> FedVPA-GP: %d tensors, prototypes %s", len(self.params_), k)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """One message per sampled node with the global model and prototypes."""
        _, connected = sample_nodes(grid, self.min_nodes, 0)
        connected = sorted(connected)
        size = min(len(connected), self.min_nodes)
        nodes = [connected[i] for i in sorted(self._rng.choice(len(connected), size=size, replace=False))]
        content = RecordDict({ARRAYS_KEY: pack_global(self.params_, self.prototypes_),
                              CONFIG_KEY: ConfigRecord({"round-id": int(server_round)})})
        return [Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN) for node in nodes]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check every reply on its own, drop the bad ones (listed in ``rejected_``), aggregate the rest."""
        updates = []
        ref = [(self.params_, 1.0)]
        for msg in replies:
            if msg.has_error():
                continue
            try:
                update = unpack_update(msg.content)
                validate_updates(ref + [(update.params, update.n_examples)])
                if self.prototypes_ is not None:
                    if update.prototypes is None:
                        raise InvalidInputError("the reply carries no prototype statistics")
                    validate_prototype_stats([update.prototypes], *self.prototypes_.mu.shape)
            except REPLY_ERRORS as exc:  # ShapeError included
                reject(self.rejected_, server_round, msg.metadata.src_node_id, reply_reason(exc))
                continue
            updates.append(update)
        if not updates:
            return None, None
        self.params_ = fedavg([(u.params, u.n_examples) for u in updates])
        if self.prototypes_ is not None:
            self.prototypes_ = aggregate_prototypes([u.prototypes for u in updates], self.prototypes_)
        return pack_global(self.params_, self.prototypes_), MetricRecord({"n-nodes": len(updates)})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None


def client_app(local_step: LocalStep) -> ClientApp:
    """A Flower ClientApp whose ``train`` runs ``local_step`` on the node's partition (``node_config['partition-id']``)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        params, protos = unpack_global(msg.content[ARRAYS_KEY])
        pid = int(context.node_config["partition-id"])
        update = local_step(params, protos, pid, int(msg.content[CONFIG_KEY]["round-id"]))
        return Message(pack_update(update), reply_to=msg)

    return app


__all__ = ["FedVPAStrategy", "client_app", "pack_global", "pack_update", "unpack_global", "unpack_update"]
