"""Choose the online replay's K-means settings (K, shrinkage) and exploring policy on a VALIDATION
split carved from train (never test): ``fedroute simulate --online``'s defaults.

The train split's fully labelled rows are split once (seeded, stratified by task) into 75% stream and
25% validation; every candidate streams the 75% (one label per query) over 20+ seeds and is scored
on the validation rows by the METRICS.md gain.
Run: ``PYTHONPATH=. HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/online_settings.py [--data ../shared/data/routerbench] [--seeds 20] [--stage kmeans|policy|posterior|confirm|targets]``;
writes ``docs/results/online_settings_<stage>.json``.

Stage ``targets`` (the default exploring policy, issue 26's targets): every candidate and ``fixed`` on
the same seeds; the choice rule (:func:`choose`) maximises validation gain subject to the served
queries' mean cost <= 1.5 x fixed logging's and their accuracy >= fixed logging's.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import numpy as np

from sdk.atomic_write import write_atomic
from trainer.data.routerbench import load_routerbench_dir
from trainer.embeddings import EmbedderConfig
from trainer.experiments import embed_tables
from trainer.online import OnlineConfig, Stream, ScoringSet, run_online
from trainer.routers.kmeans_router import KMeansRouterConfig
from trainer import metrics

DATA = Path("../shared/data/routerbench")  # beside the checkout, as the docs' commands


def validation_split(tasks: np.ndarray, share: float = 0.25, seed: int = 20261207) -> np.ndarray:
    """Boolean mask (n,) of the validation rows: ``share`` of each task, drawn once with ``seed``."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(tasks.shape[0], dtype=bool)
    for task in sorted(set(tasks.tolist())):
        idx = np.flatnonzero(tasks == task)
        mask[rng.choice(idx, size=int(round(share * idx.shape[0])), replace=False)] = True
    return mask


def carve(data: Path):
    """(stream, validation ScoringSet, weak/strong points) from the train split only."""
    train, test = load_routerbench_dir(data)
    emb, _ = embed_tables(train, test, EmbedderConfig(), None)
    full = train.labelled().all(axis=1)
    val = validation_split(train.tasks) & full
    keep = ~val & train.labelled().any(axis=1)
    stream = Stream(emb[keep], train.tasks[keep], train.accuracy[keep], np.asarray(train.cost)[keep],
                    train.labelled()[keep])
    vset = ScoringSet(emb[val], train.accuracy[val], np.asarray(train.cost)[val])
    single = metrics.single_model_points(train.accuracy[keep & full], np.asarray(train.cost)[keep & full])
    w, s = metrics.weak_strong_pair(single)
    vsingle = metrics.single_model_points(vset.accuracy, vset.cost)
    return stream, vset, (vsingle[w], vsingle[s])


#: Stage ``targets``: name -> OnlineConfig fields of one exploring policy (K and shrinkage from --clusters etc.).
TARGET_CANDIDATES = {
    "thompson (linear cost axis)": dict(policies=("thompson",)),
    "thompson (sqrt cost axis)": dict(policies=("thompson",), thompson_axis_power=0.5),
    "thompson (log cost axis)": dict(policies=("thompson",), thompson_axis_power=0.0),
    "top_two (beta 0.75, linear axis)": dict(policies=("top_two",), top_two_u_power=1.0, beta_tt=0.75),
    "top_two (beta 0.5, u = v^2)": dict(policies=("top_two",), top_two_u_power=2.0, beta_tt=0.5),
    "top_two (beta 0.75, sqrt cost axis)": dict(policies=("top_two",), top_two_u_power=1.0, beta_tt=0.75,
                                               top_two_axis_power=0.5),
    "top_two (beta 0.5, sqrt cost axis)": dict(policies=("top_two",), top_two_u_power=1.0, beta_tt=0.5,
                                              top_two_axis_power=0.5),
}
#: The served-cost limit of the choice rule, as a multiple of fixed logging's mean served cost.
COST_LIMIT = 1.5


