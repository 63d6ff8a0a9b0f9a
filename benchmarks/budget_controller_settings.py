"""Choose the BudgetController's constants (feedback gain, max step) on validation streams from the TRAIN split.

The RouterBench train split is cut in two (seeded, per task 70/30): federated K-means and MLP routers
(the main job's protocol, one seed) are trained on the 70% and exported as real bundles; the
streams of :func:`benchmarks.budget_streams.make_streams` are drawn from the other 30%. Budgets sit
at three positions of the predicted spend range on a mixed calibration sample of the 70%. The test
split is never read except by the exporter's parity gate (a fidelity check of the ONNX export, no
setting depends on it).

For each candidate (gain, max_step) every (router, stream, budget) is replayed through a fresh
controller; the score is the share of cases whose realised spend after the warm-up lies within
+-10% of the budget, ties broken by the mean |spend / budget - 1|.

    python benchmarks/budget_controller_settings.py --data ../shared/data/routerbench --out docs/results

Writes ``budget_controller_settings.json`` under ``--out``; the chosen values are copied by hand
into ``sdk/budget.py`` (``DEFAULT_GAIN``, ``DEFAULT_MAX_STEP``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time
from pathlib import Path

import numpy as np

from benchmarks import budget_streams as bs

GAINS = (0.25, 0.5, 1.0, 2.0, 4.0)
MAX_STEPS = (0.05,)
KINDS = ("kmeans", "mlp")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/routerbench"))
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--length", type=int, default=bs.STREAM_LENGTH)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for the trained routers, keys and bundles; reused when it already holds them")
    args = parser.parse_args(argv)
    logging.getLogger("fedroute.budget").setLevel(logging.ERROR)  # drift is measured in the tables, not logged

    from tqdm.auto import tqdm  # trainer extra (tqdm): progress bars

    from trainer.data.routerbench import load_routerbench_dir  # trainer extra (pandas)

    started = time.time()
    train, _test = load_routerbench_dir(args.data)
    rng = np.random.default_rng(args.seed)
    fit_rows, val_rows = [], []
    for task in sorted(set(train.tasks)):
        rows = rng.permutation(np.flatnonzero(train.tasks == task))
        cut = int(round(0.7 * rows.size))
        fit_rows.append(rows[:cut])
        val_rows.append(rows[cut:])
    fit = train.subset(np.sort(np.concatenate(fit_rows)))
    val = train.subset(np.sort(np.concatenate(val_rows))).complete_rows()
    work = args.work or bs.scratch_dir()
    if all((work / "bundles" / kind / "manifest.json").exists() for kind in KINDS):
        routers = bs.load_bundles(work / "bundles", work / "keys" / "signing.pub", KINDS)
    else:
        trained = bs.train_routers(fit, bs.embed(fit), KINDS, args.seed, str(args.data / "test.parquet"))
        routers = bs.export_routers(trained, work, args.data)
    fit_full = fit.complete_rows()
    val_emb, fit_emb = bs.embed(val), bs.embed(fit_full)

    cases, results = [], {}
    for kind, router in routers.items():
        val_pool = bs.make_pool(router, val, val_emb)
        fit_pool = bs.make_pool(router, fit_full, fit_emb)
        calibration = rng.choice(len(fit_pool.prompts), size=bs.WINDOW, replace=False)
        budgets = bs.budgets_from_calibration(fit_pool, calibration)
        streams = bs.make_streams(val_pool.tasks, np.arange(len(val_pool.prompts)), args.length, rng)
        cases += [(kind, router, val_pool, name, stream, budget) for name, stream in streams.items() for budget in budgets]
    for gain, max_step in tqdm(list(itertools.product(GAINS, MAX_STEPS)), desc="settings"):
        ratios = []
        for kind, router, pool, name, stream, budget in cases:
            replay = bs.replay_controller(router, pool, stream, budget, seed=args.seed, gain=gain, max_step=max_step)
            ratios.append(replay.summary(budget, bs.WARM_UP)["ratio"])
        ratios = np.asarray(ratios)
        results[f"gain={gain},max_step={max_step}"] = {
            "gain": gain, "max_step": max_step,
            "share_within_10pct": float(np.mean(np.abs(ratios - 1) <= 0.10)),
            "mean_abs_error": float(np.mean(np.abs(ratios - 1))),
            "worst_ratio": float(ratios[np.argmax(np.abs(ratios - 1))]),
        }
    best = max(results.values(), key=lambda r: (r["share_within_10pct"], -r["mean_abs_error"]))
    out = {
        "chosen": {"gain": best["gain"], "max_step": best["max_step"]},
        "candidates": results,
        "protocol": {"split": "RouterBench train, 70% fit / 30% validation streams per task", "seed": args.seed,
                     "stream_length": args.length, "window": bs.WINDOW, "warm_up": bs.WARM_UP,
                     "budget_positions": list(bs.BUDGET_POSITIONS), "n_cases": len(cases),
                     "streams": sorted({c[3] for c in cases}), "routers": list(KINDS)},
        "seconds": round(time.time() - started, 1),
    }
    from trainer.report import write_text  # atomic: a killed run leaves the old file

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "budget_controller_settings.json", json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["chosen"]), f"({out['seconds']} s)")
    return out


if __name__ == "__main__":
    main()
