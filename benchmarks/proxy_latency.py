"""Latency the proxy adds per request (routing + bookkeeping + one HTTP hop), upstream stubbed, next to ``choose()``.

In one run, on real RouterBench test prompts, one request at a time, the paths interleaved prompt by
prompt (so that load changes hit them alike), after 20 untimed warm-up rounds:

- **direct**: the official ``openai`` client -> the stub upstream (the baseline: what the app pays without fedroute);
- **proxy, pass-through**: client -> ``fedroute proxy`` (``model=<id>``, no routing) -> stub: the HTTP hop and
  the bookkeeping of cost and metrics;
- **proxy, routed**: client -> proxy (``model="fedroute"``: embed, score, rank, then call, record cost,
  store the pending outcome) -> stub;
- **choose() alone**: ``Router.choose(prompt, lam)`` in this process (same bundle, 1 intra-op thread),
  and the proxy's own routing time (its ``x-fedroute-routing-ms`` header).

The stub (``tests/openai_stub.py``) and the proxy (``python -m trainer.cli proxy``, the real command) run
as separate processes on 127.0.0.1; the stub answers at once, so every millisecond above *direct* is
fedroute's. Reported: median and p95 per path, and the medians of the per-prompt differences
(routed - direct = what routing through the proxy adds; routed - pass-through = routing and its
bookkeeping inside the proxy).

    python benchmarks/proxy_latency.py --bundle bundles/kmeans --public-key keys/signing.pub \
        --data ../shared/data/routerbench --out results/benchmarks

Writes ``proxy_latency.json``, ``proxy_latency.md`` and ``proxy_latency.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"
PATHS = ("direct", "passthrough", "routed", "choose")
LABELS = {"direct": "direct to upstream (baseline)", "passthrough": "proxy, pass-through",
          "routed": "proxy, routed (`model=\"fedroute\"`)", "choose": "`choose()` alone (in process)"}

STUB = r"""
import sys
sys.path.insert(0, sys.argv[2])
import uvicorn
from openai_stub import StubUpstream
uvicorn.run(StubUpstream().app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout_s} s")


def _stats(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"median_ms": float(np.median(a)), "p95_ms": float(np.percentile(a, 95)), "n": int(a.size)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--public-key", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="RouterBench folder (test.parquet)")
    parser.add_argument("--out", type=Path, default=Path("results/benchmarks"))
    parser.add_argument("--n-prompts", type=int, default=300)
    parser.add_argument("--lam", type=float, default=100.0)
    args = parser.parse_args(argv)
    if args.n_prompts < 50:
        parser.error("--n-prompts must be >= 50")

    import openai
    import pandas as pd
    from tqdm.auto import tqdm

    from sdk import Router

    prompts = [p for p in pd.read_parquet(args.data / "test.parquet")["prompt"].drop_duplicates()][: args.n_prompts + 20]
    warmup, prompts = prompts[:20], prompts[20:]
    router = Router.load(args.bundle, args.public_key, intra_op_threads=1)
    work = Path(tempfile.mkdtemp(prefix="fedroute-proxy-bench-"))
    stub_port, proxy_port = free_port(), free_port()
    stub_url = f"http://127.0.0.1:{stub_port}/v1"
    # Every model of the bundle is served by the stub; the prices (USD per 1M tokens) only feed the books.
    upstreams = {m: {"base_url": stub_url, "api_key_env": "FEDROUTE_BENCH_KEY", "model": f"up-{i}",
                     "input_usd_per_1m": 1.0, "output_usd_per_1m": 2.0} for i, m in enumerate(router.model_ids)}
    config = {"bundle": str(args.bundle.resolve()), "public_key": str(args.public_key.resolve()),
              "log": str(work / "proxy_log.sqlite"), "lam": args.lam, "upstreams": upstreams,
              "passthrough": {"ext-model": {"base_url": stub_url, "api_key_env": "FEDROUTE_BENCH_KEY",
                                            "model": "up-ext", "input_usd_per_1m": 1.0, "output_usd_per_1m": 2.0}}}
    (work / "proxy.json").write_text(json.dumps(config))
    (work / "tokens").write_text(TOKEN + "\n")
    env = {**os.environ, "FEDROUTE_BENCH_KEY": "stub-key", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    logs = open(work / "processes.log", "w")
    stub = subprocess.Popen([sys.executable, "-c", STUB, str(stub_port), str(ROOT / "tests")], env=env,
                            stdout=logs, stderr=subprocess.STDOUT)
    proxy = subprocess.Popen([sys.executable, "-m", "trainer.cli", "proxy", "--config", str(work / "proxy.json"),
                              "--token-file", str(work / "tokens"), "--port", str(proxy_port)], env=env, cwd=ROOT,
                             stdout=logs, stderr=subprocess.STDOUT)
    samples: dict[str, list[float]] = {p: [] for p in PATHS}
    proxy_routing_ms: list[float] = []
    try:
        wait_healthy(f"http://127.0.0.1:{stub_port}/docs", stub)
        wait_healthy(f"http://127.0.0.1:{proxy_port}/health", proxy)
        direct = openai.OpenAI(base_url=stub_url, api_key="stub-key", max_retries=0)
        via = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy_port}/v1", api_key=TOKEN, max_retries=0)

        def run(path: str, prompt: str) -> float:
            messages = [{"role": "user", "content": prompt}]
            t0 = time.perf_counter()
            if path == "direct":
                direct.chat.completions.create(model="up-0", messages=messages)
            elif path == "passthrough":
                via.chat.completions.create(model="ext-model", messages=messages)
            elif path == "routed":
                raw = via.chat.completions.with_raw_response.create(model="fedroute", messages=messages)
                raw.parse()
                proxy_routing_ms.append(float(raw.headers["x-fedroute-routing-ms"]))
            else:
                router.choose(prompt, args.lam)
            return (time.perf_counter() - t0) * 1e3

        for i, prompt in enumerate(warmup):
            for path in PATHS:
                run(path, prompt)
        proxy_routing_ms.clear()
        load_before = os.getloadavg()
        for i, prompt in enumerate(tqdm(prompts, desc="requests")):
            for path in PATHS[i % 4:] + PATHS[: i % 4]:  # rotate the order: no path always goes first
                samples[path].append(run(path, prompt))
        load_after = os.getloadavg()
    finally:
        for p in (proxy, stub):
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        logs.close()

    a = {p: np.asarray(v) for p, v in samples.items()}
    results = {
        "n_prompts": len(prompts), "lam": args.lam, "router_kind": router.router_kind,
        "embedder": router.embedder_name, "precision": router.precision, "max_tokens": router.max_tokens,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "load_average_1min": {"before": load_before[0], "after": load_after[0]},
        "paths": {p: _stats(v) for p, v in samples.items()},
        "proxy_routing_header": _stats(proxy_routing_ms),
        "added_ms": {
            "routed_minus_direct": _stats(list(a["routed"] - a["direct"])),
            "passthrough_minus_direct": _stats(list(a["passthrough"] - a["direct"])),
            "routed_minus_passthrough": _stats(list(a["routed"] - a["passthrough"])),
        },
    }
    results["routed_overhead_over_choose"] = (results["added_ms"]["routed_minus_direct"]["median_ms"]
                                              / results["paths"]["choose"]["median_ms"])
    from trainer.report import write_text  # atomic: a killed run leaves the old file

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "proxy_latency.json", json.dumps(results, indent=2) + "\n")
    write_text(args.out / "proxy_latency.md", markdown(results))
    plot(samples, results, args.out / "proxy_latency.png")
    print(markdown(results))
    return results


