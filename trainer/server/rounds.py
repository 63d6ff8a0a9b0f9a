"""Opening and closing federated K-means rounds (ARCHITECTURE.md §4, §6; paper 002); MLP rounds
are in :mod:`trainer.server.mlp_rounds` and closed through :func:`close_round` too.

A round announces a cell partition (global centroids), collects each client's statistics for it,
and closes when ``quorum`` clients have uploaded or at its deadline, whichever comes first. The close
aggregates, per client, the *latest* accepted update for the partition (a client that skips a round
stays counted with its last upload, as in paper 002), so with every client in, the merged statistics
equal those of the pooled logs. It then publishes a new signed bundle when the round was opened with
a bundle to publish to.

- A round where no update arrived closes as a **no-op** (no aggregate, no bundle).
- An upload for a round that is already closing or closed (a **straggler**) is stored and counted
  in the next round of the same partition; if the next round has other centroids, its statistics
  cannot be merged: it is kept in the store and reported as stale in that round's outcome.
- A crash while closing leaves the round ``closing``; the server finishes it on restart with the same
  snapshot of updates, so the outcome does not depend on the crash.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import numpy as np

from sdk.errors import InvalidInputError
from trainer.federated.kmeans_aggregation import AggregationConfig, aggregate_kmeans
from trainer.server.store import Round, Store, array_bytes


def round_settings(
    *,
    aggregation,
    prior_strength: float = 16.0,
    model_prior_strength: float = 10.0,
    prior: str = "additive",
    bundle_dir: Path | None = None,
    signing_key: Path | None = None,
    seed: int = 0,
) -> dict:
    """The JSON settings stored with a round: aggregation options (an
    :class:`~trainer.federated.kmeans_aggregation.AggregationConfig` for K-means rounds, an
    :class:`~trainer.federated.mlp_aggregation.MLPAggregationConfig` for MLP rounds), shrinkage of the
    published K-means router (defaults of :class:`trainer.routers.kmeans_router.KMeansRouterConfig`),
    where to publish and the noise seed.

    Raises
    ------
    InvalidInputError
        Only one of ``bundle_dir`` and ``signing_key`` is given.
    """
    if (bundle_dir is None) != (signing_key is None):
        raise InvalidInputError("publishing needs both a bundle dir and a signing key")
    return {
        "aggregation": dataclasses.asdict(aggregation),
        "prior_strength": float(prior_strength), "model_prior_strength": float(model_prior_strength), "prior": prior,
        "publish": None if bundle_dir is None else {"bundle_dir": str(Path(bundle_dir).absolute()),
                                                    "signing_key": str(Path(signing_key).absolute())},
        "seed": int(seed),
    }


def open_round_from_bundle(
    store: Store,
    bundle_dir: Path,
    public_key,
    *,
    deadline_s: float,
    quorum: int,
    min_count: int,
    settings: dict,
    centroids: np.ndarray | None = None,
) -> Round:
    """Open a K-means round over the partition of the verified bundle at ``bundle_dir`` (or over
    ``centroids``, e.g. the Lloyd step of the previous round, in the bundle's embedding space).

    Raises
    ------
    BundleError
        The bundle does not verify or is not a K-means bundle.
    InvalidInputError
        deadline_s <= 0, quorum < 1, min_count < 1, or centroids of another dimension.
    ValueError
        A round is still open.
    """
    import io

    from trainer.server.publish import read_base_bundle

    if not (math.isfinite(deadline_s) and deadline_s > 0) or quorum < 1 or min_count < 1:
        raise InvalidInputError(f"need deadline_s > 0, quorum >= 1, min_count >= 1; got {deadline_s}, {quorum}, {min_count}")
    bundle = read_base_bundle(bundle_dir, public_key)
    with np.load(io.BytesIO(bundle.files["kmeans.npz"]), allow_pickle=False) as z:
        base_centroids = z["centroids"]
    c = base_centroids if centroids is None else np.asarray(centroids, dtype=np.float32)
    if c.ndim != 2 or c.shape[1] != base_centroids.shape[1]:
        raise InvalidInputError(f"centroids of shape {c.shape} do not live in the bundle's {base_centroids.shape[1]}-d space")
    emb = bundle.manifest["embedder"]
    return store.open_round(
        kind="kmeans", centroids=c, models=[m["id"] for m in bundle.manifest["models"]],
        embedder={"name": emb["name"], "dim": int(emb["dim"]), "bundle_version": bundle.manifest["bundle_version"]},
        deadline_unix=time.time() + float(deadline_s), quorum=quorum, min_count=min_count, settings=settings,
    )


def close_round(store: Store, round_id: int, progress=lambda msg: None) -> dict | None:
    """Close ``round_id``: aggregate, store the aggregate, publish. Returns the outcome, or None if
    the round is already closed (another closer won).

    Outcome keys: ``result`` ("aggregated" or "no-op"), ``on_time_updates``, ``late_updates_counted``,
    ``stale_updates``, and when aggregated ``clients``, ``total_count``, ``epsilon`` (None without
    noise) and ``bundle_version`` (None when the round does not publish).
    """
    snapshot = store.claim_close(round_id)
    if snapshot is None:
        return None
    r = store.get_round(round_id)
    if r.kind == "mlp":
        from trainer.server.mlp_rounds import close_mlp_round

        return close_mlp_round(store, r, snapshot, progress)
    on_time = store.round_updates(round_id)
    waiting = store.waiting_late(snapshot, "kmeans")
    carried = [i for i, h in waiting if h == r.centroids_hash]
    stale = [i for i, h in waiting if h != r.centroids_hash]
    outcome = {"on_time_updates": len(on_time), "late_updates_counted": len(carried), "stale_updates": len(stale)}
    if not on_time and not carried:
        outcome["result"] = "no-op"
        store.finish_close(round_id, outcome, None, [], stale)
        progress(f"round {round_id}: no update arrived; closed as a no-op")
        return outcome
    latest = store.latest_updates(r.centroids_hash, up_to_id=snapshot)
    settings = r.settings
    config = AggregationConfig(**settings["aggregation"])
    rng = np.random.default_rng([int(settings.get("seed", 0)), round_id])
    agg = aggregate_kmeans(r.centroids, {cid: u for cid, (_, u) in latest.items()}, config, rng)
    outcome.update(result="aggregated", clients=list(agg.clients), total_count=float(agg.statistics.count.sum()),
                   epsilon=None if math.isinf(agg.epsilon) else agg.epsilon, bundle_version=None)
    if settings.get("publish"):
        from trainer.server.publish import publish_kmeans

        manifest = publish_kmeans(
            Path(settings["publish"]["bundle_dir"]), Path(settings["publish"]["signing_key"]), r.centroids,
            agg.statistics, prior_strength=settings["prior_strength"],
            model_prior_strength=settings["model_prior_strength"], prior=settings["prior"],
            provenance={"federated_round": round_id, "clients": len(agg.clients)},
        )
        outcome["bundle_version"] = manifest["bundle_version"]
    aggregate = array_bytes(count=agg.statistics.count, sum_accuracy=agg.statistics.sum_accuracy,
                            sum_cost=agg.statistics.sum_cost, next_centroids=agg.next_centroids,
                            cell_weights=agg.cell_weights, centroids=r.centroids)
    store.finish_close(round_id, outcome, aggregate, carried, stale)
    progress(f"round {round_id}: aggregated {len(agg.clients)} clients "
             f"({outcome['total_count']:.0f} evaluations); bundle v{outcome['bundle_version']}")
    return outcome


def close_due_rounds(store: Store, now: float | None = None, progress=lambda msg: None) -> list[dict]:
    """Close every round that is due (deadline passed, quorum reached, or left closing)."""
    done = []
    for rid in store.rounds_to_close(time.time() if now is None else now):
        outcome = close_round(store, rid, progress)
        if outcome is not None:
            done.append({"round_id": rid, **outcome})
    return done
