"""Federated MLP rounds over HTTPS (paper 002, FedAvg): real server process over TLS, devices that train
with the trainer extra (one in-process ``SyncClient`` with ``train_on_log``, one ``fedroute sync``
command), a device without torch that skips the round, FedAvg checked against the stored uploads,
the published ``router.onnx`` checked against the trainer's router; and the MLP upload checks."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import time

import numpy as np
import pytest

from sdk import EvalLog, Router
from sdk.sync import SyncClient
from trainer.federated.mlp_local import parameters_bytes, read_parameters, train_on_log

pytestmark = pytest.mark.slow

CLI = (sys.executable, "-m", "trainer.cli")
SIZES = {"gpu-box": 30, "laptop": 45, "phone": 30}  # unequal: FedAvg weights by sample count


def cli(*args: str) -> str:
    """stdout of ``fedroute ARGS``, run in this process (the operator's commands as processes: the README's
    operator quick start, tests/test_readme_quickstart.py)."""
    from typer.testing import CliRunner

    from trainer.cli import app

    done = CliRunner().invoke(app, list(args), env={"COLUMNS": "500"})
    assert done.exit_code == 0, done.output
    return done.stdout


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, make_bundle, signing_keys, fitted_routers, routerbench_dir):
    from sync_fleet import ServerProcess, write_tls_files
    from trainer.data.routerbench import load_routerbench_dir

    work = tmp_path_factory.mktemp("sync_mlp")
    bundle = make_bundle(work / "server" / "bundle", "mlp")
    write_tls_files(work)
    db = f"sqlite:///{work / 'fed.db'}"
    tokens = {c: cli("clients", "add", c, "--db", db).strip() for c in ("gpu-box", "laptop", "phone")}
    opened = json.loads(cli("rounds", "open", "--kind", "mlp", "--db", db, "--bundle-dir", str(bundle),
                            "--router", str(fitted_routers["dir"] / "mlp"), "--signing-key", str(signing_keys[0]),
                            "--quorum", "2", "--min-count", "5", "--deadline-s", "600"))
    train, _ = load_routerbench_dir(routerbench_dir)
    rng = np.random.default_rng(5)
    rows = rng.choice(train.n_queries, sum(SIZES.values()), replace=False)
    embeddings = Router.load(bundle, signing_keys[1]).embed([train.prompts[i] for i in rows])
    labelled = train.labelled()
    start = 0
    for client in tokens:
        shutil.copytree(bundle, work / client / "bundle")
        with EvalLog(work / client / "log.sqlite", train.models) as log:
            for k in range(start, start + SIZES[client]):
                i = rows[k]
                m = int(rng.choice(np.flatnonzero(labelled[i])))
                log.record(train.models[m], float(train.accuracy[i, m]), float(train.cost[i, m]), embedding=embeddings[k])
        start += SIZES[client]
        (work / client / "token").write_text(tokens[client])
    server = ServerProcess(work, db, work / "server.pem", work / "ca.pem", bundle_dir=bundle, tick_s=0.2).start()
    yield {"work": work, "db": db, "tokens": tokens, "round_id": opened["round_id"], "bundle": bundle,
           "server": server, "models": train.models, "pub": signing_keys[1], "embeddings": embeddings,
           "signing_key": signing_keys[0], "router_dir": fitted_routers["dir"] / "mlp"}
    server.stop()


def sync(fleet, client, trainer=train_on_log):
    work = fleet["work"]
    with EvalLog(work / client / "log.sqlite", fleet["models"]) as log, SyncClient(
            fleet["server"].url, fleet["tokens"][client], log, work / client / "bundle", fleet["pub"],
            ca_cert=work / "ca.pem", mlp_trainer=trainer) as client_:
        return client_.run_once()


def sync_command(fleet, client, command: str) -> dict:
    work = fleet["work"]
    args = [*CLI, "sync"] if command == "fedroute sync" else [sys.executable, "-m", "sdk.sync_cli"]
    done = subprocess.run([*args, "--server", fleet["server"].url, "--log", str(work / client / "log.sqlite"),
                           "--bundle", str(work / client / "bundle"), "--public-key", str(fleet["pub"]),
                           "--token-file", str(work / client / "token"), "--ca-cert", str(work / "ca.pem")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def first_round(fleet):
    skipped = sync_command(fleet, "phone", "fedroute-sync")  # the SDK alone cannot train
    a = sync(fleet, "gpu-box")
    b = sync_command(fleet, "laptop", "fedroute sync")
    deadline = time.monotonic() + 60
    while json.loads(cli("rounds", "status", "--db", fleet["db"]))["status"] != "closed":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    status = json.loads(cli("rounds", "status", "--db", fleet["db"]))
    picked = {c: sync(fleet, c) for c in ("gpu-box", "laptop", "phone")}
    return {"skipped": skipped, "a": a, "b": b, "status": status, "picked": picked}


def test_round_averages_the_uploads_by_sample_count(fleet, first_round):
    from trainer.server.store import Store

    assert first_round["skipped"]["uploaded"] is False and "cannot train" in first_round["skipped"]["skipped"]
    assert first_round["a"].uploaded and first_round["b"]["uploaded"]
    outcome = first_round["status"]["outcome"]
    assert outcome["result"] == "aggregated" and outcome["clients"] == ["gpu-box", "laptop"]
    assert outcome["total_count"] == SIZES["gpu-box"] + SIZES["laptop"] and outcome["bundle_version"] == 2
    store = Store(fleet["db"])
    r = store.get_round(fleet["round_id"])
    base, _ = read_parameters(r.parameters)
    uploads = {client: read_parameters(p) for _, client, _, p in store.update_payloads(store.round_updates(r.id))}
    assert sorted(uploads) == ["gpu-box", "laptop"]
    assert all(uploads[c][1]["n_samples"] == SIZES[c] for c in uploads)
    agg = store.aggregate_of(r.id)
    n_a, n_b = SIZES["gpu-box"], SIZES["laptop"]
    for name in base:  # FedAvg: sum_i n_i theta_i / sum_i n_i
        expected = (n_a * uploads["gpu-box"][0][name].astype(np.float64) + n_b * uploads["laptop"][0][name]) / (n_a + n_b)
        np.testing.assert_allclose(agg[name], expected, rtol=1e-5, atol=1e-6)
    assert any(not np.array_equal(agg[n], base[n]) for n in base)  # the round moved the parameters


def test_published_bundle_matches_the_aggregate_and_devices_pick_it_up(fleet, first_round):
    from trainer.server.mlp_rounds import router_of
    from trainer.server.store import Store

    store = Store(fleet["db"])
    r = store.get_round(fleet["round_id"])
    trainer_router = router_of(store.aggregate_of(r.id), r)
    acc, cost = trainer_router.predict(fleet["embeddings"])
    for client, result in first_round["picked"].items():
        assert result.bundle_version == 2, client
        device = Router.load(fleet["work"] / client / "bundle", fleet["pub"])
        assert device.router_kind == "mlp" and device.manifest["provenance"]["federated_round"] == r.id
        d_acc, d_cost = device.predict_from_embeddings(fleet["embeddings"])
        np.testing.assert_allclose(d_acc, acc, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(d_cost, cost, rtol=1e-4, atol=1e-9)


def test_next_round_continues_from_the_aggregate_and_an_empty_round_is_a_no_op(fleet, first_round):
    import httpx

    from trainer.server.store import Store

    opened = json.loads(cli("rounds", "open", "--kind", "mlp", "--continue", "--db", fleet["db"], "--bundle-dir",
                            str(fleet["bundle"]), "--public-key", str(fleet["pub"]), "--quorum", "5"))
    answer = httpx.get(f"{fleet['server'].url}/v1/rounds/{opened['round_id']}/parameters",
                       headers={"Authorization": f"Bearer {fleet['tokens']['phone']}"},
                       verify=ssl.create_default_context(cafile=str(fleet["work"] / "ca.pem")))
    params, _ = read_parameters(answer.content)
    agg = Store(fleet["db"]).aggregate_of(fleet["round_id"])
    assert set(params) == set(agg) and all(np.array_equal(params[k], agg[k].astype(np.float32)) for k in params)
    outcome = json.loads(cli("rounds", "close", "--db", fleet["db"]))
    assert outcome["result"] == "no-op"


# -- upload checks (in process) --------------------------------------------------------------------


@pytest.fixture
def mlp_api(tmp_path, make_bundle, signing_keys, fitted_routers):
    from fastapi.testclient import TestClient

    from trainer.federated.mlp_aggregation import MLPAggregationConfig
    from trainer.routers.mlp_router import MLPRouter
    from trainer.server.app import create_app
    from trainer.server.mlp_rounds import network_settings, open_mlp_round
    from trainer.server.round_kind import round_settings
    from trainer.server.store import Store

    bundle = make_bundle(tmp_path / "bundle", "mlp")
    store = Store(f"sqlite:///{tmp_path / 'fed.db'}")
    token = store.add_client("dev")
    trained = MLPRouter.load(fitted_routers["dir"] / "mlp")
    r = open_mlp_round(store, bundle, signing_keys[1], parameters=trained.state(), network=network_settings(trained),
                       models=trained.models, deadline_s=600, quorum=9, min_count=5,
                       settings=round_settings(aggregation=MLPAggregationConfig()))
    with TestClient(create_app(store, bundle, tick_s=60), base_url="https://testserver") as http:
        yield {"http": http, "token": token, "round": r, "store": store}


def _upload(api, params, **meta):
    r = api["round"]
    metadata = {"client_id": "dev", "round_id": r.id, "kind": "mlp", "parameters_hash": r.base_hash,
                "n_samples": 10, "log_size": 10, **meta}
    return api["http"].post(f"/v1/rounds/{r.id}/updates", content=parameters_bytes(params, metadata), headers={
        "Authorization": f"Bearer {api['token']}", "Idempotency-Key": f"k{time.time_ns()}",
        "Content-Type": "application/x-safetensors"})


def test_mlp_upload_checks(mlp_api):
    base, _ = read_parameters(mlp_api["round"].parameters)
    assert _upload(mlp_api, base).status_code == 201
    name = sorted(base)[0]
    assert _upload(mlp_api, {**base, name: base[name][..., :-1]}).status_code == 422  # wrong shape
    assert _upload(mlp_api, {k: v for k, v in base.items() if k != name}).status_code == 422  # missing tensor
    assert _upload(mlp_api, {**base, name: np.full_like(base[name], np.nan)}).status_code == 422
    assert _upload(mlp_api, base, n_samples=3, log_size=3).status_code == 422  # below min_count
    assert _upload(mlp_api, base, n_samples=20).status_code == 422  # above log_size
    assert _upload(mlp_api, base, parameters_hash="0" * 64).status_code == 409  # trained from other parameters
    assert _upload(mlp_api, base, client_id="other").status_code == 403
    assert _upload(mlp_api, base, kind="kmeans").status_code == 409
    r = mlp_api["round"]
    garbage = mlp_api["http"].post(f"/v1/rounds/{r.id}/updates", content=b"\x00" * 64, headers={
        "Authorization": f"Bearer {mlp_api['token']}", "Idempotency-Key": "g", "Content-Type": "application/x-safetensors"})
    assert garbage.status_code == 400
    json_body = mlp_api["http"].post(f"/v1/rounds/{r.id}/updates", json={"client_id": "dev", "round_id": r.id,
        "kind": "mlp", "centroids_hash": r.base_hash, "models": list(r.models), "log_size": 0, "count": [],
        "sum_accuracy": [], "sum_cost": [], "centroid_cells": [], "local_centroids": [], "local_weights": []},
        headers={"Authorization": f"Bearer {mlp_api['token']}", "Idempotency-Key": "j"})
    assert json_body.status_code == 415  # an MLP round takes safetensors
    assert mlp_api["store"].count_updates() == 1


def test_an_aggregate_with_non_finite_predictions_is_not_published(fitted_routers):
    from trainer.routers.mlp_router import MLPRouter
    from trainer.server.mlp_rounds import check_predictions
    from trainer.server.errors import PublishRefused

    trained = MLPRouter.load(fitted_routers["dir"] / "mlp")
    check_predictions(trained)  # the trained router is fine
    poisoned = {k: np.full_like(v, 3e38) for k, v in trained.state().items()}  # what one hostile upload can force
    router = MLPRouter(poisoned, trained.models, trained.d_emb, trained.cost_scale_, trained.available_,
                       trained.hidden, trained.dropout)
    with pytest.raises(PublishRefused, match="non-finite"):
        check_predictions(router)


def test_train_on_log_needs_min_count_samples(tmp_path, fitted_routers):
    from trainer.routers.mlp_router import MLPRouter
    from trainer.server.mlp_rounds import network_settings

    trained = MLPRouter.load(fitted_routers["dir"] / "mlp")
    spec = {"round_id": 1, "models": list(trained.models), "d_emb": trained.d_emb, "min_count": 5,
            "parameters_hash": "x", **network_settings(trained)}
    with EvalLog(tmp_path / "log.sqlite", trained.models) as log:
        for k in range(4):
            log.record(trained.models[0], 1.0, 0.001, embedding=fitted_routers["test_embeddings"][k])
        assert train_on_log(log.rows(), spec, parameters_bytes(trained.state()), "dev") is None
        log.record(trained.models[1], 0.0, 0.002, embedding=fitted_routers["test_embeddings"][4])
        first = train_on_log(log.rows(), spec, parameters_bytes(trained.state()), "dev")
        again = train_on_log(log.rows(), spec, parameters_bytes(trained.state()), "dev")
    assert first == again  # seeded by (client, round): a rerun uploads the same bytes (idempotent)
    params, meta = read_parameters(first)
    assert meta["n_samples"] == 5 and meta["kind"] == "mlp" and set(params) == set(trained.state())
