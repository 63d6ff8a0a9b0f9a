"""Would more helpfulness prompts close the cross-category gap? A learning curve of the router's data, measured on a
VALIDATION category only (leave one AlpacaEval subset out, never koala).

Every earlier round ended on "what would close the rest is a router that has seen more or more varied helpfulness
prompts" (docs/mor.md). This script tests that claim before anyone acts on it: in each leave-one-category-out cell
of ``benchmarks/mor_settings_setup.py`` (default pool, every client an MLP, seeds 0..2 x folds = the AlpacaEval
subsets of the pool but koala), the router is trained with the helpfulness client holding a nested random fraction
f of its training *prompts* (all pairs of a kept prompt; the other clients and every reward model unchanged), for
f in FRACTIONS. Scored with the default rules (``sparse<0.8,top2|prompt`` and ``soft|prompt|T=1|ovr``): accuracy on
the validation category, its gap to the helpfulness RM alone on the same pairs, the share of its pairs routed away
from the helpfulness client, and the clients' in-distribution validation accuracy.

The default pool gives the helpfulness client 450 of the 544 non-koala AlpacaEval prompts (x 0.6 for training), so
"all the data there is" is f = 544 / 450 = 1.21 of today's training prompts (``all_prompts_over_pool_prompts``); the
slope per doubling of f, fitted over the curve, says what that could add (optimistically: the curve is concave in log f).

``PYTHONPATH=. HF_HUB_OFFLINE=1 nice -n 5 python benchmarks/mor_router_data_curve.py [--quick]`` writes
``docs/mor_router_data_curve[_quick].json`` and ``.png``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.mor_settings_setup import loco_categories, loco_folds, setup, write_json  # noqa: E402
from trainer.data.preferences import load_preference_pairs  # noqa: E402
from trainer.report import save_figure  # noqa: E402
from trainer.rewards.client_router import ClientRouterData, FederatedRouterTrainer  # noqa: E402
from trainer.rewards.evaluation import routed_reward  # noqa: E402
from trainer.rewards.reward_models import pairwise_accuracy  # noqa: E402
from trainer.rewards.routing_rule import RoutingRule  # noqa: E402

FRACTIONS = (0.25, 0.5, 0.75, 1.0)
RULES = {"sparse": RoutingRule("sparse", 1.0, "prompt", 0.8, 2), "soft": RoutingRule("soft", 1.0, "prompt", probabilities="ovr")}


def prompt_subset(prompts: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask (n_pairs,) keeping every pair of the first ``ceil(fraction * n_prompts)`` prompts of a
    seeded permutation of the unique prompts (nested over fractions for one seed)."""
    uniq = np.unique(prompts)
    order = uniq[np.random.default_rng(seed).permutation(len(uniq))]
    keep = set(order[: int(np.ceil(fraction * len(uniq)))])
    return np.array([p in keep for p in prompts])


def main(argv: list[str]) -> None:
    bench = setup(argv)
    cfg, names = bench.cfg, bench.names
    own, folds = loco_categories(bench)
    t0 = time.perf_counter()
    pool = bench.trainer.load_pool()
    everything = load_preference_pairs(cfg.data_dir, ("alpacaeval",), seed=cfg.pool_seed)
    growth = (everything[everything["subset"] != cfg.heldout_subset]["prompt_id"].nunique()
              / pool[pool["client"] == names[own]]["prompt_id"].nunique())
    cells = []
    for fold in loco_folds(bench):
        s_cat, fc_cat, fr_cat, g_cat = fold.cat
        prompts = np.asarray(fold.clients[own].pairs("train").prompts)
        d_own = fold.data[own]
        cell = {"seed": fold.seed, "fold": fold.category, "n_cat": int(s_cat.shape[1]),
                "own_rm_cat": pairwise_accuracy(s_cat[0, :, own], s_cat[1, :, own]), "curve": {}}
        for f in FRACTIONS:
            m = prompt_subset(prompts, f, fold.seed)
            data = list(fold.data)
            data[own] = ClientRouterData(d_own.features_chosen[m], d_own.features_rejected[m], own)
            router = FederatedRouterTrainer(replace(cfg.router, weighting="equal", seed=fold.seed)).train(data, names)
            z_cat = np.stack([router.logits(fc_cat), router.logits(fr_cat)]).astype(np.float64)
            zs = [np.stack([router.logits(fc), router.logits(fr)]).astype(np.float64) for _, fc, fr, _ in fold.val]
            away = (z_cat.argmax(-1) != own).any(0).mean()
            row = {"n_own_train_pairs": int(m.sum()), "away_share": float(away)}
            for mode, rule in RULES.items():
                r = routed_reward(s_cat, z_cat, rule, g_cat)
                row[f"{mode}_cat"] = pairwise_accuracy(r[0], r[1])
                row[f"{mode}_id_val"] = float(np.mean([pairwise_accuracy(*routed_reward(v[0], z, rule, v[3]))
                                                       for v, z in zip(fold.val, zs)]))
            cell["curve"][str(f)] = row
        cells.append(cell)
        print({"seed": fold.seed, "fold": fold.category, "own_rm_cat": round(cell["own_rm_cat"], 3),
               **{f: (round(v["sparse_cat"], 3), round(v["away_share"], 3)) for f, v in cell["curve"].items()}}, flush=True)
    out = {"clients": "every client an MLP", "router": "MoRConfig().router, equal weighting",
           "rules": {k: repr(v) for k, v in RULES.items()}, "fractions": list(FRACTIONS), "folds": folds,
           "split": "validation pairs + a validation category (never koala)", "all_prompts_over_pool_prompts": growth,
           **summarise(cells, growth), "cells": cells,
           "seconds": time.perf_counter() - t0}
    path = write_json("mor_router_data_curve", bench.quick, out)
    plot(out, path.with_suffix(".png"))
    report(out)
    print(f"wrote {path} in {out['seconds']:.0f} s")


