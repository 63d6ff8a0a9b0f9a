"""``choose()`` with exploration against greedy ``choose()`` (issue 26): one process, one bundle, one query set.

:class:`sdk.Explorer` (Thompson sampling, ``seed=0``, ``--n-draws``, default 1000 as the Explorer's) against :meth:`sdk.Router.choose` on the
same loaded router. The two take turns query by query (round-robin), so a change in the machine's load hits them
alike; ``--passes`` passes over ``--n-prompts`` RouterBench test prompts, one intra-op thread. Rows:

- ``fixed lam``: the app's ``lam`` (``--lam``) for every query, as in an app that routes at one trade-off;
- ``new lam per query``: a ``lam`` drawn per query (log-uniform on [1, 1e4] USD^-1, both sides get the same one), as
  under a budget controller that moves ``lam`` often: each query looks its propensity up in the cell's table over
  ``lam`` (built at the cell's first query, :func:`sdk.explorer._switch_table`).

each on the full prompts and on short queries (the first 8 words of each prompt: the cheapest embedding, so the
largest relative cost of exploring). Reported: median ms per query of each side and their ratio, explore / greedy;
target <= 1.2.

The bundle is a K-means router on the static embedder (the fastest ``choose()`` this project ships, so the largest
relative cost of exploring; an ONNX encoder's milliseconds would hide it), built on first use under ``--build-dir``
by the recipe of ``benchmarks/choose_latency_bundles.py`` (default K-means config fitted on the train split's
labelled pairs, exported with ``--int8`` tables and parity), or given with ``--bundle`` and ``--public-key``:

    python benchmarks/choose_explore.py --data ../shared/data/routerbench --out docs/results

Beside the timings, the table of what exploring costs on the same prompts under the bundle's posterior (expected regret
per query and the share of queries sent to a model other than the greedy one, by ``lam`` and ``max_regret``).

Writes ``choose_explore.json``, ``choose_explore.md`` and ``choose_explore.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

#: The ratio the issue asks for: explore / greedy.
TARGET = 1.2
SHORT_WORDS = 8
WARM_UP_LAM = 0.123456789
#: lam (USD^-1) and max_regret of the exploration-cost table.
REGRET_LAMS = (0.0, 10.0, 100.0, 1000.0)
REGRET_CAPS = (None, 0.05, 0.02)


def static_bundle(data: Path, build_dir: Path) -> tuple[Path, Path]:
    """(bundle, public key) of a static-embedder K-means bundle under ``build_dir``, built if missing."""
    from export.pipeline import export_bundle
    from export.signing import generate_keypair
    from trainer.embeddings import EmbedderConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from choose_latency_bundles import STATIC_EMBEDDER, fit_router

    key, pub = build_dir / "keys" / "signing.key", build_dir / "keys" / "signing.pub"
    if not (key.exists() and pub.exists()):
        key, pub = generate_keypair(build_dir / "keys")
    bundle = build_dir / "bundles" / "static"
    if not (bundle / "manifest.json").exists():
        router = fit_router(data, build_dir / "routers" / "kmeans-static", EmbedderConfig(model=STATIC_EMBEDDER))
        export_bundle(router, bundle, key, int8=True, data=data)
    return bundle, pub


def measure(router, explorer, prompts: list[str], lams: np.ndarray) -> dict:
    """Median ms per query of greedy and exploring ``choose``: one round-robin pass per row of ``lams``
    (passes, n_prompts), query by query, who goes first alternating."""
    from tqdm.auto import tqdm  # trainer extra (tqdm): progress bars

    greedy, explore = [], []
    for q in prompts[:10]:  # warm-up, untimed, at a lam no timed call uses (nothing cached for them)
        router.choose(q, WARM_UP_LAM)
        explorer.choose(q, WARM_UP_LAM)
    for p in tqdm(range(lams.shape[0]), desc="passes", leave=False):
        for i, (q, lam) in enumerate(zip(prompts, lams[p])):
            sides = ((router, greedy), (explorer, explore))
            for chooser, times in (sides if (i + p) % 2 == 0 else sides[::-1]):
                t0 = time.perf_counter()
                chooser.choose(q, lam)
                times.append(time.perf_counter() - t0)
    g, e = statistics.median(greedy), statistics.median(explore)
    return {"greedy_ms": g * 1e3, "explore_ms": e * 1e3, "ratio": e / g,
            "ratio_of_means": float(np.mean(explore) / np.mean(greedy)), "n_timings": len(greedy)}


def exploration_costs(router, prompts: list[str]) -> list[dict]:
    """What exploring costs on these prompts under the bundle's posterior (no timing): per ``lam`` of
    :data:`REGRET_LAMS` and ``max_regret`` of :data:`REGRET_CAPS`, the mean over the prompts of the
    expected regret of the prompt's cell, for Thompson sampling and uniform exploration (utility given up against greedy, accuracy points at ``lam``,
    :meth:`sdk.Explorer.expected_regret`) and of the probability of a model other than the greedy one."""
    from sdk.explorer import Explorer
    from sdk.utility import decide

    cells = np.array([c.cell for c in router.choose_batch(prompts, 0.0)])
    table_acc, table_cost = router._scorer.accuracy, router._scorer.cost  # the bundle's cell table
    out = []
    for policy in ("thompson", "uniform"):
        for cap in REGRET_CAPS:
            explorer = Explorer(router, policy=policy, seed=0, max_regret=cap)
            for lam in REGRET_LAMS:
                greedy = decide(table_acc, table_cost, lam)  # per cell
                off_greedy = 1.0 - explorer.probabilities(lam)[np.arange(len(greedy)), greedy]
                out.append({"policy": policy, "lam": lam, "max_regret": cap,
                            "expected_regret_per_query": float(explorer.expected_regret(lam)[cells].mean()),
                            "explored_share": float(off_greedy[cells].mean())})
    return out


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# choose() with exploration vs greedy ({meta['machine']})", "",
             f"Bundle `{meta['bundle']}` ({meta['router']}); Explorer policy {meta['policy']}, n_draws "
             f"{meta['n_draws']}; {meta['n_prompts']} prompts x {meta['passes']} passes, round-robin; target ratio "
             f"<= {TARGET}.", "",
             "| queries | lam | greedy ms (median) | explore ms (median) | ratio | ratio of means | target |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['queries']} | {r['lam']} | {r['greedy_ms']:.3f} | {r['explore_ms']:.3f} | "
                     f"{r['ratio']:.3f} | {r['ratio_of_means']:.3f} | {'met' if r['ratio'] <= TARGET else 'NOT met'} |")
    lines += ["", "What exploring costs on these prompts under the bundle's posterior (Explorer.expected_regret: utility "
              "given up against greedy per query, accuracy points at lam; explored: probability of a model other than "
              "the greedy one):", "", "| policy | lam | max_regret | expected regret per query | explored share |",
              "|---|---|---|---|---|"]
    for c in meta["exploration_costs"]:
        lines.append(f"| {c['policy']} | {c['lam']:g} | {'none' if c['max_regret'] is None else c['max_regret']} | "
                     f"{c['expected_regret_per_query']:.4f} | {c['explored_share']:.3f} |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.report import save_figure

    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = [f"{r['queries']}\n{r['lam']}" for r in rows]
    ax.bar(labels, [r["ratio"] for r in rows], color="tab:blue")
    ax.axhline(TARGET, color="tab:red", linestyle="--", label=f"target {TARGET}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylim(0, max(1.5, max(r["ratio"] for r in rows) + 0.2))
    ax.set_ylabel("explore / greedy (median)")
    ax.set_title("choose() with Thompson exploration vs greedy, same process")
    ax.legend(loc="upper left")
    save_figure(fig, path, dpi=120)  # lays out, writes atomically, closes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="RouterBench folder (train.parquet, test.parquet)")
    parser.add_argument("--out", type=Path, default=Path("results/benchmarks"))
    parser.add_argument("--build-dir", type=Path, default=Path("results/latency-bundles"),
                        help="where the static bundle is built (reused when there)")
    parser.add_argument("--bundle", type=Path, help="a K-means bundle of your own (with --public-key)")
    parser.add_argument("--public-key", type=Path)
    parser.add_argument("--n-prompts", type=int, default=300)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--lam", type=float, default=100.0, help="lam of the fixed-lam rows, USD^-1")
    parser.add_argument("--n-draws", type=int, default=1000, help="Explorer n_draws (Monte Carlo runs per propensity)")
    args = parser.parse_args(argv)
    if (args.bundle is None) != (args.public_key is None):
        parser.error("--bundle and --public-key go together")
    if args.n_prompts < 10 or args.passes < 1:
        parser.error(f"--n-prompts must be >= 10 and --passes >= 1, got {args.n_prompts} and {args.passes}")

    import pandas as pd

    from sdk import Router
    from sdk.explorer import Explorer

    bundle, pub = (args.bundle, args.public_key) if args.bundle else static_bundle(args.data, args.build_dir)
    router = Router.load(bundle, pub, intra_op_threads=1)
    explorer = Explorer(router, seed=0, n_draws=args.n_draws)
    prompts = [str(p) for p in pd.read_parquet(args.data / "test.parquet")["prompt"][: args.n_prompts]]
    short = [" ".join(p.split()[:SHORT_WORDS]) for p in prompts]
    fixed = np.full((args.passes, len(prompts)), args.lam)
    fresh = np.exp(np.random.default_rng(0).uniform(0.0, np.log(1e4), (args.passes, len(prompts))))
    load_before = os.getloadavg()[0]
    rows = []
    for name, queries in (("full prompts", prompts), (f"short ({SHORT_WORDS} words)", short)):
        for lam_name, lams in ((f"fixed {args.lam:g}", fixed), ("new per query", fresh)):
            row = measure(router, explorer, queries, lams)
            rows.append({"queries": name, "lam": lam_name, **row})
            print(f"{name:16s} lam {lam_name:14s} greedy {row['greedy_ms']:.3f} ms  explore {row['explore_ms']:.3f} ms"
                  f"  ratio {row['ratio']:.3f}", flush=True)
    meta = {"bundle": str(bundle), "router": repr(router), "policy": explorer.policy.name,
            "n_draws": explorer.policy.n_draws, "n_prompts": len(prompts), "passes": args.passes,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {load_before:.1f} at the start, "
                       f"{os.getloadavg()[0]:.1f} at the end",
            "target": TARGET, "met": all(r["ratio"] <= TARGET for r in rows),
            "exploration_costs": exploration_costs(router, prompts)}
    out = {"meta": meta, "rows": rows}
    from trainer.report import write_text  # atomic: a killed run leaves the old file

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "choose_explore.json", json.dumps(out, indent=2) + "\n")
    write_text(args.out / "choose_explore.md", _markdown(rows, meta))
    _plot(rows, args.out / "choose_explore.png")
    return out


if __name__ == "__main__":
    main()
