"""The aggregation server under hostile or careless clients, through real sockets against a real
uvicorn server (h11, the limits of ``fedroute serve``: :mod:`sdk.http_limits`) running
in a thread of the test process, over a real SQLite store.

Header flood, slow headers, idle connection, slow body, disconnect mid-body, too many headers,
each 422 naming its field (the ``count = -5`` case in particular), MessagePack and JSON bodies of
one update storing identical rows, a token revoked by the CLI in another process refused on the
next upload, and the upload quota (429 with ``Retry-After``). Plain HTTP on 127.0.0.1: TLS is not
what these tests are about (test_sync_e2e.py and test_sync_crash.py run the TLS server).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import threading
import time

import httpx
import msgpack
import numpy as np
import pytest
import sqlalchemy as sa
import uvicorn

from sdk.cell_statistics import CellStatistics
from sdk.protocol import KMeansUpdate, RoundSpec, encode_kmeans_update, encode_kmeans_update_msgpack
from sync_fleet import free_port, run_cli
from trainer.federated.kmeans_aggregation import AggregationConfig
from trainer.server.app import create_app
from sdk.http_limits import HttpLimits
from trainer.server.kmeans_rounds import open_round_from_bundle
from trainer.server.round_kind import round_settings
from trainer.server.store import Store, updates
from trainer.server.upload_state import UploadQuota

LIMITS = HttpLimits(max_header_bytes=16 * 1024, max_headers=64, header_timeout_s=0.6, body_timeout_s=0.6,
                    keep_alive_s=5.0)


@pytest.fixture(scope="module")
def kmeans_bundle(make_bundle, tmp_path_factory):
    return make_bundle(tmp_path_factory.mktemp("limits") / "bundle", "kmeans")


@pytest.fixture(scope="module")
def live(request, kmeans_bundle, signing_keys, tmp_path_factory):
    """A real uvicorn server (the limits above; an upload quota of 1000 per 60 s that the quota test
    lowers) on a fresh SQLite store."""
    work = tmp_path_factory.mktemp("live")
    url = f"sqlite:///{work / 'fed.db'}"
    store = Store(url)
    tokens = {c: store.add_client(c) for c in ("alice", "bob", "carol", "dave", "quota")}
    r = open_round_from_bundle(store, kmeans_bundle, signing_keys[1], deadline_s=3600, quorum=100, min_count=2,
                               settings=round_settings(aggregation=AggregationConfig()))
    quota = UploadQuota(1000, 60.0)
    limits = dataclasses.replace(LIMITS, parser=getattr(request, "param", "h11"))  # h11 unless a test asks
    app = create_app(store, kmeans_bundle, tick_s=60, quota=quota, limits=limits)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="info",
                                           **limits.uvicorn_options()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield {"url": f"http://127.0.0.1:{port}", "port": port, "store": store, "tokens": tokens, "round": r,
           "db_url": url, "quota": quota}
    server.should_exit = True
    thread.join(10)
    store.close()


#: The HTTP-level tests run against both of uvicorn's parsers (``fedroute serve --http-parser``).
BOTH_PARSERS = pytest.mark.parametrize("live", ["h11", "httptools"], indirect=True)


def spec_of(r) -> RoundSpec:
    return RoundSpec(r.id, "kmeans", r.centroids, r.centroids_hash, r.models, "e", r.centroids.shape[1], r.min_count,
                     "2030-01-01T00:00:00.000000Z")


def an_update(r, scale: int = 1) -> KMeansUpdate:
    """Counts 2 and 3 (x scale) in two entries; cell 0's mean (0.6, 0, ...) over 2 queries."""
    k, m, d = r.centroids.shape[0], len(r.models), r.centroids.shape[1]
    count = np.zeros((k, m))
    count[0, 0], count[1, 2] = 2 * scale, 3 * scale
    mean = np.zeros((1, d))
    mean[0, 0] = 0.6
    return KMeansUpdate(CellStatistics(count, count * 0.5, count * 0.002), np.array([0]), mean,
                        np.array([2.0 * scale]), int(count.sum()))


def post(live, body: bytes, client: str = "alice", key: str = "k1", media: str = "application/json",
         token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token or live['tokens'][client]}", "Idempotency-Key": key,
               "Content-Type": media}
    return httpx.post(f"{live['url']}/v1/rounds/{live['round'].id}/updates", content=body, headers=headers,
                      timeout=10.0)


