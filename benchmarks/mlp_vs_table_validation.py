"""Paired comparison of the federated MLP router against the K-means cell table on a VALIDATION split
carved from train (never test), under the paper's fixed-logging protocol: does the MLP match the table
(MLP >= table - 0.01 in gain)? Decides which router ``fedroute simulate`` recommends by default.

Both routers are trained on the same sparse logs of each seed (:func:`trainer.simulation.simulate_clients`
on the 75% stream rows) and scored on the 25% validation rows (benchmarks/online_settings.py's split).
Run: ``PYTHONPATH=. HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 10 python benchmarks/mlp_vs_table_validation.py [--seeds 20]``;
writes ``docs/results/mlp_vs_table_validation.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.online_settings import DATA, validation_split
from sdk.atomic_write import write_atomic
from trainer import kinds, metrics
from trainer.data.routerbench import load_routerbench_dir
from trainer.embeddings import EmbedderConfig
from trainer.experiments import embed_tables
from trainer.routers.kmeans_router import KMeansRouterConfig
from trainer.simulation import SimulationConfig, simulate_clients
from trainer.torch_device import set_cpu_threads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--clusters", type=int, default=3)
    ap.add_argument("--prior-strength", type=float, default=16.0)
    args = ap.parse_args()
    set_cpu_threads(1)
    train, test = load_routerbench_dir(DATA)
    emb, _ = embed_tables(train, test, EmbedderConfig(), None)
    full = train.labelled().all(axis=1)
    val = validation_split(train.tasks) & full
    stream, vtab, vemb = train.subset(np.flatnonzero(~val)), train.subset(np.flatnonzero(val)), emb[val]
    semb = emb[~val]
    zero = metrics.zero_router_report(vtab.accuracy, vtab.cost).auc
    oracle = metrics.oracle_report(vtab.accuracy, vtab.cost).auc
    config = SimulationConfig(routers=("mlp", "kmeans"),
                              kmeans=KMeansRouterConfig(n_clusters=args.clusters, prior_strength=args.prior_strength))
    gains: dict[str, list[float]] = {"mlp": [], "kmeans": []}
    for seed in range(args.seeds):
        t0 = time.time()
        rng = np.random.default_rng(seed)
        clients, _ = simulate_clients(stream, semb, config, rng)
        for kind in ("mlp", "kmeans"):
            router = kinds.get(kind).fit_federated(clients, stream.models, config, np.random.default_rng([seed, 7]))
            auc = metrics.evaluate_router(*router.predict(vemb), vtab.accuracy, vtab.cost).auc
            gains[kind].append(metrics.gain(auc, zero, oracle))
        print(seed, {k: round(v[-1], 4) for k, v in gains.items()}, f"{time.time() - t0:.0f} s", flush=True)
    d = np.array(gains["mlp"]) - np.array(gains["kmeans"])
    payload = {"seeds": args.seeds, "kmeans": {"n_clusters": args.clusters, "prior_strength": args.prior_strength},
               "gain_per_seed": gains, "mlp_minus_table_mean": float(d.mean()),
               "mlp_minus_table_se": float(d.std(ddof=1) / np.sqrt(d.size)),
               "gain_mean": {k: float(np.mean(v)) for k, v in gains.items()}}
    out = Path(__file__).resolve().parents[1] / "docs" / "results" / "mlp_vs_table_validation.json"
    write_atomic(out, json.dumps(payload, indent=1).encode())
    print(payload["gain_mean"], payload["mlp_minus_table_mean"], payload["mlp_minus_table_se"])


if __name__ == "__main__":
    main()
