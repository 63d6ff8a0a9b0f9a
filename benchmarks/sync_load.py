"""Sync server load benchmark (METRICS.md): uploads/s, server CPU per upload and latency under >= 32 devices, and ``kill -9``.

Loopback only, bounded in time (about a minute with the defaults). In a fresh folder
(:func:`sync_fleet.deploy`): a trustme CA and server certificate, a SQLite database, ``--clients``
devices created with ``fedroute clients add``, and one K-means round of ``--n-cells`` cells over the
bundle's models (11 for RouterBench) whose centroids are unit vectors drawn from ``--seed`` in the
bundle's embedding space; its quorum is above the number of devices, so it stays open throughout.
``fedroute serve`` runs as a child process (TLS, 127.0.0.1, a free port). Each device uploads
synthetic statistics built with the SDK's own ``kmeans_update`` (MessagePack, as ``SyncClient`` sends
them, or JSON), back to back, a fresh ``Idempotency-Key`` per upload, retrying connection errors and 5xx
with the same key and body. Runs, in one process:

1. baseline: raw SQLite ``INSERT`` + ``COMMIT`` (WAL, ``synchronous=FULL``, one thread, no HTTP) of a
   row as large as the server stores per upload, for ``--baseline-s``;
2. baseline: 1 device over HTTPS (MessagePack) for ``--single-s``;
3. load, JSON bodies (the baseline encoding): ``--clients`` devices for ``--duration-s`` (the first
   ``--warmup-s`` not counted);
4. load, MessagePack bodies: the same. For 3 and 4 the server's CPU time (user + system of the
   server process, ``/proc/<pid>/stat``) over the run is divided by the uploads it stored (201);
5. floor: the same devices and MessagePack bodies for ``--floor-s`` against a bare ASGI app served
   as ``fedroute serve`` serves (``benchmarks/http_floor_app.py``: same uvicorn parser, limits and
   TLS; it reads each body and answers 201), then against it over plain HTTP: the server CPU per
   request that HTTP + TLS alone cost, and TLS's share;
6. crash: ``--clients`` devices (MessagePack) for ``--crash-duration-s``; at ``--kill-at-s`` the server gets SIGKILL
   and is restarted on the same database and port while the devices retry. Then every receipt any
   device got (all runs) is checked against the store (0 acknowledged uploads may be missing, each
   (device, key) is stored once), each device's last upload is re-sent (must answer the same
   receipt), the round is closed with ``fedroute rounds close`` and its aggregate compared with the
   sum of each device's latest acknowledged counts.

    python benchmarks/sync_load.py --bundle bundles/kmeans --public-key keys/signing.pub

Writes ``sync_load.json``, ``sync_load.md`` and ``sync_load.png`` under ``--out``; exits 1 if a check
of the crash run fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# The synthetic fleet is test support (tests/sync_fleet.py), shared with tests/test_sync_crash.py:
# put that folder on the path when run as a script (``python benchmarks/sync_load.py``).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sdk.http_limits import HttpLimits  # noqa: E402
from trainer.server.store import SQLITE_PAGE_BYTES  # noqa: E402
from sync_fleet import (  # noqa: E402
    Fleet,
    ServerProcess,
    check_recovery,
    deploy,
    fetch_round,
    run_with_kill,
    synthetic_uploads,
)


def raw_sqlite_inserts(path: Path, row_bytes: bytes, seconds: float) -> dict:
    """Durable single-row inserts per second into a fresh SQLite file with the server's settings
    (WAL, ``synchronous=FULL``, ``BEGIN IMMEDIATE``, the page size of a new store), one thread;
    p50/p99 per insert in ms."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(f"PRAGMA page_size={SQLITE_PAGE_BYTES}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("CREATE TABLE rows (id INTEGER PRIMARY KEY, key TEXT UNIQUE NOT NULL, payload BLOB NOT NULL)")
        samples = []
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            t = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO rows (key, payload) VALUES (?, ?)", (f"k{len(samples)}", row_bytes))
            conn.execute("COMMIT")
            samples.append(time.perf_counter() - t)
        elapsed = time.monotonic() - start
    finally:
        conn.close()
    ms = np.asarray(samples) * 1e3
    return {"inserts_per_s": len(samples) / elapsed, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max()), "row_bytes": len(row_bytes),
            "n": len(samples)}