def summarise(cells: list[dict], growth: float) -> dict:
    """Means over cells per fraction, the gap to the own RM paired per cell (± standard error), and the slope of
    each mode's category gap per doubling of the fraction (least squares on log2 f, per cell, then mean ± SE), and
    the gap that slope gives at f = ``growth`` (every non-held-out AlpacaEval prompt in the pool)."""
    own = np.array([c["own_rm_cat"] for c in cells])
    table, slopes = {}, {}
    x = np.log2(np.array(FRACTIONS))
    for f in map(str, FRACTIONS):
        row = {"away_share": float(np.mean([c["curve"][f]["away_share"] for c in cells]))}
        for mode in RULES:
            cat = np.array([c["curve"][f][f"{mode}_cat"] for c in cells])
            gap = cat - own
            row |= {f"{mode}_cat": float(cat.mean()), f"{mode}_gap": float(gap.mean()),
                    f"{mode}_gap_se": float(gap.std(ddof=1) / np.sqrt(len(gap))),
                    f"{mode}_id_val": float(np.mean([c["curve"][f][f"{mode}_id_val"] for c in cells]))}
        table[f] = row
    for mode in RULES:
        per_cell = [np.polyfit(x, [c["curve"][str(f)][f"{mode}_cat"] - c["own_rm_cat"] for f in FRACTIONS], 1)[0] for c in cells]
        slopes[mode] = {"gap_per_doubling": float(np.mean(per_cell)),
                        "se": float(np.std(per_cell, ddof=1) / np.sqrt(len(per_cell))),
                        "extrapolated_gap_all_prompts": float(table["1.0"][f"{mode}_gap"] + np.mean(per_cell) * np.log2(growth))}
    return {"own_rm_cat": float(own.mean()), "table": table, "slopes": slopes}


def plot(out: dict, path) -> None:
    f = np.array(out["fractions"])
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    for mode in RULES:
        gap = np.array([out["table"][str(v)][f"{mode}_gap"] for v in f])
        se = np.array([out["table"][str(v)][f"{mode}_gap_se"] for v in f])
        ax[0].errorbar(f, gap, yerr=se, marker="o", capsize=3, label=mode)
    ax[0].axhline(0, color="grey", lw=0.8)
    ax[0].set(xscale="log", xlabel="fraction of the helpfulness client's training prompts (router only)",
              ylabel="category accuracy - helpfulness RM", title="gap on the validation category")
    ax[0].legend()
    ax[1].plot(f, [out["table"][str(v)]["away_share"] for v in f], marker="o")
    ax[1].set(xscale="log", xlabel="fraction of training prompts", ylabel="share of pairs", title="pairs routed away (top-1)")
    for a in ax:
        a.set_xticks(f, [f"{v:g}" for v in f])
        a.minorticks_off()
    save_figure(fig, path, dpi=120)  # lays out, writes atomically, closes


def report(out: dict) -> None:
    print(f"helpfulness RM on the validation categories: {out['own_rm_cat']:.4f}")
    for f, row in out["table"].items():
        print(f"f={f:5s} away {row['away_share']:.3f} " + " ".join(
            f"{m}: cat {row[f'{m}_cat']:.4f} gap {row[f'{m}_gap']:+.4f} ± {row[f'{m}_gap_se']:.4f} id {row[f'{m}_id_val']:.4f}" for m in RULES))
    for m, s in out["slopes"].items():
        print(f"{m}: gap per doubling {s['gap_per_doubling']:+.4f} ± {s['se']:.4f}; extrapolated to every prompt (f = {out['all_prompts_over_pool_prompts']:.2f}): {s['extrapolated_gap_all_prompts']:+.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
