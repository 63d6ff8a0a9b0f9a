"""The aggregation server's HTTP API (trainer.server) in-process: every rejection of ARCHITECTURE.md §6
with its status, the idempotent retry, the empty round, the straggler and stale updates.

The app and its store are the real ones, on SQLite and on PostgreSQL (a throwaway server, see
postgres_server.py; skipped where PostgreSQL is not installed); requests go through Starlette's
TestClient. The end-to-end run with real processes and TLS is in test_sync_e2e.py.
"""

from __future__ import annotations

import dataclasses
import json

import msgpack
import numpy as np
import pytest
from fastapi.testclient import TestClient

from export.publish import BundlePublisher
from sdk.cell_statistics import CellStatistics
from trainer.federated.kmeans_aggregation import AggregationConfig
from trainer.server.app import create_app
from trainer.server.kmeans_rounds import open_round_from_bundle
from trainer.server.round_kind import PublishTarget, RoundOutcome, round_settings
from trainer.server.rounds import close_round
from trainer.server.store import Store

MAX_BODY = 256 * 1024


@pytest.fixture(scope="module")
def kmeans_bundle(make_bundle, tmp_path_factory):
    return make_bundle(tmp_path_factory.mktemp("srv") / "bundle", "kmeans")


@pytest.fixture(params=["sqlite", "postgresql"])
def server(request, tmp_path, kmeans_bundle, signing_keys, postgres):
    """The app over a fresh store: a SQLite file, or a database on a throwaway PostgreSQL server."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'fed.db'}"
    else:
        from postgres_server import fresh_database

        if postgres[0] is None:
            pytest.skip(postgres[1])
        url = fresh_database(postgres[0])
    store = Store(url)
    tokens = {c: store.add_client(c) for c in ("alice", "bob", "carol")}

    def open_round(centroids=None, min_count=2, aggregation=None):
        return open_round_from_bundle(store, kmeans_bundle, signing_keys[1], deadline_s=3600, quorum=100,
                                      min_count=min_count, settings=round_settings(aggregation=aggregation or AggregationConfig()),
                                      centroids=centroids)

    r = open_round()
    app = create_app(store, kmeans_bundle, max_body_bytes=MAX_BODY, tick_s=60, publisher=BundlePublisher())
    with TestClient(app, base_url="https://testserver") as http:
        yield {"store": store, "tokens": tokens, "round": r, "http": http, "open_round": open_round}
    store.close()


def payload(r, client="alice", scale=1):
    k, m, d = r.centroids.shape[0], len(r.models), r.centroids.shape[1]
    count = np.zeros((k, m))
    count[0, 0], count[1, 2] = 2 * scale, 3 * scale
    acc = count * 0.5
    cost = count * 0.002
    mean = np.zeros(d)
    mean[0] = 0.6
    return {"client_id": client, "round_id": r.id, "kind": "kmeans", "centroids_hash": r.centroids_hash,
            "models": list(r.models), "log_size": int(count.sum()), "count": count.tolist(),
            "sum_accuracy": acc.tolist(), "sum_cost": cost.tolist(), "centroid_cells": [0],
            "local_centroids": [mean.tolist()], "local_weights": [2.0 * scale]}


def post(s, body, client="alice", key="k1", round_id=None, raw=None, headers=None):
    round_id = s["round"].id if round_id is None else round_id
    h = {"Authorization": f"Bearer {s['tokens'][client]}", "Idempotency-Key": key, "Content-Type": "application/json"}
    h.update(headers or {})
    data = raw if raw is not None else json.dumps(body).encode()
    return s["http"].post(f"/v1/rounds/{round_id}/updates", content=data, headers=h)


def test_accepts_a_valid_update_and_describes_the_round(server):
    got = server["http"].get("/v1/rounds/current", headers={"Authorization": f"Bearer {server['tokens']['bob']}"})
    assert got.status_code == 200
    desc = got.json()
    assert desc["client_id"] == "bob" and desc["round_id"] == server["round"].id and desc["min_count"] == 2
    assert np.asarray(desc["centroids"]).shape == server["round"].centroids.shape
    answer = post(server, payload(server["round"]))
    assert answer.status_code == 201, answer.text
    assert answer.json()["late"] is False and answer.json()["counted_in_round"] == server["round"].id


def test_a_round_with_a_cost_bound_sends_it_and_the_devices_clipped_update_is_accepted(server, tmp_path):
    """A round opened with max_cost_usd below a device's logged costs: the description did not carry
    the bound, so the device sent its raw sums and every upload was refused (422 on sum_cost)."""
    from sdk import EvalLog
    from sdk.local_update import kmeans_update
    from sdk.protocol import RoundSpec

    close_round(server["store"], server["round"].id)
    r = server["open_round"](aggregation=AggregationConfig(max_cost_usd=0.01))
    auth = {"Authorization": f"Bearer {server['tokens']['alice']}"}
    desc = server["http"].get("/v1/rounds/current", headers=auth).json()
    assert desc["round_id"] == r.id and desc["max_cost_usd"] == 0.01
    spec = RoundSpec.from_json(desc)
    with EvalLog(tmp_path / "log.sqlite", list(r.models)) as log:
        for i in range(3):  # three queries of 0.05 USD each in the cell of centroid 0
            near = r.centroids[0] + 1e-3 * i
            log.record(r.models[0], 1.0, 0.05, embedding=near / np.linalg.norm(near))
        u = kmeans_update(log.rows(), spec)
    assert u.statistics.sum_cost[u.statistics.count > 0].tolist() == [pytest.approx(0.03)]  # 3 x 0.01
    answer = post(server, u.to_payload("alice", spec), key="cap", round_id=r.id)
    assert answer.status_code == 201, answer.text


@pytest.mark.parametrize("auth", [None, "Bearer nope", "Basic abc"])
def test_bad_or_missing_token_is_401(server, auth):
    headers = {"Idempotency-Key": "k", "Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = auth
    answer = server["http"].post(f"/v1/rounds/{server['round'].id}/updates", content=b"{}", headers=headers)
    assert answer.status_code == 401
    assert server["http"].get("/v1/rounds/current", headers=headers).status_code == 401
    assert server["http"].get("/v1/bundles/latest", headers=headers).status_code == 401


def test_revoked_token_is_401(server):
    server["store"].revoke_client("alice")
    assert post(server, payload(server["round"])).status_code == 401


def test_token_acting_for_another_client_is_403(server):
    answer = post(server, payload(server["round"], client="bob"), client="alice")
    assert answer.status_code == 403 and "alice" in answer.json()["detail"]


def test_wrong_round_is_409(server):
    r1 = server["round"]
    assert post(server, payload(r1), round_id=r1.id + 5, raw=json.dumps({**payload(r1), "round_id": r1.id + 5}).encode()).status_code == 409
    close_round(server["store"], r1.id)
    r2 = server["open_round"]()
    close_round(server["store"], r2.id)
    server["open_round"]()
    old = post(server, payload(r1), key="old")  # round 1 closed, and round 2 closed after it
    assert old.status_code == 409 and "newer" in old.json()["detail"]


def test_update_for_other_centroids_is_409(server):
    body = {**payload(server["round"]), "centroids_hash": "0" * 64}
    assert post(server, body).status_code == 409


def test_body_over_the_size_limit_is_413(server):
    big = b"{" + b" " * (MAX_BODY + 10) + b"}"
    assert post(server, None, raw=big).status_code == 413

    def chunks():  # no Content-Length: the limit is enforced while streaming
        for _ in range(40):
            yield b" " * 8192

    answer = server["http"].post(f"/v1/rounds/{server['round'].id}/updates", content=chunks(), headers={
        "Authorization": f"Bearer {server['tokens']['alice']}", "Idempotency-Key": "k", "Content-Type": "application/json"})
    assert answer.status_code == 413


def test_undecodable_body_missing_key_and_content_type(server):
    assert post(server, None, raw=b"{not json").status_code == 400
    assert post(server, payload(server["round"]), key="bad key with spaces").status_code == 400
    answer = post(server, payload(server["round"]), headers={"Content-Type": "text/plain"})
    assert answer.status_code == 415
    # It named only the first two MessagePack types of a K-means round, not JSON, which the server takes.
    assert answer.json()["detail"] == (
        "content type must be application/msgpack or application/x-msgpack or application/vnd.msgpack or "
        "application/json (kmeans), application/x-safetensors or application/vnd.safetensors (mlp), got 'text/plain'")


@pytest.mark.parametrize("body, reason", [
    (b"\x81\xa1a", "Unpack failed: incomplete input"),
    (b"\x81\x01\x02", "int is not allowed for map key when strict_map_key=True"),
    (b"\xc1", "a byte that starts no MessagePack value (0xc1?)"),
    (b"\x91" * 100_000 + b"\xc0", "nested deeper than MessagePack's decoder allows"),
])
def test_an_undecodable_msgpack_body_is_told_why(server, body, reason):
    """A MessagePack body that does not decode was answered with msgpack's exception class only
    ("body is not valid MessagePack: ValueError"), not what is wrong with it."""
    answer = post(server, None, raw=body, headers={"Content-Type": "application/msgpack"})
    assert answer.status_code == 400
    assert answer.json()["detail"] == f"body is not valid MessagePack: {reason}"


def _mutate(body, field, fn):
    body = json.loads(json.dumps(body))
    body[field] = fn(body[field])
    return body


def _set(matrix, value, i=0, j=0):
    matrix[i][j] = value
    return matrix


INVALID = {
    "wrong shape": lambda b: _mutate(b, "count", lambda c: c[:-1]),
    "ragged rows": lambda b: _mutate(b, "sum_cost", lambda c: [c[0][:-1], *c[1:]]),
    "negative count": lambda b: _mutate(b, "count", lambda c: _set(c, -2.0, 3, 3)),
    "fractional count": lambda b: _mutate(b, "count", lambda c: _set(c, 2.5)),
    "counts above log size": lambda b: {**b, "log_size": 4},
    "score above 1": lambda b: _mutate(b, "sum_accuracy", lambda c: _set(c, 2.5)),
    "score below 0": lambda b: _mutate(b, "sum_accuracy", lambda c: _set(c, -0.5)),
    "negative cost": lambda b: _mutate(b, "sum_cost", lambda c: _set(c, -0.001)),
    "below min_count": lambda b: _mutate(_mutate(b, "count", lambda c: _set(c, 1.0)), "sum_accuracy", lambda c: _set(c, 0.5)),
    "single-query cell mean": lambda b: {**b, "local_weights": [1.0]},
    "mean of norm > 1": lambda b: _mutate(b, "local_centroids", lambda c: _set(c, 1.5)),
    "cell out of range": lambda b: {**b, "centroid_cells": [99]},
    "models reordered": lambda b: _mutate(b, "models", lambda m: m[::-1]),
    "unknown field": lambda b: {**b, "query": "hello"},
    "string number": lambda b: {**b, "log_size": "5"},
    "missing field": lambda b: {k: v for k, v in b.items() if k != "sum_cost"},
    "round id differs from url": lambda b: {**b, "round_id": b["round_id"] + 1},
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_updates_are_422(server, case):
    answer = post(server, INVALID[case](payload(server["round"])), key=f"k-{len(case)}")
    assert answer.status_code == 422, (case, answer.text)
    assert answer.json()["detail"]
    assert server["store"].count_updates() == 0


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_inf_are_422(server, token):
    body = json.dumps(payload(server["round"])).replace("0.004", token, 1)  # a sum_cost entry
    assert token in body
    answer = post(server, None, raw=body.encode())
    assert answer.status_code == 422 and answer.json()["detail"].split(":")[0] == "sum_cost"


def test_msgpack_body_is_accepted(server):
    answer = post(server, None, raw=msgpack.packb(payload(server["round"])),
                  headers={"Content-Type": "application/msgpack"})
    assert answer.status_code == 201, answer.text


def test_retry_with_the_same_key_is_accepted_once(server):
    body = payload(server["round"])
    first = post(server, body, key="retry-1")
    again = post(server, body, key="retry-1")
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json() == again.json()
    assert server["store"].count_updates() == 1
    other = post(server, payload(server["round"], scale=2), key="retry-1")
    assert other.status_code == 422 and "different body" in other.json()["detail"]
    assert server["store"].count_updates() == 1


def test_empty_round_closes_as_a_no_op(server):
    outcome = close_round(server["store"], server["round"].id)
    assert outcome.result == "no-op" and outcome.on_time_updates == 0
    assert server["store"].aggregate_of(server["round"].id) is None
    assert server["store"].get_round(server["round"].id).status == "closed"
    assert close_round(server["store"], server["round"].id) is None  # closing twice does nothing


def test_close_message_counts_the_clients_evaluations_and_says_why_nothing_was_published(server):
    r = server["round"]  # opened without --signing-key: aggregated, not published
    assert post(server, payload(r, client="alice"), client="alice", key="a").status_code == 201
    assert post(server, payload(r, client="bob", scale=2), client="bob", key="b").status_code == 201
    messages = []
    close_round(server["store"], r.id, progress=messages.append)
    assert messages == [f"round {r.id}: aggregated 2 clients (15 evaluations); "
                        "nothing published (round opened without --signing-key)"]  # 2 + 3, then twice that


def test_straggler_is_counted_in_the_next_round(server):
    r1 = server["round"]
    assert post(server, payload(r1, client="alice"), client="alice", key="a").status_code == 201
    assert close_round(server["store"], r1.id).clients == ["alice"]
    late = post(server, payload(r1, client="bob", scale=3), client="bob", key="b")
    assert late.status_code == 201
    assert late.json()["late"] is True and late.json()["counted_in_round"] is None
    r2 = server["open_round"]()  # same centroids: bob's statistics merge
    outcome = close_round(server["store"], r2.id)
    assert outcome.result == "aggregated" and outcome.late_updates_counted == 1
    assert outcome.clients == ["alice", "bob"]  # alice still counts with her round-1 update
    agg = server["store"].aggregate_of(r2.id)
    expected = CellStatistics.merge([_stats(payload(r1)), _stats(payload(r1, scale=3))])
    np.testing.assert_allclose(agg["count"], expected.count)
    np.testing.assert_allclose(agg["sum_accuracy"], expected.sum_accuracy)


def test_straggler_for_other_centroids_is_kept_as_stale(server):
    r1 = server["round"]
    close_round(server["store"], r1.id)
    assert post(server, payload(r1, client="bob"), client="bob", key="b").status_code == 201
    r2 = server["open_round"](centroids=r1.centroids[::-1].copy())
    assert post(server, {**payload(r2, client="carol")}, client="carol", key="c", round_id=r2.id).status_code == 201
    outcome = close_round(server["store"], r2.id)
    assert outcome.stale_updates == 1 and outcome.clients == ["carol"]
    assert server["store"].count_updates() == 2  # kept, not lost


def test_latest_update_of_a_client_replaces_its_earlier_one(server):
    r = server["round"]
    assert post(server, payload(r), key="first").status_code == 201
    assert post(server, payload(r, scale=2), key="second").status_code == 201
    close_round(server["store"], r.id)
    np.testing.assert_allclose(server["store"].aggregate_of(r.id)["count"], _stats(payload(r, scale=2)).count)


def test_bundle_endpoints_serve_the_published_manifest_with_etag(server, kmeans_bundle):
    auth = {"Authorization": f"Bearer {server['tokens']['alice']}"}
    latest = server["http"].get("/v1/bundles/latest", headers=auth)
    assert latest.status_code == 200
    manifest = json.loads(latest.content)
    assert latest.content == (kmeans_bundle / "manifest.json").read_bytes()
    same = server["http"].get("/v1/bundles/latest", headers={**auth, "If-None-Match": latest.headers["etag"]})
    assert same.status_code == 304
    name, digest = min(manifest["files"].items())
    file = server["http"].get(f"/v1/bundles/files/{digest}", headers=auth)
    assert file.status_code == 200 and file.content == (kmeans_bundle / name).read_bytes()
    assert server["http"].get(f"/v1/bundles/files/{'0' * 64}", headers=auth).status_code == 404
    assert server["http"].get("/v1/bundles/files/..%2Fmanifest.json", headers=auth).status_code == 404


def _stats(body) -> CellStatistics:
    return CellStatistics(np.array(body["count"]), np.array(body["sum_accuracy"]), np.array(body["sum_cost"]))


def test_a_close_interrupted_by_a_crash_is_finished_from_the_same_snapshot(server):
    import time

    from trainer.server.rounds import close_due_rounds

    r = server["round"]
    assert post(server, payload(r, client="alice"), client="alice", key="a").status_code == 201
    # A closer claimed the round, then its process died (its lease has run out).
    snapshot = server["store"].claim_close(r.id, "dead-server", lease_s=0.0)
    assert server["store"].claim_close(r.id, "dead-server", lease_s=0.0) == snapshot  # same snapshot on retry
    late = post(server, payload(r, client="bob"), client="bob", key="b")
    assert late.status_code == 201 and late.json()["late"] is True  # closing: uploads now wait
    # The server's background closer (woken by that upload) finishes the round, as after a restart.
    deadline = time.monotonic() + 30
    while server["store"].get_round(r.id).status != "closed" and time.monotonic() < deadline:
        time.sleep(0.05)
    outcome = server["store"].get_round(r.id).outcome
    assert outcome.clients == ["alice"] and outcome.late_updates_counted == 0  # bob waits for round 2
    np.testing.assert_allclose(server["store"].aggregate_of(r.id)["count"], _stats(payload(r)).count)
    assert close_due_rounds(server["store"]) == []


def test_a_closer_holding_the_lease_keeps_others_out(server):
    r = server["round"]
    assert post(server, payload(r), key="a").status_code == 201
    snapshot = server["store"].claim_close(r.id, "operator", lease_s=600)
    assert server["store"].claim_close(r.id, "server") is None  # held: the server does not close it twice
    assert close_round(server["store"], r.id) is None
    assert server["store"].claim_close(r.id, "server", force=True) == snapshot  # a restart takes over
    assert not server["store"].finish_close(r.id, RoundOutcome("no-op"), None, [], [], "operator")  # lost it


def test_revoked_clients_no_longer_count(server):
    r = server["round"]
    assert post(server, payload(r, client="alice", scale=5), client="alice", key="a").status_code == 201
    assert post(server, payload(r, client="bob"), client="bob", key="b").status_code == 201
    server["store"].revoke_client("alice")  # e.g. found poisoning the statistics
    outcome = close_round(server["store"], r.id)
    assert outcome.clients == ["bob"]
    np.testing.assert_allclose(server["store"].aggregate_of(r.id)["count"], _stats(payload(r)).count)


HOSTILE = {
    "count beyond float64": lambda b: _mutate(b, "count", lambda c: _set(c, 10**309)),
    "count beyond INTEGER": lambda b: {**_mutate(b, "count", lambda c: _set(c, 2.0**40)), "log_size": 2**40},
    "log_size beyond INTEGER": lambda b: {**b, "log_size": 2**63},
    "cell index beyond INTEGER": lambda b: {**b, "centroid_cells": [2**64]},
    "weight beyond float64": lambda b: {**b, "local_weights": [10**400]},
    "cost above the per-query bound": lambda b: _mutate(b, "sum_cost", lambda c: _set(c, 1e308)),
    "nothing to report": lambda b: {**b, "count": np.zeros_like(np.array(b["count"])).tolist(),
                                    "sum_accuracy": np.zeros_like(np.array(b["count"])).tolist(),
                                    "sum_cost": np.zeros_like(np.array(b["count"])).tolist(),
                                    "centroid_cells": [], "local_centroids": [], "local_weights": []},
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_numbers_are_422_not_500(server, case):
    answer = post(server, HOSTILE[case](payload(server["round"])), key="h")
    assert answer.status_code == 422, (case, answer.text)
    assert server["store"].count_updates() == 0


def test_out_of_range_round_ids_in_paths_are_422(server):
    auth = {"Authorization": f"Bearer {server['tokens']['alice']}"}
    assert server["http"].get(f"/v1/rounds/{10**23}/parameters", headers=auth).status_code == 422
    answer = post(server, payload(server["round"]), round_id=10**23)
    assert answer.status_code == 422


def test_api_schema_pages_are_not_served(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert server["http"].get(path).status_code == 404


def test_a_round_that_cannot_close_is_marked_failed_and_a_new_one_can_open(server, tmp_path):
    import time

    from trainer.server.rounds import MAX_CLOSE_ATTEMPTS, close_due_rounds

    store, r = server["store"], server["round"]
    close_round(store, r.id)
    broken = server["open_round"]()  # publishes with a signing key that has since gone missing
    settings = dataclasses.replace(broken.settings, publish=PublishTarget(str(tmp_path / "b"), str(tmp_path / "gone")))
    import json as _json

    from trainer.server import store as tables

    with store.transaction() as conn:  # what an operator's typo in `rounds open --signing-key` stores
        conn.execute(tables.rounds.update().where(tables.rounds.c.id == broken.id)
                     .values(settings=_json.dumps(settings.to_json())))
    assert post(server, payload(broken), key="x", round_id=broken.id).status_code == 201
    bob = payload(broken, client="bob")
    assert post(server, bob, client="bob", key="y", round_id=broken.id).status_code == 201
    with store.transaction() as conn:  # its deadline passes
        conn.execute(tables.rounds.update().where(tables.rounds.c.id == broken.id).values(deadline_unix=0.0))
    for attempt in range(MAX_CLOSE_ATTEMPTS + 1):  # the app's own closer (woken by the upload) may try too
        close_due_rounds(store, now=time.time() + 1000.0 * (attempt + 1), owner="operator", takeover={broken.id},
                         publisher=BundlePublisher())
    outcome = store.get_round(broken.id).outcome
    assert store.get_round(broken.id).status == "closed" and outcome.result == "failed"
    assert "gone" in outcome.error
    assert store.count_updates() == 2  # the uploads are kept
    server["open_round"]()  # no longer blocked


def test_an_update_that_differs_from_the_last_one_by_a_few_queries_is_422(server):
    r = server["round"]  # min_count 2
    assert post(server, payload(r), key="first").status_code == 201
    grown = _mutate(payload(r), "count", lambda c: _set(c, 3.0))  # entry (0, 0): 2 -> 3, one new query
    grown = _mutate(grown, "sum_accuracy", lambda c: _set(c, 1.5))
    grown = {**_mutate(grown, "sum_cost", lambda c: _set(c, 0.006)), "log_size": 6}
    answer = post(server, grown, key="second")
    assert answer.status_code == 422 and "moved by 1" in answer.json()["detail"]
    more = _mutate(_mutate(_mutate(payload(r), "count", lambda c: _set(c, 4.0)), "sum_accuracy",
                           lambda c: _set(c, 2.0)), "sum_cost", lambda c: _set(c, 0.008))
    assert post(server, {**more, "log_size": 7}, key="third").status_code == 201  # moved by 2 = min_count


def test_store_refuses_in_memory_databases_and_rotates_tokens(tmp_path):
    with pytest.raises(ValueError, match="in-memory"):
        Store("sqlite:///")
    store = Store(f"sqlite:///{tmp_path / 'x.db'}")
    old = store.add_client("dev")
    store.revoke_client("dev")
    new = store.rotate_token("dev")
    assert store.authenticate(old) is None and store.authenticate(new) == "dev"
    assert store.rotate_token("nobody") is None


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_store_opened_without_create_refuses_a_database_without_its_tables_and_writes_nothing(tmp_path, postgres,
                                                                                             backend):
    """Store(url, create=False) is what the operator commands that read (`clients list`, `rounds status`, ...) open."""
    import sqlalchemy as sa

    if backend == "sqlite":
        (tmp_path / "x.db").touch()
        url = f"sqlite:///{tmp_path / 'x.db'}"
    else:
        from postgres_server import fresh_database

        if postgres[0] is None:
            pytest.skip(postgres[1])
        url = fresh_database(postgres[0])
    with pytest.raises(ValueError, match="clients"):
        Store(url, create=False)
    engine = sa.create_engine(url)
    assert sa.inspect(engine).get_table_names() == []
    engine.dispose()
    Store(url).close()  # the default creates them
    store = Store(url, create=False)
    assert store.list_clients() == []
    store.close()


def test_round_deadline_is_bounded(server, kmeans_bundle, signing_keys):
    from sdk.errors import InvalidInputError

    close_round(server["store"], server["round"].id)
    with pytest.raises(InvalidInputError, match="a year"):
        open_round_from_bundle(server["store"], kmeans_bundle, signing_keys[1], deadline_s=1e300, quorum=1,
                               min_count=1, settings=round_settings(aggregation=AggregationConfig()))


def test_an_entry_that_drops_to_zero_is_accepted(server):
    r = server["round"]
    assert post(server, payload(r), key="first").status_code == 201  # (0, 0): 2 queries, (1, 2): 3
    dropped = _mutate(_mutate(_mutate(payload(r), "count", lambda c: _set(c, 0.0)), "sum_accuracy",
                              lambda c: _set(c, 0.0)), "sum_cost", lambda c: _set(c, 0.0))
    assert post(server, {**dropped, "log_size": 3}, key="second").status_code == 201  # e.g. min_count went up


def test_one_clients_statistics_are_never_published_alone(server, kmeans_bundle, signing_keys, tmp_path):
    import shutil

    store = server["store"]
    close_round(store, server["round"].id)
    bundle = tmp_path / "published"
    shutil.copytree(kmeans_bundle, bundle)
    settings = round_settings(aggregation=AggregationConfig(), bundle_dir=bundle, signing_key=signing_keys[0])
    r = open_round_from_bundle(store, bundle, signing_keys[1], deadline_s=600, quorum=100, min_count=2,
                               settings=settings)
    assert post(server, payload(r), key="solo", round_id=r.id).status_code == 201
    outcome = close_round(store, r.id, publisher=BundlePublisher())
    assert outcome.result == "aggregated" and outcome.bundle_version is None
    assert "1 client(s)" in outcome.publish_skipped
    assert json.loads((bundle / "manifest.json").read_text())["bundle_version"] == 1  # nothing published