class FloorServer(ServerProcess):
    """``benchmarks/http_floor_app.py`` as a child process (TLS with the deployment's certificate,
    or plain HTTP when ``tls`` is False), with :meth:`ServerProcess.cpu_seconds`."""

    name = "floor app"

    def __init__(self, deployment, tls: bool) -> None:
        super().__init__(deployment.work, deployment.db_url, deployment.server_pem, deployment.ca_pem)
        self.tls = tls

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> FloorServer:
        repo = Path(__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(repo / "benchmarks" / "http_floor_app.py"), str(self.port),
                 str(self.server_pem) if self.tls else "none"], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env)
        return self.wait_healthy(ssl_context_of(self.ca_pem), timeout_s)


def ssl_context_of(ca_pem: Path):
    import ssl  # standard library; only the floor runs need it here

    return ssl.create_default_context(cafile=str(ca_pem))


def floor_run(d, uploads, clients: list[str], seconds: float, tls: bool, seed: int) -> dict:
    """64 devices (MessagePack) against the bare app for ``seconds`` (after 1 s not counted): requests/s
    and the app process's CPU ms per request."""
    server = FloorServer(d, tls).start()
    try:
        fleet = Fleet(server.url, d, uploads, seed=seed)
        asyncio.run(fleet.run(1.0, clients))
        cpu0 = server.cpu_seconds()
        with _progress(f"floor, {'TLS' if tls else 'plain HTTP'}", seconds) as bar:
            result = asyncio.run(fleet.run(seconds, clients, on_ack=lambda a: bar.update()))
        cpu1 = server.cpu_seconds()
    finally:
        server.stop()
    n = sum(a.status == 201 for a in result.acks)
    return {"tls": tls, "devices": len(clients), "duration_s": seconds, "requests": n,
            "requests_per_s": result.accepted_per_s(), "latency": result.latency_ms(),
            "server_cpu_ms_per_request": None if cpu0 is None or cpu1 is None or not n else (cpu1 - cpu0) * 1e3 / n}


def summary(result, warmup_s: float = 0.0) -> dict:
    """JSON of a :class:`sync_fleet.LoadResult`."""
    return {"devices": result.n_clients, "duration_s": result.duration_s, "warmup_s": warmup_s,
            "accepted_per_s": result.accepted_per_s(warmup_s), "accepted": sum(a.status == 201 for a in result.acks),
            "latency": result.latency_ms(warmup_s), "latency_with_retries": result.latency_ms(warmup_s, total=True),
            "errors_retried": dict(result.errors), "rejected": {str(k): v for k, v in result.rejected.items()},
            "rejected_details": result.rejected_details, "gave_up": result.gave_up, "ended_s": result.ended_s}


def timeline(result, bin_s: float) -> list[float]:
    """Stored uploads (201) per second in bins of ``bin_s`` seconds from the load's start."""
    n_bins = int(np.ceil(max(result.ended_s, result.duration_s) / bin_s))
    t = np.array([a.acked_s for a in result.acks if a.status == 201])
    counts = np.histogram(t, bins=n_bins, range=(0, n_bins * bin_s))[0]
    return (counts / bin_s).tolist()


LATENCY_EDGES_MS = np.geomspace(1.0, 100_000.0, 51)


def latency_histogram(result, warmup_s: float = 0.0) -> list[int]:
    """Counts of answered-request latencies in the bins of :data:`LATENCY_EDGES_MS`."""
    ms = [a.latency_s * 1e3 for a in result.acks if a.acked_s >= warmup_s]
    return np.histogram(np.clip(ms, LATENCY_EDGES_MS[0], LATENCY_EDGES_MS[-1]), bins=LATENCY_EDGES_MS)[0].tolist()


