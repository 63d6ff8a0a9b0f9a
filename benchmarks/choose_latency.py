"""On-device routing benchmark (METRICS.md): ``choose()`` latency, cold start and peak RSS.

In one process, on >= 500 real RouterBench test prompts, single query, warm, onnxruntime with one
intra-op thread:

- ``Router.choose(prompt, lam)`` with the bundle's fp32 and int8 embedders (median, p95 in ms);
- the baseline: sentence-transformers + torch ``encode([prompt])`` of the same prompts with the
  same truncation, ``torch.set_num_threads(1)`` (encode only; the router's own work is not added);
- ratio = baseline median / ``choose()`` median.

With ``--static-bundle`` (a router bundle whose embedder kind is ``static``, model2vec), its
precisions are timed the same way, as rows ``static fp32`` (float16 table) / ``static int8``.

In fresh subprocesses: cold start (process start to the first ``choose()`` result, median of 5) and
peak RSS of a process that loads the bundle and routes 100 queries (``VmHWM``, Linux).

    python benchmarks/choose_latency.py --bundle bundles/kmeans --public-key keys/signing.pub \
        --data ../shared/data/routerbench --out results/benchmarks

Writes ``choose_latency.json``, ``choose_latency.md`` and ``choose_latency.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import sys, time
t0 = float(sys.argv[1])
from sdk import Router
router = Router.load(sys.argv[2], sys.argv[3], precision=sys.argv[4], intra_op_threads=1)
choice = router.choose(sys.argv[5], 100.0)
first = time.time() - t0
first_cpu = time.process_time()  # CPU seconds of this process up to the first choice (imports included)
queries = sys.argv[6:]
for q in queries:
    router.choose(q, 100.0)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so it would count the parent's torch.
hwm_kb = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
print(f"{first:.6f} {hwm_kb / 1024:.1f} {first_cpu:.6f} {choice.model}")
"""


def _percentiles(samples_s: list[float]) -> dict:
    ms = np.asarray(samples_s) * 1e3
    return {"median_ms": float(np.median(ms)), "p95_ms": float(np.percentile(ms, 95)), "n": int(len(ms))}


def time_calls(fn, prompts: list[str], warmup: int = 20) -> dict:
    """Median and p95 (ms) of ``fn(prompt)`` over ``prompts``, after ``warmup`` untimed calls."""
    for p in prompts[:warmup]:
        fn(p)
    samples, cpu = [], []
    for p in prompts:
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn(p)
        cpu.append(time.thread_time() - start_cpu)
        samples.append(time.perf_counter() - start)
    # CPU time of this thread: the work itself, robust to other processes' load (one intra-op thread)
    return {**_percentiles(samples), "cpu_median_ms": float(np.median(cpu) * 1e3)}