def choose(results: dict[str, dict], fixed: dict) -> str | None:
    """The candidate with the highest validation gain among those whose served queries cost at most
    ``COST_LIMIT`` x fixed logging's mean and are at least as accurate; None if none qualifies."""
    ok = [name for name, r in results.items()
          if r["served_cost_usd"] <= COST_LIMIT * fixed["served_cost_usd"] and r["served_acc"] >= fixed["served_acc"]]
    return max(ok, key=lambda name: results[name]["gain_mean"], default=None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--stage", choices=("kmeans", "policy", "posterior", "confirm", "targets"), default="kmeans")
    ap.add_argument("--clusters", type=int, default=3)
    ap.add_argument("--prior-strength", type=float, default=16.0)
    ap.add_argument("--passes", type=float, default=1.0)
    args = ap.parse_args()
    stream, vset, ws = carve(args.data)
    print(f"stream {stream.accuracy.shape[0]} rows, validation {vset.accuracy.shape[0]} rows", flush=True)
    rows = []
    if args.stage == "kmeans":
        grid = [dict(kmeans=KMeansRouterConfig(n_clusters=k, prior_strength=kap), policies=("fixed", "thompson"))
                for k, kap in itertools.product((2, 3, 4, 6), (4.0, 8.0, 16.0, 32.0))]
    elif args.stage == "policy":
        km = KMeansRouterConfig(n_clusters=args.clusters, prior_strength=args.prior_strength)
        grid = [dict(kmeans=km, policies=("thompson", "top_two"), thompson_u_power=p, top_two_u_power=p, beta_tt=b)
                for p, b in itertools.product((1.0, 2.0, 3.0, 4.0), (0.5, 0.75))]
    elif args.stage == "confirm":  # the front-runners again, on more seeds (run with --seeds 60)
        km = KMeansRouterConfig(n_clusters=args.clusters, prior_strength=args.prior_strength)
        grid = [dict(kmeans=km, policies=("fixed", "uniform", "thompson", "top_two"), top_two_u_power=1.0, beta_tt=0.75),
                dict(kmeans=km, policies=("top_two",), top_two_u_power=2.0, beta_tt=0.5)]
    elif args.stage == "targets":
        km = KMeansRouterConfig(n_clusters=args.clusters, prior_strength=args.prior_strength)
        grid = [dict(kmeans=km, policies=("fixed",))] + [dict(kmeans=km, **c) for c in TARGET_CANDIDATES.values()]
    else:  # the exploring posterior's prior strength, and positions favouring the expensive end
        km = KMeansRouterConfig(n_clusters=args.clusters, prior_strength=args.prior_strength)
        grid = ([dict(kmeans=km, policies=("thompson",), thompson_u_power=p) for p in (0.5, 0.75)]
                + [dict(kmeans=km, policies=("thompson",), explore_prior_strength=k) for k in (8.0, 16.0, 64.0)])
    for cand in grid:
        t0 = time.time()
        cfg = OnlineConfig(passes=args.passes, **cand)
        summary = run_online(stream, vset, cfg, range(args.seeds), ws)
        row = {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in cand.items()}
        row["results"] = {p: {k: v for k, v in summary[p].items() if k not in ("curve", "curve_se", "gain_per_seed")}
                          for p in cfg.policies}
        row["gain_per_seed"] = {p: summary[p]["gain_per_seed"] for p in cfg.policies}
        row["dense_ceiling"] = summary["dense_ceiling"]
        rows.append(row)
        brief = "  ".join(f"{p} {summary[p]['gain_mean']:.4f}±{summary[p]['gain_se']:.4f} "
                          f"save {summary[p]['cost_saved_at_best_acc_median']:.2f} never {summary[p]['never_reaches_best_share']:.2f} "
                          f"served {summary[p]['served_acc']:.3f}/{summary[p]['served_cost_usd']*1e3:.2f}e-3"
                          for p in cfg.policies)
        print({k: v for k, v in row.items() if k not in ("results", "gain_per_seed")}, brief,
              f"ceiling {summary['dense_ceiling']['gain_mean']:.3f} ({time.time() - t0:.0f} s)", flush=True)
    extra = {}
    if args.stage == "targets":
        fixed = rows[0]["results"]["fixed"]
        named = {name: row["results"][row["policies"][0]] for name, row in zip(TARGET_CANDIDATES, rows[1:])}
        for name, r in named.items():
            print(f"{name}: gain {r['gain_mean']:.4f} ± {r['gain_se']:.4f}, served cost {r['served_cost_usd'] / fixed['served_cost_usd']:.2f}x "
                  f"fixed, served acc {r['served_acc']:.3f} vs {fixed['served_acc']:.3f}")
        extra = {"rule": f"max validation gain s.t. served cost <= {COST_LIMIT} x fixed and served acc >= fixed",
                 "candidates": list(TARGET_CANDIDATES), "chosen": choose(named, fixed)}
        print("chosen:", extra["chosen"])
    out = Path(__file__).resolve().parents[1] / "docs" / "results" / f"online_settings_{args.stage}.json"
    write_atomic(out, json.dumps({"seeds": args.seeds, "passes": args.passes, "rows": rows, **extra}, indent=1).encode())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