def _progress(desc: str, seconds: float):
    from tqdm.auto import tqdm

    return tqdm(desc=desc, unit=" uploads", leave=True, mininterval=0.5, postfix={"load s": seconds})


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, required=True, help="signed K-means bundle (fedroute export)")
    parser.add_argument("--public-key", type=Path, required=True, help="signing.pub that verifies the bundle")
    parser.add_argument("--out", type=Path, default=Path("results/benchmarks"))
    parser.add_argument("--work", type=Path, default=None, help="folder for the database and certificates "
                        "(default: a temporary folder, deleted)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent devices (>= 32)")
    parser.add_argument("--n-cells", type=int, default=32)
    parser.add_argument("--min-count", type=int, default=2)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--crash-duration-s", type=float, default=10.0)
    parser.add_argument("--kill-at-s", type=float, default=4.0)
    parser.add_argument("--single-s", type=float, default=3.0)
    parser.add_argument("--floor-s", type=float, default=8.0, help="seconds of each floor run (0: none)")
    parser.add_argument("--baseline-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.clients < 32:
        parser.error(f"--clients={args.clients} should be >= 32 (METRICS.md asks for >= 32 concurrent devices)")
    if not 0 < args.warmup_s < args.duration_s:
        parser.error(f"--warmup-s={args.warmup_s} must lie in (0, --duration-s={args.duration_s})")
    if not 0 < args.kill_at_s < args.crash_duration_s:
        parser.error(f"--kill-at-s={args.kill_at_s} must lie in (0, --crash-duration-s={args.crash_duration_s})")

    with tempfile.TemporaryDirectory(prefix="sync_load_") as tmp:
        work = args.work if args.work is not None else Path(tmp)
        results = run(args, work)
    from trainer.report import write_text  # atomic: a killed run leaves the old file

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "sync_load.json", json.dumps(results, indent=2) + "\n")
    write_text(args.out / "sync_load.md", markdown(results))
    plot(results, args.out / "sync_load.png")
    print(markdown(results))
    if results["crash"]["failed_checks"]:
        print(f"FAILED: {results['crash']['failed_checks']}", file=sys.stderr)
        raise SystemExit(1)
    return results


