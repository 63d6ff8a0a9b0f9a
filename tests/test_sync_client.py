"""sdk.SyncClient against a scripted server: an ``httpx.MockTransport``, no socket, no real waits.

Retries (5xx and transport errors only), exact error classes, the state file, idempotency after a
lost state, answer size limits, the privacy threshold floor and the holding of small changes
between two uploads, and the bundle step with real signed bundles (``make_bundle``): downgrades,
foreign signatures, wrong hashes, damaged local files, bundles without estimates, and a bundle
step that still runs after the upload step failed.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest

from sdk import EvalLog, bundle_install
from sdk import bundle_manifest as fmt
from sdk.errors import (
    BundleError,
    InvalidInputError,
    ShapeError,
    SyncError,
    SyncRejectedError,
)
from sdk.local_update import centroids_hash
from sdk.protocol import MSGPACK_ARRAYS, MSGPACK_MEDIA_TYPE, STATE_LOSS_ADVICE, Receipt, unpack_msgpack_array
from sdk.sync import SyncClient

MODELS = ("cheap", "mid", "strong")
CENTROIDS = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=np.float32)


def kmeans_round(min_count: int = 1, round_id: int = 3) -> dict:
    return {"round_id": round_id, "kind": "kmeans", "client_id": "dev-1", "centroids": CENTROIDS.tolist(),
            "centroids_hash": centroids_hash(CENTROIDS), "models": list(MODELS), "embedder_name": "toy",
            "d_emb": 3, "min_count": min_count, "deadline_utc": "2026-12-01T00:00:00Z"}


def posted(request: httpx.Request) -> dict:
    """An upload body as JSON-like lists, in either encoding (``SyncClient`` sends MessagePack by default)."""
    if request.headers["content-type"] != MSGPACK_MEDIA_TYPE:
        return json.loads(request.content)
    obj = msgpack.unpackb(request.content)
    for name, (dtype, rank) in MSGPACK_ARRAYS.items():
        obj[name] = unpack_msgpack_array(obj[name], dtype, rank).tolist()
    return obj


class FakeServer:
    """A scripted aggregation server for ``httpx.MockTransport``, recording every request.

    round_ : the open round's description, or None (204). bundle : a bundle folder to publish
    (manifest and files by sha256), or None (404). ``manifest`` replaces the published manifest
    bytes; ``routes[(method, path)]`` replaces one answer (a callable of the request)."""

    def __init__(self, round_: dict | None = None, bundle: Path | None = None) -> None:
        self.round, self.requests, self.routes = round_, [], {}
        self.manifest = (bundle / fmt.MANIFEST_FILE).read_bytes() if bundle else None
        listed = json.loads(self.manifest)["files"] if bundle else {}
        self.files = {digest: (bundle / name).read_bytes() for name, digest in listed.items()}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        request.read()
        path = request.url.path
        if (request.method, path) in self.routes:
            return self.routes[(request.method, path)](request)
        if path == "/v1/rounds/current":
            return httpx.Response(204) if self.round is None else httpx.Response(200, json=self.round)
        if request.method == "POST" and path.endswith("/updates"):
            body = posted(request)
            return httpx.Response(201, json=Receipt(len(self.posts()), body["client_id"], body["round_id"], False,
                                                    body["round_id"], body["log_size"]).to_json())
        if path == "/v1/bundles/latest":
            if self.manifest is None:
                return httpx.Response(404, json={"detail": "no bundle"})
            return httpx.Response(200, content=self.manifest, headers={"etag": '"m1"'})
        digest = path.rsplit("/", 1)[-1]
        if path.startswith("/v1/bundles/files/") and digest in self.files:
            return httpx.Response(200, content=self.files[digest])
        return httpx.Response(404, json={"detail": f"no route {path}"})

    def paths(self) -> list[str]:
        return [r.url.path for r in self.requests]

    def posts(self) -> list[httpx.Request]:
        return [r for r in self.requests if r.method == "POST"]

    def file_requests(self) -> list[str]:
        return [r.url.path.rsplit("/", 1)[-1] for r in self.requests if r.url.path.startswith("/v1/bundles/files/")]


@pytest.fixture
def device(tmp_path, signing_keys):
    """``device(server, log=..., bundle=..., **kwargs) -> (SyncClient, sleeps)`` with the state beside
    the test's files; sleeps records the backoff delays instead of waiting."""
    clients = []

    def make(server: FakeServer, log: EvalLog | None = None, bundle: Path | None = None, **kwargs):
        sleeps: list[float] = []
        log = log or EvalLog(tmp_path / "log.sqlite", MODELS)
        kwargs.setdefault("state_path", tmp_path / "state.json")
        client = SyncClient("https://fed.test", "fr_token", log, bundle or tmp_path / "bundle", signing_keys[1],
                            transport=httpx.MockTransport(server), sleep=sleeps.append, **kwargs)
        clients.append((client, log))
        return client, sleeps

    yield make
    for client, log in clients:
        client.close()
        log.close()