def probe(bundle: Path, public_key: Path, precision: str, prompts: list[str], n_queries: int) -> tuple[float, float, float]:
    """(seconds from process start to the first choice, peak RSS in MB, CPU seconds to the first
    choice) of a fresh process."""
    args = [sys.executable, "-c", PROBE, str(time.time()), str(bundle), str(public_key), precision,
            prompts[0], *prompts[1:n_queries]]
    out = subprocess.run(args, capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    first, rss, cpu, _ = out.stdout.split(maxsplit=3)
    return float(first), float(rss), float(cpu)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--public-key", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="RouterBench folder (test.parquet)")
    parser.add_argument("--out", type=Path, default=Path("results/benchmarks"))
    parser.add_argument("--n-prompts", type=int, default=500)
    parser.add_argument("--lam", type=float, default=100.0)
    parser.add_argument("--static-bundle", type=Path, default=None,
                        help="also time a bundle with the static (model2vec) embedder")
    parser.add_argument("--static-public-key", type=Path, default=None, help="its key (default: --public-key)")
    parser.add_argument("--precisions", default=None, help="comma-separated precisions of --bundle to time (default: all)")
    args = parser.parse_args(argv)
    if args.n_prompts < 100:
        parser.error("--n-prompts must be >= 100 (METRICS.md asks for >= 500)")

    import torch
    from tqdm.auto import tqdm

    from sdk import Router
    from trainer.data.routerbench import load_routerbench_dir
    from trainer.embeddings import EmbedderConfig, load_sentence_transformer

    torch.set_num_threads(1)
    test = load_routerbench_dir(args.data)[1]
    prompts = list(test.prompts[: args.n_prompts])
    if len(prompts) < args.n_prompts:
        parser.error(f"{args.data} has only {len(prompts)} test prompts")
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    emb = manifest["embedder"]
    results: dict = {"n_prompts": len(prompts), "lam": args.lam, "bundle_version": manifest["bundle_version"],
                     "router_kind": manifest["router_kind"], "embedder": {k: emb[k] for k in ("name", "max_tokens", "truncation_side")},
                     "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                 "python": platform.python_version()},
                     "intra_op_threads": 1, "choose": {}, "cold_start_s": {}, "peak_rss_mb": {}}
    precisions = args.precisions.split(",") if args.precisions else list(emb["files"])
    # (row name, bundle, precision): the main bundle's precisions, then the static bundle's
    rows = [(p, args.bundle, p) for p in precisions]
    keys = {args.bundle: args.public_key, args.static_bundle: args.static_public_key or args.public_key}
    if args.static_bundle is not None:
        static_files = json.loads((args.static_bundle / "manifest.json").read_text())["embedder"]["files"]
        rows += [(f"static {p}", args.static_bundle, p) for p in static_files]
    for name, bundle, precision in tqdm(rows, desc="choose()"):
        router = Router.load(bundle, keys[bundle], precision=precision, intra_op_threads=1)
        results["choose"][name] = time_calls(lambda p: router.choose(p, args.lam), prompts)
        if bundle == args.bundle:
            tokens = router.token_counts(prompts)
            results["tokens_per_prompt"] = {"median": float(np.median(tokens)), "max": int(max(tokens))}
        del router
    st = load_sentence_transformer(EmbedderConfig(model=emb["name"], max_tokens=emb["max_tokens"],
                                                  truncation_side=emb["truncation_side"]))
    results["baseline"] = {"what": "sentence-transformers + torch encode([prompt]), torch threads = 1",
                           **time_calls(lambda p: st.encode([p], convert_to_numpy=True, normalize_embeddings=True), prompts)}
    del st
    for name, bundle, precision in tqdm(rows, desc="cold start / RSS"):
        runs = [probe(bundle, keys[bundle], precision, prompts, 100) for _ in range(5)]
        results["cold_start_s"][name] = statistics.median(r[0] for r in runs)
        results["peak_rss_mb"][name] = max(r[1] for r in runs)
        results.setdefault("cold_start_cpu_s", {})[name] = statistics.median(r[2] for r in runs)
    base = results["baseline"]["median_ms"]
    results["speedup_vs_baseline"] = {name: base / results["choose"][name]["median_ms"] for name, _, _ in rows}
    base_cpu = results["baseline"]["cpu_median_ms"]
    results["cpu_speedup_vs_baseline"] = {name: base_cpu / results["choose"][name]["cpu_median_ms"] for name, _, _ in rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "choose_latency.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "choose_latency.md").write_text(markdown(results))
    plot(results, args.out / "choose_latency.png")
    print(markdown(results))
    return results


def markdown(r: dict) -> str:
    lines = [
        f"`choose()` on {r['n_prompts']} RouterBench test prompts ({r['embedder']['name']}, last "
        f"{r['embedder']['max_tokens']} tokens, median {r['tokens_per_prompt']['median']:.0f} tokens), "
        f"1 intra-op thread, {r['machine']['cores']} cores:",
        "",
        "| path | median ms | p95 ms | speed-up vs torch | CPU ms (median) | CPU speed-up | cold start s | cold start CPU s | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| sentence-transformers + torch (encode only) | {r['baseline']['median_ms']:.2f} | {r['baseline']['p95_ms']:.2f} | 1.00x | "
        f"{r['baseline']['cpu_median_ms']:.2f} | 1.00x | | | |",
    ]
    for p, c in r["choose"].items():
        lines.append(f"| fedroute `choose()` {p} | {c['median_ms']:.2f} | {c['p95_ms']:.2f} | "
                     f"{r['speedup_vs_baseline'][p]:.2f}x | {c['cpu_median_ms']:.2f} | {r['cpu_speedup_vs_baseline'][p]:.2f}x | "
                     f"{r['cold_start_s'][p]:.2f} | {r['cold_start_cpu_s'][p]:.2f} | {r['peak_rss_mb'][p]:.0f} |")
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.report import save_figure

    names = ["torch (encode)"] + [f"choose() {p}" for p in r["choose"]]
    med = [r["baseline"]["median_ms"]] + [c["median_ms"] for c in r["choose"].values()]
    p95 = [r["baseline"]["p95_ms"]] + [c["p95_ms"] for c in r["choose"].values()]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.bar(x - 0.2, med, 0.4, label="median")
    ax.bar(x + 0.2, p95, 0.4, label="p95")
    ax.set_xticks(x, names)
    ax.set_ylabel("ms per query (1 thread)")
    ax.set_title(f"Single-query latency, {r['n_prompts']} RouterBench prompts")
    ax.legend()
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
