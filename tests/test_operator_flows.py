"""A new operator's ``fedroute rounds`` / ``publish`` / ``serve`` runs and a device's ``fedroute-sync``,
through the real commands, on the tiny K-means bundle of ``tiny_kmeans.py`` (no encoder export).

Each test is a run that went wrong before its fix: a ``rounds close`` that failed once and then
answered "already closed" for ten minutes, ``fedroute publish`` skipping the rules the close
applies before publishing, a negative ``--seed`` that failed every close, a ``--prior-router``
without statistics ending in a traceback, ``fedroute-sync`` tracebacks on a state path it cannot
write, ``serve`` creating an empty database at a mistyped ``--db``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from sdk.cell_statistics import CellStatistics
from sdk.local_update import KMeansUpdate
from sdk.protocol import Receipt, encode_kmeans_update_record
from tiny_kmeans import MODELS, write_tiny_kmeans
from trainer.cli import app
from trainer.federated.kmeans_aggregation import AggregationConfig
from trainer.server.kmeans_rounds import open_round_from_bundle
from trainer.server.round_kind import round_settings
from trainer.server.rounds import close_round
from trainer.server.store import Store

ROOT = Path(__file__).resolve().parents[1]


def flat(output: str) -> str:
    """The message without rich's box and line breaks."""
    return " ".join(output.replace("│", " ").split())


@pytest.fixture(scope="module")
def tiny(signing_keys, tmp_path_factory) -> tuple[Path, Path]:
    return write_tiny_kmeans(tmp_path_factory.mktemp("tiny"), signing_keys[0])


@pytest.fixture
def fed(request, tmp_path, tiny, signing_keys):
    """A database with clients alice and bob and a copy of the tiny bundle to publish into: a SQLite
    file, or with ``indirect`` parameter "postgresql" a database on a throwaway PostgreSQL server."""
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny[0], bundle)
    url = f"sqlite:///{tmp_path / 'fed.db'}"
    if getattr(request, "param", "sqlite") == "postgresql":
        from postgres_server import fresh_database

        server, why = request.getfixturevalue("postgres")
        if server is None:
            pytest.skip(why)
        url = fresh_database(server)
    store = Store(url)
    tokens = {c: store.add_client(c) for c in ("alice", "bob")}
    yield {"store": store, "url": url, "bundle": bundle, "router": tiny[1], "tokens": tokens,
           "key": signing_keys[0], "pub": signing_keys[1], "tmp": tmp_path}
    store.close()


def open_round(fed, *, publish_key: Path | None = None, min_total_count: int = 1, **aggregation):
    settings = round_settings(aggregation=AggregationConfig(**aggregation), seed=0, min_total_count=min_total_count,
                              bundle_dir=fed["bundle"] if publish_key else None, signing_key=publish_key)
    return open_round_from_bundle(fed["store"], fed["bundle"], fed["pub"], deadline_s=3600, quorum=10, min_count=2,
                                  settings=settings)


def upload(fed, r, client: str, n: int = 5, key: str = "") -> None:
    """``client``'s statistics: ``n`` evaluations of model-x in cell 0 and of model-y in cell 1, stored
    as the server stores an accepted upload (``key``: its Idempotency-Key, default one per client and round)."""
    count = np.array([[n, 0], [0, n]], dtype=np.float64)
    update = KMeansUpdate(CellStatistics(count, 0.5 * count, 0.001 * count), np.zeros(0, np.int64),
                          np.zeros((0, 3)), np.zeros(0), int(count.sum()))
    fed["store"].add_update(client_id=client, round_=r, key=key or f"{client}-{r.id}", body_sha256=f"{client}{r.id}-{n}",
                            payload=encode_kmeans_update_record(update), log_size=update.log_size,
                            receipt_for=lambda uid, late, counted: Receipt(uid, client, r.id, late, counted,
                                                                           update.log_size).to_json())


def fedroute(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "500"})


def bundle_version(bundle: Path) -> int:
    return json.loads((bundle / "manifest.json").read_text())["bundle_version"]


# --- rounds close ------------------------------------------------------------------------------