def unit_rows(n: int, seed: int = 0, axis: int = 0) -> np.ndarray:
    """n distinct unit vectors near axis ``axis`` (all in that Voronoi cell), (n, 3) float32."""
    x = np.random.default_rng(seed).normal(scale=0.2, size=(n, 3))
    x[:, axis] += 1.0
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def filled_log(path: Path, n: int = 12, seed: int = 0) -> EvalLog:
    log = EvalLog(path, MODELS)
    for i, e in enumerate(unit_rows(n, seed)):
        log.record("cheap", float(i % 2), 0.001, embedding=e)
    return log


# --- HTTP: what is retried, what is not --------------------------------------------------------


@pytest.mark.parametrize("status", [400, 401, 403, 409, 413, 422])
def test_4xx_is_not_retried(device, status):
    server = FakeServer()
    server.routes[("GET", "/v1/rounds/current")] = lambda r: httpx.Response(status, json={"detail": "no, because"})
    client, sleeps = device(server, retries=3)
    with pytest.raises(SyncRejectedError) as info:
        client.run_once()
    assert type(info.value) is SyncRejectedError
    assert info.value.status == status and info.value.detail == "no, because"
    assert server.paths().count("/v1/rounds/current") == 1 and sleeps == []


def test_5xx_is_retried_then_sync_error(device):
    server = FakeServer()
    server.routes[("GET", "/v1/rounds/current")] = lambda r: httpx.Response(503, text="busy")
    client, sleeps = device(server, retries=3, backoff_s=0.5, max_backoff_s=1.0)
    with pytest.raises(SyncError, match="after 4 attempts: 503 busy") as info:
        client.run_once()
    assert type(info.value) is SyncError
    assert len(server.requests) == 4 and len(sleeps) == 3
    for delay, base in zip(sleeps, (0.5, 1.0, 1.0)):  # doubling, capped, with jitter in [0.5, 1) x
        assert 0.5 * base <= delay < base


def test_transport_errors_are_retried_then_sync_error(device):
    server = FakeServer()

    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    server.routes[("GET", "/v1/rounds/current")] = refuse
    client, sleeps = device(server, retries=2)
    with pytest.raises(SyncError, match="ConnectError") as info:
        client.run_once()
    assert type(info.value) is SyncError
    assert len(server.requests) == 3 and len(sleeps) == 2


def test_a_5xx_then_success_is_one_sync(device):
    server, answers = FakeServer(), [httpx.Response(502), httpx.Response(204)]
    server.routes[("GET", "/v1/rounds/current")] = lambda r: answers.pop(0)
    client, sleeps = device(server, retries=3)
    result = client.run_once()
    assert result.round_id is None and not result.uploaded and len(sleeps) == 1


@pytest.mark.parametrize("status", [302, 202, 301])
def test_other_statuses_are_not_retried(device, status):
    server = FakeServer()
    server.routes[("GET", "/v1/rounds/current")] = lambda r: httpx.Response(
        status, headers={"location": "https://elsewhere.test/"})
    client, sleeps = device(server, retries=3)
    with pytest.raises(SyncError, match=str(status)) as info:
        client.run_once()
    assert type(info.value) is SyncError
    assert server.paths() == ["/v1/rounds/current"] and sleeps == []


