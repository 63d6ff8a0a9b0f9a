"""Wire and file formats (docs/protocol.md): fixed-bytes (golden) tests and round trips, one per encoder.

The golden files in ``tests/golden/`` hold the bytes each encoder wrote for the small, hand-written
values below; a change of any format shows here as a byte difference. To write them again after a
deliberate format change (bump the format's version and say so in docs/protocol.md):
``FEDROUTE_WRITE_GOLDEN=1 python -m pytest tests/test_protocol.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import msgpack
import numpy as np
import pytest

from sdk.cell_statistics import CellStatistics
from sdk.errors import PayloadError, SyncError
from sdk.protocol import (
    UPDATE_ARRAYS,
    KMeansUpdate,
    Receipt,
    RoundSpec,
    SyncState,
    centroids_hash,
    decode_kmeans_update_json,
    decode_kmeans_update_msgpack,
    decode_kmeans_update_npz,
    decode_kmeans_update_record,
    decode_sent_record,
    decode_sync_state,
    encode_json,
    encode_kmeans_round,
    encode_kmeans_update,
    encode_kmeans_update_msgpack,
    encode_kmeans_update_npz,
    encode_kmeans_update_record,
    encode_sent_record,
    encode_sync_state,
    kmeans_update_from_arrays,
    kmeans_update_to_arrays,
)

pytestmark = pytest.mark.sdk  # runs in the base-install venv of .ci/run too


GOLDEN = Path(__file__).parent / "golden"
WRITE = os.environ.get("FEDROUTE_WRITE_GOLDEN") == "1"

CENTROIDS = np.array([[1.0, 0.0, 0.0], [0.0, 0.6, -0.8]], dtype=np.float32)
MODELS = ("cheap", "strong")


def spec() -> RoundSpec:
    return RoundSpec.from_json(round_json())


def round_json() -> dict:
    return encode_kmeans_round(3, "open", MODELS, "all-MiniLM-L6-v2", 3, 2, 5, "2026-01-02T03:04:05.000000Z", CENTROIDS)


def update() -> KMeansUpdate:
    """2 cells x 2 models; cell 0's mean embedding is reported (3 queries)."""
    stats = CellStatistics(np.array([[3.0, 0.0], [0.0, 2.0]]), np.array([[1.5, 0.0], [0.0, 2.0]]),
                           np.array([[0.003, 0.0], [0.0, 0.25]]))
    return KMeansUpdate(stats, np.array([0], dtype=np.int64), np.array([[0.5, 0.25, -0.125]]), np.array([3.0]), 5,
                        np.array([3], dtype=np.int64))


def golden(name: str, data: bytes) -> None:
    path = GOLDEN / name
    if WRITE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_bytes(data)
    assert data == path.read_bytes(), f"{name}: the encoder's bytes changed (see docs/protocol.md)"


def assert_same_update(a: KMeansUpdate, b: KMeansUpdate) -> None:
    for name in UPDATE_ARRAYS:
        x, y = kmeans_update_to_arrays(a)[name], kmeans_update_to_arrays(b)[name]
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name


# --- golden bytes --------------------------------------------------------------------------------


def test_kmeans_round_description_golden_bytes():
    golden("kmeans_round.json", encode_json(round_json()))
    assert round_json()["centroids_hash"] == centroids_hash(CENTROIDS)
    assert round_json()["centroids"][1] == [0.0, 0.6000000238418579, -0.800000011920929]  # float32 values, exact


def test_kmeans_update_wire_golden_bytes():
    data = encode_kmeans_update(update(), "dev-1", spec())
    golden("kmeans_update.json", data)
    assert data.startswith(b'{"client_id":"dev-1","round_id":3,"kind":"kmeans","centroids_hash":"')
    assert b'"count":[[3.0,0.0],[0.0,2.0]]' in data and b'"local_centroids":[[0.5,0.25,-0.125]]' in data
    assert b"local_distinct" not in data  # kept on the device


