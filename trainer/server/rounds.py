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
import os
import secrets
import time
from collections.abc import Collection
from pathlib import Path

import numpy as np

from sdk.cell_statistics import CellStatistics
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
    seed: int | None = None,
    min_total_count: int = 1,
    prior_statistics: CellStatistics | None = None,
) -> dict:
    """The JSON settings stored with a round: aggregation options (an
    :class:`~trainer.federated.kmeans_aggregation.AggregationConfig` for K-means rounds, an
    :class:`~trainer.federated.mlp_aggregation.MLPAggregationConfig` for MLP rounds), shrinkage of the
    published K-means router (defaults of :class:`trainer.routers.kmeans_router.KMeansRouterConfig`),
    where to publish, the smallest total count worth publishing, statistics already published to
    merge in (``prior_statistics``, e.g. the shipped router's: without them the first round's router
    knows only that round's clients), and the noise seed: secret by default (random, kept on the
    server; whoever knows it can subtract the noise).

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
        "seed": secrets.randbits(63) if seed is None else int(seed),
        "round_uid": secrets.token_hex(8),  # identifies the round across databases (idempotent publishing)
        "min_total_count": int(min_total_count),
        "prior_statistics": None if prior_statistics is None else {
            "count": prior_statistics.count.tolist(), "sum_accuracy": prior_statistics.sum_accuracy.tolist(),
            "sum_cost": prior_statistics.sum_cost.tolist()},
    }


def check_round_args(deadline_s: float, quorum: int, min_count: int) -> None:
    """Raise InvalidInputError unless 0 < deadline_s <= MAX_DEADLINE_S, quorum >= 1, min_count >= 1."""
    if not (math.isfinite(deadline_s) and 0 < deadline_s <= MAX_DEADLINE_S) or quorum < 1 or min_count < 1:
        raise InvalidInputError(f"need 0 < deadline_s <= {MAX_DEADLINE_S:.0f} (a year), quorum >= 1, min_count >= 1; "
                                f"got {deadline_s}, {quorum}, {min_count}")


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

    check_round_args(deadline_s, quorum, min_count)
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


#: Longest round (seconds): deadlines stay representable as dates (a year).
MAX_DEADLINE_S = 366 * 86400.0


#: Failed close attempts after which a round is closed as "failed" (its updates stay stored), and
#: the first wait before retrying (doubled after each failure): 30 s, 60 s, then failed.
MAX_CLOSE_ATTEMPTS = 3
CLOSE_RETRY_S = 30.0


def close_round(store: Store, round_id: int, progress=lambda msg: None, owner: str | None = None,
                force: bool = False) -> dict | None:
    """Close ``round_id``: aggregate, store the aggregate, publish. Returns the outcome, or None if
    the round is closed already or another closer holds it (see :meth:`Store.claim_close`).

    Outcome keys: ``result`` ("aggregated", "no-op" or "failed"), ``on_time_updates``,
    ``late_updates_counted``, ``stale_updates``, and when aggregated ``clients`` (omitted under DP
    noise), ``total_count``, ``epsilon`` (None without noise), ``bundle_version`` (None when nothing
    was published) and ``publish_skipped`` (why not, when the round publishes but did not).
    """
    owner = owner or f"closer-{os.getpid()}-{secrets.token_hex(4)}"
    snapshot = store.claim_close(round_id, owner, force=force)
    if snapshot is None:
        return None
    r = store.get_round(round_id)
    if r.kind == "mlp":
        from trainer.server.mlp_rounds import close_mlp_round

        return close_mlp_round(store, r, snapshot, owner, progress)
    on_time = store.round_updates(round_id)
    waiting = store.waiting_late(snapshot, "kmeans")
    carried = [i for i, h, _ in waiting if h == r.centroids_hash]
    stale = [i for i, h, _ in waiting if h != r.centroids_hash]
    outcome = {"on_time_updates": len(on_time), "late_updates_counted": len(carried), "stale_updates": len(stale)}
    latest = store.latest_updates(r.centroids_hash, up_to_id=snapshot)
    if not latest or (not on_time and not carried):
        outcome["result"] = "no-op"
        if store.finish_close(round_id, outcome, None, [], stale, owner):
            progress(f"round {round_id}: no update arrived; closed as a no-op")
            return outcome
        return None
    settings = r.settings
    config = AggregationConfig(**settings["aggregation"])
    rng = np.random.default_rng([int(settings["seed"]), round_id])
    agg = aggregate_kmeans(r.centroids, {cid: u for cid, (_, u) in latest.items()}, config, rng)
    stats = agg.statistics
    if settings.get("prior_statistics"):  # already published: merged after the noise
        p = settings["prior_statistics"]
        stats = CellStatistics.merge([stats, CellStatistics(np.array(p["count"]), np.array(p["sum_accuracy"]),
                                                            np.array(p["sum_cost"]))])
    noisy = not math.isinf(agg.epsilon)
    outcome.update(result="aggregated", total_count=float(stats.count.sum()),
                   epsilon=None if not noisy else agg.epsilon, bundle_version=None)
    if not noisy:  # under DP the exact number of participants would leak membership
        outcome["clients"] = list(agg.clients)
    federated = float(agg.statistics.count.sum())
    if settings.get("publish") and (federated < settings.get("min_total_count", 1) or (not noisy and len(agg.clients) < 2)):
        # Checked on the federated part (the prior is public): one client's statistics are never
        # published alone, nor a handful of evaluations.
        outcome["publish_skipped"] = (f"{federated:.0f} federated evaluations from {len(agg.clients)} client(s): "
                                      f"need min_total_count={settings.get('min_total_count', 1)} and, without "
                                      "noise, at least 2 clients")
    elif settings.get("publish"):
        from trainer.server.publish import PublishRefused, publish_kmeans

        try:
            manifest = publish_kmeans(
                Path(settings["publish"]["bundle_dir"]), Path(settings["publish"]["signing_key"]), r.centroids, stats,
                prior_strength=settings["prior_strength"], model_prior_strength=settings["model_prior_strength"],
                prior=settings["prior"], embedder=r.embedder, min_total_count=0,
                provenance={"federated_round": round_id, "round_uid": settings.get("round_uid"),
                            **({} if noisy else {"clients": len(agg.clients)})},
            )
            outcome["bundle_version"] = manifest["bundle_version"]
        except PublishRefused as exc:
            outcome["publish_skipped"] = str(exc)
    aggregate = array_bytes(count=stats.count, sum_accuracy=stats.sum_accuracy, sum_cost=stats.sum_cost,
                            next_centroids=agg.next_centroids, cell_weights=agg.cell_weights, centroids=r.centroids)
    if not store.finish_close(round_id, outcome, aggregate, carried, stale, owner):
        return None
    prior = outcome["total_count"] - federated  # the prior router's statistics are not the clients' evaluations
    progress(f"round {round_id}: aggregated {len(agg.clients)} clients ({federated:.0f} evaluations"
             f"{f', plus {prior:.0f} of the prior' if prior else ''}); " + (
                 f"bundle v{outcome['bundle_version']}" if outcome["bundle_version"] is not None else
                 f"nothing published ({outcome.get('publish_skipped', 'round opened without --signing-key')})"))
    return outcome


def close_due_rounds(store: Store, now: float | None = None, progress=lambda msg: None,
                     owner: str | None = None, takeover: Collection[int] = ()) -> list[dict]:
    """Close every round that is due (deadline passed, quorum reached, or left closing), as ``owner``;
    rounds in ``takeover`` (left closing by a crashed server) are taken over even if their lease
    has not run out. A close that raises is retried after ``CLOSE_RETRY_S * 2**(failures - 1)``
    seconds; after :data:`MAX_CLOSE_ATTEMPTS` failures the round is closed as ``"failed"`` (with the error; its
    updates stay stored) so a new round can open."""
    import logging

    done = []
    now = time.time() if now is None else now
    for rid in store.rounds_to_close(now):
        failures, last_failure = store.close_failures(rid)
        if failures and now < last_failure + CLOSE_RETRY_S * 2 ** (failures - 1):
            continue  # back off: a transient error (a locked database, a full disk) gets time to clear
        try:
            outcome = close_round(store, rid, progress, owner=owner, force=rid in takeover)
        except Exception as exc:
            failures = store.record_close_failure(rid, now)
            logging.getLogger("fedroute.server").exception("closing round %s failed (attempt %s)", rid, failures)
            if failures < MAX_CLOSE_ATTEMPTS or owner is None:
                continue
            outcome = {"result": "failed", "error": f"{type(exc).__name__}: {exc}"[:500]}
            if not store.finish_close(rid, outcome, None, [], [], owner):
                continue
        if outcome is not None:
            done.append({"round_id": rid, **outcome})
    return done