@pytest.mark.parametrize("kwargs, field", [
    ({"server_url": "http://fed.test"}, "server_url"),  # the token would leak
    ({"server_url": "https://[::1"}, "server_url"),  # not a URL (was httpx.InvalidURL)
    ({"token": " "}, "token"),
    ({"token": "t\x00k"}, "token"),  # not printable ASCII: it travels in a header
    ({"retries": "3"}, "retries"),
    ({"retries": float("nan")}, "retries"),
    ({"backoff_s": float("nan")}, "backoff_s"),
    ({"max_backoff_s": -1.0}, "max_backoff_s"),
    ({"timeout_s": -1}, "timeout_s"),
    ({"eval_log": None}, "eval_log"),
    ({"bundle_dir": None}, "bundle_dir"),
    ({"min_count_floor": 0}, "min_count_floor"),
    ({"upload_format": "xml"}, "upload_format"),
])
def test_constructor_arguments_of_the_wrong_type_or_range_are_refused(tmp_path, signing_keys, kwargs, field):
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log:
        args = {"server_url": "https://fed.test", "token": "t", "eval_log": log, "bundle_dir": tmp_path / "b",
                "public_key": signing_keys[1], **kwargs}
        with pytest.raises(InvalidInputError) as info:
            SyncClient(**args)
        assert str(info.value).startswith(field)


def test_a_closed_client_says_so(tmp_path, signing_keys):
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log:
        client = SyncClient("https://fed.test", "t", log, tmp_path / "b", signing_keys[1])
        client.close()
        # was httpx's RuntimeError
        with pytest.raises(SyncError, match="is closed"):
            client.run_once()


# --- answer size limits ------------------------------------------------------------------------


def test_an_oversized_manifest_is_refused_without_reading_it_all(device):
    server, produced = FakeServer(), []

    def huge(request):
        def body():
            for _ in range(64):
                produced.append(1)
                yield b" " * (256 << 10)  # 16 MiB in all, no Content-Length

        return httpx.Response(200, content=body())

    server.routes[("GET", "/v1/bundles/latest")] = huge
    client, _ = device(server)
    with pytest.raises(SyncError, match=f"over the {fmt.MAX_MANIFEST_BYTES}-byte limit") as info:
        client.run_once()
    assert type(info.value) is SyncError
    assert len(produced) * (256 << 10) <= fmt.MAX_MANIFEST_BYTES + (256 << 10)  # stopped at the limit


def test_an_oversized_round_description_is_refused_from_its_length(device):
    server = FakeServer()
    server.routes[("GET", "/v1/rounds/current")] = lambda r: httpx.Response(
        200, content=b"{}", headers={"content-length": str(1 << 40)})
    client, _ = device(server)
    with pytest.raises(SyncError, match="over the .*-byte limit") as info:
        client.run_once()
    assert type(info.value) is SyncError


# --- state -------------------------------------------------------------------------------------


def test_an_unreadable_state_file_is_a_sync_error(device, tmp_path):
    (tmp_path / "state.json").write_text("{not json")
    server = FakeServer()
    client, _ = device(server)
    with pytest.raises(SyncError, match="unreadable") as info:
        client.run_once()
    assert type(info.value) is SyncError and server.requests == []
    # It advised "delete it to start over": the server then refused (422) every upload that moved an entry
    # by fewer than min_count since the one the deleted state recorded, for as long as one such entry remained.
    assert "delete" not in str(info.value)
    assert str(info.value).endswith("; " + STATE_LOSS_ADVICE)
    assert STATE_LOSS_ADVICE.startswith("restore it from a backup if there is one. Only if not, move it aside: ")


def test_a_422_for_a_small_change_after_a_lost_state_says_why_and_that_it_clears(device, tmp_path):
    """A device without a record of its last upload (state lost) cannot hold small changes back; the
    server's refusal now says so, and that later syncs succeed without repair."""
    server = FakeServer(kmeans_round(min_count=1))
    detail = "invalid update: count[0, 0] moved by 1 since your last upload for these centroids, fewer than ..."
    server.routes[("POST", "/v1/rounds/3/updates")] = lambda r: httpx.Response(422, json={"detail": detail})
    client, _ = device(server, log=filled_log(tmp_path / "log.sqlite"))
    with pytest.raises(SyncRejectedError) as info:
        client.run_once()
    assert info.value.status == 422 and info.value.detail == detail
    assert info.value.__notes__[0].startswith("this device has no record of its last upload for these centroids "
                                              "(its sync state is new or was lost)")
    other = FakeServer(kmeans_round(min_count=1))  # any other refusal: no such note
    other.routes[("POST", "/v1/rounds/3/updates")] = lambda r: httpx.Response(422, json={"detail": "count: bad"})
    client, _ = device(other, log=filled_log(tmp_path / "log2.sqlite"))
    with pytest.raises(SyncRejectedError) as info:
        client.run_once()
    assert not any("no record of its last upload" in n for n in getattr(info.value, "__notes__", []))


