"""Router-side changes against the confident misroutes of an unseen AlpacaEval category, chosen on VALIDATION folds
only (leave one AlpacaEval subset out of the helpfulness client and the router, never koala).

Setup and choice rule: those of ``benchmarks/mor_heldout_gap_settings.py`` (default pool, every client an MLP, seeds
0..2 x folds = the AlpacaEval subsets of the pool but koala; the validation category S is removed from the
helpfulness client, so its reward model and the router never see it). The routing rules are the current defaults,
``MoRConfig().sparse_rule()`` (``sparse<0.8,top2|prompt``) and ``MoRConfig().soft_rule()`` (``soft|prompt|T=1|ovr``).

Candidates (each keeps the paper's router: BCE towards the own client index, FedAvg with equal weighting; only
the router differs, the client reward models are the same per cell):

- ``base``: ``MoRConfig().router``;
- ``ls0.05``, ``ls0.1``: label smoothing of the BCE targets, ``(1 - eps) e_k + eps / K`` (Szegedy et al. 2016,
  Sec. 7; ``RouterConfig.label_smoothing``): a router trained towards 0/1 targets is pushed to certainty on any row
  that looks like one client's data, smoothing bounds the logits it aims for;
- ``ens3``: the mean of the logits of 3 routers, each FedAvg-trained from its own initialisation seed (seed,
  seed + 1000, seed + 2000; ``stack_routers``: one router of 3x the width, so saving, export and online routing are
  unchanged); communication 3x per round (reported);
- ``r15``: 15 rounds instead of 30 (fewer router epochs: less time to grow confident).

Choice rule fixed before the run: the highest mean of (ID validation accuracy, validation-category accuracy), means
over the 12 seed x fold cells, per mode (sparse, soft); a candidate replaces the default only when it beats
``base``'s score (ties keep the default). Also per candidate: the share of validation-category pairs routed away
with the largest softmax weight >= 0.8 (the "away, sure" bucket of the diagnosis) and its cost.

``PYTHONPATH=. HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/mor_router_generalisation_settings.py`` writes
``docs/mor_router_generalisation_settings.json``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import numpy as np
import torch

from benchmarks.mor_heldout_gap_settings import buckets
from benchmarks.mor_settings_setup import loco_categories, loco_folds, print_candidates, score_table, setup, write_json
from trainer.rewards.client_router import FederatedRouterTrainer, router_bce_loss, stack_routers
from trainer.rewards.evaluation import routed_reward
from trainer.rewards.reward_models import pairwise_accuracy

CANDIDATES = {"base": {}, "ls0.05": {"label_smoothing": 0.05}, "ls0.1": {"label_smoothing": 0.1},
              "ens3": {"ensemble": 3}, "r15": {"rounds": 15}}
# second batch (``--batch2``, run after the first batch's table was seen, same folds and rule): early stopping of the
# router's rounds on the clients' in-distribution validation pairs, and a 5-member ensemble
CANDIDATES_2 = {"base": {}, "es": {"early_stop": True}, "ens5": {"ensemble": 5}}
ES_ROUNDS = (5, 10, 15, 20, 25, 30)
EARLY_STOP_ROUNDS: list[int] = []


def val_bce(router, val) -> float:
    """Mean over clients (equal weight) of the router loss ``L_router^(k)`` on client k's validation pairs."""
    losses = []
    for k, (_, fc, fr, _) in enumerate(val):
        losses.append(float(router_bce_loss(torch.from_numpy(router.logits(fc)), torch.from_numpy(router.logits(fr)), k)))
    return float(np.mean(losses))


def train_router(cfg_router, data, names, seed: int, ensemble: int = 1, early_stop: bool = False, val=None, **overrides):
    """(router, bytes per round): ``ensemble`` FedAvg-trained routers (seeds seed + 1000 m) stacked by logit mean;
    ``early_stop``: the number of rounds in :data:`ES_ROUNDS` with the lowest :func:`val_bce` on ``val`` (training
    with R rounds is the first R rounds of the 30-round run: every client takes part, shuffling is seeded per round)."""
    if early_stop:
        runs = [train_router(cfg_router, data, names, seed, rounds=r) for r in ES_ROUNDS]
        best = int(np.argmin([val_bce(rt, val) for rt, _ in runs]))
        EARLY_STOP_ROUNDS.append(ES_ROUNDS[best])
        return runs[best]
    members, nbytes = [], 0
    for m in range(ensemble):
        rt = FederatedRouterTrainer(replace(cfg_router, weighting="equal", seed=seed + 1000 * m, **overrides))
        members.append(rt.train(data, names))
        nbytes += rt.bytes_per_round_
    return (members[0] if ensemble == 1 else stack_routers(members)), nbytes