def json_body(live, client: str = "alice", scale: int = 1, **changes) -> bytes:
    obj = json.loads(encode_kmeans_update(an_update(live["round"], scale), client, spec_of(live["round"])))
    obj.update(changes)
    return json.dumps(obj).encode()


def health_latency_s(live) -> float:
    start = time.monotonic()
    answer = httpx.get(f"{live['url']}/v1/health", timeout=10.0)
    assert answer.status_code == 200
    return time.monotonic() - start


def raw_connection(live) -> socket.socket:
    return socket.create_connection(("127.0.0.1", live["port"]), timeout=10.0)


def read_answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass  # the server cutting the connection is how these answers end; what arrived is the answer
    return data


@BOTH_PARSERS
def test_header_flood_is_cut_at_the_header_limit_while_others_are_served(live):
    """While three connections flood one header, health requests are served within 1 s plus ten times the
    slowest health request without the flood, measured just before: the bound grows with the machine's load."""
    without_flood = max(health_latency_s(live) for _ in range(10))
    stop, cut = threading.Event(), threading.Event()
    sent_per_connection: list[int] = []
    answers: list[bytes] = []

    def flood() -> None:
        chunk = b"x" * 65536
        while not stop.is_set():
            sock, sent = raw_connection(live), 0
            try:
                sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Flood: ")
                while sent < 120 << 20 and not stop.is_set():  # up to 120 MB of one header
                    sock.sendall(chunk)
                    sent += len(chunk)
            except OSError:
                answers.append(read_answer(sock))
                cut.set()
            finally:
                sent_per_connection.append(sent)
                sock.close()

    flooders = [threading.Thread(target=flood, daemon=True) for _ in range(3)]
    for t in flooders:
        t.start()
    try:
        assert cut.wait(60), "no flooding connection was cut"  # the flood is on and being cut
        latencies = [health_latency_s(live) for _ in range(10)]
    finally:
        stop.set()
        for t in flooders:
            t.join(10)
    assert max(latencies) < 1.0 + 10 * without_flood, (latencies, without_flood)
    assert len(sent_per_connection) >= 3
    # Each flooding connection was closed after a few socket buffers, far from its 120 MB.
    assert max(sent_per_connection) < 8 << 20, sent_per_connection
    # h11 answers 400 at h11_max_incomplete_event_size, httptools our 431 at max_header_bytes
    assert any(a.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")) for a in answers), answers[:3]


@BOTH_PARSERS
def test_a_complete_request_head_over_the_limit_is_431(live):
    """The cap counted only heads still incomplete after max_header_bytes: a complete 24 KiB head that
    arrived in one piece (or, over TLS, in two 16 KiB records) was parsed and served (200)."""
    def get_with_header(n_bytes: int) -> bytes:
        sock = raw_connection(live)
        try:
            sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: " + b"a" * n_bytes
                         + b"\r\n\r\n")
            return read_answer(sock)
        finally:
            sock.close()

    assert get_with_header(24 * 1024).startswith(b"HTTP/1.1 431")
    assert get_with_header(15 * 1024).startswith(b"HTTP/1.1 200")