def test_a_rerun_after_a_lost_state_sends_the_same_idempotency_key(device, tmp_path):
    server = FakeServer(kmeans_round(min_count=5))
    log = filled_log(tmp_path / "log.sqlite")
    client, _ = device(server, log=log)
    first = client.run_once()
    assert first.uploaded and first.round_id == 3 and first.log_size == 12
    again = client.run_once()  # state kept: acknowledged before, not sent again
    assert not again.uploaded and again.update_id == first.update_id and len(server.posts()) == 1
    (tmp_path / "state.json").unlink()  # the device died before saving its state
    client.run_once()
    a, b = server.posts()
    assert a.headers["idempotency-key"] == b.headers["idempotency-key"] and a.content == b.content
    assert a.headers["idempotency-key"].startswith("r3-")


def test_round_1_of_a_new_server_database_is_not_taken_for_the_old_round_1(device, tmp_path):
    """An operator who starts a new database (the advice of the schema-version error) opens round 1
    again. The key was r{round_id}-sha256(body): a device whose log had not changed took the new round 1
    for the old one ("acknowledged before") and sent nothing in it. The key now also covers the round's
    deadline, which a new round 1 does not share."""
    log = filled_log(tmp_path / "log.sqlite")
    old = FakeServer(kmeans_round(min_count=5, round_id=1))
    client, _ = device(old, log=log)
    assert client.run_once().uploaded
    new = FakeServer(dict(kmeans_round(min_count=5, round_id=1), deadline_utc="2026-12-02T09:00:00Z"))
    client, _ = device(new, log=log)
    result = client.run_once()
    assert result.uploaded and result.round_id == 1 and len(new.posts()) == 1
    assert new.posts()[0].content == old.posts()[0].content  # the same update, in a round it was not sent to
    assert new.posts()[0].headers["idempotency-key"] != old.posts()[0].headers["idempotency-key"]


def test_a_damaged_record_of_the_last_sent_update_is_a_sync_error(device, tmp_path):
    sent = {"centroids_hash": centroids_hash(CENTROIDS), "models": list(MODELS), "count": [[1.0]]}
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "sent": sent}))
    server = FakeServer(kmeans_round(min_count=1))
    client, _ = device(server, log=filled_log(tmp_path / "log.sqlite"))
    with pytest.raises(SyncError, match="last sent update is damaged") as info:
        client.run_once()
    assert type(info.value) is SyncError and server.posts() == []  # rather than dropping the guarantee
    assert "delete" not in str(info.value) and str(info.value).endswith("; " + STATE_LOSS_ADVICE)


# --- privacy: the device's floor, and two uploads of a growing log -----------------------------


def test_the_device_floor_raises_a_lax_round_min_count(device, tmp_path):
    server = FakeServer(kmeans_round(min_count=1))
    log = EvalLog(tmp_path / "log.sqlite", MODELS)
    for i, e in enumerate(unit_rows(8)):
        log.record("cheap" if i < 5 else "mid", 1.0, 0.001, embedding=e)  # cell 0: cheap x 5, mid x 3
    client, _ = device(server, log=log, min_count_floor=4)
    assert client.run_once().uploaded
    body = posted(server.posts()[0])
    assert body["count"] == [[5.0, 0.0, 0.0], [0.0, 0.0, 0.0]]  # the 3 "mid" ones are suppressed
    assert body["local_weights"] == [8.0]


