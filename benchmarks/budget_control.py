"""Budgets that hold: realised spend per 1,000 queries vs the budget on RouterBench test-split streams.

Routers: the main job's federated K-means and MLP routers (METRICS.md protocol, seed 0, trained on
the train split in this script, or ``--bundles`` exported by ``fedroute export``), as real signed
bundles loaded with :class:`sdk.Router`. Streams of 3,000 queries drawn from the test split: mixed,
one per task (arc-challenge, mbpp, winogrande only) and two shifting ones (winogrande -> mbpp at
the half; mbpp -> arc -> winogrande by thirds). Budgets at three positions of the predicted spend
range on a mixed calibration sample of 200 *train* prompts (``benchmarks.budget_streams``).

Methods, each on the same stream:

- **one-off** (the baseline): ``Router.lam_for_budget``'s rule (the smallest ``lam`` whose predicted
  mean cost on the calibration prompts fits the budget) once, then that ``lam`` for every query;
- **controller**: :class:`sdk.BudgetController` (window 200, default constants chosen on train-split
  validation streams by ``benchmarks/budget_controller_settings.py``), ``choose`` then ``record``
  of the realised cost;
- **hindsight lam** (reference, not deployable): the one-off rule calibrated on the whole stream.

Predictions come from the bundles' router heads on the cached trainer embeddings of the prompts
(``Router.predict_from_embeddings``; the export's parity gate bounds the gap to the ONNX encoder),
so no prompt is embedded twice. Spend and accuracy are measured after a warm-up of 200 queries, over 3 seeds (stream draw and
controller). Target: within +-10% of the budget after the warm-up.

    python benchmarks/budget_control.py --data ../shared/data/routerbench --out docs/results

Writes ``budget_control.json``, ``budget_control.md`` and ``budget_control.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from pathlib import Path

import numpy as np

from benchmarks import budget_streams as bs

KINDS = ("kmeans", "mlp")
SEEDS = (0, 1, 2)
PLOT_STREAMS = ("winogrande only", "mbpp only", "winogrande -> mbpp", "mbpp -> arc -> winogrande")


def _plot(path: Path, traces: dict, budgets: dict) -> None:
    import matplotlib  # trainer extra (matplotlib): the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # trainer extra (matplotlib)

    from trainer.report import save_figure

    fig, axes = plt.subplots(len(KINDS), len(PLOT_STREAMS), figsize=(4.2 * len(PLOT_STREAMS), 3.3 * len(KINDS)),
                             sharex=True, squeeze=False)
    kernel = np.ones(bs.WINDOW) / bs.WINDOW
    for r, kind in enumerate(KINDS):
        for c, stream in enumerate(PLOT_STREAMS):
            ax = axes[r][c]
            budget = budgets[kind]
            ax.axhspan(0.9 * budget, 1.1 * budget, color="0.9", label="budget +-10%")
            ax.axhline(budget, color="k", lw=1, label="budget")
            for method, colour in (("one-off", "tab:red"), ("controller", "tab:blue")):
                costs = traces[(kind, stream, method)]
                x = np.arange(bs.WINDOW, costs.size + 1)
                ax.plot(x, 1000 * np.convolve(costs, kernel, mode="valid"), color=colour, lw=1.2, label=method)
            ax.axvline(bs.WARM_UP, color="0.5", ls=":", lw=1)
            ax.set_title(f"{'K-means' if kind == 'kmeans' else 'MLP'}: {stream}", fontsize=9)
            if c == 0:
                ax.set_ylabel(f"USD per 1k queries\n(mean of last {bs.WINDOW})")
            if r == len(KINDS) - 1:
                ax.set_xlabel("query")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.suptitle("Realised spend vs budget on RouterBench test streams (middle budget, seed 0)", fontsize=10)
    save_figure(fig, path, dpi=120)  # lays out, writes atomically, closes


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Budget control on RouterBench test streams",
        "",
        f"Streams of {meta['stream_length']} queries, warm-up {meta['warm_up']}, controller window {meta['window']}, "
        f"seeds {meta['seeds']}. *ratio* = realised spend after the warm-up / budget (mean over seeds; "
        "*worst* = the seed farthest from 1); *acc* = mean correctness after the warm-up; *in +-10%* = every "
        "seed within 10% of the budget. *floor* = spend of the router's cheapest decisions on the stream / "
        "budget (a budget below it cannot be met).",
        "",
        "| router | stream | budget USD/1k | floor | one-off ratio (worst) | one-off acc | controller ratio (worst) "
        "| controller acc | controller in +-10% | hindsight-lam ratio | hindsight acc |",
        "|---|---|---:|---:|---:|---:|---:|---:|:---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['router']} | {r['stream']} | {r['budget_usd_per_1k']:.4f} | {r['floor_ratio']:.2f} "
            f"| {r['one-off']['ratio']:.3f} ({r['one-off']['worst_ratio']:.3f}) | {r['one-off']['accuracy']:.3f} "
            f"| {r['controller']['ratio']:.3f} ({r['controller']['worst_ratio']:.3f}) | {r['controller']['accuracy']:.3f} "
            f"| {'yes' if r['controller']['within_10pct'] else '**no**'} "
            f"| {r['hindsight']['ratio']:.3f} | {r['hindsight']['accuracy']:.3f} |")
    n_ok = sum(r["controller"]["within_10pct"] for r in rows)
    n_base = sum(r["one-off"]["within_10pct"] for r in rows)
    lines += ["", f"Controller within +-10% on every seed: {n_ok} of {len(rows)} cases; one-off calibration: "
              f"{n_base} of {len(rows)}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/routerbench"))
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--bundles", type=Path, default=None,
                        help="folder with <kind>/ bundles (fedroute export); default: train and export here")
    parser.add_argument("--public-key", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for the trained routers, keys and bundles; reused when it already holds them")
    parser.add_argument("--prepare-only", action="store_true", help="stop once the bundles exist")
    parser.add_argument("--length", type=int, default=bs.STREAM_LENGTH)
    args = parser.parse_args(argv)
    logging.getLogger("fedroute.budget").setLevel(logging.ERROR)  # drift is measured in the tables, not logged

    from tqdm.auto import tqdm  # trainer extra (tqdm): progress bars

    from trainer.data.routerbench import load_routerbench_dir  # trainer extra (pandas)

    started = time.time()
    train, test = load_routerbench_dir(args.data)
    work = args.work or bs.scratch_dir()
    source = "federated routers trained here (METRICS.md protocol, seed 0), exported and loaded as bundles"
    if args.bundles is not None:
        routers = bs.load_bundles(args.bundles, args.public_key, KINDS)
        source = str(args.bundles)
    elif all((work / "bundles" / kind / "manifest.json").exists() for kind in KINDS):
        routers = bs.load_bundles(work / "bundles", work / "keys" / "signing.pub", KINDS)
    else:
        trained = bs.train_routers(train, bs.embed(train), KINDS, 0, str(args.data / "test.parquet"))
        routers = bs.export_routers(trained, work, args.data)
    if args.prepare_only:
        print(f"bundles ready under {work / 'bundles'}")
        return {}
    test = test.complete_rows()
    test_emb = bs.embed(test)
    calibration_rng = np.random.default_rng(1234)
    calibration = train.subset(np.sort(calibration_rng.choice(train.n_queries, size=bs.WINDOW, replace=False)))
    calibration_emb = bs.embed(calibration)
    all_calibration = np.arange(bs.WINDOW)

    rows, traces, plot_budgets = [], {}, {}
    for kind, router in routers.items():
        pool = bs.make_pool(router, test, test_emb)
        cal_pool = bs.make_pool(router, calibration, calibration_emb)  # its labels are not used
        budgets = bs.budgets_from_calibration(cal_pool, all_calibration)
        plot_budgets[kind] = budgets[1]
        by_seed = {seed: bs.make_streams(pool.tasks, np.arange(len(pool.prompts)), args.length,
                                         np.random.default_rng(seed)) for seed in SEEDS}
        for budget in budgets:
            lam_one_off = bs.calibrated_lam(cal_pool, all_calibration, budget)
            for stream_name in tqdm(list(by_seed[SEEDS[0]]), desc=f"{kind} budget {budget:.3f}", leave=False):
                results = {"one-off": [], "controller": [], "hindsight": []}
                floors = []
                for seed in SEEDS:
                    stream = by_seed[seed][stream_name]
                    one_off = bs.replay_fixed(pool, stream, lam_one_off)
                    controlled = bs.replay_controller(router, pool, stream, budget, seed)
                    hindsight = bs.replay_fixed(pool, stream, bs.calibrated_lam(pool, stream, budget))
                    for name, replay in (("one-off", one_off), ("controller", controlled), ("hindsight", hindsight)):
                        results[name].append(replay.summary(budget, bs.WARM_UP))
                    floor = bs.replay_fixed(pool, stream, 1e12)  # every query to its cheapest predicted model
                    floors.append(floor.summary(budget, bs.WARM_UP)["ratio"])
                    if seed == SEEDS[0] and budget == budgets[1]:
                        traces[(kind, stream_name, "one-off")] = one_off.costs
                        traces[(kind, stream_name, "controller")] = controlled.costs
                row = {"router": kind, "stream": stream_name, "budget_usd_per_1k": budget,
                       "lam_one_off": lam_one_off, "floor_ratio": float(np.max(floors))}
                for name, summaries in results.items():
                    ratios = np.array([s["ratio"] for s in summaries])
                    row[name] = {
                        "ratio": float(ratios.mean()),
                        "worst_ratio": float(ratios[np.argmax(np.abs(ratios - 1))]),
                        "accuracy": float(np.mean([s["accuracy"] for s in summaries])),
                        "spend_usd_per_1k": float(np.mean([s["spend_usd_per_1k"] for s in summaries])),
                        "worst_window_ratio": float(max((s["worst_window_ratio"] for s in summaries),
                                                        key=lambda v: abs(v - 1))),
                        "within_10pct": bool(np.all(np.abs(ratios - 1) <= 0.10)),
                        "per_seed_ratio": ratios.tolist(),
                    }
                rows.append(row)

    meta = {"stream_length": args.length, "warm_up": bs.WARM_UP, "window": bs.WINDOW, "seeds": list(SEEDS),
            "budget_positions": list(bs.BUDGET_POSITIONS), "routers": source, "test_prompts": len(test.prompts),
            "calibration": f"{bs.WINDOW} random train prompts (seed 1234)",
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the end",
            "seconds": round(time.time() - started, 1)}
    out = {"meta": meta, "rows": rows}
    from trainer.report import write_text  # atomic: a killed run leaves the old file

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "budget_control.json", json.dumps(out, indent=2) + "\n")
    write_text(args.out / "budget_control.md", _markdown(rows, meta))
    _plot(args.out / "budget_control.png", traces, plot_budgets)
    print(_markdown(rows, meta))
    return out


if __name__ == "__main__":
    main()
