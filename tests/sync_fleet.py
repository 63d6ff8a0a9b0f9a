"""A synthetic device fleet against the real aggregation server, and the checks after a ``kill -9``.

Shared by ``benchmarks/sync_load.py`` (the load benchmark) and ``tests/test_sync_crash.py`` (the
same crash scenario at small scale). Everything is real except the devices' logs:

- :func:`deploy` lays out a deployment in a folder: a ``trustme`` CA and server certificate, a
  SQLite database, clients created with the real CLI (``python -m trainer.cli clients add``, the
  ``fedroute`` console script's module, run by this interpreter) and a K-means round opened through
  :func:`trainer.server.kmeans_rounds.open_round_from_bundle` over ``n_cells`` centroids that are unit
  vectors drawn from a fixed seed in the bundle's embedding space (:func:`unit_centroids`), with a
  quorum above the number of clients and a one-hour deadline, so the round stays open under load,
  and without publishing (public key only).
- :class:`ServerProcess` runs ``fedroute serve`` (TLS, 127.0.0.1) as a child process that can be
  killed with SIGKILL and restarted on the same database and port.
- :func:`synthetic_uploads` builds each device's upload bodies with the SDK's own code
  (:func:`sdk.local_update.kmeans_update` on a synthetic :class:`sdk.Evaluations`, then
  :func:`sdk.protocol.encode_kmeans_update_msgpack`, the bytes :class:`sdk.sync.SyncClient` sends, and
  :func:`sdk.protocol.encode_kmeans_update`, its JSON encoding), so they
  pass the server's validation: whole counts, entries below ``min_count`` zeroed, mean embeddings of
  unit vectors over at least ``max(min_count, 2)`` queries.
- :class:`Fleet` runs concurrent clients (asyncio, one ``httpx.AsyncClient`` and TLS connection
  per device) that upload back to back for a bounded time, each upload with a fresh
  ``Idempotency-Key``; a connection error or 5xx is retried with the *same* key and body (as
  :class:`sdk.sync.SyncClient` does) until acknowledged; every receipt is recorded (:class:`Ack`).
- :func:`check_recovery` then compares the acknowledged receipts with the store, re-sends each
  device's last acknowledged upload, closes the round with ``fedroute rounds close`` and compares the
  aggregate with the sum of each device's latest acknowledged counts (:class:`RecoveryCheck`).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from sdk.eval_log import Evaluations
from sdk.local_update import KMeansUpdate, RoundSpec, hold_small_changes, kmeans_update
from sdk.protocol import JSON_MEDIA_TYPE, MSGPACK_MEDIA_TYPE, encode_kmeans_update, encode_kmeans_update_msgpack

CLI = (sys.executable, "-m", "trainer.cli")


def run_cli(*args: str) -> str:
    """stdout of ``fedroute ARGS`` (run as ``python -m trainer.cli`` by this interpreter).

    Raises
    ------
    RuntimeError
        The command failed; the message holds its stderr.
    """
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"fedroute {' '.join(args[:2])} exited {done.returncode}: {done.stderr.strip()[-800:]}")
    return done.stdout


def unit_centroids(n_cells: int, d_emb: int, seed: int) -> np.ndarray:
    """``n_cells`` random unit vectors: ndarray of shape (n_cells, d_emb), float32 (fixed ``seed``)."""
    c = np.random.default_rng(seed).standard_normal((n_cells, d_emb))
    return (c / np.linalg.norm(c, axis=1, keepdims=True)).astype(np.float32)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- deployment ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    """A server's files in ``work``: database URL, TLS files, client tokens and the open round.

    tokens : client id -> bearer token, in creation order.
    """

    work: Path
    db_url: str
    ca_pem: Path
    server_pem: Path
    tokens: dict[str, str]
    round_id: int
    n_cells: int
    models: tuple[str, ...]
    d_emb: int
    min_count: int


def write_tls_files(work: Path) -> tuple[Path, Path]:
    """A local CA (``trustme``) and a certificate for 127.0.0.1 / localhost in ``work``: returns
    ``(server.pem, ca.pem)``, the first holding the server's key and certificate chain."""
    import trustme

    ca = trustme.CA()
    server_pem, ca_pem = Path(work) / "server.pem", Path(work) / "ca.pem"
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(str(server_pem))
    ca.cert_pem.write_to_path(str(ca_pem))
    return server_pem, ca_pem