def test_uploads_are_msgpack_by_default_and_json_on_request(device, tmp_path):
    bodies = {}
    for upload_format in ("msgpack", "json"):
        server = FakeServer(kmeans_round(min_count=1))
        log = filled_log(tmp_path / f"log-{upload_format}.sqlite", n=30)
        kwargs = {} if upload_format == "msgpack" else {"upload_format": "json"}
        client, _ = device(server, log=log, state_path=tmp_path / f"state-{upload_format}.json", **kwargs)
        assert client.run_once().uploaded
        post = server.posts()[0]
        assert post.headers["content-type"] == f"application/{upload_format}"
        bodies[upload_format] = posted(post)
    a, b = bodies["msgpack"], bodies["json"]
    assert a.keys() == b.keys() and a["count"] == b["count"] and a["local_weights"] == b["local_weights"]
    # the cell means travel as float32 in MessagePack: equal to the JSON ones rounded to float32
    np.testing.assert_array_equal(np.float32(b["local_centroids"]), np.float32(a["local_centroids"]))


def test_mlp_rounds_below_the_floor_are_skipped(device):
    mlp_round = {"round_id": 4, "kind": "mlp", "client_id": "dev-1", "parameters_url": "/v1/rounds/4/parameters",
                 "parameters_hash": "0" * 64, "min_count": 2}
    server = FakeServer(mlp_round)
    trained = []
    client, _ = device(server, mlp_trainer=lambda *a: trained.append(a) or b"x")
    result = client.run_once()
    assert not result.uploaded and "min_count=2 is below this device's min_count_floor=5" in result.skipped
    assert trained == [] and [r.url.path for r in server.requests] == ["/v1/rounds/current", "/v1/bundles/latest"]


def test_one_more_query_between_two_syncs_is_not_revealed(device, tmp_path):
    server = FakeServer(kmeans_round(min_count=1))
    log = filled_log(tmp_path / "log.sqlite", n=30)
    client, _ = device(server, log=log)  # floor 5
    assert client.run_once().uploaded
    log.record("cheap", 1.0, 0.0123, embedding=unit_rows(1, seed=9)[0])  # lands in cell 0 too
    assert client.run_once().uploaded
    a, b = (posted(r) for r in server.posts())
    assert b["log_size"] == a["log_size"] + 1
    for key in ("count", "sum_accuracy", "sum_cost", "centroid_cells", "local_centroids", "local_weights"):
        assert b[key] == a[key], key  # nothing to subtract
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["sent"]["centroids_hash"] == centroids_hash(CENTROIDS) and state["sent"]["count"] == a["count"]
    for i, e in enumerate(unit_rows(5, seed=10)):  # five more: the entry and the cell mean move
        log.record("cheap", 1.0, 0.001, embedding=e)
    client.run_once()
    c = posted(server.posts()[2])
    assert c["count"][0][0] == 36 and c["local_weights"] == [36.0]


# --- the bundle step ---------------------------------------------------------------------------


def npz_with(bundle: Path, **arrays) -> bytes:
    """The bundle's kmeans.npz with some arrays replaced."""
    with np.load(bundle / "kmeans.npz", allow_pickle=False) as z:
        data = {k: z[k] for k in z.files}
    data.update(arrays)
    buf = io.BytesIO()
    np.savez(buf, **data)
    return buf.getvalue()


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, make_bundle):
    """Signed K-means bundles: v1 (the device's), v2 (same files), v2 whose kmeans.npz differs, and
    v2 with no accuracy estimate at all."""
    work = tmp_path_factory.mktemp("sync_client_bundles")
    v1 = make_bundle(work / "v1", int8=False)
    with np.load(v1 / "kmeans.npz") as z:
        accuracy = z["accuracy"]
    return {
        "v1": v1,
        "v2": make_bundle(work / "v2", int8=False, bundle_version=2),
        "v2_npz": make_bundle(work / "v2_npz", int8=False, bundle_version=2,
                              files={"kmeans.npz": npz_with(v1, accuracy=np.clip(accuracy * 0.9, 0, 1))}),
        "v2_nan": make_bundle(work / "v2_nan", int8=False, bundle_version=2,
                              files={"kmeans.npz": npz_with(v1, accuracy=np.full_like(accuracy, np.nan))}),
    }


@pytest.fixture
def device_bundle(tmp_path, bundles):
    """The device's copy of v1 (a plain folder, as copied by hand), returned with its manifest bytes."""
    path = tmp_path / "bundle"
    shutil.copytree(bundles["v1"], path)
    return path


def assert_still(bundle: Path, version: int) -> None:
    assert bundle_install.read_version(bundle) == version
    assert len(bundle_install.version_dirs(bundle)) <= 1  # no half-installed version left behind


