"""Why a one-pass online router rarely saves anything at gpt-4's accuracy: the top of each final router's
accuracy-cost curve, on the validation split of ``benchmarks/online_settings.py`` (never test).

A cell-table router saves at the best single model's accuracy only when, going down from its most accurate
decisions, its first step is to a model that is as accurate as the best one on the scored rows (on the test
split: gpt-3.5-turbo ties gpt-4 on mbpp). Per seed and policy this script reads the final router's decisions
over the lambda grid: its decisions at lam = 0 (every cell on the most accurate model?) and the first cell and
model to step down from there, with the labels that router had of the best model and of that model in the cell.
Run: ``PYTHONPATH=. HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/online_savings_diagnosis.py [--seeds 60]``;
writes ``docs/results/online_savings_diagnosis.json``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.online_settings import DATA, carve
from sdk.atomic_write import write_atomic
from trainer import metrics
from trainer.online import OnlineConfig, _seed_cells, run_online_seed


def top_of_curve(acc: np.ndarray, cost: np.ndarray, best: int) -> tuple[bool, tuple[int, int] | None]:
    """(every cell on ``best`` at lam = 0, (cell, model) of the first step away from all-``best`` or None)."""
    prev = None
    for lam in metrics.lambda_grid():
        d = np.argmax(acc - lam * cost, axis=1)
        if prev is not None and (prev == best).all() and not (d == best).all():
            k = int(np.flatnonzero(d != best)[0])
            return True, (k, int(d[k]))
        if prev is None and not (d == best).all():
            return False, None
        prev = d
    return True, None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=60)
    ap.add_argument("--data", type=Path, default=DATA)
    args = ap.parse_args()
    stream, vset, _ = carve(args.data)
    from trainer.data.routerbench import load_routerbench_dir

    models = load_routerbench_dir(args.data)[0].models
    cfg = OnlineConfig()
    refs = (metrics.zero_router_report(vset.accuracy, vset.cost).auc, metrics.oracle_report(vset.accuracy, vset.cost).auc)
    best = int(np.argmax(vset.accuracy.mean(axis=0)))
    steps: dict[str, Counter] = {p: Counter() for p in cfg.policies}
    labels: dict[str, list] = {p: [] for p in cfg.policies}
    for seed in range(args.seeds):
        _, _, cells = _seed_cells(stream, cfg, np.random.default_rng(seed))
        task_of = {k: Counter(stream.tasks[cells == k].tolist()).most_common(1)[0][0] for k in range(cells.max() + 1)}
        for p, r in run_online_seed(stream, vset, cfg, seed, refs).items():
            all_best, step = top_of_curve(*r.tables, best)
            key = ("not all on the best model at lam = 0" if not all_best else
                   "no step" if step is None else f"{task_of[step[0]]} -> {models[step[1]]}")
            steps[p][key] += 1
            q, m = r.chosen[:, 0], r.chosen[:, 1]
            mbpp = stream.tasks[q] == "mbpp"
            labels[p].append([int((mbpp & (m == best)).sum()), int((mbpp & (m == models.index("gpt-3.5-turbo-1106"))).sum()),
                              int(mbpp.sum())])
    out = {"seeds": args.seeds, "best_model": models[best],
           "first_step_down": {p: dict(c.most_common()) for p, c in steps.items()},
           "mbpp_labels_mean": {p: dict(zip(("gpt-4", "gpt-3.5", "all models"), np.mean(v, axis=0).round(1).tolist()))
                                for p, v in labels.items()}}
    print(json.dumps(out, indent=1))
    path = Path(__file__).resolve().parents[1] / "docs" / "results" / "online_savings_diagnosis.json"
    write_atomic(path, json.dumps(out, indent=1).encode())


if __name__ == "__main__":
    main()