def markdown(r: dict) -> str:
    lines = [
        f"{r['n_prompts']} RouterBench test prompts, one request at a time, upstream stubbed (answers at once), "
        f"{r['router_kind']} bundle ({r['embedder']} {r['precision']}, last {r['max_tokens']} tokens), lam {r['lam']:g}; "
        f"{r['machine']['cores']} cores, load average {r['load_average_1min']['before']:.1f} -> "
        f"{r['load_average_1min']['after']:.1f}.",
        "",
        "| path | median ms | p95 ms |",
        "|---|---|---|",
    ]
    for p in PATHS:
        s = r["paths"][p]
        lines.append(f"| {LABELS[p]} | {s['median_ms']:.2f} | {s['p95_ms']:.2f} |")
    h = r["proxy_routing_header"]
    lines.append(f"| routing inside the proxy (`x-fedroute-routing-ms`) | {h['median_ms']:.2f} | {h['p95_ms']:.2f} |")
    lines += ["", "Per-prompt differences (median, p95 of the paired differences):", "",
              "| added latency | median ms | p95 ms |", "|---|---|---|"]
    names = {"routed_minus_direct": "routed through the proxy - direct (what fedroute adds)",
             "passthrough_minus_direct": "pass-through - direct (HTTP hop + books)",
             "routed_minus_passthrough": "routed - pass-through (routing + its bookkeeping)"}
    for k, label in names.items():
        s = r["added_ms"][k]
        lines.append(f"| {label} | {s['median_ms']:.2f} | {s['p95_ms']:.2f} |")
    lines += ["", f"Routing through the proxy adds {r['routed_overhead_over_choose']:.2f}x the median of "
              "`choose()` alone."]
    return "\n".join(lines) + "\n"


def plot(samples: dict, r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.report import save_figure

    fig, ax = plt.subplots(figsize=(7.0, 3.8))
    for p in PATHS:
        v = np.sort(np.asarray(samples[p]))
        ax.plot(v, np.arange(1, v.size + 1) / v.size, label=f"{LABELS[p].replace('`', '')} "
                f"(median {r['paths'][p]['median_ms']:.1f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("ms per request (log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"Latency per request, upstream stubbed, {r['n_prompts']} RouterBench prompts")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