def test_a_newer_bundle_is_installed_reusing_unchanged_files(device, bundles, device_bundle):
    server = FakeServer(bundle=bundles["v2_npz"])
    client, _ = device(server, bundle=device_bundle)
    result = client.run_once()
    assert result.bundle_updated and result.bundle_version == 2 and device_bundle.is_symlink()
    listed = json.loads(server.manifest)["files"]
    assert server.file_requests() == [listed["kmeans.npz"]]  # only the changed file is downloaded
    fmt.read_verified(device_bundle, client.public_key, wanted=())
    again = client.run_once()  # ETag: the manifest is not fetched in full again
    assert not again.bundle_updated and server.requests[-1].headers["if-none-match"] == '"m1"'


def test_an_older_bundle_is_not_installed(device, bundles, tmp_path):
    current = tmp_path / "bundle"
    shutil.copytree(bundles["v2"], current)
    server = FakeServer(bundle=bundles["v1"])
    client, _ = device(server, bundle=current)
    result = client.run_once()
    assert not result.bundle_updated and result.bundle_version == 2
    assert server.file_requests() == [] and not current.is_symlink()
    assert_still(current, 2)


def test_a_bundle_signed_by_another_key_is_refused(device, bundles, device_bundle):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from export.bundle_writer import build_manifest

    served = bundles["v2_npz"]
    manifest = json.loads((served / fmt.MANIFEST_FILE).read_text())
    fields = {k: v for k, v in manifest.items() if k not in ("format_version", "created_utc", "files", "signature")}
    files = {n: (served / n).read_bytes() for n in manifest["files"]}
    server = FakeServer(bundle=served)
    server.manifest = json.dumps(build_manifest(files, {**fields, "bundle_version": 9},
                                                Ed25519PrivateKey.generate())).encode()
    client, _ = device(server, bundle=device_bundle)
    with pytest.raises(BundleError, match="signature") as info:
        client.run_once()
    assert type(info.value) is BundleError and server.file_requests() == []
    assert_still(device_bundle, 1)


def test_a_downloaded_file_with_the_wrong_hash_is_refused(device, bundles, device_bundle):
    server = FakeServer(bundle=bundles["v2_npz"])
    digest = json.loads(server.manifest)["files"]["kmeans.npz"]
    served = bytearray(server.files[digest])
    served[-1] ^= 1
    server.files[digest] = bytes(served)
    client, _ = device(server, bundle=device_bundle)
    with pytest.raises(BundleError, match="kmeans.npz: downloaded sha256") as info:
        client.run_once()
    assert type(info.value) is BundleError
    assert_still(device_bundle, 1)


def test_a_bundle_without_any_estimate_is_refused(device, bundles, device_bundle):
    server = FakeServer(bundle=bundles["v2_nan"])
    client, _ = device(server, bundle=device_bundle)
    with pytest.raises(BundleError, match="probe") as info:
        client.run_once()
    assert type(info.value) is BundleError
    assert_still(device_bundle, 1)


def test_a_damaged_local_file_is_downloaded_instead(device, bundles, device_bundle):
    tokenizer = device_bundle / fmt.TOKENIZER_FILE
    data = bytearray(tokenizer.read_bytes())
    data[100] ^= 1  # one bit rotted in the bundle in use
    tokenizer.write_bytes(bytes(data))
    server = FakeServer(bundle=bundles["v2"])
    client, _ = device(server, bundle=device_bundle)
    result = client.run_once()
    listed = json.loads(server.manifest)["files"]
    assert result.bundle_updated and server.file_requests() == [listed[fmt.TOKENIZER_FILE]]
    fmt.read_verified(device_bundle, client.public_key, wanted=(fmt.TOKENIZER_FILE,))  # the good one
    assert_still(device_bundle, 2)


@pytest.mark.parametrize("rows", ["empty", "cells_only"])
def test_nothing_to_report_is_not_uploaded_but_the_bundle_is_updated(device, bundles, device_bundle, tmp_path, rows):
    log = EvalLog(tmp_path / "log.sqlite", MODELS)
    if rows == "cells_only":
        log.record("cheap", 1.0, 0.001, cell=0)
    server = FakeServer(kmeans_round(min_count=1), bundle=bundles["v2"])
    client, _ = device(server, log=log, bundle=device_bundle)
    result = client.run_once()
    assert result.round_id == 3 and not result.uploaded and result.skipped.startswith("nothing to report")
    assert server.posts() == []
    assert result.bundle_updated and result.bundle_version == 2
    absent = [w for w in result.warnings if "no embedding" in w or "norm is not 1" in w]  # not "norm 0" for none
    assert [w.split(" (")[0] for w in absent] == (["1 rows of the log have no embedding"] if rows == "cells_only"
                                                  else [])