def main(argv: list[str]) -> None:
    bench = setup(argv)
    cfg, names = bench.cfg, bench.names
    rules = {"sparse": cfg.sparse_rule(), "soft": cfg.soft_rule()}
    own, folds = loco_categories(bench)
    t0 = time.perf_counter()
    batch2 = "--batch2" in argv
    cands = CANDIDATES_2 if batch2 else CANDIDATES
    cells, router_seconds, nbytes = [], dict.fromkeys(cands, 0.0), {}
    for fold in loco_folds(bench):
        seed, cat, data, val = fold.seed, fold.category, fold.data, fold.val
        s_cat, fc_cat, fr_cat, g_cat = fold.cat
        cell = {"seed": seed, "fold": cat, "n_cat": int(s_cat.shape[1]),
                "own_rm_val": [pairwise_accuracy(v[0][0, :, k], v[0][1, :, k]) for k, v in enumerate(val)],
                "own_rm_cat": pairwise_accuracy(s_cat[0, :, own], s_cat[1, :, own]), "val": {}, "cat": {}, "away_sure": {}}
        for name, kw in cands.items():
            t = time.perf_counter()
            router, nbytes[name] = train_router(cfg.router, data, names, seed, val=val, **kw)
            router_seconds[name] += time.perf_counter() - t
            zs = [np.stack([router.logits(fc), router.logits(fr)]).astype(np.float64) for _, fc, fr, _ in val]
            z_cat = np.stack([router.logits(fc_cat), router.logits(fr_cat)]).astype(np.float64)
            for mode, rule in rules.items():
                acc = lambda s, z, g: pairwise_accuracy(*routed_reward(s, z, rule, g))  # noqa: E731
                cell["val"][f"{name}/{mode}"] = [acc(v[0], z, v[3]) for v, z in zip(val, zs)]
                cell["cat"][f"{name}/{mode}"] = acc(s_cat, z_cat, g_cat)
            b = buckets(s_cat, z_cat, g_cat, own)["away_sure"]
            cell["away_sure"][name] = {"share": b["share"], "cost": b["cost"]}
        cells.append(cell)
        print(json.dumps({"seed": seed, "fold": cat, "own_rm_cat": round(cell["own_rm_cat"], 3),
                          **{k: round(v, 3) for k, v in cell["cat"].items()},
                          "t": round(time.perf_counter() - t0)}), flush=True)
    out = {"clients": "every client an MLP", "router": "MoRConfig().router (pair, dropout 0.5, wd 1, equal)",
           "rules": {m: r.variant for m, r in rules.items()}, "candidates": cands,
           "early_stop_rounds": EARLY_STOP_ROUNDS,
           "seeds": [0, 1, 2], "folds": folds, "split": "validation pairs + a validation category (never koala)",
           "router_bytes_per_round": nbytes, "router_seconds_total": router_seconds,
           **summarise(cells), "cells": cells, "seconds": time.perf_counter() - t0}
    path = write_json("mor_router_generalisation_settings" + ("_batch2" if batch2 else ""), False, out)
    report(out)
    print(f"wrote {path} in {out['seconds']:.0f} s")


def summarise(cells: list[dict]) -> dict:
    names = list(cells[0]["cat"])
    table = score_table(cells, lambda n: "base/" + n.split("/")[1])
    for n in names:
        cand = n.split("/")[0]
        table[n] |= {"cat_minus_own_rm": float(np.mean([c["cat"][n] - c["own_rm_cat"] for c in cells])),
                     "away_sure_share": float(np.mean([c["away_sure"][cand]["share"] for c in cells])),
                     "away_sure_cost": float(np.mean([c["away_sure"][cand]["cost"] for c in cells]))}
    chosen = {m: max((n for n in names if n.endswith("/" + m)), key=lambda n: (table[n]["score"], n == f"base/{m}"))
              for m in ("sparse", "soft")}
    oracle = {"id": float(np.mean([np.mean(c["own_rm_val"]) for c in cells])), "cat": float(np.mean([c["own_rm_cat"] for c in cells]))}
    return {"table": table, "oracle_own_rm": oracle, "chosen": chosen}


def report(out: dict) -> None:
    o = out["oracle_own_rm"]
    print(f"own RM: id {o['id']:.4f} cat {o['cat']:.4f}")
    print_candidates(out["table"], 14, lambda v: f"  away-sure {v['away_sure_share']:.3f} cost {v['away_sure_cost']:.4f}")
    print("router bytes/round", out["router_bytes_per_round"], "router s", {k: round(v) for k, v in out["router_seconds_total"].items()})
    print("chosen:", out["chosen"])


if __name__ == "__main__":
    main(sys.argv[1:])
