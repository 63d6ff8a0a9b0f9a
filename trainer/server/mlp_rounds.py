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

import math
import time
from pathlib import Path

import numpy as np

from sdk import bundle_manifest as fmt
from sdk.errors import BundleError
from trainer.federated.mlp_aggregation import (
    MLPAggregationConfig,
    MLPUpdate,
    aggregate_mlp,
)
from trainer.federated.mlp_local import parameters_bytes, read_parameters
from trainer.server.store import Round, Store, array_bytes


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
    settings: dict,
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
    from trainer.server.rounds import check_round_args

    check_round_args(deadline_s, quorum, min_count)
    manifest = fmt.read_verified(bundle_dir, public_key, wanted=()).manifest
    if manifest["router_kind"] != "mlp":
        raise BundleError(f"{bundle_dir} holds a {manifest['router_kind']!r} bundle; an MLP round needs an MLP bundle")
    if [m["id"] for m in manifest["models"]] != list(models):
        raise BundleError(f"{bundle_dir} lists other models than the router's {list(models)}")
    emb = manifest["embedder"]
    return store.open_round(
        kind="mlp", parameters=parameters_bytes(parameters), models=list(models),
        embedder={"name": emb["name"], "dim": int(emb["dim"]), "bundle_version": manifest["bundle_version"]},
        deadline_unix=time.time() + float(deadline_s), quorum=quorum, min_count=min_count,
        settings={**settings, "network": network},
    )


def router_of(parameters: dict[str, np.ndarray], r: Round):
    """The trainer MLPRouter of ``parameters`` with the round's network settings and models."""
    from trainer.routers.mlp_router import MLPRouter

    net = r.settings["network"]
    scale = np.array([np.nan if s is None else s for s in net["cost_scale_usd"]], dtype=np.float64)
    return MLPRouter(parameters, r.models, int(r.embedder["dim"]), scale, np.array(net["available"]),
                     net["hidden"], net["dropout"])


def check_predictions(router, n_probes: int = 32) -> None:
    """Refuse (:class:`~trainer.server.publish.PublishRefused`) a router whose predictions are not
    finite for every model it has data for, on fixed random unit-norm probe embeddings: extreme
    client parameters (a poisoned upload) would otherwise ship a bundle on which every ``choose``
    fails."""
    from trainer.server.publish import PublishRefused

    probes = np.random.default_rng(0).normal(size=(n_probes, router.d_emb)).astype(np.float32)
    probes /= np.linalg.norm(probes, axis=1, keepdims=True)
    acc, cost = router.predict(probes)
    ok = np.isfinite(acc[:, router.available_]).all() and np.isfinite(cost[:, router.available_]).all()
    if not ok or not np.abs(acc[:, router.available_]).max() < 1e6:
        raise PublishRefused("the aggregate predicts non-finite or absurd values (a poisoned or diverged update?)")


def close_mlp_round(store: Store, r: Round, snapshot: int, owner: str, progress=lambda msg: None) -> dict | None:
    """Aggregate an MLP round claimed for closing by ``owner`` (see
    :func:`trainer.server.rounds.close_round`); None if another closer took it over."""
    on_time = store.round_updates(r.id)
    # A straggler's delta applies only to the parameters it was trained from continued here.
    waiting = store.waiting_late(snapshot, "mlp")
    parent = r.settings.get("continued_from")
    carried = [i for i, _, sent in waiting if sent == parent]
    stale = [i for i, _, sent in waiting if sent != parent]
    latest: dict[str, tuple[int, int, bytes]] = {}
    for uid, client, sent_round, payload in store.update_payloads(sorted(on_time + carried)):
        if client not in latest or sent_round >= latest[client][1]:  # a client's on-time upload wins
            latest[client] = (uid, sent_round, payload)
    used_late = sum(1 for _, sent, _ in latest.values() if sent != r.id)
    outcome = {"on_time_updates": len(on_time), "late_updates_counted": used_late, "stale_updates": len(stale)}
    if not latest:
        outcome["result"] = "no-op"
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
    config = MLPAggregationConfig(**settings["aggregation"])
    rng = np.random.default_rng([int(settings["seed"]), r.id])
    global_params = read_parameters(r.parameters)[0]
    agg = aggregate_mlp(global_params, updates, config, rng)
    noisy = not math.isinf(agg.epsilon)
    outcome.update(result="aggregated", total_count=float(agg.n_samples),
                   epsilon=agg.epsilon if noisy else None, bundle_version=None)
    if not noisy:  # under DP the exact number of participants would leak membership
        outcome["clients"] = list(agg.clients)
    if settings.get("publish"):
        from trainer.server.publish import PublishRefused, publish_router

        router = router_of(agg.parameters, r)
        try:
            check_predictions(router)
            manifest = publish_router(Path(settings["publish"]["bundle_dir"]), Path(settings["publish"]["signing_key"]),
                                      router, {"federated_round": r.id, "round_uid": settings.get("round_uid"),
                                               **({} if noisy else {"clients": len(agg.clients)})},
                                      embedder=r.embedder)
            outcome["bundle_version"] = manifest["bundle_version"]
        except PublishRefused as exc:
            outcome["publish_skipped"] = str(exc)
    if not store.finish_close(r.id, outcome, array_bytes(**agg.parameters), carried, stale, owner):
        return None
    progress(f"round {r.id}: FedAvg of {len(agg.clients)} clients ({agg.n_samples} samples); " + (
        f"bundle v{outcome['bundle_version']}" if outcome["bundle_version"] is not None else
        f"nothing published ({outcome.get('publish_skipped', 'round opened without --signing-key')})"))
    return outcome