def test_a_refused_upload_still_updates_the_bundle_then_raises(device, bundles, device_bundle, tmp_path):
    server = FakeServer(kmeans_round(min_count=1), bundle=bundles["v2"])
    server.routes[("POST", "/v1/rounds/3/updates")] = lambda r: httpx.Response(409, json={"detail": "round closed"})
    client, sleeps = device(server, log=filled_log(tmp_path / "log.sqlite"), bundle=device_bundle)
    with pytest.raises(SyncRejectedError) as info:
        client.run_once()
    assert type(info.value) is SyncRejectedError and info.value.status == 409 and sleeps == []
    assert "bundle step still ran: version 2" in "".join(info.value.__notes__)
    assert_still(device_bundle, 2)


def test_a_refused_upload_is_raised_even_if_the_bundle_step_fails_too(device, tmp_path):
    server = FakeServer(kmeans_round(min_count=1))
    server.routes[("POST", "/v1/rounds/3/updates")] = lambda r: httpx.Response(413, json={"detail": "too large"})
    server.manifest = b'{"bundle_version": 2}'  # unsigned
    client, _ = device(server, log=filled_log(tmp_path / "log.sqlite"))
    with pytest.raises(SyncRejectedError) as info:
        client.run_once()
    assert type(info.value) is SyncRejectedError and info.value.status == 413
    assert "the bundle update failed too: BundleError" in "".join(info.value.__notes__)
    assert isinstance(info.value.__context__, BundleError)


def test_a_log_of_another_embedder_still_updates_the_bundle_then_raises(device, bundles, device_bundle, tmp_path):
    log = EvalLog(tmp_path / "log.sqlite", MODELS)
    log.record("cheap", 1.0, 0.001, embedding=np.full(4, 0.5, dtype=np.float32))  # 4-d, the round is 3-d
    server = FakeServer(kmeans_round(min_count=1), bundle=bundles["v2"])
    client, _ = device(server, log=log, bundle=device_bundle)
    with pytest.raises(ShapeError, match="dimension 4") as info:
        client.run_once()
    assert type(info.value) is ShapeError and server.posts() == []
    assert_still(device_bundle, 2)


def test_a_certificate_that_does_not_verify_is_not_retried(tmp_path, signing_keys):
    import ssl

    import httpx

    from sdk.errors import SyncError

    calls = []

    def handler(request):
        calls.append(request)
        try:
            raise ssl.SSLCertVerificationError(1, "certificate verify failed: self-signed certificate")
        except ssl.SSLCertVerificationError as exc:
            raise httpx.ConnectError("[SSL: CERTIFICATE_VERIFY_FAILED]", request=request) from exc

    from sdk import EvalLog
    from sdk.sync import SyncClient

    with EvalLog(tmp_path / "log.sqlite", ["a", "b"]) as log, SyncClient(
            "https://fed.test", "tok", log, tmp_path / "bundle", signing_keys[1], transport=httpx.MockTransport(handler),
            sleep=lambda s: None, retries=5) as client:
        with pytest.raises(SyncError, match="does not verify"):
            client.run_once()
    assert len(calls) == 1


def test_a_state_file_of_the_wrong_shape_is_a_sync_error(tmp_path, signing_keys):
    import httpx

    from sdk import EvalLog
    from sdk.errors import SyncError
    from sdk.sync import SyncClient

    state = tmp_path / "state.json"
    state.write_text('{"version": 1, "last_upload": "x"}')
    with EvalLog(tmp_path / "log.sqlite", ["a", "b"]) as log, SyncClient(
            "https://fed.test", "tok", log, tmp_path / "bundle", signing_keys[1], state_path=state,
            transport=httpx.MockTransport(lambda r: httpx.Response(204)), sleep=lambda s: None) as client:
        with pytest.raises(SyncError, match="unknown format"):
            client.run_once()


