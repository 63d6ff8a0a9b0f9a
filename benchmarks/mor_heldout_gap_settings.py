"""Where router + RM loses against the helpfulness RM alone on an unseen AlpacaEval category, and which principled
change of the routing closes it, chosen on a VALIDATION category only (leave one AlpacaEval subset out, never koala).

Setup: that of ``benchmarks/mor_router_inputs_settings.py --loco`` (default pool, every client an MLP, seeds 0..2 x
folds = the AlpacaEval subsets of the pool but koala): in fold S the subset S is removed from the helpfulness client,
so its reward model and the router never see it, and S's pairs are the validation category. One router per fold:
``MoRConfig().router`` (pair input, dropout 0.5, weight decay 1, equal weighting), the default.

Diagnosis (per fold, the default rule ``sparse<0.8|prompt``): the validation category's pairs in four buckets by
where the router sends them (``home``: the largest routing weight is the helpfulness client for both responses, else
``away``) and how sure it is (``sure``: the pair's largest weight >= 0.8, else ``unsure``, scored by the soft
fallback); per bucket the share of pairs, the routed accuracy, the helpfulness RM's accuracy on the same pairs and the
cost (helpfulness RM minus routed, per pair of the category).

Candidates (each scored on the clients' in-distribution validation pairs and the validation category; all keep the
router trained by BCE towards the own client index with FedAvg):

- ``base``: the current defaults (``sparse<0.8|prompt``, ``soft|prompt|T=1``), and the same family at tau 0.6 / 0.95;
- ``calT``: router calibration by temperature scaling (Guo et al. 2017, "On Calibration of Modern Neural Networks",
  Sec. 4.2): one T per fold minimising the softmax cross-entropy of the router on the clients' in-distribution
  VALIDATION responses towards their own client; routing weights ``softmax(z / T)`` (the fallback threshold then
  compares calibrated probabilities), tau in (0.6, 0.8, 0.95) and soft;
- ``prior``: logit adjustment for the clients' share of training pairs (Menon et al. 2021, "Long-tail learning via
  logit adjustment", Eq. 8): the router was trained class-balanced (equal weighting), ``z + log pi_k`` with
  ``pi_k = n_k / sum n`` restores the prior of the traffic the clients' data stands for;
- ``top2``: the fallback mixes only the two clients with the largest weights (renormalised): an unsure row is scored
  by the two candidate criteria, not by a third client the router all but rules out;
- ``sig``: "unsure" read from the router's own one-vs-rest probabilities: the BCE loss (paper 001, ``L_router``)
  trains ``sigmoid(z_k)`` = P(client k's data), and the softmax hides a row no client claims (all sigmoids low,
  an unseen kind of prompt); sparse unless the pair's largest mean ``sigmoid(z_k)`` is below tau;
- ``ovr``: routing weights ``sigmoid(z) / sum_k sigmoid(z_k)`` (the same probabilities, normalised) instead of the
  softmax, tau in (0.6, 0.8, 0.95) and soft.

Choice rule fixed before the run (as ``--loco``): the highest mean of (ID validation accuracy, validation-category
accuracy), means over seeds and folds; sparse-like and soft rules separately. A candidate replaces the default only
when it beats the default's score (ties keep the default).

``PYTHONPATH=. HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/mor_heldout_gap_settings.py`` writes
``docs/mor_heldout_gap_settings.json``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import numpy as np
from scipy.optimize import minimize_scalar

from benchmarks.mor_settings_setup import loco_categories, loco_folds, print_candidates, score_table, setup, write_json
from trainer.rewards.client_router import FederatedRouterTrainer
from trainer.rewards.evaluation import routed_reward
from trainer.rewards.reward_models import pairwise_accuracy
from trainer.rewards.routing_rule import RoutingRule, softmax

TAUS = (0.6, 0.8, 0.95)


def fit_temperature(z: np.ndarray, own: np.ndarray) -> float:
    """Temperature scaling: T > 0 minimising mean ``-log softmax(z / T)[own]`` over rows z (n, K), own (n,) ints."""
    def nll(log_t: float) -> float:
        p = softmax(z / np.exp(log_t))
        return float(-np.log(np.clip(p[np.arange(len(z)), own], 1e-12, None)).mean())
    return float(np.exp(minimize_scalar(nll, bounds=(-4.0, 4.0), method="bounded").x))


def rule_reward(s: np.ndarray, z: np.ndarray, groups: np.ndarray, tau: float | None, temperature: float = 1.0,
                bias: np.ndarray | None = None, top: int | None = None, sure: str = "softmax",
                weights: str = "softmax") -> np.ndarray:
    """Routed reward (2, n) of scores s (2, n, K) and logits z (2, n, K), responses of a prompt routed together:
    weights ``softmax((z + bias) / T)`` (``weights="ovr"``: ``sigmoid(z) / sum_k sigmoid(z_k)``, the one-vs-rest
    probabilities the BCE loss trains) averaged per prompt group; tau None = soft for every row, else sparse except
    rows whose largest weight (``sure="sigmoid"``: largest group-mean ``sigmoid(z_k)``) is below tau (soft fallback,
    over the ``top`` largest weights renormalised if set)."""
    flat = (np.asarray(z) + (0 if bias is None else bias)).reshape(-1, z.shape[-1])
    g = np.concatenate([groups, groups])
    grouped = lambda p: RoutingRule("soft", 1.0, "prompt").weights(np.log(np.clip(p, 1e-300, None)), g)  # noqa: E731
    sig = 1 / (1 + np.exp(-flat / temperature))
    if weights == "ovr":
        w = grouped(sig / sig.sum(1, keepdims=True))
    else:
        w = RoutingRule("soft", temperature, "prompt").weights(flat, g)
    conf = w.max(1)
    if sure == "sigmoid":
        # group mean of the per-client sigmoid probabilities (softmax of their logs renormalises, so average by hand)
        _, inv = np.unique(g, return_inverse=True)
        sums = np.zeros((inv.max() + 1, sig.shape[1]))
        np.add.at(sums, inv, sig)
        conf = (sums[inv] / np.bincount(inv)[inv, None]).max(1)
    sf = np.asarray(s).reshape(flat.shape)
    if top is not None:
        keep = np.argsort(-w, axis=1)[:, :top]
        m = np.zeros_like(w)
        np.put_along_axis(m, keep, 1.0, axis=1)
        w = w * m / (w * m).sum(1, keepdims=True)
    mix = (w * sf).sum(1)
    if tau is None:
        return mix.reshape(z.shape[:2])
    top1 = sf[np.arange(len(sf)), w.argmax(1)]
    return np.where(conf < tau, mix, top1).reshape(z.shape[:2])


def candidates(t_cal: float, bias: np.ndarray) -> dict:
    """name -> kwargs of :func:`rule_reward`."""
    out = {}
    for name, kw in (("base", {}), ("calT", {"temperature": t_cal}), ("prior", {"bias": bias}), ("top2", {"top": 2}),
                     ("sig", {"sure": "sigmoid"}), ("ovr", {"weights": "ovr"})):
        for tau in TAUS:
            out[f"{name}/sparse<{tau:g}"] = kw | {"tau": tau}
        if name not in ("top2", "sig"):
            out[f"{name}/soft"] = kw | {"tau": None}
    return out


def buckets(s: np.ndarray, z: np.ndarray, groups: np.ndarray, own: int, tau: float = 0.8) -> dict:
    """Diagnosis of ``sparse<tau|prompt`` on a set of pairs owned by client ``own``: per bucket (home|away) x
    (sure|unsure) the share of pairs, routed and own-RM accuracy, and the cost per pair of the set."""
    won = lambda r: (r[0] > r[1]) + 0.5 * (r[0] == r[1])  # noqa: E731
    routed = won(rule_reward(s, z, groups, tau))
    own_acc = won(s[..., own])
    w = RoutingRule("soft", 1.0, "prompt").weights(z.reshape(-1, z.shape[-1]), np.concatenate([groups, groups])).reshape(z.shape)
    away = (w.argmax(-1) != own).any(0)
    unsure = (w.max(-1) < tau).any(0)
    out = {}
    n = len(routed)
    for b, m in (("home_sure", ~away & ~unsure), ("home_unsure", ~away & unsure), ("away_sure", away & ~unsure),
                 ("away_unsure", away & unsure)):
        out[b] = {"share": float(m.mean()), "routed": float(routed[m].mean()) if m.any() else None,
                  "own_rm": float(own_acc[m].mean()) if m.any() else None,
                  "cost": float((own_acc[m].sum() - routed[m].sum()) / n),
                  "away_to": np.bincount(w.argmax(-1)[:, m].ravel(), minlength=z.shape[-1]).tolist()}
    return out


def main(argv: list[str]) -> None:
    bench = setup(argv)
    cfg, names = bench.cfg, bench.names
    own, folds = loco_categories(bench)
    t0 = time.perf_counter()
    cells = []
    for fold in loco_folds(bench):
        seed, cat, clients, data, val = fold.seed, fold.category, fold.clients, fold.data, fold.val
        s_cat, fc_cat, fr_cat, g_cat = fold.cat
        router = FederatedRouterTrainer(replace(cfg.router, weighting="equal", seed=seed)).train(data, names)
        zs = [np.stack([router.logits(fc), router.logits(fr)]).astype(np.float64) for _, fc, fr, _ in val]
        z_cat = np.stack([router.logits(fc_cat), router.logits(fr_cat)]).astype(np.float64)
        t_cal = fit_temperature(np.concatenate([z.reshape(-1, z.shape[-1]) for z in zs]),
                                np.concatenate([np.full(z.shape[0] * z.shape[1], k) for k, z in enumerate(zs)]))
        n_train = np.array([len(cl.train) for cl in clients], dtype=np.float64)
        bias = np.log(n_train / n_train.sum())
        cands = candidates(t_cal, bias)
        acc = lambda r: pairwise_accuracy(r[0], r[1])  # noqa: E731
        # the script's rule_reward must equal the library's RoutingRule on the defaults (one code path)
        for name, rule in (("base/sparse<0.8", RoutingRule("sparse", 1.0, "prompt", 0.8)), ("base/soft", RoutingRule("soft", 1.0, "prompt")),
                           ("top2/sparse<0.8", RoutingRule("sparse", 1.0, "prompt", 0.8, 2)),
                           ("ovr/soft", RoutingRule("soft", 1.0, "prompt", probabilities="ovr"))):
            assert np.allclose(rule_reward(s_cat, z_cat, g_cat, **cands[name]), routed_reward(s_cat, z_cat, rule, g_cat))
        cell = {"seed": seed, "fold": cat, "n_cat": int(s_cat.shape[1]), "t_cal": t_cal, "prior": np.exp(bias).tolist(),
                "own_rm_val": [pairwise_accuracy(v[0][0, :, k], v[0][1, :, k]) for k, v in enumerate(val)],
                "own_rm_cat": pairwise_accuracy(s_cat[0, :, own], s_cat[1, :, own]),
                "val": {name: [acc(rule_reward(v[0], z, v[3], **kw)) for v, z in zip(val, zs)] for name, kw in cands.items()},
                "cat": {name: acc(rule_reward(s_cat, z_cat, g_cat, **kw)) for name, kw in cands.items()},
                "diagnosis_cat": buckets(s_cat, z_cat, g_cat, own),
                "diagnosis_val_own": buckets(val[own][0], zs[own], val[own][3], own)}
        cells.append(cell)
        print(json.dumps({"seed": seed, "fold": cat, "t_cal": round(t_cal, 3), "own_rm_cat": round(cell["own_rm_cat"], 3),
                          **{k: round(v, 3) for k, v in cell["cat"].items()}}), flush=True)
    out = {"clients": "every client an MLP", "router": "MoRConfig().router (pair, dropout 0.5, wd 1, equal)",
           "seeds": [0, 1, 2], "folds": folds, "split": "validation pairs + a validation category (never koala)",
           **summarise(cells), "cells": cells, "seconds": time.perf_counter() - t0}
    path = write_json("mor_heldout_gap_settings", False, out)
    report(out)
    print(f"wrote {path} in {out['seconds']:.0f} s")


def summarise(cells: list[dict]) -> dict:
    names = list(cells[0]["cat"])
    table = score_table(cells, lambda n: "base/soft" if n.endswith("/soft") else "base/sparse<0.8")
    for n in names:
        table[n]["cat_minus_own_per_cell"] = [float(c["cat"][n] - c["own_rm_cat"]) for c in cells]
    oracle = {"id": float(np.mean([np.mean(c["own_rm_val"]) for c in cells])), "cat": float(np.mean([c["own_rm_cat"] for c in cells]))}
    diag = {}
    for key in ("diagnosis_cat", "diagnosis_val_own"):
        diag[key] = {b: {m: float(np.nanmean([np.nan if c[key][b][m] is None else c[key][b][m] for c in cells]))
                         for m in ("share", "routed", "own_rm", "cost")} for b in cells[0][key]}
    sparse = max((n for n in names if "/sparse" in n), key=lambda n: (table[n]["score"], n == "base/sparse<0.8"))
    soft = max((n for n in names if n.endswith("/soft")), key=lambda n: (table[n]["score"], n == "base/soft"))
    return {"table": table, "oracle_own_rm": oracle, "diagnosis": diag, "t_cal_mean": float(np.mean([c["t_cal"] for c in cells])),
            "chosen": {"sparse": sparse, "soft": soft}}


def report(out: dict) -> None:
    o = out["oracle_own_rm"]
    print(f"own RM: id {o['id']:.3f} cat {o['cat']:.3f}; mean calibrated T {out['t_cal_mean']:.3f}")
    print_candidates(out["table"], 20)
    for key, d in out["diagnosis"].items():
        print(key)
        for b, v in d.items():
            print(f"  {b:12s} " + " ".join(f"{m} {x:.3f}" for m, x in v.items()))
    print("chosen:", out["chosen"])


if __name__ == "__main__":
    main(sys.argv[1:])
