"""Federated MLP-router rounds over HTTPS (paper 002, "Federated parametric optimisation").

A round broadcasts the global parameters ``theta_r`` (safetensors, ``GET /v1/rounds/{id}/parameters``)
with the network's shape and the models' cost scales; each client that can train (torch, see
:mod:`trainer.federated.mlp_local`) runs one local epoch and uploads its parameters and sample
count. At close (quorum or deadline, as for K-means rounds) the server averages the deltas
(:func:`trainer.federated.mlp_aggregation.aggregate_mlp`), stores ``theta_{r+1}`` and publishes it as
a new MLP bundle (``router.onnx``). The next round starts from it (``rounds open --kind mlp
--continue``).

- A round with no update closes as a no-op (``theta`` unchanged).
- Each client counts once per round (its latest upload in the round).
- A straggler's upload, trained from ``theta_{r-1}``, is kept and its delta applied in the next
  MLP round if that round continues from ``theta_{r-1}``'s aggregate (buffered asynchronous FedAvg);
  a round started from other parameters (``--router``) keeps it as stale.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import numpy as np

from sdk import bundle_manifest as fmt
from sdk import kinds as sdk_kinds
from sdk.errors import BundleError, InvalidInputError
from trainer.federated.mlp_aggregation import (MLPAggregationConfig, MLPUpdate, aggregate_mlp)
from trainer.federated.mlp_local import parameters_bytes, read_parameters
from trainer.routers.mlp_router import MLPRouter
from trainer.server.errors import PublishRefused
from trainer.server.round_kind import (AcceptedUpload, OpenRequest, ParsedUpload, Publisher, RoundOutcome,
    RoundSettings, ServerRoundKind, check_round_args, common_description, round_settings)
from trainer.server.store import Round, Store, array_bytes
from trainer.server.validation import SAFETENSORS_TYPES, parse_mlp_upload, validate_mlp_update


def network_settings(router, local_epochs: int = 1) -> dict:
    """The shape and cost scales of a trainer :class:`~trainer.routers.mlp_router.MLPRouter` that
    clients need to rebuild and train it (stored in the round's settings)."""
    return {"hidden": int(router.hidden), "dropout": float(router.dropout), "local_epochs": int(local_epochs),
            "cost_scale_usd": [float(s) if np.isfinite(s) else None for s in router.cost_scale_],
            "available": [bool(a) for a in router.available_]}


def open_mlp_round(
    store: Store,
    bundle_dir: Path,
    public_key,
    *,
    parameters: dict[str, np.ndarray],
    network: dict,
    models,
    deadline_s: float,
    quorum: int,
    min_count: int,
    settings: RoundSettings,
) -> Round:
    """Open an MLP round from ``parameters`` over the MLP bundle at ``bundle_dir`` (which fixes the
    embedder and the models; published bundles replace its ``router.onnx``).

    Raises
    ------
    BundleError
        The bundle does not verify, is not an MLP bundle, or lists other models.
    InvalidInputError
        deadline_s <= 0, quorum < 1 or min_count < 1.
    ValueError
        A round is still open.
    """
    check_round_args(deadline_s, quorum, min_count)
    manifest = fmt.read_verified(bundle_dir, public_key, wanted=()).manifest
    held = sdk_kinds.manifest_kinds(manifest).get(sdk_kinds.ROUTER_FAMILY)
    if held != MlpRoundKind.name:
        raise BundleError(f"{bundle_dir}: router_kind is {held!r}; an MLP round needs an MLP bundle")
    if [m["id"] for m in manifest["models"]] != list(models):
        raise BundleError(f"{bundle_dir} lists other models than the router's {list(models)}")
    emb = manifest["embedder"]
    return store.open_round(
        kind=MlpRoundKind.name, parameters=parameters_bytes(parameters), models=list(models),
        embedder={"name": emb["name"], "dim": int(emb["dim"]), "bundle_version": manifest["bundle_version"]},
        deadline_unix=time.time() + float(deadline_s), quorum=quorum, min_count=min_count,
        settings=dataclasses.replace(settings, network=network),
    )


def router_of(parameters: dict[str, np.ndarray], r: Round):
    """The trainer MLPRouter of ``parameters`` with the round's network settings and models."""
    net = r.settings.network
    scale = np.array([np.nan if s is None else s for s in net["cost_scale_usd"]], dtype=np.float64)
    return MLPRouter(parameters, r.models, int(r.embedder["dim"]), scale, np.array(net["available"]),
                     net["hidden"], net["dropout"])


def check_predictions(router, n_probes: int = 32) -> None:
    """Refuse (:class:`~trainer.server.errors.PublishRefused`) a router whose predictions are not
    finite for every model it has data for, on fixed random unit-norm probe embeddings: extreme
    client parameters (a poisoned upload) would otherwise ship a bundle on which every ``choose``
    fails."""
    probes = np.random.default_rng(0).normal(size=(n_probes, router.d_emb)).astype(np.float32)
    probes /= np.linalg.norm(probes, axis=1, keepdims=True)
    acc, cost = router.predict(probes)
    ok = np.isfinite(acc[:, router.available_]).all() and np.isfinite(cost[:, router.available_]).all()
    if not ok or not np.abs(acc[:, router.available_]).max() < 1e6:
        raise PublishRefused("the aggregate predicts non-finite or absurd values (a poisoned or diverged update?)")


class MlpRoundKind(ServerRoundKind):
    """``router/mlp`` rounds: FedAvg of parameters trained on the devices; see the module docstring."""

    name = "mlp"
    media_types = SAFETENSORS_TYPES
    options = ("router", "resume", "clip_norm")

    def open(self, store: Store, request: OpenRequest) -> Round:
        wrong = request.given() - set(self.options)
        if wrong:
            raise InvalidInputError(f"{sorted(wrong)} are not options of an {self.name} round (they are for "
                                    "other kinds)")
        router_dir, resume = request.options.get("router"), bool(request.options.get("resume"))
        if (router_dir is None) == (not resume):
            raise InvalidInputError("an MLP round starts from --router DIR or --continue (one of them)")
        last = None
        if router_dir is not None:
            try:
                trained = MLPRouter.load(Path(router_dir))
            except (OSError, KeyError, ValueError) as exc:
                raise InvalidInputError(f"--router {router_dir} is not a trained MLP router folder ({exc})") from exc
            parameters, network, models = trained.state(), network_settings(trained), trained.models
        else:
            last = store.last_aggregate_of_kind(self.name, published_only=True)
            if last is None:
                raise InvalidInputError("--continue needs an aggregated MLP round before this one whose publishing "
                                        "was not refused")
            previous = store.get_round(last[0])
            parameters, network, models = last[1], previous.settings.network, previous.models
        noise = request.noise_multiplier
        aggregation = MLPAggregationConfig(request.clip_count, request.trim_fraction, request.options.get("clip_norm"),
                                           noise, request.delta, request.quorum if noise > 0 else None)
        publishing = request.signing_key is not None
        settings = round_settings(aggregation=aggregation, bundle_dir=request.bundle_dir if publishing else None,
                                  signing_key=request.signing_key, seed=request.seed)
        settings = dataclasses.replace(settings, continued_from=last[0] if resume else None)
        return open_mlp_round(store, request.bundle_dir, request.public_key, parameters=parameters, network=network,
                              models=models, settings=settings, deadline_s=request.deadline_s,
                              quorum=request.quorum, min_count=request.min_count)

    def describe(self, round_: Round) -> dict:
        net = round_.settings.network
        return {**common_description(round_), "parameters_hash": round_.base_hash,
                "parameters_url": f"/v1/rounds/{round_.id}/parameters",
                "hidden": net["hidden"], "dropout": net["dropout"], "cost_scale_usd": net["cost_scale_usd"],
                "available": net["available"], "local_epochs": net.get("local_epochs", 1)}

    def summary(self, round_: Round) -> dict:
        return {"parameters_hash": round_.base_hash}

    def parse(self, raw: bytes, content_type: str) -> ParsedUpload:
        return parse_mlp_upload(raw)

    def validate(self, upload: ParsedUpload, round_: Round) -> AcceptedUpload:
        parameters, metadata = upload.content
        return AcceptedUpload(upload.raw, validate_mlp_update(parameters, metadata, round_), None)

    def close(self, store: Store, round_: Round, snapshot: int, owner: str, progress, publisher) -> RoundOutcome | None:
        """Aggregate an MLP round claimed for closing by ``owner``; None if another closer took it over."""
        r = round_
        on_time = store.round_updates(r.id)
        # A straggler's delta applies only to the parameters it was trained from continued here.
        waiting = store.waiting_late(snapshot, self.name)
        parent = r.settings.continued_from
        carried = [i for i, _, sent in waiting if sent == parent]
        stale = [i for i, _, sent in waiting if sent != parent]
        latest: dict[str, tuple[int, int, bytes]] = {}
        for uid, client, sent_round, payload in store.update_payloads(sorted(on_time + carried)):
            if client not in latest or sent_round >= latest[client][1]:  # a client's on-time upload wins
                latest[client] = (uid, sent_round, payload)
        used_late = sum(1 for _, sent, _ in latest.values() if sent != r.id)
        outcome = RoundOutcome("no-op", len(on_time), used_late, len(stale))
        if not latest:
            if store.finish_close(r.id, outcome, None, carried, stale, owner):
                progress(f"round {r.id}: no update arrived; closed as a no-op")
                return outcome
            return None
        bases = {sent: read_parameters(store.get_round(sent).parameters)[0] for _, sent, _ in latest.values()}
        updates = {}
        for client, (_, sent_round, payload) in latest.items():
            params, meta = read_parameters(payload)
            updates[client] = MLPUpdate(params, int(meta["n_samples"]), bases[sent_round])
        settings = r.settings
        config = MLPAggregationConfig(**settings.aggregation)
        rng = np.random.default_rng([int(settings.seed), r.id])
        global_params = read_parameters(r.parameters)[0]
        agg = aggregate_mlp(global_params, updates, config, rng)
        noisy = not math.isinf(agg.epsilon)
        outcome.result, outcome.total_count = "aggregated", float(agg.n_samples)
        outcome.epsilon = agg.epsilon if noisy else None
        if not noisy:  # under DP the exact number of participants would leak membership
            outcome.clients = list(agg.clients)
        if settings.publish and publisher is None:
            outcome.publish_skipped = "the server was started without a publisher; run `fedroute publish`"
        elif settings.publish:
            router = router_of(agg.parameters, r)
            try:
                check_predictions(router)
                manifest = publisher.publish(
                    Path(settings.publish.bundle_dir), Path(settings.publish.signing_key), router,
                    {"federated_round": r.id, "round_uid": settings.round_uid,
                     **({} if noisy else {"clients": len(agg.clients)})}, embedder=r.embedder)
                outcome.bundle_version = manifest["bundle_version"]
            except PublishRefused as exc:
                outcome.publish_skipped = str(exc)
        if not store.finish_close(r.id, outcome, array_bytes(**agg.parameters), carried, stale, owner):
            return None
        progress(f"round {r.id}: FedAvg of {len(agg.clients)} clients ({agg.n_samples} samples); "
                 + outcome.published_note())
        return outcome

    def publish(self, round_: Round, aggregate: dict, bundle_dir: Path, signing_key: Path, provenance: dict,
                publisher: Publisher) -> dict:
        """As the close publishes: refused for non-finite or absurd predictions (:func:`check_predictions`)
        or a bundle whose embedder is no longer the round's."""
        router = router_of(aggregate, round_)
        check_predictions(router)
        return publisher.publish(bundle_dir, signing_key, router, provenance, embedder=round_.embedder)