def test_kmeans_update_msgpack_golden_bytes():
    data = encode_kmeans_update_msgpack(update(), "dev-1", spec())
    golden("kmeans_update.msgpack", data)
    # A fixmap of the 12 fields, client_id first: 0x8c, fixstr "client_id", fixstr "dev-1".
    assert data.startswith(b"\x8c\xa9client_id\xa5dev-1\xa8round_id\x03\xa4kind\xa6kmeans")
    # count: [shape [2, 2], bin8 of 32 bytes: four little-endian float64]
    count = np.array([[3.0, 0.0], [0.0, 2.0]], dtype="<f8").tobytes()
    assert b"\xa5count\x92\x92\x02\x02\xc4\x20" + count in data
    # local_centroids as float32: [shape [1, 3], bin8 of 12 bytes]
    means = np.array([[0.5, 0.25, -0.125]], dtype="<f4").tobytes()
    assert b"\xaecentroid_cells\x92\x91\x01\xc4\x08" + np.array([0], "<i8").tobytes() in data
    assert b"\xaflocal_centroids\x92\x92\x01\x03\xc4\x0c" + means in data
    assert b"local_distinct" not in data
    assert len(data) == 382  # 3 x 32 + 12 + 8 + 8 bytes of arrays, 12 keys, shapes and the envelope


def test_kmeans_update_npz_golden_bytes():
    golden("kmeans_update.npz", encode_kmeans_update_npz(update()))


def test_kmeans_update_store_record_golden_bytes():
    data = encode_kmeans_update_record(update())
    golden("kmeans_update.record.msgpack", data)
    assert data.startswith(b"\x88\xa6format\xb9fedroute.kmeans_update.v3\xa5count\x92\x92\x02\x02\xc4\x20")
    means = np.array([[0.5, 0.25, -0.125]], dtype="<f4").tobytes()  # float32, as on the MessagePack wire
    assert b"\xaflocal_centroids\x92\x92\x01\x03\xc4\x0c" + means in data
    assert data.endswith(b"\xa8log_size\x05")
    assert len(data) == 275  # 124 bytes of arrays (3 x 32 + 8 + 12 + 8), 151 of keys, shapes, headers and the tag


def test_store_records_of_the_previous_version_are_read():
    v2 = (GOLDEN / "kmeans_update.record_v2.msgpack").read_bytes()  # written by the v2 encoder (float64 means)
    assert v2.startswith(b"\x88\xa6format\xb9fedroute.kmeans_update.v2")
    means = np.array([[0.5, 0.25, -0.125]], dtype="<f8").tobytes()
    assert b"\xaflocal_centroids\x92\x92\x01\x03\xc4\x18" + means in v2
    assert_same_update(decode_kmeans_update_record(v2), update())
    # A mean that is not a float32 value keeps its float64 value from a v2 row (and is rounded in v3).
    exact = msgpack.unpackb(v2)
    exact["local_centroids"][1] = np.array([[0.1, 0.2, 0.3]], dtype="<f8").tobytes()
    back = decode_kmeans_update_record(msgpack.packb(exact))
    np.testing.assert_array_equal(back.local_centroids, [[0.1, 0.2, 0.3]])
    assert back.local_centroids.dtype == np.float64
    shorter = KMeansUpdate(update().statistics, update().centroid_cells, np.array([[0.1, 0.2, 0.3]]),
                           update().local_weights, 5)
    np.testing.assert_array_equal(decode_kmeans_update_record(encode_kmeans_update_record(shorter)).local_centroids,
                                  np.float32([[0.1, 0.2, 0.3]]).astype(np.float64))


def test_receipt_golden_bytes():
    golden("receipt.json", encode_json(Receipt(7, "dev-1", 3, False, 3, 5).to_json()))
    assert (GOLDEN / "receipt.json").read_bytes() == (
        b'{"update_id":7,"client_id":"dev-1","round_id":3,"late":false,"counted_in_round":3,"log_size":5}')


def test_sync_state_golden_bytes():
    state = SyncState(last_upload={"round_id": 3, "key": "r3-ab", "update_id": 7, "late": False, "log_size": 5},
                      sent=encode_sent_record(update(), spec()), bundle_etag='"e1"', bundle_version=2)
    data = encode_sync_state(state)
    golden("sync_state.json", data)
    assert json.loads(data)["sent"]["local_distinct"] == [3] and json.loads(data)["version"] == 1


