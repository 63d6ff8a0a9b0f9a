"""The federated K-means router as a Flower App for Flower's deployment engine (``flwr run``).

Design notes: docs/sync-protocol-and-operations.md (Module notes).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from sdk.atomic_write import write_atomic
from sdk.errors import InvalidInputError
from trainer.federated.flower_app import FederatedKMeansStrategy, centroids_record, make_client_app
from trainer.routers.base import read_meta
from trainer.routers.kmeans_router import KMeansRouter

#: File of ``out`` with the run's summary: nodes merged, replies refused, aggregates, epsilon.
SUMMARY_FILE = "flower_run.json"


@dataclass(frozen=True)
class DeployConfig:
    """The ServerApp's run config (design notes); :meth:`from_run_config` checks it."""

    prior_router: Path
    out: Path
    num_server_rounds: int
    centroid_rounds: int
    min_nodes: int
    min_count: int
    round_timeout_s: float

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, object]) -> DeployConfig:
        """Read and check Flower's ``context.run_config``.

        Raises
        ------
        InvalidInputError
            A key is missing, empty or out of range (the message names it).
        """
        def text(key: str) -> Path:
            value = run_config.get(key)
            if not isinstance(value, str) or not value.strip():
                raise InvalidInputError(f"run config {key!r} must name a folder: flwr run --run-config '{key}=\"...\"'")
            return Path(value)

        def whole(key: str, low: int) -> int:
            value = run_config.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidInputError(f"run config {key!r} must be an int >= {low}, got {value!r}")
            return value

        timeout = run_config.get("round-timeout-s")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InvalidInputError(f"run config 'round-timeout-s' must be > 0 seconds, got {timeout!r}")
        return cls(text("prior-router"), text("out"), whole("num-server-rounds", 1), whole("centroid-rounds", 0),
                   whole("min-nodes", 1), whole("min-count", 1), float(timeout))


def run_federation(grid: Grid, config: DeployConfig) -> KMeansRouter:
    """Run ``config.num_server_rounds`` rounds of :class:`FederatedKMeansStrategy` on ``grid`` from the
    prior router's centroids, write the merged router and :data:`SUMMARY_FILE` to ``config.out``, and
    return the router.

    Raises
    ------
    InvalidInputError
        The prior router is not a saved K-means router with an embedder identity, or no round produced
        an aggregate.
    """
    meta = read_meta(config.prior_router)
    if meta.get("kind") != "kmeans":
        raise InvalidInputError(f"{config.prior_router}: a {meta.get('kind')!r} router, not a K-means one")
    embedder = meta.get("embedder")
    if not isinstance(embedder, dict) or not embedder.get("name"):
        raise InvalidInputError(f"{config.prior_router}: the router records no embedder identity "
                                "(fedroute simulate writes one)")
    prior = KMeansRouter.load(config.prior_router)
    strategy = FederatedKMeansStrategy(prior.models, str(embedder["name"]), min_count=config.min_count,
                                       centroid_rounds=config.centroid_rounds, min_train_nodes=config.min_nodes,
                                       min_available_nodes=config.min_nodes)
    strategy.start(grid=grid, initial_arrays=centroids_record(prior.centroids_), num_rounds=config.num_server_rounds,
                   timeout=config.round_timeout_s)
    router = strategy.to_router(prior.prior_strength, prior.model_prior_strength, prior.prior, embedder=embedder)
    router.save(config.out)
    summary = {"nodes": list(strategy.clients_), "aggregates": strategy.n_aggregates_,
               "rejected": [r.reason for r in strategy.rejected_],
               "epsilon": strategy.epsilon_ if math.isfinite(strategy.epsilon_) else None,
               "queries": int(strategy.statistics_.count.sum())}
    write_atomic(config.out / SUMMARY_FILE, json.dumps(summary, indent=1).encode())
    return router


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    run_federation(grid, DeployConfig.from_run_config(context.run_config))


#: Each SuperNode's ClientApp: the update of the EvalLog its node config ``eval-log`` names.
client_app = make_client_app()

__all__ = ["SUMMARY_FILE", "DeployConfig", "client_app", "run_federation", "server_app"]