def run(args, work: Path) -> dict:
    from sdk.protocol import encode_kmeans_update_record as update_bytes

    started = time.time()
    load_before = list(os.getloadavg())
    print(f"deploying in {work}: {args.clients} devices (fedroute clients add), a round of {args.n_cells} cells",
          flush=True)
    d = deploy(work, args.bundle, args.public_key, n_clients=args.clients, n_cells=args.n_cells,
               min_count=args.min_count, seed=args.seed)
    clients = list(d.tokens)
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    server = ServerProcess.for_deployment(d).start()
    try:
        spec = fetch_round(server.url, d, clients[0])
        rng = np.random.default_rng(args.seed)
        uploads = {c: synthetic_uploads(spec, c, rng) for c in clients}
        bodies = [len(u.body) for us in uploads.values() for u in us]
        msgpack_bodies = [len(u.msgpack_body) for us in uploads.values() for u in us]
        by_size = sorted((u for us in uploads.values() for u in us), key=lambda u: len(u.body))
        print(f"{len(bodies)} bodies, median {np.median(bodies) / 1e3:.0f} KB; baseline: raw SQLite inserts", flush=True)
        raw = raw_sqlite_inserts(work / "raw_baseline.db", update_bytes(by_size[len(by_size) // 2].update), args.baseline_s)
        fleet = Fleet(server.url, d, uploads, seed=args.seed)

        with _progress("1 device", args.single_s) as bar:
            single = asyncio.run(fleet.run(args.single_s, clients[:1], on_ack=lambda a: bar.update()))
        loads, cpu = {}, {}
        for wire_format in ("json", "msgpack"):
            fleet.wire_format = wire_format
            cpu0, main0, own0 = server.cpu_seconds(), server.main_thread_cpu_seconds(), time.process_time()
            with _progress(f"{args.clients} devices, {wire_format}", args.duration_s) as bar:
                loads[wire_format] = asyncio.run(fleet.run(args.duration_s, clients, on_ack=lambda a: bar.update()))
            cpu[wire_format] = (cpu0, server.cpu_seconds(), own0, time.process_time(), main0,
                                server.main_thread_cpu_seconds())
        load = loads["msgpack"]
        floors = {} if args.floor_s <= 0 else {
            "tls": floor_run(d, uploads, clients, args.floor_s, True, args.seed),
            "plain": floor_run(d, uploads, clients, args.floor_s, False, args.seed)}
        with _progress(f"{args.clients} devices, kill -9 at {args.kill_at_s:g} s", args.crash_duration_s) as bar:
            crash, times = asyncio.run(run_with_kill(fleet, server, args.crash_duration_s, args.kill_at_s, clients,
                                                     on_ack=lambda a: bar.update()))
        print("checking receipts against the store; replaying; fedroute rounds close", flush=True)
        check = check_recovery(fleet, single.acks + loads["json"].acks + load.acks + crash.acks)
    finally:
        server.stop()
    load_summary = summary(load, args.warmup_s)
    load_runs = {}
    for wire_format, result in loads.items():
        (cpu0, cpu1, own0, own1, main0, main1), n = cpu[wire_format], sum(a.status == 201 for a in result.acks)
        measured = None not in (cpu0, cpu1, main0, main1) and n > 0
        load_runs[wire_format] = {
            **summary(result, args.warmup_s), "wire_format": wire_format, "timeline_per_s": timeline(result, 0.5),
            "latency_histogram": latency_histogram(result, args.warmup_s),
            "server_cpu_ms_per_upload": (cpu1 - cpu0) * 1e3 / n if measured else None,
            # the event loop (HTTP, TLS, decoding and checks) and the other threads (the group-commit
            # writer: SQLite; the thread pool: the round closer)
            "server_main_thread_cpu_ms_per_upload": (main1 - main0) * 1e3 / n if measured else None,
            "server_other_threads_cpu_ms_per_upload": ((cpu1 - cpu0) - (main1 - main0)) * 1e3 / n if measured else None,
            "devices_cpu_ms_per_upload": (own1 - own0) * 1e3 / max(n, 1)}
    failed = [name for name, bad in [
        ("acknowledged_missing", check.acknowledged_missing != 0), ("receipt_mismatch", check.receipt_mismatch != 0),
        ("duplicate_keys", check.duplicate_keys != 0), ("replay_mismatch", check.replay_mismatch != 0),
        ("stored_unacknowledged", check.stored_unacknowledged != 0),
        ("gave_up", single.gave_up + loads["json"].gave_up + load.gave_up + crash.gave_up != 0),
        ("rejected", bool(single.rejected or loads["json"].rejected or load.rejected or crash.rejected)),
        ("round_not_aggregated", check.outcome.get("result") != "aggregated"),
        ("aggregate_total", check.aggregated_total_count != check.expected_total_count),
        ("aggregate_counts", not check.count_matrix_equal)] if bad]
    return {
        "setup": {
            "devices": args.clients, "n_cells": d.n_cells, "n_models": len(d.models), "d_emb": d.d_emb,
            "min_count": d.min_count, "centroids": f"{d.n_cells} unit vectors drawn with seed {args.seed} "
            "(standard normal, normalised) in the bundle's embedding space",
            "bundle": {"version": manifest["bundle_version"], "embedder": manifest["embedder"]["name"]},
            "body_bytes": {"median": float(np.median(bodies)), "max": int(max(bodies))},
            "msgpack_body_bytes": {"median": float(np.median(msgpack_bodies)), "max": int(max(msgpack_bodies))},
            "stored_row_bytes": raw["row_bytes"], "transport": "HTTPS (TLS, trustme CA) on 127.0.0.1",
            "server": f"fedroute serve: 1 uvicorn process ({HttpLimits().parser}), SQLite WAL synchronous=FULL, "
                      "no upload quota",
            "load_average_before": load_before, "load_average_after": list(os.getloadavg()),
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "python": platform.python_version()},
        },
        "baseline": {"raw_sqlite": raw, "single_device": {**summary(single),
                                                          "latency_histogram": latency_histogram(single)}},
        "latency_edges_ms": LATENCY_EDGES_MS.tolist(),
        "load": load_runs["msgpack"],
        "load_json": load_runs["json"],
        "ratios": {
            "load_vs_raw_sqlite": load_summary["accepted_per_s"] / raw["inserts_per_s"],
            "load_vs_single_device": load_summary["accepted_per_s"] / max(summary(single)["accepted_per_s"], 1e-9),
            "msgpack_vs_json_uploads_per_s": load_summary["accepted_per_s"] / max(load_runs["json"]["accepted_per_s"], 1e-9),
            "json_vs_msgpack_server_cpu": None if not load_runs["msgpack"]["server_cpu_ms_per_upload"]
            else load_runs["json"]["server_cpu_ms_per_upload"] / load_runs["msgpack"]["server_cpu_ms_per_upload"],
        },
        "floor": floors,
        "breakdown_ms_per_upload": breakdown(load_runs["msgpack"]["server_cpu_ms_per_upload"], floors,
                                             load_runs["msgpack"]),
        "crash": {**summary(crash), **times, "timeline_per_s": timeline(crash, 0.5), "recovery": check.to_json(),
                  "failed_checks": failed},
        "wall_s": time.time() - started,
    }


def breakdown(total_ms: float | None, floors: dict, threads: dict | None = None) -> dict | None:
    """Server CPU per MessagePack upload split into TLS, HTTP (uvicorn + parser, no TLS) and the rest
    (the app: FastAPI/Starlette, checks, the store), from the floor runs of the same run; with
    ``threads`` (the load run's JSON), the rest split again into the event loop's share (decoding,
    checks, hand-over to the store, the answer) and the other threads' (the group-commit writer's
    SQLite inserts and commits, and the round closer)."""
    tls, plain = (floors.get(k, {}).get("server_cpu_ms_per_request") for k in ("tls", "plain"))
    if total_ms is None or tls is None or plain is None:
        return None
    out = {"total": total_ms, "http_without_tls": plain, "tls": tls - plain, "app_and_store": total_ms - tls,
           "tls_share": (tls - plain) / total_ms, "http_and_tls_share": tls / total_ms}
    if threads is not None and threads.get("server_main_thread_cpu_ms_per_upload") is not None:
        main, other = threads["server_main_thread_cpu_ms_per_upload"], threads["server_other_threads_cpu_ms_per_upload"]
        # The floor app runs on its event loop only: HTTP and TLS are in the main thread's share.
        out.update(main_thread=main, other_threads=other, app_on_event_loop=main - tls)
    return out


def markdown(r: dict) -> str:
    s, raw, single, load, crash = r["setup"], r["baseline"]["raw_sqlite"], r["baseline"]["single_device"], r["load"], r["crash"]
    load_json = r["load_json"]
    rec = crash["recovery"]

    def row(name, devices, rate, lat, errors="", rejected="", cpu=None):
        cpu_text = "" if cpu is None else f"{cpu:.2f}"
        return (f"| {name} | {devices} | {rate:.1f} | {cpu_text} | {lat['p50_ms']:.1f} | {lat['p99_ms']:.1f} | "
                f"{lat['max_ms']:.1f} | {errors} | {rejected} |")

    def errs(x):
        return ", ".join(f"{k} {v}" for k, v in x["errors_retried"].items()) or "0"

    def rej(x):
        return ", ".join(f"{k}: {v}" for k, v in x["rejected"].items()) or "0"

    lines = [
        (f"Sync server under load: {s['devices']} devices uploading K-means statistics for {s['n_cells']} cells x "
         f"{s['n_models']} models (MessagePack bodies, median {s['msgpack_body_bytes']['median'] / 1e3:.0f} KB, or "
         f"JSON, median {s['body_bytes']['median'] / 1e3:.0f} KB: counts, sums and {s['d_emb']}-d cell means), "
         f"{s['transport']}; {s['server']}; {s['machine']['cores']} cores shared by the server and the devices "
         f"(load average {s['load_average_before'][0]:.2f} before the run, {s['load_average_after'][0]:.2f} after)."),
        "",
        ("| run | devices | accepted uploads/s | server CPU ms per upload | p50 ms | p99 ms | max ms | "
         "errors (retried) | rejected (4xx) |"),
        "|---|---|---|---|---|---|---|---|---|",
        (f"| raw SQLite INSERT + COMMIT of a {raw['row_bytes'] / 1e3:.0f} KB row (fsync, 1 thread, no HTTP) | - | "
         f"{raw['inserts_per_s']:.1f} | | {raw['p50_ms']:.1f} | {raw['p99_ms']:.1f} | {raw['max_ms']:.1f} | | |"),
        row("server, 1 device, MessagePack", 1, single["accepted_per_s"], single["latency"], errs(single), rej(single)),
        row(f"server, {load_json['devices']} devices, JSON (baseline encoding; {load_json['duration_s']:g} s, first "
            f"{load_json['warmup_s']:g} s not counted)", load_json["devices"], load_json["accepted_per_s"],
            load_json["latency"], errs(load_json), rej(load_json), load_json["server_cpu_ms_per_upload"]),
        row(f"server, {load['devices']} devices, MessagePack ({load['duration_s']:g} s, first {load['warmup_s']:g} s "
            "not counted)", load["devices"], load["accepted_per_s"], load["latency"], errs(load), rej(load),
            load["server_cpu_ms_per_upload"]),
        *[row(f"floor: bare ASGI app answering 201, {'TLS' if f['tls'] else 'plain HTTP'} ({f['duration_s']:g} s)",
              f["devices"], f["requests_per_s"], f["latency"], cpu=f["server_cpu_ms_per_request"])
          for f in r.get("floor", {}).values()],
        row(f"server, {crash['devices']} devices, MessagePack, kill -9 at {crash['kill_s']:.1f} s of "
            f"{crash['duration_s']:g} s", crash["devices"], crash["accepted_per_s"], crash["latency"], errs(crash),
            rej(crash)),
        "",
        (f"Ratios (same run): {load['devices']} devices / raw SQLite = **{r['ratios']['load_vs_raw_sqlite']:.2f}x**; "
         f"{load['devices']} devices / 1 device = **{r['ratios']['load_vs_single_device']:.2f}x**; MessagePack / JSON "
         f"uploads/s = **{r['ratios']['msgpack_vs_json_uploads_per_s']:.2f}x**"
         + ("" if r["ratios"]["json_vs_msgpack_server_cpu"] is None
            else f"; server CPU per upload JSON / MessagePack = **{r['ratios']['json_vs_msgpack_server_cpu']:.2f}x**")
         + f". Devices' CPU (this process) per upload: JSON {load_json['devices_cpu_ms_per_upload']:.1f} ms, "
           f"MessagePack {load['devices_cpu_ms_per_upload']:.1f} ms."),
        "",
        *([] if not r.get("breakdown_ms_per_upload") else [
            (f"Server CPU per MessagePack upload, {r['breakdown_ms_per_upload']['total']:.2f} ms: HTTP without TLS "
             f"(uvicorn, the parser, the event loop) {r['breakdown_ms_per_upload']['http_without_tls']:.2f} ms, TLS "
             f"{r['breakdown_ms_per_upload']['tls']:.2f} ms ({100 * r['breakdown_ms_per_upload']['tls_share']:.0f}%), "
             f"the app and the store {r['breakdown_ms_per_upload']['app_and_store']:.2f} ms (floor runs of the same "
             "run; the bare app's per-request cost also falls as its request rate rises)"
             + ("" if "main_thread" not in r["breakdown_ms_per_upload"] else
                f"; by thread: the event loop {r['breakdown_ms_per_upload']['main_thread']:.2f} ms (HTTP, TLS, "
                f"decoding and checks: {r['breakdown_ms_per_upload']['app_on_event_loop']:.2f} ms beyond the TLS "
                f"floor), the group-commit writer and the thread pool "
                f"{r['breakdown_ms_per_upload']['other_threads']:.2f} ms (SQLite inserts and commits, the round "
                "closer)") + "."), ""]),
        (f"kill -9 at {crash['kill_s']:.2f} s; the restarted server answered at {crash['ready_s']:.2f} s; "
         + ("no receipt after the kill" if crash["first_ack_after_s"] is None
            else f"first receipt after the kill at {crash['first_ack_after_s']:.2f} s")
         + f"; p99 with retries {crash['latency_with_retries']['p99_ms']:.0f} ms."),
        "",
        (f"- acknowledged uploads missing after the restart: **{rec['acknowledged_missing']}** of "
         f"{rec['acknowledged']} acknowledged (all runs)"),
        (f"- receipts that disagree with the store: {rec['receipt_mismatch']}; (device, key) stored twice: "
         f"{rec['duplicate_keys']}; stored but never acknowledged: {rec['stored_unacknowledged']}"),
        (f"- uploads retried: {rec['retried']} ({rec['retried_already_stored']} answered 200: stored before the kill, "
         f"receipt lost with the connection); each device's last upload re-sent: {rec['replayed']}, "
         f"answers that differ: {rec['replay_mismatch']}"),
        (f"- `fedroute rounds close`: {rec['outcome'].get('result')}, {len(rec['outcome'].get('clients', []))} "
         f"devices, {rec['outcome'].get('on_time_updates')} updates; total count {rec['aggregated_total_count']:.0f}, "
         f"expected {rec['expected_total_count']:.0f} (sum of each device's latest acknowledged upload); "
         f"count matrix equal: {'yes' if rec['count_matrix_equal'] else 'NO'}"),
        f"- failed checks: {', '.join(crash['failed_checks']) or 'none'}",
    ]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.report import save_figure

    load, load_json, crash = r["load"], r["load_json"], r["crash"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for series, label, color in [(load_json["timeline_per_s"], f"{load_json['devices']} devices, JSON", "tab:gray"),
                                 (load["timeline_per_s"], f"{load['devices']} devices, MessagePack", "tab:blue"),
                                 (crash["timeline_per_s"], f"{crash['devices']} devices, kill -9", "tab:orange")]:
        t = (np.arange(len(series)) + 0.5) * 0.5
        ax1.plot(t, series, label=label, color=color)
    ax1.axvline(crash["kill_s"], color="red", linestyle="--", label="kill -9")
    ax1.axvline(crash["ready_s"], color="green", linestyle=":", label="restarted")
    ax1.set_xlabel("seconds from the start of the run")
    ax1.set_ylabel("stored uploads/s (0.5 s bins)")
    ax1.set_title(f"Accepted uploads (raw SQLite: {r['baseline']['raw_sqlite']['inserts_per_s']:.0f} inserts/s)",
                  fontsize=10)
    ax1.legend(fontsize=8)
    edges = np.asarray(r["latency_edges_ms"])
    for run, label in [(r["baseline"]["single_device"], "1 device"), (load_json, f"{load['devices']} devices, JSON"),
                       (load, f"{load['devices']} devices, MessagePack")]:
        counts = np.asarray(run["latency_histogram"], dtype=float)
        ax2.stairs(counts / max(counts.sum(), 1), edges, label=f"{label} (p99 {run['latency']['p99_ms']:.0f} ms)")
    ax2.set_xscale("log")
    ax2.set_xlabel("upload latency, ms (request to receipt)")
    ax2.set_ylabel("share of uploads")
    ax2.set_title("Latency", fontsize=10)
    ax2.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
