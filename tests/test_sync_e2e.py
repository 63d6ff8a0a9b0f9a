"""End to end over real HTTPS between real processes (issue: federated sync).

The server runs as ``fedroute serve`` on 127.0.0.1 over TLS (a local CA made with trustme); the
operator uses the real CLI (in process); three devices hold real :class:`sdk.EvalLog` files built from RouterBench
rows, embedded by the bundle's own ONNX embedder as ``Router.choose`` does on a device. One device
syncs in-process through :class:`sdk.SyncClient` with a transport that records every request it
sends (privacy check), the other two run the ``fedroute-sync`` command. One round closes on quorum,
a new bundle is published and picked up by every device, and the merged statistics equal the
centralised statistics of the pooled logs. A second round shows a device restarted mid-round with
the same identity: counted once, with its latest log.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import time
import httpx
import msgpack
import numpy as np
import pytest

from sdk import EvalLog, Router
from sdk.cell_statistics import CellStatistics
from sdk.protocol import MSGPACK_ARRAYS, decode_kmeans_update_msgpack, unpack_msgpack_array
from sdk.sync import SyncClient
from sdk.voronoi import nearest_cell

pytestmark = pytest.mark.slow

SYNC_CLI = (sys.executable, "-m", "sdk.sync_cli")
PER_CLIENT = 40


class RecordingTransport(httpx.HTTPTransport):
    """httpx's own transport, keeping a copy of every request (method, path, body) it sends."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sent: list[tuple[str, str, bytes]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((request.method, request.url.path, request.read()))
        return super().handle_request(request)


def cli(*args: str) -> str:
    """stdout of ``fedroute ARGS``, run in this process (the operator's commands as processes: the README's
    operator quick start, tests/test_readme_quickstart.py)."""
    from typer.testing import CliRunner

    from trainer.cli import app

    done = CliRunner().invoke(app, list(args), env={"COLUMNS": "500"})
    assert done.exit_code == 0, done.output
    return done.stdout


def wait_for(predicate, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, make_bundle, signing_keys, routerbench_dir):
    """Server bundle, three device bundles and logs, the TLS files, clients and an open round."""
    from sync_fleet import write_tls_files
    from trainer.data.routerbench import load_routerbench_dir

    work = tmp_path_factory.mktemp("sync_e2e")
    server_bundle = make_bundle(work / "server" / "bundle", "kmeans")
    write_tls_files(work)
    db = f"sqlite:///{work / 'fed.db'}"
    tokens = {c: cli("clients", "add", c, "--db", db).strip() for c in ("dev-a", "dev-b", "dev-c")}
    opened = json.loads(cli("rounds", "open", "--db", db, "--bundle-dir", str(server_bundle), "--signing-key",
                            str(signing_keys[0]), "--quorum", "3", "--min-count", "1", "--deadline-s", "600"))

    train, _ = load_routerbench_dir(routerbench_dir)
    rng = np.random.default_rng(11)
    rows = rng.choice(train.n_queries, 3 * PER_CLIENT + 10, replace=False)
    router = Router.load(server_bundle, signing_keys[1])
    prompts = [train.prompts[i] for i in rows]
    embeddings = router.embed(prompts)
    labelled = train.labelled()
    logs, pooled = {}, []
    for j, client in enumerate(tokens):
        shutil.copytree(server_bundle, work / client / "bundle")  # the device's copy of v1
        logs[client] = work / client / "eval_log.sqlite"
        with EvalLog(logs[client], train.models) as log:
            for k in range(j * PER_CLIENT, (j + 1) * PER_CLIENT):
                i = rows[k]
                m = int(rng.choice(np.flatnonzero(labelled[i])))  # the one model this query went to
                log.record(train.models[m], float(train.accuracy[i, m]), float(train.cost[i, m]),
                           embedding=embeddings[k])
                pooled.append((client, k, m, float(train.accuracy[i, m]), float(train.cost[i, m])))
    return {"work": work, "db": db, "tokens": tokens, "round_id": opened["round_id"], "server_bundle": server_bundle,
            "logs": logs, "pooled": pooled, "embeddings": embeddings, "prompts": prompts, "rows": rows,
            "models": train.models, "train": train, "ca": work / "ca.pem", "pub": signing_keys[1]}