@pytest.mark.parametrize("fed", ["sqlite", "postgresql"], indirect=True)
def test_a_rounds_close_that_failed_can_be_rerun_at_once(fed):
    """`rounds close` of a round opened to publish whose signing key had gone (moved, unreadable) failed,
    and kept the round "closing" under its ten-minute lease: each rerun, even after the key was put
    back, answered "round 1 is already closed (or does not exist)" while `rounds status` said closing."""
    from export.errors import ExportError

    gone = fed["tmp"] / "signing.key"
    r = open_round(fed, publish_key=gone)
    upload(fed, r, "alice")
    upload(fed, r, "bob")
    for _ in range(2):
        result = fedroute("rounds", "close", "--db", fed["url"])
        assert isinstance(result.exception, ExportError), result.output
        assert f"cannot read signing key {gone}" in str(result.exception)
    shutil.copy(fed["key"], gone)
    result = fedroute("rounds", "close", "--db", fed["url"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[-1])["bundle_version"] == 2 == bundle_version(fed["bundle"])


@pytest.mark.parametrize("fed", ["sqlite", "postgresql"], indirect=True)
def test_rounds_close_and_open_name_the_closer_that_holds_a_round(fed):
    """A round another closer holds (the server, or a `rounds close` in another shell) was reported as
    "already closed (or does not exist)" by `rounds close` and as "still open" by `rounds open`."""
    r = open_round(fed)
    upload(fed, r, "alice")
    assert fed["store"].claim_close(r.id, "server-4242-beef", lease_s=600) is not None
    result = fedroute("rounds", "close", "--db", fed["url"])
    assert result.exit_code == 2
    said = re.search(rf"round {r.id} is being closed by server-4242-beef; if that process died, its claim runs out "
                     r"in (\d+) s \(then rerun this\)", flat(result.output))
    assert said and 590 <= int(said.group(1)) <= 600  # the lease's seconds left, counted when the CLI answers
    result = fedroute("rounds", "open", "--bundle-dir", fed["bundle"], "--public-key", fed["pub"], "--db", fed["url"])
    assert result.exit_code == 2
    assert f"round {r.id} is still closing (by server-4242-beef); a new round opens once it is closed" in flat(result.output)


@pytest.mark.parametrize("fed", ["sqlite", "postgresql"], indirect=True)
def test_rounds_status_counts_the_clients_the_quorum_counts(fed):
    """docs/privacy-and-dp.md: under DP noise the outcome leaves the clients out and "the operator's
    `rounds status` does" say how many took part; it printed only `updates_counted`, the stored rows
    (a client's replaced uploads and revoked clients included), not what the quorum counts."""
    r = open_round(fed)
    upload(fed, r, "alice")
    fed["store"].add_client("carol")
    for client in ("bob", "carol"):
        upload(fed, r, client)
    upload(fed, r, "alice", n=9, key="again")  # replaces its first upload
    fed["store"].revoke_client("carol")
    result = fedroute("rounds", "status", "--db", fed["url"])
    status = json.loads(result.stdout)
    assert (status["updates_counted"], status["clients_counted"], status["quorum"]) == (4, 2, 10)


# --- publish -----------------------------------------------------------------------------------


@pytest.mark.parametrize("clients, min_total_count, why", [
    (["alice"], 1, "20 federated evaluations from 1 client(s): need min_total_count=1 and, without noise, at least "
                   "2 clients"),
    (["alice", "bob"], 100, "20 federated evaluations from 2 client(s): need min_total_count=100"),
])
def test_publish_refuses_what_the_close_would_not_publish(fed, clients, min_total_count, why):
    """A round opened without --signing-key is published with `fedroute publish` (its close says so):
    that published one client's statistics alone, or a handful of evaluations, which a round opened
    to publish refuses (docs/sync-protocol-and-operations.md, Rounds)."""
    from trainer.server.errors import PublishRefused

    r = open_round(fed, min_total_count=min_total_count)
    for client in clients:
        upload(fed, r, client, n=10 // len(clients))  # 20 evaluations in all
    outcome = close_round(fed["store"], r.id)
    assert outcome.result == "aggregated" and outcome.bundle_version is None
    result = fedroute("publish", "--round", r.id, "--bundle-dir", fed["bundle"], "--signing-key", fed["key"],
                      "--db", fed["url"])
    assert isinstance(result.exception, PublishRefused), result.output
    assert why in str(result.exception)
    assert bundle_version(fed["bundle"]) == 1


@pytest.mark.parametrize("fed", ["sqlite", "postgresql"], indirect=True)
def test_publish_checks_the_embedder_and_publishes_a_round_once(fed, signing_keys, tmp_path):
    """`fedroute publish` put the round's cells into a bundle whose embedder had changed since the round
    opened (the close refuses that: its centroids live in the old embedder's space), and a rerun
    published the same aggregate again as a new version."""
    from trainer.server.errors import PublishRefused

    r = open_round(fed)
    upload(fed, r, "alice")
    upload(fed, r, "bob")
    close_round(fed["store"], r.id)
    args = ("publish", "--round", r.id, "--bundle-dir", fed["bundle"], "--signing-key", fed["key"], "--db", fed["url"])
    for _ in range(2):  # a rerun (did it publish?) publishes nothing new
        result = fedroute(*args)
        assert result.exit_code == 0, result.output
        assert "bundle v2 published" in result.output and bundle_version(fed["bundle"]) == 2
    manifest = json.loads((fed["bundle"] / "manifest.json").read_text())
    assert manifest["provenance"] == {"federated_round": r.id, "round_uid": r.settings.round_uid, "clients": 2}

    other, _ = write_tiny_kmeans(tmp_path / "other", signing_keys[0], embedder_name="other-static")
    fed["bundle"].unlink()  # publishing left a symlink to the new version's folder
    shutil.copytree(other, fed["bundle"])
    result = fedroute(*args)
    assert isinstance(result.exception, PublishRefused), result.output
    assert "now holds embedder 'other-static'; the round was opened on 'tiny-static'" in str(result.exception)
    assert bundle_version(fed["bundle"]) == 1


def test_publish_refuses_a_round_older_than_the_published_one(fed):
    """`fedroute publish --round 1` (a command from the shell's history) after round 2 was published
    wrote round 1's aggregate as a new, higher bundle version: every device rolled back to older
    statistics, and nothing said so."""
    from trainer.server.errors import PublishRefused

    for n in (5, 7):
        r = open_round(fed)
        upload(fed, r, "alice", n=n)
        upload(fed, r, "bob", n=n)
        close_round(fed["store"], r.id)
        result = fedroute("publish", "--round", r.id, "--bundle-dir", fed["bundle"], "--signing-key", fed["key"],
                          "--db", fed["url"])
        assert result.exit_code == 0, result.output
    assert bundle_version(fed["bundle"]) == 3
    result = fedroute("publish", "--round", r.id - 1, "--bundle-dir", fed["bundle"], "--signing-key", fed["key"],
                      "--db", fed["url"])
    assert isinstance(result.exception, PublishRefused), result.output
    assert str(result.exception) == (f"--round {r.id - 1}: {fed['bundle']} already holds the aggregate of the newer "
                                     f"round {r.id}; publishing round {r.id - 1}'s would roll the devices back to "
                                     "older statistics")
    manifest = json.loads((fed["bundle"] / "manifest.json").read_text())
    assert (manifest["bundle_version"], manifest["provenance"]["federated_round"]) == (3, r.id)


def test_publish_with_another_key_names_the_options(fed, tmp_path):
    """`fedroute publish --signing-key` with a key that did not sign the bundle said only "manifest
    signature does not verify ...: the bundle was modified or signed by another key", as if the
    bundle had been tampered with; `rounds open` names --bundle-dir and --signing-key."""
    from export.signing import generate_keypair

    r = open_round(fed)
    upload(fed, r, "alice")
    upload(fed, r, "bob")
    close_round(fed["store"], r.id)
    other, _ = generate_keypair(tmp_path / "other")
    result = fedroute("publish", "--round", r.id, "--bundle-dir", fed["bundle"], "--signing-key", other,
                      "--db", fed["url"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert (f"--bundle-dir {fed['bundle']} (checked with --signing-key {other}): manifest signature does not verify "
            "with public key") in flat(result.output), flat(result.output)
    assert bundle_version(fed["bundle"]) == 1


def test_publish_refuses_an_mlp_aggregate_whose_predictions_are_not_finite(fed):
    """The close of an MLP round stores but does not publish an aggregate that predicts NaN (a poisoned
    upload); `fedroute publish` of that round published it."""
    import dataclasses
    import time

    import torch

    from trainer.federated.mlp_aggregation import MLPAggregationConfig
    from trainer.federated.mlp_local import parameters_bytes
    from trainer.routers.mlp_router import build_network
    from trainer.server.errors import PublishRefused
    from trainer.server.round_kind import RoundOutcome
    from trainer.server.store import array_bytes

    torch.set_num_threads(1)
    params = {k: v.numpy().copy() for k, v in build_network(3, len(MODELS), 8, 0.0).state_dict().items()}
    network = {"hidden": 8, "dropout": 0.0, "local_epochs": 1, "cost_scale_usd": [0.001, 0.001],
               "available": [True, True]}
    store = fed["store"]
    r = store.open_round(kind="mlp", parameters=parameters_bytes(params), models=list(MODELS),
                         embedder={"name": "tiny-static", "dim": 3, "bundle_version": 1},
                         deadline_unix=time.time() + 3600, quorum=2, min_count=2,
                         settings=dataclasses.replace(round_settings(aggregation=MLPAggregationConfig(), seed=0),
                                                      network=network))
    poisoned = {**params, "accuracy_head.bias": np.full(len(MODELS), np.nan, dtype=np.float32)}
    assert store.claim_close(r.id, "test") is not None
    assert store.finish_close(r.id, RoundOutcome("aggregated", 2, 0, 0, 40.0, None, None, ["alice", "bob"]),
                              array_bytes(**poisoned), [], [], "test")
    result = fedroute("publish", "--round", r.id, "--bundle-dir", fed["bundle"], "--signing-key", fed["key"],
                      "--db", fed["url"])
    assert isinstance(result.exception, PublishRefused), result.output
    assert "the aggregate predicts non-finite or absurd values" in str(result.exception)


# --- rounds open -------------------------------------------------------------------------------


def test_rounds_open_refuses_a_negative_seed(fed):
    """--seed -1 opened the round; every close then failed (numpy's seed sequence takes no negative
    number) and after three tries the round ended "failed", its uploads never aggregated."""
    from sdk.errors import InvalidInputError

    result = fedroute("rounds", "open", "--bundle-dir", fed["bundle"], "--public-key", fed["pub"], "--seed", "-1",
                      "--db", fed["url"])
    assert result.exit_code == 2 and "--seed" in flat(result.output)
    assert fed["store"].latest_round() is None
    with pytest.raises(InvalidInputError, match=r"seed must be an integer >= 0, got -1"):
        round_settings(aggregation=AggregationConfig(), seed=-1)


@pytest.mark.parametrize("damage", ["missing", "garbage"])
def test_rounds_open_names_a_prior_router_without_readable_statistics(fed, tmp_path, damage):
    """A --prior-router folder whose kmeans.npz is missing (e.g. an MLP router's folder) or damaged
    ended in a FileNotFoundError / BadZipFile traceback."""
    prior = tmp_path / "prior"
    shutil.copytree(fed["router"], prior)
    if damage == "missing":
        (prior / "kmeans.npz").unlink()
    else:
        (prior / "kmeans.npz").write_bytes(b"PK\x03\x04 not a zip")
    result = fedroute("rounds", "open", "--bundle-dir", fed["bundle"], "--public-key", fed["pub"],
                      "--prior-router", prior, "--db", fed["url"])
    assert result.exit_code == 2, result.output
    assert f"--prior-router {prior}: not a saved K-means router" in flat(result.output)
    assert fed["store"].latest_round() is None


@pytest.mark.parametrize("router_kind", [None, "mlp"])
def test_rounds_open_refuses_a_bundle_that_is_not_k_means(fed, router_kind):
    """kmeans_rounds reads operator-signed bundles with format checks only: a manifest without router_kind
    ended in a KeyError."""
    from export.bundle_writer import write_bundle
    from export.signing import load_signing_key
    from sdk.errors import BundleError

    manifest = json.loads((fed["bundle"] / "manifest.json").read_text())
    fields = {k: v for k, v in manifest.items() if k not in ("format_version", "created_utc", "files", "signature",
                                                             "router_kind")}
    other = fed["tmp"] / "other"
    write_bundle(other, {name: (fed["bundle"] / name).read_bytes() for name in manifest["files"]},
                 {**fields, **({"router_kind": router_kind} if router_kind else {})}, load_signing_key(fed["key"]))
    result = fedroute("rounds", "open", "--bundle-dir", other, "--public-key", fed["pub"], "--db", fed["url"])
    assert isinstance(result.exception, BundleError) and "router_kind" in str(result.exception), result.output
    assert fed["store"].latest_round() is None


# --- the database ------------------------------------------------------------------------------


def test_a_new_sqlite_database_is_readable_by_its_owner_only(tmp_path):
    """fed.db holds every client's exact uploads and the secret seed of the DP noise (docs/privacy-and-dp.md:
    whoever knows it can subtract the noise from the published router); `clients add` created it, and
    its -wal file, readable by every local user (0644 under the usual umask 022)."""
    old = os.umask(0o022)
    try:
        result = fedroute("clients", "add", "phone-1", "--db", f"sqlite:///{tmp_path / 'fed.db'}")
        store = Store(f"sqlite:///{tmp_path / 'fed.db'}")
        store.add_client("phone-2")  # the WAL and shared-memory files exist while it is open
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in tmp_path.iterdir()}
        store.close()
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    assert modes == {"fed.db": "0o600", "fed.db-wal": "0o600", "fed.db-shm": "0o600"}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_clients_added_in_parallel_to_a_new_database_all_get_a_token(request, tmp_path, backend):
    """Provisioning a fleet with parallel `fedroute clients add` on a new database: the processes that
    created the tables together failed ("database is locked": SQLite refuses at once a read
    transaction's upgrade to a write; PostgreSQL: "already exists"), leaving their devices' token
    files empty. Eight stores created at the same moment, as eight CLI processes do. SQLite, 30 new
    databases: switching a new file to WAL also answered "database is locked" at once, in ~3% of such
    starts (2 of 60), so one database would rarely catch it."""
    import threading

    if backend == "postgresql":
        from postgres_server import fresh_database

        server, why = request.getfixturevalue("postgres")
        if server is None:
            pytest.skip(why)
        urls = [fresh_database(server)]
    else:
        urls = [f"sqlite:///{tmp_path / f'fed{k}.db'}" for k in range(30)]
    for url in urls:
        start, errors = threading.Barrier(8), []

        def provision(i: int) -> None:
            start.wait()
            try:
                store = Store(url)
                store.add_client(f"dev{i}")
                store.close()
            except Exception as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(f"{type(exc).__name__}: {str(exc)[:80]}")

        threads = [threading.Thread(target=provision, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [], url
        store = Store(url)
        assert [c["id"] for c in store.list_clients()] == [f"dev{i}" for i in range(8)]
        store.close()


# --- demo-log --------------------------------------------------------------------------------


def write_eval_csv(path: Path, x_correct: float) -> Path:
    """Eight prompts in the local wide schema (trainer.data.routerbench): "a ..." ones in model-x's
    cell, "b ..." ones in model-y's; model-x's correctness ``x_correct`` (NaN: unlabelled), model-y
    unlabelled."""
    import pandas as pd

    prompts = ["a", "a a", "a a a", "a c", "b", "b b", "b b b", "b c"]
    pd.DataFrame({"sample_id": [f"s{i}" for i in range(8)], "task": ["t"] * 8, "prompt": prompts,
                  "model-x|correctness": [x_correct] * 8, "model-x|cost_usd": [0.001] * 8,
                  "model-y|correctness": [np.nan] * 8, "model-y|cost_usd": [0.001] * 8}).to_csv(path, index=False)
    return path


def test_demo_log_refuses_a_negative_seed_before_reading_anything(fed, tmp_path):
    """--seed -1 loaded the table and the bundle, then ended in numpy's "expected non-negative integer"
    traceback."""
    data = write_eval_csv(tmp_path / "evals.csv", 1.0)
    result = fedroute("demo-log", "--bundle", fed["bundle"], "--public-key", fed["pub"], "--data", data,
                      "--out", tmp_path / "log.sqlite", "--seed", "-1")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "--seed" in flat(result.output) and not (tmp_path / "log.sqlite").exists()


def test_demo_log_prints_json_when_nothing_was_recorded(fed, tmp_path):
    """Rows whose picked model is unlabelled are skipped; with none left, `mean_score` was NaN and the
    "one JSON line" held a bare NaN, which JSON parsers (jq, JSON.parse) refuse."""
    data = write_eval_csv(tmp_path / "evals.csv", np.nan)  # no model labelled: every row is skipped
    result = fedroute("demo-log", "--bundle", fed["bundle"], "--public-key", fed["pub"], "--data", data,
                      "--out", tmp_path / "log.sqlite", "--rows", "4", "--explore", "0", "--lam", "0", "--seed", "3")
    assert result.exit_code == 0, result.output

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    out = json.loads(result.stdout.strip().splitlines()[-1], parse_constant=refuse)
    assert (out["n_recorded"], out["skipped"], out["mean_score"], out["total_cost_usd"]) == (0, 4, None, 0.0)


# --- fedroute-sync and serve -------------------------------------------------------------------


def test_fedroute_sync_names_a_state_path_it_cannot_use(fed, tmp_path):
    """An OSError of the state file or its lock (a file in the way, a full disk, a read-only folder)
    ended `fedroute-sync` in a traceback with exit status 1: the timer unit's "exit 2 and one line
    on an error of ours" (sdk/sync_cli.py) did not hold."""
    from sdk import EvalLog

    with EvalLog(tmp_path / "log.sqlite", MODELS):
        pass
    (tmp_path / "token").write_text(fed["tokens"]["alice"])
    (tmp_path / "in-the-way").write_text("")
    state = tmp_path / "in-the-way" / "state.json"
    out = subprocess.run(
        [sys.executable, "-c", "from sdk.sync_cli import main; main()", "--server", "https://127.0.0.1:9",
         "--token-file", str(tmp_path / "token"), "--log", str(tmp_path / "log.sqlite"), "--bundle",
         str(fed["bundle"]), "--public-key", str(fed["pub"]), "--state", str(state), "--retries", "0"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert out.stderr.strip() == f"error: {tmp_path / 'in-the-way'}: File exists"


def test_serve_refuses_a_sqlite_database_that_does_not_exist(tmp_path):
    """A typo in `serve --db` created an empty database and served it: every device got 401 (no such
    token) and `GET /v1/rounds/current` 204, as if nothing was wrong on the server."""
    from sync_fleet import write_tls_files

    server_pem, _ = write_tls_files(tmp_path)
    typo = tmp_path / "fd.db"
    result = fedroute("serve", "--db", f"sqlite:///{typo}", "--tls-cert", server_pem, "--tls-key", server_pem,
                      "--port", "0")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert (f"--db sqlite:///{typo}: no database at {typo}; `fedroute clients add` or `fedroute rounds open` "
            "creates one") in flat(result.output)
    assert not typo.exists()


@pytest.mark.parametrize("case, reason, fix", [
    ("not yet valid", "certificate is not yet valid", "check this device's clock (it reads "),
    ("expired", "certificate has expired", "check this device's clock (it reads "),
    ("other name", "mismatch", "use a server name or address the certificate was issued for in the server URL"),
])
def test_a_certificate_that_does_not_verify_is_explained_by_its_reason(tmp_path, signing_keys, case, reason, fix):
    """A device whose clock is wrong (an edge box without a clock battery before NTP) or a server URL
    with another name than the certificate's was told "pass the CA that signed it as --ca-cert",
    which it already did. A real TLS handshake against a certificate of each kind."""
    import datetime as dt
    import socket
    import ssl
    import threading

    import trustme

    from sdk import EvalLog
    from sdk.errors import SyncError
    from sdk.sync import SyncClient

    ca = trustme.CA()
    now = dt.datetime.now(dt.timezone.utc)
    dates = {"not yet valid": (now + dt.timedelta(days=2), now + dt.timedelta(days=30)),
             "expired": (now - dt.timedelta(days=30), now - dt.timedelta(days=2))}.get(case, (None, None))
    names = ("fed.example",) if case == "other name" else ("127.0.0.1", "localhost")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names, not_before=dates[0], not_after=dates[1]).configure_cert(context)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    listener = socket.create_server(("127.0.0.1", 0))

    def handshake_once() -> None:
        conn, _ = listener.accept()
        try:
            context.wrap_socket(conn, server_side=True).close()
        except (ssl.SSLError, OSError):
            pass  # the client refused the certificate
        finally:
            conn.close()

    threading.Thread(target=handshake_once, daemon=True).start()
    url = f"https://127.0.0.1:{listener.getsockname()[1]}"
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log, SyncClient(
            url, "fr_token", log, tmp_path / "bundle", signing_keys[1], ca_cert=tmp_path / "ca.pem", timeout_s=10,
            retries=2, sleep=lambda s: None) as client:
        with pytest.raises(SyncError) as info:
            client.run_once()
    listener.close()
    assert reason in str(info.value) and fix in str(info.value), str(info.value)


def newer_bundle_server(tmp_path: Path, signing_key: Path, round_: dict | None = None):
    """An ``httpx.MockTransport`` handler playing a server that publishes the tiny bundle as version 2
    and describes ``round_`` (None: no round open, 204)."""
    import httpx

    newer, _ = write_tiny_kmeans(tmp_path / "v2", signing_key, version=2)
    manifest = (newer / "manifest.json").read_bytes()
    files = {digest: (newer / name).read_bytes() for name, digest in json.loads(manifest)["files"].items()}

    def server(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/rounds/current":
            return httpx.Response(204) if round_ is None else httpx.Response(200, json=round_)
        if path == "/v1/bundles/latest":
            return httpx.Response(200, content=manifest, headers={"etag": '"v2"'})
        if path.startswith("/v1/bundles/files/"):
            return httpx.Response(200, content=files[path.rsplit("/", 1)[-1]])
        return httpx.Response(404, json={"detail": f"no route {path}"})

    return httpx.MockTransport(server)


def test_a_bundle_whose_vocabulary_lacks_the_probe_word_is_installed(fed, tmp_path, signing_keys):
    """The device checks that a new bundle gives some estimate for a probe query, "hello"; a static
    embedder whose vocabulary has no token of it (another language's, here a 4-word one) raised
    InvalidQueryError there, so no bundle of that embedder was ever installed by a sync."""
    from sdk import EvalLog
    from sdk.sync import SyncClient

    device_bundle = tmp_path / "device" / "bundle"
    shutil.copytree(fed["bundle"], device_bundle)
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log, SyncClient(
            "https://fed.test", "fr_token", log, device_bundle, signing_keys[1],
            transport=newer_bundle_server(tmp_path, signing_keys[0]), sleep=lambda s: None) as client:
        result = client.run_once()
    assert (result.round_id, result.bundle_version, result.bundle_updated) == (None, 2, True)
    assert bundle_version(device_bundle) == 2


def test_a_log_that_cannot_be_read_still_lets_the_device_install_a_newer_bundle(fed, tmp_path, signing_keys):
    """A damaged log row (here an embedding of 2 bytes in a 3-d log) raised EvalLogError in the upload
    step, before the bundle step: every sync stopped there and the device stayed on its old bundle for
    good, while the docs promise "a device is never stuck on an old bundle"."""
    import sqlite3

    from sdk import EvalLog
    from sdk.errors import EvalLogError
    from sdk.local_update import centroids_hash
    from sdk.sync import SyncClient

    centroids = np.eye(3, dtype=np.float32)[:2]
    round_ = {"round_id": 1, "kind": "kmeans", "client_id": "alice", "centroids": centroids.tolist(),
              "centroids_hash": centroids_hash(centroids), "models": list(MODELS), "embedder_name": "tiny-static",
              "d_emb": 3, "min_count": 2, "deadline_utc": "2026-12-01T00:00:00.000000Z"}
    device_bundle = tmp_path / "device" / "bundle"
    shutil.copytree(fed["bundle"], device_bundle)
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log:
        log.record("model-x", 1.0, 0.001, embedding=[1.0, 0.0, 0.0])
    db = sqlite3.connect(tmp_path / "log.sqlite")
    with db:
        db.execute("UPDATE evaluations SET embedding = x'0000' WHERE id = 1")
    db.close()
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log, SyncClient(
            "https://fed.test", "fr_token", log, device_bundle, signing_keys[1],
            transport=newer_bundle_server(tmp_path, signing_keys[0], round_), sleep=lambda s: None) as client:
        with pytest.raises(EvalLogError, match="row 1 has an embedding of 2 bytes") as info:
            client.run_once()
    assert info.value.__notes__ == ["the bundle step still ran: version 2 in use (newly installed)"]
    assert bundle_version(device_bundle) == 2


@pytest.mark.parametrize("command", [
    ("serve", "--tls-cert", "{pem}", "--tls-key", "{pem}", "--port", "0"),
    ("clients", "add", "dev"),
    ("rounds", "status"),
])
def test_operator_commands_refuse_a_database_holding_other_tables(tmp_path, command):
    """`fedroute serve --db sqlite:///eval_log.sqlite` (a device's log given by mistake) added the
    server's tables to it; every command taking --db shares the store opener that now refuses it."""
    from sync_fleet import write_tls_files

    from sdk.eval_log import EvalLog

    server_pem, _ = write_tls_files(tmp_path)
    log_path = tmp_path / "eval_log.sqlite"
    EvalLog(log_path, ["m"]).close()
    before = log_path.read_bytes()
    args = [a.format(pem=server_pem) for a in command]
    result = fedroute(*args, "--db", f"sqlite:///{log_path}")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert ("holds tables that are not the aggregation server's: ['evaluations', 'meta']"
            in flat(result.output)), flat(result.output)
    import sqlite3

    with sqlite3.connect(log_path) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables == {"evaluations", "meta", "sqlite_sequence"} and log_path.read_bytes() == before


@pytest.mark.parametrize("command", [
    ("serve", "--tls-cert", "{pem}", "--tls-key", "{pem}", "--port", "0"),
    ("clients", "add", "dev"),
    ("rounds", "status"),
])
def test_a_db_given_as_a_file_name_is_answered_with_the_url_to_use(tmp_path, command):
    """`--db fed.db` (a file name, not a URL) answered "Could not parse SQLAlchemy URL from given URL
    string", which does not say what to write instead."""
    from sync_fleet import write_tls_files

    server_pem, _ = write_tls_files(tmp_path)
    result = fedroute(*[a.format(pem=server_pem) for a in command], "--db", "fed.db")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert ("cannot open database 'fed.db': Could not parse SQLAlchemy URL from given URL string; a SQLite file "
            "is given as a URL: --db sqlite:///fed.db") in flat(result.output), flat(result.output)


def encrypted_tls_files(work: Path, passphrase: bytes) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (``trustme``) and its key encrypted with ``passphrase`` (``cryptography``,
    PKCS#8): ``(cert.pem, key.pem)``."""
    import trustme
    from cryptography.hazmat.primitives import serialization

    issued = trustme.CA().issue_cert("127.0.0.1")
    key = serialization.load_pem_private_key(issued.private_key_pem.bytes(), None)
    cert_pem, key_pem = work / "cert.pem", work / "key.pem"
    cert_pem.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    key_pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.BestAvailableEncryption(passphrase)))
    return cert_pem, key_pem


def serve_until_started(args: list[str], stdin: bytes, timeout_s: float = 60.0) -> tuple[bool, str]:
    """Run ``fedroute serve ARGS --port 0`` without a terminal (a new session: no /dev/tty), ``stdin`` as its
    input; stop it once uvicorn reports its startup. Returns (started, what it wrote on stdout and stderr)."""
    import selectors
    import time

    process = subprocess.Popen([sys.executable, "-m", "trainer.cli", "serve", *args, "--port", "0"], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    process.stdin.write(stdin)
    process.stdin.close()
    out, started, deadline = b"", False, time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline and not started:
            if not sel.select(timeout=0.5):
                continue
            chunk = os.read(process.stdout.fileno(), 65536)
            if not chunk:
                break
            out += chunk
            started = b"Application startup complete" in out
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    process.stdout.close()
    return started, out.decode(errors="replace")


@pytest.mark.parametrize("how", ["asked", "--tls-key-password-file"])
def test_serve_asks_an_encrypted_keys_passphrase_once(tmp_path, how):
    """`serve` with an encrypted --tls-key had OpenSSL ask its passphrase twice (our check of the key, then
    uvicorn's load), and without a terminal the second read found nothing: uvicorn's SSLError. It is now
    asked once (or read from --tls-key-password-file, not asked at all) and handed to uvicorn."""
    cert_pem, key_pem = encrypted_tls_files(tmp_path, b"s3cret")
    db = tmp_path / "fed.db"
    Store(f"sqlite:///{db}").close()
    args = ["--db", f"sqlite:///{db}", "--tls-cert", str(cert_pem), "--tls-key", str(key_pem)]
    if how == "asked":
        started, out = serve_until_started(args, b"s3cret\n")
    else:
        (tmp_path / "passphrase").write_text("s3cret\n")
        started, out = serve_until_started([*args, "--tls-key-password-file", str(tmp_path / "passphrase")], b"")
    assert started, out
    assert out.count(f"passphrase of --tls-key {key_pem}") == (how == "asked") and "PEM pass phrase" not in out, out


def test_serve_refuses_a_wrong_passphrase_in_one_line(tmp_path):
    cert_pem, key_pem = encrypted_tls_files(tmp_path, b"s3cret")
    (tmp_path / "passphrase").write_text("wrong\n")
    (tmp_path / "empty").write_text("\n")
    db = tmp_path / "fed.db"
    Store(f"sqlite:///{db}").close()
    args = ["serve", "--db", f"sqlite:///{db}", "--tls-cert", cert_pem, "--tls-key", key_pem, "--port", "0"]
    result = fedroute(*args, "--tls-key-password-file", tmp_path / "passphrase")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert f"--tls-cert {cert_pem} / --tls-key {key_pem}: [SSL]" in flat(result.output)
    assert "(a wrong passphrase?)" in flat(result.output)
    result = fedroute(*args, "--tls-key-password-file", tmp_path / "empty")
    assert result.exit_code == 2
    assert f"--tls-key-password-file {tmp_path / 'empty'}: its first line is empty" in flat(result.output)


def test_a_full_disk_answers_503_and_loses_no_acknowledged_upload(fed, tmp_path):
    """A server whose disk filled up answered every upload "500 Internal Server Error" and logged a
    traceback per upload. Now 503 naming the storage failure, with Retry-After, one log line; after a
    restart with room again every acknowledged upload is there and the refused one is taken once.
    The full disk is a real ``fedroute serve`` under a file-size limit (RLIMIT_FSIZE: its writes beyond
    it fail with EFBIG, as on a full disk)."""
    import resource
    import ssl

    import httpx

    from sdk.protocol import RoundSpec, encode_kmeans_update
    from sync_fleet import CLI, ServerProcess, write_tls_files

    r = open_round(fed)
    server_pem, ca_pem = write_tls_files(tmp_path)
    server = ServerProcess(tmp_path, fed["url"], server_pem, ca_pem)
    db_file = tmp_path / "fed.db"
    limit = max(db_file.stat().st_size, 64 << 10) + (64 << 10)  # the WAL and the database can grow a little

    def no_room() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    with server.log_path.open("ab") as log:
        server.process = subprocess.Popen(
            [*CLI, "serve", "--db", fed["url"], "--tls-cert", str(server_pem), "--tls-key", str(server_pem),
             "--port", str(server.port), "--upload-quota", "0", "--tick-s", "60"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=no_room)
    verify = ssl.create_default_context(cafile=str(ca_pem))
    headers = {"Authorization": f"Bearer {fed['tokens']['alice']}", "Content-Type": "application/json"}
    try:
        server.wait_healthy(verify, 120)
        spec = RoundSpec.from_json(httpx.get(f"{server.url}/v1/rounds/current", headers=headers, verify=verify,
                                             timeout=30).json())
        count = np.array([[4.0, 0.0], [0.0, 4.0]])
        update = KMeansUpdate(CellStatistics(count, 0.5 * count, 0.001 * count), np.zeros(0, np.int64),
                              np.zeros((0, 3)), np.zeros(0), 8)
        body = encode_kmeans_update(update, "alice", spec)
        acked, refused = [], None
        with httpx.Client(verify=verify, timeout=30) as client:
            for i in range(2000):  # each commit grows the WAL by a few pages: the limit comes within ~40
                answer = client.post(f"{server.url}/v1/rounds/{r.id}/updates", content=body,
                                     headers={**headers, "Idempotency-Key": f"k{i}"})
                if answer.status_code != 201:
                    refused = (f"k{i}", answer)
                    break
                acked.append(answer.json()["update_id"])
        assert refused is not None, "the file-size limit was never reached"
        key, answer = refused
        assert answer.status_code == 503, answer.text
        assert answer.headers["Retry-After"] == "30"
        detail = answer.json()["detail"]
        assert detail.startswith("the server could not store the upload (disk I/O error)"), detail
        assert detail.endswith("nothing was acknowledged: retry later with the same Idempotency-Key")
        server.stop()
        assert "Traceback" not in server.log_tail(100_000)
        assert "upload not stored, the database refused the write: disk I/O error" in server.log_tail(100_000)
        server.start(120)  # room again
        with httpx.Client(verify=verify, timeout=30) as client:
            retry = client.post(f"{server.url}/v1/rounds/{r.id}/updates", content=body,
                                headers={**headers, "Idempotency-Key": key})
            again = client.post(f"{server.url}/v1/rounds/{r.id}/updates", content=body,
                                headers={**headers, "Idempotency-Key": key})
        assert (retry.status_code, again.status_code) == (201, 200)
        stored = fed["store"].round_updates(r.id)
        assert sorted(stored) == sorted([*acked, retry.json()["update_id"]])
    finally:
        server.stop()


def test_a_database_that_went_away_is_503_and_one_log_line(tiny, signing_keys, caplog):
    """A PostgreSQL server stopped under `fedroute serve`: every request was a 500 "Internal Server
    Error" with a traceback, and the closer logged a traceback every tick (3,600 an hour). Now 503
    with Retry-After naming the database, and one ERROR line each; it serves again once PostgreSQL is
    back. A real throwaway PostgreSQL server (tests/postgres_server.py), stopped with pg_ctl."""
    import logging
    import subprocess as sp
    import time

    from fastapi.testclient import TestClient

    from postgres_server import start
    from sdk.protocol import RoundSpec, encode_kmeans_update
    from trainer.server.app import create_app

    server, why = start()
    if server is None:
        pytest.skip(why)
    pg_ctl = [*server.run_as, "pg_ctl", "-D", str(server.directory / "data")]
    store = Store(server.url)
    try:
        token = store.add_client("alice")
        r = open_round_from_bundle(store, tiny[0], signing_keys[1], deadline_s=3600, quorum=10, min_count=2,
                                   settings=round_settings(aggregation=AggregationConfig()))
        headers = {"Authorization": f"Bearer {token}"}
        app = create_app(store, tiny[0], tick_s=0.05)
        with TestClient(app, base_url="https://testserver") as http, caplog.at_level(logging.INFO):
            spec = RoundSpec.from_json(http.get("/v1/rounds/current", headers=headers).json())
            count = np.array([[4.0, 0.0], [0.0, 4.0]])
            body = encode_kmeans_update(KMeansUpdate(CellStatistics(count, 0.5 * count, 0.001 * count),
                                                     np.zeros(0, np.int64), np.zeros((0, 3)), np.zeros(0), 8),
                                        "alice", spec)
            sp.run([*pg_ctl, "-m", "immediate", "stop"], capture_output=True, check=True, timeout=60)
            caplog.clear()
            got = http.get("/v1/rounds/current", headers=headers)
            sent = http.post(f"/v1/rounds/{r.id}/updates", content=body,
                             headers={**headers, "Idempotency-Key": "k1", "Content-Type": "application/json"})
            time.sleep(0.5)  # the closer's ticks meet the stopped database too
            assert (got.status_code, sent.status_code) == (503, 503), (got.text, sent.text)
            assert got.headers["Retry-After"] == sent.headers["Retry-After"] == "30"
            assert got.json()["detail"].startswith("the server's database is unavailable (")
            assert sent.json()["detail"].startswith("the server could not store the upload (")
            errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
            assert any("closing rounds failed, the database is unavailable" in rec.getMessage() for rec in errors)
            assert [rec.getMessage() for rec in errors if rec.exc_info] == []  # no traceback
            sp.run([*pg_ctl, "-o", f"-c listen_addresses='' -k {server.directory}", "-l",
                    str(server.directory / "log"), "-w", "start"], capture_output=True, check=True, timeout=120)
            again = http.post(f"/v1/rounds/{r.id}/updates", content=body,
                              headers={**headers, "Idempotency-Key": "k1", "Content-Type": "application/json"})
            assert again.status_code == 201, again.text
    finally:
        store.close()
        server.stop()


def test_serve_refuses_a_bundle_dir_without_a_bundle_and_warns_of_a_round_publishing_elsewhere(fed, tmp_path):
    """`serve --bundle-dir bundles` (the folder above bundles/kmeans) started and answered every device
    404 on /v1/bundles/latest, which devices take as "nothing published": no device ever got the
    bundles the rounds published to bundles/kmeans, and nothing said so."""
    from sync_fleet import write_tls_files

    server_pem, _ = write_tls_files(tmp_path)
    parent = tmp_path / "bundles"
    parent.mkdir()
    shutil.copytree(fed["bundle"], parent / "kmeans")
    started, out = serve_until_started(["--db", fed["url"], "--tls-cert", str(server_pem), "--tls-key",
                                        str(server_pem), "--bundle-dir", str(parent)], b"")
    assert not started, out
    # rich wraps the panel inside long paths (a worker's tmp path): compare without any whitespace
    assert "".join((f"--bundle-dir {parent} holds no manifest.json, so no bundle to serve; the bundles in it: "
                    f"{parent / 'kmeans'}").split()) in "".join(flat(out).split()), flat(out)

    r = open_round(fed, publish_key=fed["key"])  # publishes to fed["bundle"] at close
    started, out = serve_until_started(["--db", fed["url"], "--tls-cert", str(server_pem), "--tls-key",
                                        str(server_pem), "--bundle-dir", str(parent / "kmeans")], b"")
    assert started, out
    assert (f"warning: round {r.id} publishes its bundle to {fed['bundle']}, but this server serves --bundle-dir "
            f"{parent / 'kmeans'}: the devices will not get it; serve --bundle-dir {fed['bundle']}") in " ".join(out.split())
    started, out = serve_until_started(["--db", fed["url"], "--tls-cert", str(server_pem), "--tls-key",
                                        str(server_pem), "--bundle-dir", str(fed["bundle"])], b"")
    assert started and "warning" not in out, out