def test_manifest_golden_bytes_and_signature():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from export.bundle_writer import build_manifest
    from sdk.bundle_manifest import encode_manifest_file, verify_manifest

    key = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))  # Ed25519 signatures are deterministic
    files = {"tokenizer.json": b"{}", "embedder.onnx": b"onnx", "kmeans.npz": b"npz"}
    fields = {"bundle_version": 1, "router_kind": "kmeans",
              "models": [{"id": "cheap", "price_per_1k_input_usd": 0.5, "price_per_1k_output_usd": None,
                          "mean_cost_usd": 0.001}],
              "embedder": {"name": "all-MiniLM-L6-v2", "dim": 384, "max_tokens": 256, "truncation_side": "left",
                           "pooling": "mean", "normalised": True, "files": {"fp32": "embedder.onnx"}}}
    data = encode_manifest_file(build_manifest(files, fields, key, created_utc="2026-01-01T00:00:00Z"))
    golden("manifest.json", data)
    manifest = verify_manifest(data, key.public_key())  # decoder: signature, then schema
    assert manifest["files"]["kmeans.npz"] == hashlib.sha256(b"npz").hexdigest()


def test_mlp_update_golden_bytes():
    pytest.importorskip("safetensors")
    from trainer.federated.mlp_local import parameters_bytes, read_parameters

    params = {"trunk.0.weight": np.array([[0.5, -1.0]], dtype=np.float32), "head.bias": np.array([0.25], np.float32)}
    envelope = {"client_id": "dev-1", "round_id": 4, "kind": "mlp", "parameters_hash": "0" * 64,
                "n_samples": 9, "log_size": 12}
    data = parameters_bytes(params, envelope)
    golden("mlp_update.safetensors", data)
    back, meta = read_parameters(data)
    assert meta == envelope and set(back) == set(params)
    assert all(np.array_equal(back[k], params[k]) for k in params)


# --- round trips ---------------------------------------------------------------------------------


def test_round_description_round_trip():
    s = spec()
    assert (s.round_id, s.kind, s.models, s.min_count, s.d_emb) == (3, "kmeans", MODELS, 2, 3)
    np.testing.assert_array_equal(s.centroids, CENTROIDS)
    assert s.centroids_hash == centroids_hash(CENTROIDS)


def test_update_arrays_and_npz_round_trip():
    assert_same_update(kmeans_update_from_arrays(kmeans_update_to_arrays(update())), update())
    assert_same_update(decode_kmeans_update_npz(encode_kmeans_update_npz(update())), update())
    with pytest.raises(PayloadError, match="not an .npz"):
        decode_kmeans_update_npz(b"PK not a zip")
    assert_same_update(decode_kmeans_update_record(encode_kmeans_update_record(update())), update())
    assert_same_update(decode_kmeans_update_record(encode_kmeans_update_npz(update())), update())  # older rows
    with pytest.raises(PayloadError, match="fedroute.kmeans_update.v3"):
        decode_kmeans_update_record(b"\x80")


def _round():
    from trainer.federated.kmeans_aggregation import AggregationConfig
    from trainer.server.round_kind import round_settings
    from trainer.server.store import Round

    return Round(id=3, kind="kmeans", status="open", opened_unix=0.0, deadline_unix=1.0, quorum=5, min_count=2,
                 centroids=CENTROIDS, parameters=None, base_hash=centroids_hash(CENTROIDS), models=MODELS,
                 embedder={"name": "all-MiniLM-L6-v2", "dim": 3},
                 settings=round_settings(aggregation=AggregationConfig()), closed_unix=None, outcome=None)


def test_update_wire_round_trips_json_and_msgpack():
    for encode, decode in ((encode_kmeans_update, decode_kmeans_update_json),
                           (encode_kmeans_update_msgpack, decode_kmeans_update_msgpack)):
        envelope, back = decode(encode(update(), "dev-1", spec()))
        assert envelope == {"client_id": "dev-1", "round_id": 3, "kind": "kmeans",
                            "centroids_hash": centroids_hash(CENTROIDS), "models": list(MODELS)}
        assert_same_update(back, update())
    with pytest.raises(PayloadError, match="MessagePack"):
        decode_kmeans_update_msgpack(b"\xc1")
    with pytest.raises(PayloadError, match="exactly the keys"):
        decode_kmeans_update_msgpack(b"\x80")  # an empty map
    import msgpack

    bad = msgpack.unpackb(encode_kmeans_update_msgpack(update(), "dev-1", spec()))
    bad["count"][1] = bad["count"][1][:-8]  # one float64 short of the shape [2, 2]
    from sdk.errors import ShapeError

    with pytest.raises(ShapeError, match="count: shape"):
        decode_kmeans_update_msgpack(msgpack.packb(bad))