def deploy(work: Path, bundle: Path, public_key, *, n_clients: int, n_cells: int = 32, min_count: int = 2,
           seed: int = 0, cli_jobs: int = 4) -> Deployment:
    """Certificates, database, ``n_clients`` clients (``fedroute clients add``, ``cli_jobs`` at a
    time) and an open K-means round over :func:`unit_centroids` ``(n_cells, seed)`` in ``work``.

    Parameters
    ----------
    work : empty or new folder.
    bundle : a signed K-means bundle (``fedroute export``); the round takes its models and embedder.
    public_key : the key that verifies ``bundle`` (path or key); the round does not publish.
    n_clients : devices to create (ids ``dev000``, ``dev001``, ...).
    n_cells : cells of the round's partition.
    min_count : the round's privacy threshold.

    Raises
    ------
    RuntimeError
        A CLI call failed.
    """
    from trainer.federated.kmeans_aggregation import AggregationConfig
    from trainer.server.kmeans_rounds import open_round_from_bundle
    from trainer.server.round_kind import round_settings
    from trainer.server.store import Store

    work = Path(work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    server_pem, ca_pem = write_tls_files(work)
    db_url = f"sqlite:///{work / 'fed.db'}"
    store = Store(db_url)  # creates the schema once, before CLI processes race to create it
    try:
        ids = [f"dev{i:03d}" for i in range(n_clients)]
        with ThreadPoolExecutor(max(1, cli_jobs)) as pool:
            tokens = list(pool.map(lambda c: run_cli("clients", "add", c, "--db", db_url).strip(), ids))
        from sdk.bundle_manifest import read_verified

        dim = int(read_verified(bundle, public_key, wanted=()).manifest["embedder"]["dim"])
        r = open_round_from_bundle(store, Path(bundle), public_key, deadline_s=3600.0, quorum=n_clients + 1,
                                   min_count=min_count, settings=round_settings(aggregation=AggregationConfig()),
                                   centroids=unit_centroids(n_cells, dim, seed))
    finally:
        store.close()
    return Deployment(work, db_url, ca_pem, server_pem, dict(zip(ids, tokens)), r.id, n_cells, r.models, dim,
                      min_count)


def ssl_context(deployment: Deployment) -> ssl.SSLContext:
    """A client TLS context that trusts the deployment's CA only."""
    return ssl.create_default_context(cafile=str(deployment.ca_pem))


# -- the server process --------------------------------------------------------------------------


class ServerProcess:
    """``fedroute serve`` as a child process on ``127.0.0.1:port`` over TLS (``server_pem`` holds the
    key and certificate chain, ``ca_pem`` the CA that clients trust), serving the bundle at
    ``bundle_dir`` if given.

    Its output is appended to ``work/server.log`` across restarts. :meth:`start` again after
    :meth:`kill9` restarts it on the same database and port.
    """

    #: What the process is called in error messages.
    name = "server"

    def __init__(self, work: Path, db_url: str, server_pem: Path, ca_pem: Path, *, bundle_dir: Path | None = None,
                 port: int | None = None, tick_s: float = 1.0) -> None:
        self.work, self.db_url, self.server_pem, self.ca_pem = Path(work), db_url, Path(server_pem), Path(ca_pem)
        self.bundle_dir = bundle_dir
        self.port = free_port() if port is None else int(port)
        self.tick_s = tick_s
        self.extra_args = tuple(os.environ.get("FEDROUTE_SERVE_ARGS", "").split())  # e.g. "--http-parser httptools"
        self.log_path = self.work / "server.log"
        self.process: subprocess.Popen | None = None
        self.starts = 0

    @classmethod
    def for_deployment(cls, deployment: Deployment, **kwargs) -> ServerProcess:
        """The server of a :func:`deploy` ment."""
        d = deployment
        return cls(d.work, d.db_url, d.server_pem, d.ca_pem, **kwargs)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> ServerProcess:
        """Start the server and return once ``/v1/health`` answers over TLS.

        Raises
        ------
        RuntimeError
            The process exited or did not answer within ``timeout_s``; the message holds its log tail.
        """
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"server pid {self.process.pid} is still running")
        extra = [] if self.bundle_dir is None else ["--bundle-dir", str(self.bundle_dir)]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [*CLI, "serve", "--db", self.db_url, "--tls-cert", str(self.server_pem), "--tls-key",
                 str(self.server_pem), "--host", "127.0.0.1", "--port", str(self.port), "--tick-s", str(self.tick_s),
                 "--upload-quota", "0", *extra, *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.starts += 1
        return self.wait_healthy(ssl.create_default_context(cafile=str(self.ca_pem)), timeout_s)

    def wait_healthy(self, verify, timeout_s: float):
        """Poll ``GET /v1/health`` every 50 ms until it answers 200 (returns ``self``); ``verify`` is
        httpx's (an ``ssl.SSLContext``, or anything for plain HTTP).

        Raises
        ------
        RuntimeError
            The process exited, or no 200 within ``timeout_s`` (the process is then stopped); the
            message holds its log tail.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.process.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/v1/health", verify=verify, timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass  # not listening yet: poll again
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer /v1/health within {timeout_s} s: {self.log_tail()}")

    def kill9(self) -> None:
        """SIGKILL the server (no shutdown code runs) and reap it."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (graceful shutdown), SIGKILL after ``timeout_s``; no-op if not running."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill9()

    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds of the running process (Linux ``/proc``), else None."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, AttributeError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def main_thread_cpu_seconds(self) -> float | None:
        """User + system CPU seconds of the running process's main thread (the thread id equal to
        the process id: uvicorn's event loop, which runs HTTP, TLS and the app's checks; the other
        threads are the store's group-commit writer and the thread pool), else None."""
        pid = self.process.pid if self.process is not None else None
        try:
            fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, AttributeError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log_tail(self, n_chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return "(no log)"


def fetch_round(server_url: str, deployment: Deployment, client_id: str) -> RoundSpec:
    """``GET /v1/rounds/current`` as ``client_id``, parsed as the SDK does.

    Raises
    ------
    RuntimeError
        No round is open (204) or the request failed.
    """
    answer = httpx.get(f"{server_url}/v1/rounds/current", verify=ssl_context(deployment), timeout=30.0,
                       headers={"Authorization": f"Bearer {deployment.tokens[client_id]}"})
    if answer.status_code != 200:
        raise RuntimeError(f"GET /v1/rounds/current answered {answer.status_code}")
    return RoundSpec.from_json(answer.json())


# -- synthetic uploads ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticUpload:
    """One upload's bodies and what they hold.

    body : bytes, the JSON body (``KMeansUpdate.to_payload``, compact).
    update : the KMeansUpdate it encodes; ``update.statistics.count`` of shape (n_cells, n_models).
    msgpack_body : bytes, the MessagePack body of the same update (what ``SyncClient`` sends).
    """

    body: bytes
    update: KMeansUpdate
    msgpack_body: bytes = b""

    def encoded(self, wire_format: str) -> tuple[bytes, str]:
        """(body, Content-Type) in ``wire_format``: ``"json"`` or ``"msgpack"``."""
        return (self.msgpack_body, MSGPACK_MEDIA_TYPE) if wire_format == "msgpack" else (self.body, JSON_MEDIA_TYPE)


def synthetic_log(rng: np.random.Generator, spec: RoundSpec, n_queries: int, spread: float = 0.5) -> Evaluations:
    """A device's synthetic evaluation log for ``spec``: ``n_queries`` rows, each a unit embedding
    near one centroid (a per-device Dirichlet(0.5) mix over cells, so devices are non-IID), a
    uniformly drawn model, a 0/1 score and a log-normal cost (USD, median about $0.0009)."""
    k, d = spec.centroids.shape
    cells = rng.choice(k, n_queries, p=rng.dirichlet(np.full(k, 0.5)))
    emb = spec.centroids[cells].astype(np.float64) + rng.standard_normal((n_queries, d)) * (spread / np.sqrt(d))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    models = rng.integers(0, len(spec.models), n_queries)
    accuracy = rng.uniform(0.3, 0.9, len(spec.models))
    n = n_queries
    return Evaluations(
        id=np.arange(1, n + 1), timestamp=np.zeros(n), model=tuple(spec.models[m] for m in models),
        score=(rng.random(n) < accuracy[models]).astype(np.float64), cost_usd=rng.lognormal(-7.0, 1.0, n),
        latency_ms=np.full(n, np.nan), cell=np.full(n, -1), embedding=emb.astype(np.float32),
        bundle_version=np.full(n, -1), query=(None,) * n)


def synthetic_uploads(spec: RoundSpec, client_id: str, rng: np.random.Generator, *, n_variants: int = 3,
                      log_sizes: tuple[int, int] = (500, 2000)) -> list[SyntheticUpload]:
    """``n_variants`` uploads of one device for ``spec``: its log (size drawn in ``log_sizes``)
    read at growing lengths, as a device whose log grows between syncs. Later variants hold back
    changes below the privacy threshold relative to the first (:func:`sdk.local_update.hold_small_changes`,
    as a device does), and :class:`Fleet` alternates the first with the others, so every upload
    passes the server's check against the device's previous one."""
    size = int(rng.integers(log_sizes[0], log_sizes[1] + 1))
    log = synthetic_log(rng, spec, size)
    uploads = []
    for v in range(1, n_variants + 1):
        n = size * v // n_variants
        part = Evaluations(log.id[:n], log.timestamp[:n], log.model[:n], log.score[:n], log.cost_usd[:n],
                           log.latency_ms[:n], log.cell[:n], log.embedding[:n], log.bundle_version[:n], log.query[:n])
        update = kmeans_update(part, spec)
        if uploads:
            update = hold_small_changes(update, uploads[0].update, spec.min_count)
        body = encode_kmeans_update(update, client_id, spec)
        uploads.append(SyntheticUpload(body, update, encode_kmeans_update_msgpack(update, client_id, spec)))
    return uploads


# -- the fleet -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ack:
    """A receipt a device got. Times in seconds from the load's start (monotonic clock).

    upload : index of the body in the device's uploads; wire_format : the encoding sent. status : 201
    (stored) or 200 (a retry of a stored key). attempts : requests sent for it (> 1: retried). latency_s : of the answered
    request; total_s : from the first attempt, retries and backoff included.
    """

    client_id: str
    key: str
    update_id: int
    upload: int
    status: int
    attempts: int
    sent_s: float
    acked_s: float
    latency_s: float
    total_s: float
    wire_format: str = "msgpack"


@dataclass
class LoadResult:
    """Everything a load run saw. ``errors``: failed attempts by kind (retried);
    ``rejected``: 4xx answers by status (not retried; ``rejected_details`` keeps a few)."""

    duration_s: float
    n_clients: int
    acks: list[Ack] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)
    rejected_details: list[str] = field(default_factory=list)
    gave_up: int = 0
    ended_s: float = 0.0

    def accepted_per_s(self, warmup_s: float = 0.0) -> float:
        """Uploads stored (201) per second of load, counting those acknowledged after ``warmup_s``."""
        n = sum(1 for a in self.acks if a.status == 201 and warmup_s <= a.acked_s <= self.duration_s)
        return n / max(self.duration_s - warmup_s, 1e-9)

    def latency_ms(self, warmup_s: float = 0.0, total: bool = False) -> dict:
        """p50, p99, max (ms) of the answered requests (``total``: with retries) after ``warmup_s``."""
        ms = np.array([(a.total_s if total else a.latency_s) * 1e3 for a in self.acks if a.acked_s >= warmup_s])
        if ms.size == 0:
            return {"p50_ms": None, "p99_ms": None, "max_ms": None, "n": 0}
        return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                "max_ms": float(ms.max()), "n": int(ms.size)}


