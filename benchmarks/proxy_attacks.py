"""``fedroute proxy`` under hostile clients: how long another caller and ``/health`` wait meanwhile.

Starts the stub upstream (``tests/openai_stub.py``) and the proxy (``python -m trainer.cli proxy``, the
real command, its HTTP-limit options as given) as separate processes on 127.0.0.1, then, all at once
and for ``--duration-s`` seconds, from this process (asyncio, raw sockets):

- **header flood**: connections that send a request head of ``--flood-mb`` MB (one header, no token),
  one after the other;
- **half-open**: ``--half-open`` connections that send a request line and one header, never the end;
- **idle**: ``--idle`` connections that send nothing;
- **slow bodies**: ``--slow-bodies`` authenticated requests declaring a 1,000-byte body and sending
  one byte every 5 s;
- **disconnects**: ``--disconnects`` requests that send half their body and close (every 2 s);
- **many messages**: an authenticated chat request of ``--messages`` one-word messages (60,000:
  2.1 MB), again as soon as the last one is answered; the config's ``max_messages`` is set above it
  so that it is routed and sent upstream (the costly path), not refused.

Meanwhile the **victim**, another caller (own token, own process), sends a routed chat request and a ``GET /health``
every 0.25 s, each on a new connection; their latencies are the result (median, p99, max per
probe), next to the same probes for ``--baseline-s`` seconds before the attacks (the baseline: the
same processes and load, no attack). Also recorded: how many attack connections the proxy closed and when (seconds after
their start), the flood's answer, and whether the proxy's log holds a traceback.

    python benchmarks/proxy_attacks.py --bundle bundles/kmeans --public-key keys/signing.pub --out results/benchmarks

Writes ``proxy_attacks.json``, ``.md`` and ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_latency import STUB, free_port, wait_healthy  # noqa: E402

from trainer import report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ATTACKER, VICTIM = "attacker-token", "victim-token"


async def _closed_after(reader: asyncio.StreamReader, t0: float, limit_s: float) -> tuple[float | None, bytes]:
    """Seconds from ``t0`` until the server closed the connection (None: still open at ``limit_s``), and
    the first bytes it answered."""
    data = b""
    try:
        data = await asyncio.wait_for(reader.read(200), limit_s - (time.monotonic() - t0))
        while not reader.at_eof():
            await asyncio.wait_for(reader.read(4096), limit_s - (time.monotonic() - t0))
    except asyncio.TimeoutError:
        return None, data
    except ConnectionError:  # reset: the proxy closed while our bytes were unread
        pass
    return time.monotonic() - t0, data


async def hold(port: int, first: bytes, limit_s: float) -> tuple[float | None, bytes]:
    """Open a connection, send ``first`` (maybe nothing) and wait for the server to close it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    if first:
        writer.write(first)
    result = await _closed_after(reader, t0, limit_s)
    writer.close()
    return result


