"""Federated K-means rounds (ARCHITECTURE.md §4, §6; paper 002): the ``kmeans`` server round kind.

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

Uploads are JSON or MessagePack (:mod:`trainer.server.validation`). Publishing rebuilds the
trainer's :class:`~trainer.routers.kmeans_router.KMeansRouter` from the merged statistics and
hands it to the server's publisher.
"""

from __future__ import annotations

import io
import math
import time
import zipfile
from pathlib import Path

import numpy as np

from sdk import bundle_manifest as fmt
from sdk.cell_statistics import CellStatistics
from sdk.errors import BundleError, InvalidInputError, PrivacyError
from sdk.protocol import (KMeansUpdate, centroids_hash, decode_kmeans_update_record, encode_kmeans_round,
    encode_kmeans_update_record)
from trainer.federated.kmeans_aggregation import AggregationConfig, aggregate_kmeans
from trainer.federated.update_checks import check_difference
from trainer.routers.kmeans_router import KMeansRouter
from trainer.server.errors import PublishRefused, UploadRejected
from trainer.server.pool_changes import align_to_pool
from trainer.server.round_kind import (AcceptedUpload, OpenRequest, ParsedUpload, Publisher, RoundOutcome,
    RoundSettings, ServerRoundKind, check_round_args, common_description, round_settings)
from trainer.server.store import Round, Store, array_bytes
from trainer.server.validation import (JSON_TYPES, MSGPACK_TYPES, decode_body, parse_kmeans_body, record_pairs,
    validate_update)

KMEANS_FILE = "kmeans.npz"


def read_base_bundle(bundle_dir: Path, public_key) -> fmt.VerifiedBundle:
    """The verified K-means bundle at ``bundle_dir`` (all files).

    Raises
    ------
    BundleError
        The bundle does not verify or is not a K-means bundle.
    """
    bundle = fmt.read_verified(bundle_dir, public_key)
    held = bundle.manifest.get("router_kind")  # the manifest's format is verified, its kinds are not
    if held != KMeansRoundKind.name:
        raise BundleError(f"{bundle_dir}: router_kind is {held!r}; federated K-means rounds start from a "
                          "K-means bundle")
    return bundle


def bundle_centroids(bundle: fmt.VerifiedBundle) -> np.ndarray:
    """The centroids (n_cells, d_emb) of a verified K-means bundle."""
    with np.load(io.BytesIO(bundle.files[KMEANS_FILE]), allow_pickle=False) as z:
        return z["centroids"]