@BOTH_PARSERS
def test_a_head_under_the_limit_is_served_whatever_body_follows_it(live):
    """A head just under the limit whose end straddles two chunks, followed in the second chunk by a
    body (JSON may hold line breaks) that takes the bytes received past the limit: only the head counts."""
    body = b"\r\n\r\n" * 2048 + json_body(live, client="bob")
    head = (f"POST /v1/rounds/{live['round'].id}/updates HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {live['tokens']['bob']}\r\nIdempotency-Key: padded\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
            f"X-Pad: {'a' * 15000}\r\n\r\n").encode()
    assert len(head) < LIMITS.max_header_bytes < len(head) + len(body)
    sock = raw_connection(live)
    try:
        sock.sendall(head[:-1])
        time.sleep(0.2)  # the head's last byte arrives with the body
        sock.sendall(head[-1:] + body)
        answer = read_answer(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 201"), answer[:300]


@BOTH_PARSERS
def test_slow_and_idle_headers_get_408_and_the_connection_closed(live):
    slow, idle = raw_connection(live), raw_connection(live)
    try:
        slow.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        start = time.monotonic()
        assert health_latency_s(live) < 1.0  # others are served meanwhile
        answer_slow, answer_idle = read_answer(slow), read_answer(idle)
        waited = time.monotonic() - start
    finally:
        slow.close()
        idle.close()
    assert answer_slow.startswith(b"HTTP/1.1 408") and answer_idle.startswith(b"HTTP/1.1 408")
    assert LIMITS.header_timeout_s - 0.3 < waited < LIMITS.header_timeout_s + 3.0


@BOTH_PARSERS
def test_slow_body_gets_408_and_nothing_is_stored(live):
    before = live["store"].count_updates()
    body = json_body(live, client="carol")
    sock = raw_connection(live)
    try:
        sock.sendall((f"POST /v1/rounds/{live['round'].id}/updates HTTP/1.1\r\nHost: x\r\n"
                      f"Authorization: Bearer {live['tokens']['carol']}\r\nIdempotency-Key: slow\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body[:100])
        assert health_latency_s(live) < 1.0
        answer = read_answer(sock)  # the rest of the body never comes
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"connection: close" in answer.lower() and b"not received within" in answer
    assert live["store"].count_updates() == before


@BOTH_PARSERS
def test_disconnect_mid_body_is_quiet_and_the_server_keeps_serving(live, caplog):
    caplog.set_level(logging.INFO)
    body = json_body(live, client="dave")
    sock = raw_connection(live)
    sock.sendall((f"POST /v1/rounds/{live['round'].id}/updates HTTP/1.1\r\nHost: x\r\n"
                  f"Authorization: Bearer {live['tokens']['dave']}\r\nIdempotency-Key: gone\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body[:500])
    time.sleep(0.1)
    sock.close()
    time.sleep(0.3)
    assert health_latency_s(live) < 1.0
    answer = post(live, body, client="dave", key="after")  # the same upload, complete, is stored
    assert answer.status_code == 201, answer.text
    text = caplog.text
    assert "client disconnected during POST" in text
    assert "Traceback" not in text and "Exception in ASGI application" not in text


@BOTH_PARSERS
def test_too_many_headers_is_431(live):
    headers = {f"X-H{i}": "1" for i in range(LIMITS.max_headers + 1)}
    assert httpx.get(f"{live['url']}/v1/health", headers=headers, timeout=10).status_code == 431
    assert httpx.get(f"{live['url']}/v1/health", timeout=10).status_code == 200


def _set(rows, value, i=0, j=0):
    rows[i][j] = value
    return rows


#: A bad value per field (applied to a valid JSON body) and the field the 422 must name first.
BAD_FIELDS = {
    "client_id": lambda b: {**b, "client_id": ""},
    "round_id": lambda b: {**b, "round_id": "1"},
    "kind": lambda b: {**b, "kind": 5},
    "centroids_hash": lambda b: {**b, "centroids_hash": "abc"},
    "models": lambda b: {**b, "models": list(reversed(b["models"]))},
    "log_size": lambda b: {**b, "log_size": -1},
    "count": lambda b: {**b, "count": _set(b["count"], -5)},
    "sum_accuracy": lambda b: {**b, "sum_accuracy": _set(b["sum_accuracy"], 2.5)},  # count is 2
    "sum_cost": lambda b: {**b, "sum_cost": _set(b["sum_cost"], -0.01)},
    "centroid_cells": lambda b: {**b, "centroid_cells": [10**6]},
    "local_centroids": lambda b: {**b, "local_centroids": _set(b["local_centroids"], 1.5)},
    "local_weights": lambda b: {**b, "local_weights": [2.5]},
}


@pytest.mark.parametrize("field", sorted(BAD_FIELDS))
def test_each_422_names_the_first_offending_field(live, field):
    base = json.loads(json_body(live, client="bob"))
    body = BAD_FIELDS[field](base)
    answer = post(live, json.dumps(body).encode(), client="bob", key=f"bad-{field}")
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"].startswith(f"{field}:"), answer.json()["detail"]
    # The same body as MessagePack names the same field.
    answer = post(live, msgpack.packb(body), client="bob", key=f"bad-mp-{field}", media="application/msgpack")
    assert answer.status_code == 422 and answer.json()["detail"].startswith(f"{field}:"), answer.text


def test_negative_count_names_count_not_the_cost_bound(live):
    body = json.loads(json_body(live, client="bob"))
    body["count"][0][0] = -5  # before the fix: "sum_cost is above 1000 USD per query"
    answer = post(live, json.dumps(body).encode(), client="bob", key="neg")
    assert answer.status_code == 422
    assert answer.json()["detail"].split(":")[0] == "count"


def test_msgpack_and_json_bodies_of_one_update_store_identical_rows(live):
    r = live["round"]
    update = an_update(r, scale=3)
    update = KMeansUpdate(update.statistics, update.centroid_cells,
                          update.local_centroids + 1e-9,  # not a float32 value: both store its float32 rounding
                          update.local_weights, update.log_size)
    first = post(live, encode_kmeans_update(update, "alice", spec_of(r)), client="alice", key="same-json")
    second = post(live, encode_kmeans_update_msgpack(update, "bob", spec_of(r)), client="bob", key="same-mp",
                  media="application/msgpack")
    assert (first.status_code, second.status_code) == (201, 201), (first.text, second.text)
    columns = [updates.c.client_id, updates.c.sent_round, updates.c.counted_round, updates.c.late, updates.c.base_hash,
               updates.c.log_size, updates.c.payload]
    with live["store"].engine.connect() as conn:
        rows = {row.client_id: row for row in conn.execute(sa.select(*columns).where(
            updates.c.id.in_([first.json()["update_id"], second.json()["update_id"]])))}
    a, b = rows["alice"], rows["bob"]
    assert a[1:] == b[1:]  # every column but the client: the stored update bytes are identical
    assert first.json() == {**second.json(), "update_id": first.json()["update_id"], "client_id": "alice"}


def test_a_token_revoked_by_the_cli_in_another_process_is_refused_on_the_next_upload(live):
    r = live["round"]
    token = live["store"].add_client("eve")
    live["tokens"]["eve"] = token
    ok = post(live, encode_kmeans_update_msgpack(an_update(r), "eve", spec_of(r)), client="eve", key="e1",
              media="application/msgpack")
    assert ok.status_code == 201  # the token is now cached
    run_cli("clients", "revoke", "eve", "--db", live["db_url"])  # another process, same database
    before = live["store"].count_updates()
    refused = post(live, encode_kmeans_update_msgpack(an_update(r, 2), "eve", spec_of(r)), client="eve", key="e2",
                   media="application/msgpack")
    assert refused.status_code == 401, refused.text
    assert live["store"].count_updates() == before
    # Rotated back to a new token: the new one works, the revoked one stays refused.
    new = run_cli("clients", "rotate", "eve", "--db", live["db_url"]).strip()
    live["tokens"]["eve"] = new
    assert post(live, encode_kmeans_update_msgpack(an_update(r, 2), "eve", spec_of(r)), client="eve", key="e3",
                media="application/msgpack").status_code == 201
    assert post(live, encode_kmeans_update_msgpack(an_update(r, 2), "eve", spec_of(r)), key="e4", token=token,
                media="application/msgpack").status_code == 401


def test_upload_quota_answers_429_with_retry_after(live):
    live["quota"].uploads = 3
    try:
        answers = [post(live, json_body(live, client="quota", scale=1 + i), client="quota", key=f"q{i}").status_code
                   for i in range(3)]
        over = post(live, json_body(live, client="quota", scale=9), client="quota", key="q9")
        other = post(live, json_body(live, client="carol", scale=7), client="carol", key="c7")
    finally:
        live["quota"].uploads = 1000
    assert answers == [201, 201, 201]
    assert over.status_code == 429, over.text
    assert 1 <= int(over.headers["retry-after"]) <= 60 and "quota of 3 uploads per 60 s" in over.json()["detail"]
    assert other.status_code == 201  # per client


def test_quota_window_slides():
    now = [100.0]
    quota = UploadQuota(2, 10.0, clock=lambda: now[0])
    assert quota.take("a") is None
    now[0] = 104.0
    assert quota.take("a") is None
    now[0] = 105.5
    assert quota.take("a") == 5  # the first request leaves the window at 110.0: 4.5 s, rounded up
    assert quota.take("b") is None  # per client
    now[0] = 110.0
    assert quota.take("a") is None  # 100.0 has left the window
    assert quota.take("a") == 4  # 104.0 leaves at 114.0
    assert UploadQuota(0, 1.0).take("a") is None  # 0 disables it