@pytest.fixture(scope="module")
def server(deployment):
    from sync_fleet import ServerProcess

    work = deployment["work"]
    process = ServerProcess(work, deployment["db"], work / "server.pem", deployment["ca"],
                            bundle_dir=deployment["server_bundle"], tick_s=0.2).start()
    yield process.url
    process.stop()


# The rounds of this module run with --min-count 1 so that the merged statistics can be compared with
# the centralised ones entry by entry; the devices accept it (their default floor is 5).
FLOOR = 1


def sync_in_process(deployment, server, client, transport=None):
    with EvalLog(deployment["logs"][client], deployment["models"]) as log, SyncClient(
            server, deployment["tokens"][client], log, deployment["work"] / client / "bundle", deployment["pub"],
            ca_cert=deployment["ca"], transport=transport, min_count_floor=FLOOR) as sync:
        return sync.run_once()


def sync_command(deployment, server, client) -> dict:
    token_file = deployment["work"] / client / "token"
    token_file.write_text(deployment["tokens"][client])
    done = subprocess.run([*SYNC_CLI, "--server", server, "--log", str(deployment["logs"][client]), "--bundle",
                           str(deployment["work"] / client / "bundle"), "--public-key", str(deployment["pub"]),
                           "--token-file", str(token_file), "--ca-cert", str(deployment["ca"]),
                           "--min-count-floor", str(FLOOR)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def first_round(deployment, server):
    context = ssl.create_default_context(cafile=str(deployment["ca"]))
    transport = RecordingTransport(verify=context)
    results = {"dev-a": sync_in_process(deployment, server, "dev-a", transport)}
    for client in ("dev-b", "dev-c"):
        results[client] = sync_command(deployment, server, client)

    def closed():
        status = json.loads(cli("rounds", "status", "--db", deployment["db"]))
        return status if status["status"] == "closed" else None

    status = wait_for(closed)
    picked = {"dev-a": sync_in_process(deployment, server, "dev-a")}
    for client in ("dev-b", "dev-c"):
        picked[client] = sync_command(deployment, server, client)
    return {"uploads": results, "status": status, "picked": picked, "sent": transport.sent}


def centralised(deployment, centroids, clients=("dev-a", "dev-b", "dev-c"), extra=()) -> CellStatistics:
    rows = [r for r in deployment["pooled"] if r[0] in clients] + list(extra)
    emb = deployment["embeddings"][[r[1] for r in rows]]
    return CellStatistics.from_samples(nearest_cell(emb, centroids), [r[2] for r in rows], [r[3] for r in rows],
                                       [r[4] for r in rows], centroids.shape[0], len(deployment["models"]))



def wire_object(body: bytes) -> dict:
    """A MessagePack upload body (what SyncClient sends) with its arrays as nested lists."""
    obj = msgpack.unpackb(body)
    for name, (dtype, rank) in MSGPACK_ARRAYS.items():
        obj[name] = unpack_msgpack_array(obj[name], dtype, rank).tolist()
    return obj

def test_round_closes_on_quorum_and_statistics_equal_the_centralised_ones(deployment, first_round):
    from trainer.server.store import Store

    for client, result in first_round["uploads"].items():
        assert result["uploaded"] if isinstance(result, dict) else result.uploaded, client
    outcome = first_round["status"]["outcome"]
    assert outcome["result"] == "aggregated" and outcome["clients"] == ["dev-a", "dev-b", "dev-c"]
    assert outcome["total_count"] == 3 * PER_CLIENT and outcome["bundle_version"] == 2
    store = Store(deployment["db"])
    r = store.get_round(deployment["round_id"])
    agg = store.aggregate_of(r.id)
    expected = centralised(deployment, r.centroids)
    np.testing.assert_array_equal(agg["count"], expected.count)
    np.testing.assert_allclose(agg["sum_accuracy"], expected.sum_accuracy, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(agg["sum_cost"], expected.sum_cost, rtol=1e-12, atol=1e-15)


def test_new_bundle_is_published_and_picked_up_by_every_device(deployment, first_round):
    from trainer.server.store import Store

    r = Store(deployment["db"]).get_round(deployment["round_id"])
    expected = centralised(deployment, r.centroids)
    for client, result in first_round["picked"].items():
        version = result["bundle_version"] if isinstance(result, dict) else result.bundle_version
        assert version == 2, client
        bundle = deployment["work"] / client / "bundle"
        assert bundle.is_symlink()
        router = Router.load(bundle, deployment["pub"])
        assert router.bundle_version == 2 and {k: router.manifest["provenance"][k] for k in ("federated_round", "clients")} == {
            "federated_round": 1, "clients": 3}
        with np.load(bundle / "kmeans.npz") as z:
            np.testing.assert_array_equal(z["count"], expected.count)
        choice = router.choose(deployment["prompts"][-1], lam=0.0)  # a query no device logged
        assert choice.model in deployment["models"]
    server_manifest = json.loads((deployment["server_bundle"] / "manifest.json").read_text())
    assert server_manifest["bundle_version"] == 2 and "parity.json" not in server_manifest["files"]


def test_requests_carry_no_text_and_no_per_query_embedding(deployment, first_round):
    sent = first_round["sent"]
    assert [(m, p) for m, p, _ in sent][:2] == [("GET", "/v1/rounds/current"), ("POST", "/v1/rounds/1/updates")]
    posts = [body for method, _, body in sent if method == "POST"]
    assert len(posts) == 1 and all(body == b"" for method, _, body in sent if method == "GET")
    body = posts[0]  # MessagePack, what SyncClient sends by default
    for prompt in deployment["prompts"]:
        for start in range(0, max(1, len(prompt) - 24), 24):  # no 24-character piece of any prompt
            piece = prompt[start:start + 24]
            if len(piece.strip()) >= 16:
                assert piece.encode() not in body
    upload = msgpack.unpackb(body)
    _, update = decode_kmeans_update_msgpack(body)
    own = deployment["embeddings"][:PER_CLIENT].astype(np.float64)
    means = update.local_centroids
    assert means.shape[0] >= 1 and (update.local_weights >= 2).all()
    distance = np.linalg.norm(means[:, None, :] - own[None, :, :], axis=2)
    assert distance.min() > 1e-3  # no reported vector is (numerically) one query's embedding
    assert set(upload) == {"client_id", "round_id", "kind", "centroids_hash", "models", "log_size", "count",
                           "sum_accuracy", "sum_cost", "centroid_cells", "local_centroids", "local_weights"}


def test_device_restarted_mid_round_is_counted_once_with_its_latest_log(deployment, server, first_round, signing_keys):
    from trainer.server.store import Store

    opened = json.loads(cli("rounds", "open", "--db", deployment["db"], "--bundle-dir", str(deployment["server_bundle"]),
                            "--signing-key", str(signing_keys[0]), "--quorum", "3", "--min-count", "1",
                            "--deadline-s", "600"))
    first = sync_in_process(deployment, server, "dev-a")
    assert first.uploaded and first.round_id == opened["round_id"]
    # The device dies after the upload was acknowledged, before it saved its state: it runs again.
    state = deployment["work"] / "dev-a" / ".bundle.sync.json"
    state.unlink()
    again = sync_in_process(deployment, server, "dev-a")
    assert again.update_id == first.update_id  # the server recognised the retry (same key, same body)
    # It then logs more evaluations and syncs again within the same round: its new update replaces the old.
    train, extra = deployment["train"], []
    with EvalLog(deployment["logs"]["dev-a"], deployment["models"]) as log:
        for k in range(3 * PER_CLIENT, 3 * PER_CLIENT + 10):
            i = deployment["rows"][k]
            m = int(np.flatnonzero(train.labelled()[i])[0])
            log.record(train.models[m], float(train.accuracy[i, m]), float(train.cost[i, m]),
                       embedding=deployment["embeddings"][k])
            extra.append(("dev-a", k, m, float(train.accuracy[i, m]), float(train.cost[i, m])))
    grown = sync_in_process(deployment, server, "dev-a")
    assert grown.uploaded and grown.update_id != first.update_id and grown.log_size == PER_CLIENT + 10
    store = Store(deployment["db"])
    assert len(store.round_updates(opened["round_id"])) == 2  # two distinct bodies, no duplicate
    outcome = json.loads(cli("rounds", "close", "--db", deployment["db"]))
    assert outcome["clients"] == ["dev-a", "dev-b", "dev-c"]  # b and c still count with round 1
    r = store.get_round(opened["round_id"])
    expected = centralised(deployment, r.centroids, extra=extra)
    np.testing.assert_array_equal(store.aggregate_of(r.id)["count"], expected.count)
    assert outcome["total_count"] == 3 * PER_CLIENT + 10


def test_one_more_query_between_two_uploads_cannot_be_recovered_by_subtracting_them(deployment, server):
    """A device (default min_count_floor 5) logs one more query between two syncs of one round: the
    server, subtracting the two bodies, learns neither its embedding nor its score and cost."""
    from trainer.server.store import Store

    opened = json.loads(cli("rounds", "open", "--db", deployment["db"], "--bundle-dir", str(deployment["server_bundle"]),
                            "--public-key", str(deployment["pub"]), "--quorum", "10", "--min-count", "1",
                            "--deadline-s", "600"))
    centroids = Store(deployment["db"]).get_round(opened["round_id"]).centroids
    token = cli("clients", "add", "dev-d", "--db", deployment["db"]).strip()
    work = deployment["work"] / "dev-d"
    shutil.copytree(deployment["server_bundle"], work / "bundle")
    emb, model = deployment["embeddings"], deployment["models"][0]
    transport = RecordingTransport(verify=ssl.create_default_context(cafile=str(deployment["ca"])))

    def sync():
        with EvalLog(work / "log.sqlite", deployment["models"]) as log, SyncClient(
                server, token, log, work / "bundle", deployment["pub"], ca_cert=deployment["ca"],
                transport=transport) as client:
            return client.run_once()

    with EvalLog(work / "log.sqlite", deployment["models"]) as log:
        for k in range(2 * PER_CLIENT):
            log.record(model, float(k % 2), 0.001 * (1 + k % 3), embedding=emb[k])
    assert sync().uploaded
    first = wire_object(next(body for method, _, body in transport.sent if method == "POST"))
    weights = dict(zip(first["centroid_cells"], first["local_weights"]))
    cells = nearest_cell(emb, centroids)
    secret = next(k for k in range(2 * PER_CLIENT, len(emb)) if weights.get(int(cells[k]), 0) >= 5)
    cell = int(cells[secret])  # a cell whose mean is reported: unheld, n -> n + 1 would reveal the query
    with EvalLog(work / "log.sqlite", deployment["models"]) as log:
        log.record(model, 1.0, 0.0123, embedding=emb[secret])
    assert sync().uploaded
    a, b = (wire_object(body) for method, _, body in transport.sent if method == "POST")
    assert b["log_size"] == a["log_size"] + 1 == 2 * PER_CLIENT + 1
    assert first["count"][cell][0] >= 5  # the entry the query falls in is reported ...
    count_a, count_b = np.asarray(a["count"]), np.asarray(b["count"])
    changed = count_a != count_b
    assert not ((np.abs(count_b - count_a) < 5) & changed).any()  # ... and no entry moved by fewer than 5
    for name in ("sum_accuracy", "sum_cost"):
        np.testing.assert_array_equal(np.asarray(b[name])[~changed], np.asarray(a[name])[~changed])
    means_a = dict(zip(a["centroid_cells"], np.asarray(a["local_centroids"])))
    for k, w, mu in zip(b["centroid_cells"], b["local_weights"], np.asarray(b["local_centroids"])):
        w_a = weights.get(k, 0.0)
        if w != w_a:
            assert abs(w - w_a) >= 5
            recovered = (w * mu - w_a * means_a.get(k, 0.0)) / (w - w_a)
            assert np.linalg.norm(recovered - emb[secret]) > 1e-3
        else:
            np.testing.assert_array_equal(mu, means_a[k])
    assert weights[cell] == dict(zip(b["centroid_cells"], b["local_weights"]))[cell]