def open_round_from_bundle(
    store: Store,
    bundle_dir: Path,
    public_key,
    *,
    deadline_s: float,
    quorum: int,
    min_count: int,
    settings: RoundSettings,
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
    check_round_args(deadline_s, quorum, min_count)
    bundle = read_base_bundle(bundle_dir, public_key)
    base_centroids = bundle_centroids(bundle)
    c = base_centroids if centroids is None else np.asarray(centroids, dtype=np.float32)
    if c.ndim != 2 or c.shape[1] != base_centroids.shape[1]:
        raise InvalidInputError(f"centroids of shape {c.shape} do not live in the bundle's {base_centroids.shape[1]}-d space")
    emb = bundle.manifest["embedder"]
    return store.open_round(
        kind=KMeansRoundKind.name, centroids=c, models=[m["id"] for m in bundle.manifest["models"]],
        embedder={"name": emb["name"], "dim": int(emb["dim"]), "bundle_version": bundle.manifest["bundle_version"]},
        deadline_unix=time.time() + float(deadline_s), quorum=quorum, min_count=min_count, settings=settings,
    )


def publish_refusal(federated: float, n_clients: int | None, min_total_count: float) -> str | None:
    """Why an aggregate of ``federated`` evaluations (the clients' part: the prior router's statistics
    are public) from ``n_clients`` clients (None under DP noise, which allows one) is not published,
    else None: one client's statistics are never published alone, nor a handful of evaluations."""
    if federated >= min_total_count and (n_clients is None or n_clients >= 2):
        return None
    source = "" if n_clients is None else f" from {n_clients} client(s)"
    return (f"{federated:.0f} federated evaluations{source}: need min_total_count={min_total_count:g} and, without "
            "noise, at least 2 clients")


def publish_kmeans(
    publisher: Publisher,
    bundle_dir: Path,
    signing_key: Path,
    centroids,
    statistics: CellStatistics,
    *,
    prior_strength: float,
    model_prior_strength: float,
    prior: str,
    provenance: dict,
    embedder: dict | None = None,
    min_total_count: float = 1,
) -> dict:
    """Publish (through ``publisher``) the K-means router built from ``statistics`` over ``centroids``.

    Refused (:class:`PublishRefused`) when the statistics hold fewer than ``min_total_count``
    evaluations, or no evaluation of a model that the current bundle has data for: devices would
    stop routing to that model for good (it would never be chosen, so never observed again).

    Parameters
    ----------
    publisher : the server's :class:`~trainer.server.round_kind.Publisher`.
    centroids : ndarray of shape (n_cells, d_emb), float32, the round's partition.
    statistics : merged CellStatistics of shape (n_cells, n_models).
    prior_strength, model_prior_strength, prior : shrinkage of the cell means
        (:func:`trainer.routers.shrinkage.shrunk_means`).
    provenance : JSON-able facts recorded in the manifest (round id, clients).

    Raises
    ------
    BundleError
        The current bundle does not verify with the signing key's public key, or is not K-means.
    ExportError
        The signing key is unreadable (raised by the publisher).
    PublishRefused
        See above, or the bundle no longer fits the router (see the publisher).
    """
    base = read_base_bundle(bundle_dir, publisher.public_key(signing_key))
    models = [m["id"] for m in base.manifest["models"]]
    if statistics.n_models != len(models):
        raise PublishRefused(f"the bundle's model pool {models} changed while the round ran (its statistics have "
                             f"{statistics.n_models} models): open a new round over the new bundle")
    total = float(statistics.count.sum())
    if total < min_total_count:
        raise PublishRefused(f"{total:.0f} evaluations, below min_total_count={min_total_count:g}")
    with np.load(io.BytesIO(base.files[KMEANS_FILE]), allow_pickle=False) as z:
        had = z["count"].sum(axis=0) > 0
    lost = [m for m, h, n in zip(models, had, statistics.count.sum(axis=0)) if h and n == 0]
    if lost:
        raise PublishRefused(f"no evaluation of {lost} (the current bundle has some): open the round with the "
                             "shipped statistics merged in (--prior-router) or wait for more clients")
    router = KMeansRouter(centroids, statistics, models, prior_strength, model_prior_strength, prior)
    return publisher.publish(bundle_dir, signing_key, router, provenance, embedder, base=base)


class KMeansRoundKind(ServerRoundKind):
    """``router/kmeans`` rounds: statistics per (cell, model) + local centroids; see the module docstring."""

    name = "kmeans"
    media_types = (*MSGPACK_TYPES, *JSON_TYPES)
    options = ("recluster", "prior_router", "max_cost_usd", "min_total_count")

    def open(self, store: Store, request: OpenRequest) -> Round:
        wrong = request.given() - set(self.options)
        if wrong:
            raise InvalidInputError(f"{sorted(wrong)} are not options of a {self.name} round (they are for "
                                    "other kinds)")
        opts = request.options
        centroids = None
        if opts.get("recluster"):
            last = store.last_aggregate_of_kind(self.name)
            if last is None:
                raise InvalidInputError("--recluster needs an aggregated K-means round before this one")
            centroids = last[1]["next_centroids"]
        prior = None
        if opts.get("prior_router") is not None:
            if centroids is not None:
                raise InvalidInputError("--prior-router and --recluster do not go together (other cells)")
            try:
                prior_router = KMeansRouter.load(Path(opts["prior_router"]))
            except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:  # e.g. an MLP router's folder
                raise InvalidInputError(f"--prior-router {opts['prior_router']}: not a saved K-means router "
                                        f"({type(exc).__name__}: {exc})") from exc
            if centroids_hash(prior_router.centroids_) != centroids_hash(
                    bundle_centroids(read_base_bundle(request.bundle_dir, request.public_key))):
                raise InvalidInputError("--prior-router has other centroids than the bundle: give the router the "
                                        "bundle was exported from")
            bundle_models = [m["id"] for m in read_base_bundle(request.bundle_dir, request.public_key).manifest["models"]]
            if list(prior_router.models) != bundle_models:
                raise InvalidInputError(
                    f"--prior-router has the model pool {list(prior_router.models)}, the bundle {bundle_models}: give "
                    "the router the bundle was exported from (after `fedroute add-model`, the wider router and its bundle)")
            prior = prior_router.statistics_
        aggregation = AggregationConfig(request.clip_count, opts.get("max_cost_usd"), request.trim_fraction,
                                        request.noise_multiplier, request.delta)
        publishing = request.signing_key is not None
        settings = round_settings(
            aggregation=aggregation, bundle_dir=request.bundle_dir if publishing else None,
            signing_key=request.signing_key, seed=request.seed, prior_statistics=prior,
            min_total_count=opts.get("min_total_count") or 100)
        return open_round_from_bundle(store, request.bundle_dir, request.public_key, settings=settings,
                                      centroids=centroids, deadline_s=request.deadline_s, quorum=request.quorum,
                                      min_count=request.min_count)

    def describe(self, round_: Round) -> dict:
        d = common_description(round_)
        return encode_kmeans_round(d["round_id"], d["status"], d["models"], d["embedder_name"], d["d_emb"],
                                   d["min_count"], d["quorum"], d["deadline_utc"], round_.centroids,
                                   max_cost_usd=round_.settings.aggregation.get("max_cost_usd"))

    def summary(self, round_: Round) -> dict:
        return {"n_cells": int(round_.centroids.shape[0])}

    def parse(self, raw: bytes, content_type: str) -> ParsedUpload:
        body = parse_kmeans_body(decode_body(raw, content_type))
        return ParsedUpload(body.client_id, body.round_id, body.kind, body, raw)

    def validate(self, upload: ParsedUpload, round_: Round) -> AcceptedUpload:
        update = validate_update(upload.content, round_)

        def check_previous(previous: KMeansUpdate | None) -> None:
            try:
                check_difference(update, previous, round_.min_count)
            except PrivacyError as exc:
                raise UploadRejected(422, f"invalid update: {exc}") from exc

        record = encode_kmeans_update_record(update, packed=record_pairs(upload.content, update))
        return AcceptedUpload(record, update.log_size, check_previous, memo=update)

    def memo_of(self, payload: bytes) -> KMeansUpdate:
        return decode_kmeans_update_record(payload)

    def close(self, store: Store, round_: Round, snapshot: int, owner: str, progress, publisher) -> RoundOutcome | None:
        r, round_id = round_, round_.id
        on_time = store.round_updates(round_id)
        waiting = store.waiting_late(snapshot, self.name)
        carried = [i for i, h, _ in waiting if h == r.centroids_hash]
        stale = [i for i, h, _ in waiting if h != r.centroids_hash]
        outcome = RoundOutcome("no-op", len(on_time), len(carried), len(stale))
        latest = store.latest_updates(r.centroids_hash, up_to_id=snapshot)
        latest, other_pool = align_to_pool(store, latest, r.models)  # uploads for an older pool (add-model)
        if other_pool:
            progress(f"round {round_id}: the latest uploads of {other_pool} name models this round's pool lacks; "
                     "not merged (kept in the store; their next upload replaces them)")
        if not latest or (not on_time and not carried):
            if store.finish_close(round_id, outcome, None, [], stale, owner):
                progress(f"round {round_id}: no update arrived; closed as a no-op")
                return outcome
            return None
        settings = r.settings
        config = AggregationConfig(**settings.aggregation)
        rng = np.random.default_rng([int(settings.seed), round_id])
        agg = aggregate_kmeans(r.centroids, {cid: u for cid, (_, u) in latest.items()}, config, rng)
        stats = agg.statistics
        if settings.prior_statistics:  # already published: merged after the noise
            p = settings.prior_statistics
            stats = CellStatistics.merge([stats, CellStatistics(np.array(p["count"]), np.array(p["sum_accuracy"]),
                                                                np.array(p["sum_cost"]))])
        noisy = not math.isinf(agg.epsilon)
        outcome.result, outcome.total_count = "aggregated", float(stats.count.sum())
        outcome.epsilon = agg.epsilon if noisy else None
        if not noisy:  # under DP the exact number of participants would leak membership
            outcome.clients = list(agg.clients)
        federated = float(agg.statistics.count.sum())
        too_few = publish_refusal(federated, None if noisy else len(agg.clients), settings.min_total_count)
        if settings.publish and too_few:
            outcome.publish_skipped = too_few
        elif settings.publish and publisher is None:
            outcome.publish_skipped = "the server was started without a publisher; run `fedroute publish`"
        elif settings.publish:
            try:
                manifest = publish_kmeans(
                    publisher, Path(settings.publish.bundle_dir), Path(settings.publish.signing_key),
                    r.centroids, stats, prior_strength=settings.prior_strength,
                    model_prior_strength=settings.model_prior_strength, prior=settings.prior,
                    embedder=r.embedder, min_total_count=0,
                    provenance={"federated_round": round_id, "round_uid": settings.round_uid,
                                **({} if noisy else {"clients": len(agg.clients)})},
                )
                outcome.bundle_version = manifest["bundle_version"]
            except PublishRefused as exc:
                outcome.publish_skipped = str(exc)
        aggregate = array_bytes(count=stats.count, sum_accuracy=stats.sum_accuracy, sum_cost=stats.sum_cost,
                                next_centroids=agg.next_centroids, cell_weights=agg.cell_weights, centroids=r.centroids)
        if not store.finish_close(round_id, outcome, aggregate, carried, stale, owner):
            return None
        prior = outcome.total_count - federated  # the prior router's statistics are not the clients' evaluations
        progress(f"round {round_id}: aggregated {len(agg.clients)} clients ({federated:.0f} evaluations"
                 f"{f', plus {prior:.0f} of the prior' if prior else ''}); " + outcome.published_note())
        return outcome

    def publish(self, round_: Round, aggregate: dict, bundle_dir: Path, signing_key: Path, provenance: dict,
                publisher: Publisher) -> dict:
        """The close's rules first (:func:`publish_refusal` on the clients' part of the aggregate; the
        bundle's embedder still the round's), then :func:`publish_kmeans`."""
        s = round_.settings
        prior = float(np.sum(s.prior_statistics["count"])) if s.prior_statistics else 0.0
        noisy = round_.outcome.epsilon is not None
        why = publish_refusal(float(aggregate["count"].sum()) - prior,
                              None if noisy else len(round_.outcome.clients or []), s.min_total_count)
        if why:
            raise PublishRefused(why)
        return publish_kmeans(publisher, bundle_dir, signing_key, aggregate["centroids"],
                              CellStatistics(aggregate["count"], aggregate["sum_accuracy"], aggregate["sum_cost"]),
                              prior_strength=s.prior_strength, model_prior_strength=s.model_prior_strength,
                              prior=s.prior, provenance=provenance, embedder=round_.embedder)