async def slow_body(port: int, limit_s: float) -> tuple[float | None, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ATTACKER.encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    closing = asyncio.create_task(_closed_after(reader, t0, limit_s))
    while not closing.done():
        try:
            writer.write(b" ")
            await writer.drain()
        except ConnectionError:
            break
        await asyncio.wait([closing], timeout=5.0)
    writer.close()
    return await closing


async def flood(port: int, megabytes: int, stop: float) -> list[dict]:
    """Header floods one after the other until ``stop``: bytes sent before the server closed, its answer."""
    chunk = b"a" * (1 << 16)
    runs = []
    while time.monotonic() < stop:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sent, t0 = 0, time.monotonic()
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Flood: ")
        try:
            while sent < megabytes << 20:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
            writer.write(b"\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            pass
        try:
            answer = await asyncio.wait_for(reader.read(100), 5.0)
        except (asyncio.TimeoutError, ConnectionError):
            answer = b""
        writer.close()
        runs.append({"sent_bytes": sent, "answer": answer.split(b"\r\n")[0].decode(errors="replace"),
                     "s": time.monotonic() - t0})
        await asyncio.sleep(0.05)
    return runs


async def disconnects(port: int, stop: float) -> int:
    n = 0
    while time.monotonic() < stop:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ATTACKER.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messages\": [")
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        n += 1
        await asyncio.sleep(2.0)
    return n


async def many_messages(base: str, n_messages: int, stop: float) -> list[dict]:
    import httpx

    body = json.dumps({"model": "fedroute", "messages": [{"role": "user", "content": "hi"}] * n_messages}).encode()
    runs = []
    async with httpx.AsyncClient(base_url=base, timeout=120.0) as client:
        while time.monotonic() < stop:
            t0 = time.monotonic()
            r = await client.post("/v1/chat/completions", content=body,
                                  headers={"Authorization": f"Bearer {ATTACKER}", "Content-Type": "application/json"})
            runs.append({"status": r.status_code, "s": time.monotonic() - t0})
    return runs


async def victim(base: str, stop: float) -> dict[str, list[tuple[float, float, int]]]:
    """(seconds since the start, latency s, status) per probe: a routed chat request and /health."""
    import httpx

    t_start = time.monotonic()
    out: dict[str, list] = {"chat": [], "health": []}
    limits = httpx.Limits(max_keepalive_connections=0)  # a new connection per probe, as a new caller's
    async with httpx.AsyncClient(base_url=base, timeout=30.0, limits=limits) as client:
        while time.monotonic() < stop:
            for name, call in (("health", lambda: client.get("/health")),
                               ("chat", lambda: client.post("/v1/chat/completions", headers={
                                   "Authorization": f"Bearer {VICTIM}"}, json={
                                   "model": "fedroute", "messages": [{"role": "user", "content": "Sort a list in Python."}]}))):
                t0 = time.monotonic()
                try:
                    status = (await call()).status_code
                except httpx.HTTPError:
                    status = 0
                out[name].append((t0 - t_start, time.monotonic() - t0, status))
            await asyncio.sleep(0.25)
    return out


def run_victim(base: str, seconds: float) -> dict:
    """:func:`victim` for ``seconds``, in its own process (the attacks' sockets do not delay its probes)."""
    return asyncio.run(victim(base, time.monotonic() + seconds))


async def attack(port: int, args) -> dict:
    base = f"http://127.0.0.1:{port}"
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(1) as pool:
        baseline = await loop.run_in_executor(pool, run_victim, base, args.baseline_s)
        return {"baseline": baseline, **await _attacks(port, base, args, loop.run_in_executor(
            pool, run_victim, base, args.duration_s))}


async def _attacks(port: int, base: str, args, victim_probes) -> dict:
    limit = args.duration_s
    stop = time.monotonic() + args.duration_s
    half_open = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    tasks = {
        "victim": victim_probes,
        "flood": flood(port, args.flood_mb, stop),
        "half_open": asyncio.gather(*(hold(port, half_open, limit) for _ in range(args.half_open))),
        "idle": asyncio.gather(*(hold(port, b"", limit) for _ in range(args.idle))),
        "slow_bodies": asyncio.gather(*(slow_body(port, limit) for _ in range(args.slow_bodies))),
        "disconnects": disconnects(port, stop),
        "many_messages": many_messages(base, args.messages, stop),
    }
    results = dict(zip(tasks, await asyncio.gather(*tasks.values())))
    out = {"victim": results["victim"], "flood": results["flood"], "disconnects": results["disconnects"],
           "many_messages": results["many_messages"]}
    for name in ("half_open", "idle", "slow_bodies"):
        closed = [s for s, _ in results[name] if s is not None]
        answers = sorted({a.split(b"\r\n")[0].decode(errors="replace") for _, a in results[name]})
        out[name] = {"n": len(results[name]), "closed_by_proxy": len(closed),
                     "closed_after_s_max": max(closed) if closed else None, "answers": answers}
    return out


def summary(samples: list[tuple[float, float, int]]) -> dict:
    lat = np.array([s[1] for s in samples])
    return {"n": int(lat.size), "median_s": float(np.median(lat)), "p99_s": float(np.percentile(lat, 99)),
            "max_s": float(lat.max()), "statuses": sorted({s[2] for s in samples})}


def markdown(r: dict) -> str:
    a = r["settings"]
    lines = [f"Attacks for {a['duration_s']:g} s: {a['flood_mb']} MB header floods (one after another), "
             f"{a['half_open']} half-open requests, {a['idle']} idle connections, {a['slow_bodies']} slow bodies "
             f"(1 byte per 5 s), a disconnect mid-body every 2 s, {a['messages']:,}-message chat requests back to "
             f"back. Proxy options: {' '.join(a['proxy_options']) or '(defaults)'}. {r['machine']}.", "",
             "| victim probe | n | median (s) | p99 (s) | max (s) | statuses |", "|---|---|---|---|---|---|"]
    for name in ("health", "chat"):
        for label, s in ((f"{name}, no attack (baseline)", r["baseline"][name]), (f"{name}, under attack", r[name])):
            lines.append(f"| {label} | {s['n']} | {s['median_s']:.3f} | {s['p99_s']:.3f} | {s['max_s']:.3f} | "
                         f"{s['statuses']} |")
    lines += ["", "| attack | connections | closed by the proxy | last closed after (s) | answers |", "|---|---|---|---|---|"]
    for name in ("half_open", "idle", "slow_bodies"):
        s = r["attacks"][name]
        last = "-" if s["closed_after_s_max"] is None else f"{s['closed_after_s_max']:.1f}"
        lines.append(f"| {name} | {s['n']} | {s['closed_by_proxy']} | {last} | {s['answers']} |")
    f, m = r["attacks"]["flood"], r["attacks"]["many_messages"]
    lines += ["", f"Header floods: {len(f)}, each cut after at most {max(x['sent_bytes'] for x in f) / 1024:.0f} KiB "
              f"sent, answers {sorted({x['answer'] for x in f})}. Many-message requests: {len(m)}, statuses "
              f"{sorted({x['status'] for x in m})}, median {np.median([x['s'] for x in m]):.2f} s each. "
              f"Tracebacks in the proxy's log: {r['tracebacks']}."]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for name in ("health", "chat"):
        t, lat = zip(*[(s[0], s[1]) for s in r["attacks"]["victim"][name]])
        ax.plot(t, np.array(lat) * 1e3, ".", ms=3, label=f"victim {name}")
    ax.axhline(1000, color="grey", ls="--", lw=0.8, label="1 s target")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the attacks started")
    ax.set_ylabel("latency (ms)")
    ax.set_title("another caller's latency under attack (fedroute proxy)")
    ax.legend(fontsize=8)
    report.save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--public-key", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("results/benchmarks"))
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--baseline-s", type=float, default=10.0)
    parser.add_argument("--flood-mb", type=int, default=120)
    parser.add_argument("--half-open", type=int, default=300)
    parser.add_argument("--idle", type=int, default=300)
    parser.add_argument("--slow-bodies", type=int, default=50)
    parser.add_argument("--messages", type=int, default=60_000)
    parser.add_argument("--proxy-option", action="append", default=[], dest="proxy_options",
                        help="passed to `fedroute proxy` (e.g. --proxy-option=--header-timeout-s=2)")
    args = parser.parse_args(argv)

    from sdk import Router

    router = Router.load(args.bundle, args.public_key)
    work = Path(tempfile.mkdtemp(prefix="fedroute-proxy-attacks-"))
    stub_port, proxy_port = free_port(), free_port()
    stub_url = f"http://127.0.0.1:{stub_port}/v1"
    upstreams = {m: {"base_url": stub_url, "api_key_env": "FEDROUTE_BENCH_KEY", "model": f"up-{i}",
                     "input_usd_per_1m": 1.0, "output_usd_per_1m": 2.0} for i, m in enumerate(router.model_ids)}
    config = {"bundle": str(args.bundle.resolve()), "public_key": str(args.public_key.resolve()),
              "log": str(work / "proxy_log.sqlite"), "lam": 100.0, "upstreams": upstreams,
              "max_messages": args.messages + 1}
    (work / "proxy.json").write_text(json.dumps(config))
    (work / "tokens").write_text(f"{ATTACKER}\n{VICTIM}\n")
    env = {**os.environ, "FEDROUTE_BENCH_KEY": "stub-key", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log_path = work / "proxy.log"
    with open(work / "stub.log", "w") as stub_log, open(log_path, "w") as proxy_log:
        stub = subprocess.Popen([sys.executable, "-c", STUB, str(stub_port), str(ROOT / "tests")], env=env,
                                stdout=stub_log, stderr=subprocess.STDOUT)
        proxy = subprocess.Popen([sys.executable, "-m", "trainer.cli", "proxy", "--config", str(work / "proxy.json"),
                                  "--token-file", str(work / "tokens"), "--port", str(proxy_port),
                                  *args.proxy_options], env=env, cwd=ROOT, stdout=proxy_log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"http://127.0.0.1:{stub_port}/docs", stub)
            wait_healthy(f"http://127.0.0.1:{proxy_port}/health", proxy)
            load_before = os.getloadavg()[0]
            attacks = asyncio.run(attack(proxy_port, args))
        finally:
            for p in (proxy, stub):
                p.terminate()
                p.wait(30)
    text = log_path.read_text(errors="replace")
    result = {"settings": {k: v for k, v in vars(args).items() if k not in ("bundle", "public_key", "out")},
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, 1-minute load average {load_before:.1f} before "
                         f"and {os.getloadavg()[0]:.1f} after the run",
              "health": summary(attacks["victim"]["health"]), "chat": summary(attacks["victim"]["chat"]),
              "baseline": {name: summary(attacks["baseline"][name]) for name in ("health", "chat")},
              "tracebacks": text.count("Traceback"), "attacks": attacks, "proxy_log": str(log_path)}
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_text(args.out / "proxy_attacks.json", json.dumps(result, indent=1))
    report.write_text(args.out / "proxy_attacks.md", markdown(result))
    plot(result, args.out / "proxy_attacks.png")
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