def test_update_wire_round_trip_through_the_servers_decoder():
    pytest.importorskip("fastapi")
    from trainer.server.validation import decode_body, parse_kmeans_body, validate_update

    stored = []
    for encode, media in ((encode_kmeans_update, "application/json"),
                          (encode_kmeans_update_msgpack, "application/msgpack")):
        body = parse_kmeans_body(decode_body(encode(update(), "dev-1", spec()), media))
        assert (body.client_id, body.round_id, body.kind) == ("dev-1", 3, "kmeans")
        accepted = validate_update(body, _round())
        assert_same_update(accepted, update())
        stored.append(encode_kmeans_update_record(accepted))
    assert stored[0] == stored[1]  # both encodings store the same bytes


def test_sent_record_round_trip_and_model_alignment():
    record = json.loads(json.dumps(encode_sent_record(update(), spec())))  # through the state file's JSON
    back = decode_sent_record(record, spec())
    assert_same_update(back, update())
    np.testing.assert_array_equal(back.local_distinct, [3])
    swapped = RoundSpec.from_json({**round_json(), "models": ["strong", "cheap"]})
    np.testing.assert_array_equal(decode_sent_record(record, swapped).statistics.count, [[0.0, 3.0], [2.0, 0.0]])
    other = RoundSpec.from_json(encode_kmeans_round(3, "open", MODELS, "e", 3, 2, 5, "t", CENTROIDS * 0.5))
    assert decode_sent_record(record, other) is None  # another partition: nothing was sent for it
    with pytest.raises(SyncError, match="damaged"):
        decode_sent_record({**record, "count": [[1.0]]}, spec())


def test_receipt_round_trip_and_refusals():
    r = Receipt(7, "dev-1", 3, True, None, 5)
    assert Receipt.from_json(json.loads(encode_json(r.to_json()))) == r
    for bad in ({**r.to_json(), "late": 1}, {k: v for k, v in r.to_json().items() if k != "update_id"}, [1]):
        with pytest.raises(SyncError, match="malformed receipt"):
            Receipt.from_json(bad)


def test_sync_state_round_trip_and_refusals():
    state = SyncState(last_upload={"round_id": 1, "key": "k"}, sent=None, bundle_etag=None, bundle_version=4)
    assert decode_sync_state(encode_sync_state(state)) == state
    assert decode_sync_state(encode_sync_state(SyncState())) == SyncState()
    for raw in (b"{", b'{"version": 2}', b'{"version": 1, "last_upload": "x"}', b"[1]",
                # a hand-edited etag or version: httpx raised TypeError on the If-None-Match header
                b'{"version": 1, "bundle_etag": 5, "bundle_version": 4}', b'{"version": 1, "bundle_version": "4"}'):
        with pytest.raises(SyncError):
            decode_sync_state(raw, "state.json")


def test_round_settings_and_outcome_round_trip_through_json():
    from trainer.federated.kmeans_aggregation import AggregationConfig
    from trainer.server.round_kind import PublishTarget, RoundOutcome, RoundSettings, round_settings

    settings = round_settings(aggregation=AggregationConfig(clip_count=100.0), bundle_dir=Path("/b"),
                              signing_key=Path("/k"), seed=7)
    assert settings.publish == PublishTarget("/b", "/k") and settings.aggregation["clip_count"] == 100.0
    assert RoundSettings.from_json(json.loads(json.dumps(settings.to_json()))) == settings
    old = {k: v for k, v in settings.to_json().items() if k not in ("min_total_count", "network", "continued_from")}
    assert RoundSettings.from_json(old).min_total_count == 1  # a round stored before the field existed
    for outcome in (RoundOutcome("no-op", 2, 1, 0),
                    RoundOutcome("aggregated", 3, 0, 1, 120.0, None, 4, ["a", "b"]),
                    RoundOutcome("aggregated", 1, 0, 0, 9.0, 0.5, None, None, "1 client(s)"),
                    RoundOutcome("failed", error="OSError: disk full")):
        assert RoundOutcome.from_json(json.loads(json.dumps(outcome.to_json()))) == outcome
    assert RoundOutcome("aggregated", 1, 0, 0, 9.0, 0.5, None, None).to_json() == {
        "on_time_updates": 1, "late_updates_counted": 0, "stale_updates": 0, "result": "aggregated",
        "total_count": 9.0, "epsilon": 0.5, "bundle_version": None}  # clients left out under DP noise
    assert not RoundOutcome("aggregated", publish_skipped="refused").published and RoundOutcome("aggregated").published
