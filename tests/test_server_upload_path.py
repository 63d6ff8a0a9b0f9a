"""Pieces of the server's upload path, called directly on a real SQLite store: the whole-array checks
of :func:`trainer.server.validation.validate_update` (each 422 names its field, for MessagePack and
JSON bodies), the group writer's commit delay and the closer's first-upload-in-a-round signal
(:mod:`trainer.server.group_commit`, :mod:`trainer.server.upload_state`)."""

from __future__ import annotations

import asyncio
import json
import time

import msgpack
import numpy as np
import pytest

from sdk.cell_statistics import CellStatistics
from sdk.protocol import KMeansUpdate, RoundSpec, decode_kmeans_update_record, encode_kmeans_update_msgpack
from trainer.federated.kmeans_aggregation import AggregationConfig
from trainer.server import round_kinds
from trainer.server.errors import UploadRejected
from trainer.server.group_commit import GroupWriter
from trainer.server.round_kind import round_settings
from trainer.server.store import Store, hash_token
from trainer.server.upload_state import UploadState

N_CELLS, D_EMB, MODELS = 4, 3, ("a", "b")


@pytest.fixture()
def store_round(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'fed.db'}")
    centroids = np.eye(N_CELLS, D_EMB, dtype=np.float32)
    r = store.open_round(kind="kmeans", models=list(MODELS), embedder={"name": "e", "dim": D_EMB},
                         deadline_unix=time.time() + 3600, quorum=10, min_count=2,
                         settings=round_settings(aggregation=AggregationConfig()), centroids=centroids)
    yield store, r
    store.close()


def an_update() -> KMeansUpdate:
    """Counts 2 and 3 in two entries, scores 0.5, cost 0.002 USD per query; cell 1's mean (0, 0.6, 0.1)
    (not a float32 value) over 2 queries."""
    count = np.zeros((N_CELLS, len(MODELS)))
    count[0, 0], count[1, 1] = 2, 3
    return KMeansUpdate(CellStatistics(count, count * 0.5, count * 0.002), np.array([1]), np.array([[0.0, 0.6, 0.1]]),
                        np.array([2.0]), 5)


def msgpack_body(r, **changes) -> dict:
    spec = RoundSpec(r.id, "kmeans", r.centroids, r.centroids_hash, r.models, "e", D_EMB, r.min_count,
                     "2030-01-01T00:00:00.000000Z")
    body = msgpack.unpackb(encode_kmeans_update_msgpack(an_update(), "alice", spec))
    body.update(changes)
    return body


def mp_array(values, dtype: str) -> list:
    a = np.asarray(values, dtype=dtype)
    return [list(a.shape), a.tobytes()]


def check(r, body, media: str = "application/msgpack"):
    raw = msgpack.packb(body) if media == "application/msgpack" else json.dumps(body).encode()
    return round_kinds.validate_upload(round_kinds.parse_upload(raw, media), r)


def rejected(r, body, media: str = "application/msgpack") -> str:
    with pytest.raises(UploadRejected) as info:
        check(r, body, media)
    assert info.value.status == 422
    return info.value.detail


def test_a_valid_msgpack_body_keeps_its_float32_means_exactly(store_round):
    _, r = store_round
    accepted = check(r, msgpack_body(r))
    stored = decode_kmeans_update_record(accepted.payload)
    np.testing.assert_array_equal(stored.local_centroids, np.float32([[0.0, 0.6, 0.1]]).astype(np.float64))
    np.testing.assert_array_equal(stored.statistics.count[:2], [[2, 0], [0, 3]])


@pytest.mark.parametrize("field,dtype,values", [
    ("count", "<f8", np.full((N_CELLS, 2), np.nan)),
    ("count", "<f8", [[2, 0], [0, 3.5], [0, 0], [0, 0]]),
    ("sum_accuracy", "<f8", [[1, 0], [0, np.inf], [0, 0], [0, 0]]),
    ("sum_accuracy", "<f8", [[1, 0], [0, 3.1], [0, 0], [0, 0]]),
    ("sum_cost", "<f8", [[-0.001, 0], [0, 0], [0, 0], [0, 0]]),
    ("sum_cost", "<f8", [[2001.0, 0], [0, 0], [0, 0], [0, 0]]),  # above 1000 USD per query
    ("centroid_cells", "<i8", [N_CELLS]),
    ("local_centroids", "<f4", [[0.0, 0.9, 0.9]]),  # norm above 1
    ("local_weights", "<f8", [-np.inf]),
    ("local_weights", "<f8", [2.5]),
])
def test_each_array_check_names_its_field(store_round, field, dtype, values):
    _, r = store_round
    assert rejected(r, msgpack_body(r, **{field: mp_array(values, dtype)})).split(":")[0] == field


def test_repeated_or_out_of_range_cells_are_refused(store_round):
    _, r = store_round
    two = {"local_centroids": mp_array([[0, 0.6, 0], [0, 0.6, 0]], "<f4"), "local_weights": mp_array([2, 2], "<f8")}
    for cells in ([1, 1], [1, N_CELLS]):
        assert rejected(r, msgpack_body(r, centroid_cells=mp_array(cells, "<i8"), **two)).split(":")[0] == "centroid_cells"