class Fleet:
    """Concurrent devices uploading to the server at ``server_url``.

    Parameters
    ----------
    server_url : ``https://127.0.0.1:PORT``.
    deployment : its tokens and CA.
    uploads : client id -> the device's bodies, sent in turn (each time with a fresh key).
    timeout_s : seconds per request phase (httpx).
    backoff_s, max_backoff_s : first and largest wait before a retry (doubling, with jitter).
    retry_grace_s : how long after the load ends an unacknowledged upload is still retried.
    wire_format : ``"msgpack"`` (as ``SyncClient`` sends) or ``"json"``; settable between runs.
    """

    def __init__(self, server_url: str, deployment: Deployment, uploads: dict[str, list[SyntheticUpload]], *,
                 timeout_s: float = 60.0, backoff_s: float = 0.05, max_backoff_s: float = 1.0,
                 retry_grace_s: float = 60.0, seed: int = 0, wire_format: str = "msgpack") -> None:
        self.wire_format = wire_format
        self.server_url = server_url
        self.deployment = deployment
        self.uploads = uploads
        self.timeout_s, self.backoff_s, self.max_backoff_s = timeout_s, backoff_s, max_backoff_s
        self.retry_grace_s = retry_grace_s
        self._random = random.Random(seed)
        self.tls = ssl_context(deployment)

    async def run(self, duration_s: float, clients: list[str], *, t0: float | None = None,
                  on_ack: Callable[[Ack], None] | None = None) -> LoadResult:
        """Upload back to back from each of ``clients`` for ``duration_s`` seconds (counted from
        ``t0``, a ``time.monotonic()`` value, default now); uploads in flight at the end are
        finished (retried if need be) before this returns."""
        t0 = time.monotonic() if t0 is None else t0
        result = LoadResult(duration_s=duration_s, n_clients=len(clients))
        await asyncio.gather(*(self._device(c, t0, result, on_ack) for c in clients))
        result.ended_s = time.monotonic() - t0
        return result

    async def _device(self, client_id: str, t0: float, result: LoadResult, on_ack) -> None:
        bodies = self.uploads[client_id]
        headers = {"Authorization": f"Bearer {self.deployment.tokens[client_id]}"}
        async with httpx.AsyncClient(base_url=self.server_url, headers=headers, verify=self.tls,
                                     timeout=self.timeout_s) as http:
            i = 0
            while time.monotonic() - t0 < result.duration_s:
                key = f"{client_id}.{uuid.uuid4().hex}"
                index = 0 if i % 2 == 0 or len(bodies) == 1 else 1 + (i // 2) % (len(bodies) - 1)
                ack = await self.send(http, client_id, key, index, t0, result)
                if ack is not None and on_ack is not None:
                    on_ack(ack)
                i += 1

    async def send(self, http: httpx.AsyncClient, client_id: str, key: str, index: int, t0: float,
                   result: LoadResult) -> Ack | None:
        """POST one upload; retry connection errors and 5xx with the same key and body until
        acknowledged or ``retry_grace_s`` after the load; None if rejected (4xx) or given up."""
        path = f"/v1/rounds/{self.deployment.round_id}/updates"
        body, media = self.uploads[client_id][index].encoded(self.wire_format)
        headers = {"Idempotency-Key": key, "Content-Type": media}
        first = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            start = time.monotonic()
            try:
                answer = await http.post(path, content=body, headers=headers)
            except httpx.TransportError as exc:
                result.errors[type(exc).__name__] += 1
            else:
                now = time.monotonic()
                if answer.status_code in (200, 201):
                    ack = Ack(client_id, key, int(answer.json()["update_id"]), index, answer.status_code, attempt,
                              first - t0, now - t0, now - start, now - first, self.wire_format)
                    result.acks.append(ack)
                    return ack
                if answer.status_code < 500:
                    result.rejected[answer.status_code] += 1
                    if len(result.rejected_details) < 5:
                        result.rejected_details.append(f"{answer.status_code} {answer.text[:300]}")
                    return None
                result.errors[f"http_{answer.status_code}"] += 1
            if time.monotonic() - t0 > result.duration_s + self.retry_grace_s:
                result.gave_up += 1
                return None
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
            await asyncio.sleep(delay * (0.5 + self._random.random() / 2))


async def run_with_kill(fleet: Fleet, server: ServerProcess, duration_s: float, kill_at_s: float,
                        clients: list[str], on_ack: Callable[[Ack], None] | None = None) -> tuple[LoadResult, dict]:
    """Run the fleet for ``duration_s``; at ``kill_at_s`` SIGKILL the server and restart it on the
    same database and port while the devices keep retrying. Returns the load and the crash's times
    (seconds from the load's start): ``kill_s``, ``ready_s`` (restarted server answers health),
    ``first_ack_after_s`` (first receipt after the kill)."""
    t0 = time.monotonic()
    task = asyncio.create_task(fleet.run(duration_s, clients, t0=t0, on_ack=on_ack))
    await asyncio.sleep(kill_at_s)
    if task.done():
        await task
        raise RuntimeError("the load ended before the kill")
    kill_s = time.monotonic() - t0
    server.kill9()
    await asyncio.to_thread(server.start)  # the devices keep retrying meanwhile
    ready_s = time.monotonic() - t0
    result = await task
    after = [a.acked_s for a in result.acks if a.acked_s > kill_s]  # from the restarted process
    return result, {"kill_s": kill_s, "ready_s": ready_s, "first_ack_after_s": min(after) if after else None}


# -- checks after the crash ----------------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryCheck:
    """What the store and the closed round say about the receipts the devices hold.

    acknowledged : distinct (client, key) acknowledged.
    acknowledged_missing : acknowledged update ids absent from the store (must be 0).
    receipt_mismatch : acknowledged keys whose stored row has another id than the receipt (must be 0).
    duplicate_keys : (client, key) pairs stored more than once (must be 0).
    stored_unacknowledged : stored rows that no device holds a receipt for (0 unless a device gave up).
    retried : acknowledged uploads that needed more than one request.
    retried_already_stored : of those, answered 200: stored before the kill, receipt lost with it.
    replayed, replay_mismatch : each device's last acknowledged upload re-sent with its key; answers
        that were not 200 with the same update id, or that added a row (must be 0).
    expected_total_count : sum of the counts of each device's latest acknowledged upload.
    aggregated_total_count : ``total_count`` of the round's outcome; count_matrix_equal : the
        aggregate's (n_cells, n_models) counts equal the sum of those uploads' counts exactly.
    outcome : the JSON printed by ``fedroute rounds close``.
    """

    acknowledged: int
    acknowledged_missing: int
    receipt_mismatch: int
    duplicate_keys: int
    stored_unacknowledged: int
    retried: int
    retried_already_stored: int
    replayed: int
    replay_mismatch: int
    expected_total_count: float
    aggregated_total_count: float | None
    count_matrix_equal: bool
    outcome: dict

    def to_json(self) -> dict:
        return asdict(self)


def stored_keys(db_url: str) -> tuple[set[int], dict[tuple[str, str], list[int]]]:
    """The store's update ids (``Store.update_ids``) and (client, key) -> stored ids."""
    import sqlalchemy as sa

    from trainer.server.store import Store, updates

    store = Store(db_url)
    try:
        ids = store.update_ids()
        with store.engine.connect() as conn:
            rows = conn.execute(sa.select(updates.c.client_id, updates.c.idempotency_key, updates.c.id)).all()
    finally:
        store.close()
    by_key: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        by_key.setdefault((r.client_id, r.idempotency_key), []).append(int(r.id))
    return ids, by_key


async def replay_last(fleet: Fleet, acks: list[Ack]) -> tuple[int, int]:
    """Re-send each device's last acknowledged upload (same key, same body); returns (replayed,
    mismatches): answers other than 200 with the receipt's update id."""
    mismatch = 0
    last = latest_acks(acks)
    for ack in last.values():
        body, media = fleet.uploads[ack.client_id][ack.upload].encoded(ack.wire_format)
        headers = {"Authorization": f"Bearer {fleet.deployment.tokens[ack.client_id]}",
                   "Idempotency-Key": ack.key, "Content-Type": media}
        async with httpx.AsyncClient(base_url=fleet.server_url, verify=fleet.tls, timeout=fleet.timeout_s) as http:
            answer = await http.post(f"/v1/rounds/{fleet.deployment.round_id}/updates", headers=headers,
                                     content=body)
        if answer.status_code != 200 or answer.json().get("update_id") != ack.update_id:
            mismatch += 1
    return len(last), mismatch


def latest_acks(acks: list[Ack]) -> dict[str, Ack]:
    """Client id -> its acknowledged upload with the highest update id."""
    latest: dict[str, Ack] = {}
    for a in acks:
        if a.client_id not in latest or a.update_id > latest[a.client_id].update_id:
            latest[a.client_id] = a
    return latest


def expected_counts(acks: list[Ack], uploads: dict[str, list[SyntheticUpload]], shape: tuple[int, int]) -> np.ndarray:
    """Sum over devices of the counts of each one's latest acknowledged upload (highest update id,
    the one the round aggregates): ndarray of shape (n_cells, n_models), float64."""
    total = np.zeros(shape)
    for a in latest_acks(acks).values():
        total += uploads[a.client_id][a.upload].update.statistics.count
    return total


def check_recovery(fleet: Fleet, acks: list[Ack]) -> RecoveryCheck:
    """Compare ``acks`` (all receipts of the run, every phase) with the store, replay each
    device's last upload, then close the round with ``fedroute rounds close`` (the server may be
    running) and compare its aggregate with :func:`expected_counts`. Call it outside an event loop."""
    from trainer.server.store import Store

    d = fleet.deployment
    ids, by_key = stored_keys(d.db_url)
    acked: dict[tuple[str, str], set[int]] = {}
    for a in acks:
        acked.setdefault((a.client_id, a.key), set()).add(a.update_id)
    acked_ids = {i for s in acked.values() for i in s}
    mismatch = sum(1 for k, s in acked.items() if len(s) != 1 or by_key.get(k, [None]) != [next(iter(s))])
    replayed, replay_mismatch = asyncio.run(replay_last(fleet, acks))
    ids_after, _ = stored_keys(d.db_url)
    replay_mismatch += len(ids_after - ids)
    outcome = json.loads(run_cli("rounds", "close", "--db", d.db_url, "--round", str(d.round_id)).strip().splitlines()[-1])
    store = Store(d.db_url)
    try:
        aggregate = store.aggregate_of(d.round_id)
    finally:
        store.close()
    expected = expected_counts(acks, fleet.uploads, (d.n_cells, len(d.models)))
    retried = [a for a in acks if a.attempts > 1]
    return RecoveryCheck(
        acknowledged=len(acked), acknowledged_missing=len(acked_ids - ids), receipt_mismatch=mismatch,
        duplicate_keys=sum(1 for v in by_key.values() if len(v) > 1),
        stored_unacknowledged=len(ids - acked_ids), retried=len(retried),
        retried_already_stored=sum(1 for a in retried if a.status == 200), replayed=replayed,
        replay_mismatch=replay_mismatch, expected_total_count=float(expected.sum()),
        aggregated_total_count=outcome.get("total_count"),
        count_matrix_equal=aggregate is not None and np.array_equal(aggregate["count"], expected),
        outcome=outcome)