def test_a_round_over_other_centroids_is_skipped_after_an_upload(device, tmp_path):
    server = FakeServer(kmeans_round(min_count=1))
    log = filled_log(tmp_path / "log.sqlite", n=30)
    client, _ = device(server, log=log)
    assert client.run_once().uploaded
    moved = np.array([[0.9, 0.1, 0.0], [0.0, 1.0, 0.0]], dtype=np.float32)  # a re-clustered partition
    server.round = {**kmeans_round(min_count=1, round_id=4), "centroids": moved.tolist(),
                    "centroids_hash": centroids_hash(moved)}
    log.record("cheap", 1.0, 0.0123, embedding=unit_rows(1, seed=9)[0])
    result = client.run_once()
    assert not result.uploaded and "other centroids" in result.skipped and len(server.posts()) == 1
    opted_in, _ = device(server, log=log, allow_repartition=True)
    assert opted_in.run_once().uploaded


def test_rows_logged_with_longer_embeddings_are_left_out_of_the_upload_and_kept(device, tmp_path):
    """A log an older SDK filled with non-unit embeddings got 422 on every upload (the server refuses
    cell means of norm above 1). EvalLog.record now refuses them; rows already logged stay in the log,
    and the K-means upload leaves them out with a warning."""
    import sqlite3

    log = filled_log(tmp_path / "log.sqlite", n=12)
    log.close()
    with sqlite3.connect(tmp_path / "log.sqlite") as db:  # as the old SDK stored them: twice the unit vector
        for row_id, blob in db.execute("SELECT id, embedding FROM evaluations WHERE id <= 2").fetchall():
            db.execute("UPDATE evaluations SET embedding = ? WHERE id = ?",
                       ((2 * np.frombuffer(blob, "<f4")).astype("<f4").tobytes(), row_id))
    log = EvalLog(tmp_path / "log.sqlite", MODELS)
    log.record("cheap", 1.0, 0.001, cell=0)  # a cell only: left out too, and said so (it was silent)
    server = FakeServer(kmeans_round(min_count=1))
    client, _ = device(server, log=log)
    result = client.run_once()
    assert result.uploaded and result.log_size == 10 and len(log) == 13
    assert result.warnings[-2].startswith("1 rows of the log have no embedding (logged with a cell only)")
    assert result.warnings[-1:] == ("2 rows of the log have an embedding whose norm is not 1 (e.g. row 1: 2; logged "
                               "before EvalLog.record refused them): left out of this upload (the server refuses "
                               "means of them); they stay in the log",)


def test_a_refused_upload_is_not_kept_as_the_sent_record(device, tmp_path):
    server = FakeServer(kmeans_round(min_count=1))
    log = filled_log(tmp_path / "log.sqlite", n=30)
    client, _ = device(server, log=log)
    assert client.run_once().uploaded
    sent = json.loads((tmp_path / "state.json").read_text())["sent"]
    for e in unit_rows(6, seed=11):
        log.record("cheap", 1.0, 0.001, embedding=e)
    server.routes[("POST", "/v1/rounds/3/updates")] = lambda r: httpx.Response(422, json={"detail": "moved by 1"})
    with pytest.raises(SyncRejectedError):
        client.run_once()
    assert json.loads((tmp_path / "state.json").read_text())["sent"] == sent  # still what the server holds


def test_an_unused_precision_that_is_corrupt_is_still_refused_at_install(device, make_bundle, tmp_path):
    """Router.load hashes only the chosen precision's files; the install hashes every file, so a
    corrupt fp32 encoder in a bundle whose device would load int8 is never installed."""
    served = make_bundle(tmp_path / "served", bundle_version=2)  # fp32 + int8: auto loads int8
    server = FakeServer(bundle=served)
    digest = json.loads(server.manifest)["files"]["embedder.onnx"]
    data = bytearray(server.files[digest])
    data[len(data) // 2] ^= 1
    server.files[digest] = bytes(data)
    client, _ = device(server, bundle=tmp_path / "bundle")  # nothing installed yet: every file is downloaded
    with pytest.raises(BundleError, match="embedder.onnx: downloaded sha256"):
        client.run_once()
    assert not (tmp_path / "bundle").exists() and bundle_install.version_dirs(tmp_path / "bundle") == []