@pytest.mark.parametrize("bad", [True, None, "1"])
def test_json_arrays_refuse_non_numbers_including_booleans(store_round, bad):
    _, r = store_round
    body = msgpack_body(r)
    body = {k: v for k, v in body.items() if not isinstance(v, list) or not v or not isinstance(v[-1], bytes)}
    u = an_update()
    body.update(count=u.statistics.count.tolist(), sum_accuracy=u.statistics.sum_accuracy.tolist(),
                sum_cost=u.statistics.sum_cost.tolist(), centroid_cells=[1], local_centroids=u.local_centroids.tolist(),
                local_weights=[2.0])
    check(r, body, "application/json")  # the valid JSON body passes
    body["sum_accuracy"][3][1] = bad
    assert rejected(r, body, "application/json") == "sum_accuracy: must hold only numbers"


def test_a_client_s_first_upload_in_a_round_is_reported_once():
    state = UploadState(max_rounds=2)
    assert state.first_in_round(1, "alice") is True
    assert state.first_in_round(1, "alice") is False
    assert state.first_in_round(1, "bob") is True
    assert state.first_in_round(2, "alice") is True
    assert state.first_in_round(3, "alice") is True  # round 1 forgotten (2 rounds kept)
    assert state.first_in_round(1, "alice") is True


def test_the_group_writer_waits_for_an_upload_on_its_way(store_round):
    store, r = store_round
    token = store.add_client("alice")
    row = {"client_id": "alice", "token_sha256": hash_token(token), "round_id": r.id, "body_sha256": "0" * 64,
           "payload": b"x" * 100, "log_size": 5, "previous_id": None}
    writer = GroupWriter(store, commit_delay_s=5.0)

    async def two_uploads():
        writer.active = 2  # two uploads inside the route: the first batch waits for the second
        first = asyncio.ensure_future(writer.insert(**row, key="k1"))
        await asyncio.sleep(0.2)
        second = await writer.insert(**row, key="k2")
        return await first, second

    try:
        first, second = asyncio.run(two_uploads())
    finally:
        writer.close()
    assert (writer.batches, writer.rows) == (1, 2)
    assert (first["client_id"], second["client_id"], second["update_id"] - first["update_id"]) == ("alice", "alice", 1)
    assert store.count_updates() == 2


def test_a_new_sqlite_store_gets_16_kib_pages_and_an_old_one_keeps_its_own(tmp_path):
    import sqlite3

    Store(f"sqlite:///{tmp_path / 'new.db'}").close()
    old = sqlite3.connect(tmp_path / "old.db")
    old.execute("CREATE TABLE t (x)")  # created with SQLite's default 4096-byte pages
    old.execute("DROP TABLE t")  # the page size stays; a table that is not the server's would be refused
    old.commit()
    old.close()
    Store(f"sqlite:///{tmp_path / 'old.db'}").close()
    for name, page in (("new.db", 16384), ("old.db", 4096)):
        conn = sqlite3.connect(tmp_path / name)
        assert conn.execute("PRAGMA page_size").fetchone()[0] == page, name
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal", name
        conn.close()


def test_a_failed_batch_stores_none_of_its_rows_and_the_next_batch_is_stored(store_round):
    import sqlalchemy as sa

    store, r = store_round
    token_sha256 = hash_token(store.add_client("alice"))
    row = {"client_id": "alice", "token_sha256": token_sha256, "round_id": r.id, "body_sha256": "0" * 64,
           "payload": b"x" * 100, "log_size": 5, "previous_id": None}
    with pytest.raises(sa.exc.IntegrityError):  # the second row's payload breaks NOT NULL: the batch rolls back
        store.insert_updates([{**row, "key": "k1"}, {**row, "key": "k2", "payload": None}])
    assert store.count_updates() == 0
    # The batch connection was replaced; a stored key is skipped (None), a revoked token too.
    first, again = store.insert_updates([{**row, "key": "k1"}, {**row, "key": "k1"}])
    assert (first["client_id"], first["round_id"], first["late"], again) == ("alice", r.id, False, None)
    assert store.insert_updates([{**row, "key": "k3", "token_sha256": "f" * 64}]) == [None]
    assert store.count_updates() == 1


def test_the_stored_record_reuses_the_msgpack_bytes_and_equals_the_packed_one(store_round):
    from sdk.protocol import encode_kmeans_update, encode_kmeans_update_record

    _, r = store_round
    body = msgpack_body(r)
    accepted = check(r, body)
    update = decode_kmeans_update_record(accepted.payload)
    assert accepted.payload == encode_kmeans_update_record(update)  # the same bytes as packing the update
    spec = RoundSpec(r.id, "kmeans", r.centroids, r.centroids_hash, r.models, "e", D_EMB, r.min_count,
                     "2030-01-01T00:00:00.000000Z")
    from_json = round_kinds.validate_upload(round_kinds.parse_upload(
        encode_kmeans_update(an_update(), "alice", spec), "application/json"), r)
    assert accepted.payload == from_json.payload  # JSON packs its arrays; the same bytes
    # An empty local_centroids sent as [0, 0] is stored with the round's d_emb, like JSON's [].
    empty = msgpack_body(r, centroid_cells=mp_array(np.zeros(0), "<i8"),
                         local_centroids=mp_array(np.zeros((0, 0)), "<f4"), local_weights=mp_array([], "<f8"))
    stored = decode_kmeans_update_record(check(r, empty).payload)
    assert stored.local_centroids.shape == (0, D_EMB)
