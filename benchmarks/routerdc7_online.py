"""routerdc7 (7 open models, 13 tasks, no costs): the online replay with equal costs, quality only.

Gain = (accuracy of the router's choices - best single model's) / (per-query oracle's - best single
model's) on the test split, reported on the test rows of the tasks that also appear in train and,
apart, on the tasks that appear only in test (MATH_prealgebra, ceval, javascript, mbpp). Same seeds,
streams and policies for both (scoring does not change what is logged). Settings are the online
defaults (K = 3 and prior strength 32, chosen on RouterBench validation; nothing tuned here).
Embedder: the static table of all-MiniLM-L6-v2 (docs/static_embedder.md): 20,600 prompts embed in
seconds where the transformer takes most of an hour on a shared 2-core machine.
Run: ``PYTHONPATH=. HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/routerdc7_online.py
[--data ../shared/data/routerdc7] [--seeds 20] [--clusters K]``; writes ``docs/results/routerdc7_online.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd

from sdk.atomic_write import write_atomic
from trainer.data.routerbench import EvalTable
from trainer.embeddings import EmbedderConfig
from trainer.experiments import embed_tables
from trainer.online import OnlineConfig, ScoringSet, Stream, run_online
from trainer.routers.kmeans_router import KMeansRouterConfig


def tables(path: Path) -> tuple[EvalTable, EvalTable]:
    frame = pd.read_parquet(path / "scores.parquet")
    models = tuple(frame.columns[3:])

    def table(part: pd.DataFrame, split: str) -> EvalTable:
        acc = part[list(models)].to_numpy(dtype=np.float64)
        return EvalTable(tuple(part["question"]), part["task"].to_numpy(dtype=object),
                         np.array([f"{split}-{i}" for i in range(len(part))], dtype=object), models, acc,
                         np.zeros_like(acc), f"{path}/scores.parquet[{split}]")

    return table(frame[frame.split == "train"], "train"), table(frame[frame.split == "test"], "test")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("../shared/data/routerdc7"))
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--clusters", type=int, default=3)
    args = ap.parse_args()
    train, test = tables(args.data)
    t0 = time.time()
    tr_emb, te_emb = embed_tables(train, test, EmbedderConfig(model="static:all-MiniLM-L6-v2"), None)
    print(f"embedded {train.n_queries + test.n_queries} prompts in {time.time() - t0:.0f} s", flush=True)
    stream = Stream(tr_emb, train.tasks, train.accuracy, train.cost, train.labelled())
    seen = np.isin(test.tasks, np.unique(train.tasks))
    config = OnlineConfig(kmeans=KMeansRouterConfig(n_clusters=args.clusters, prior_strength=32.0))
    out = {"seeds": args.seeds, "n_clusters": args.clusters, "models": list(train.models),
           "test_only_task_names": sorted(set(test.tasks[~seen].tolist()))}
    for name, rows in (("tasks_in_train", seen), ("test_only_tasks", ~seen)):
        t0 = time.time()
        scoring = ScoringSet(te_emb[rows], test.accuracy[rows], test.cost[rows])
        summary = run_online(stream, scoring, config, range(args.seeds), None)
        out[name] = {"n_rows": int(rows.sum()),
                     "best_single_accuracy": float(test.accuracy[rows].mean(axis=0).max()),
                     "oracle_accuracy": float(test.accuracy[rows].max(axis=1).mean()), **summary}
        print(name, int(rows.sum()), "rows", {p: (round(v["gain_mean"], 3), round(v["gain_se"], 3))
                                             for p, v in summary.items()}, f"{time.time() - t0:.0f} s", flush=True)
    path = Path(__file__).resolve().parents[1] / "docs" / "results" / "routerdc7_online.json"
    write_atomic(path, json.dumps(out, indent=1).encode())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
