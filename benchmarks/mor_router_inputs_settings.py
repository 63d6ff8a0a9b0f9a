"""Choose what the MoR router reads, ``Enc(x, y)`` (the paper) or the prompt alone ``e(x)``, on VALIDATION pairs
only (never test, never the held-out category), and show where router + RM loses on validation: routing errors
(a pair scored by another client than its own) vs reward-model errors (its own client's RM ranks it wrongly).

For seeds 0..2 of :class:`MoRConfig`'s default pool (``--quick``: the quick pool), every client an MLP (a LoRA
candidate costs ~1 s per pair on this CPU; the routers do not depend on the clients' architecture), the client
reward models are trained once per seed; then a router is trained for each ``router_inputs`` in
{pair, text (no length columns), prompt} x weighting in {samples, equal}, and every routing variant
(:func:`trainer.rewards.evaluation.routing_variants`, the same RoutingRule code path as RoutedReward and GRPO)
is scored on each client's validation pairs. Per client: the own RM's accuracy (the oracle), the routed
accuracy, the share of validation responses routed away from their client, and the accuracy on the pairs
whose two responses both went home vs the others.

Choice: the ``router_inputs`` whose best (weighting, variant) has the highest mean over seeds of the mean
over clients of validation accuracy. Run:
``PYTHONPATH=. HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/mor_router_inputs_settings.py [--quick]``;
writes ``docs/mor_router_inputs_settings[_quick].json``.

``--loco`` (leave one category out): the cross-category settings, chosen without the held-out category (koala).
In fold S, the AlpacaEval subset S (every subset of the pool but koala, in turn) is removed from the helpfulness
client: its reward model and the router never see it, and S scores each candidate as a *validation category*.
Candidates: routers :data:`LOCO_ROUTERS` (pair vs prompt input, fewer / more rounds, dropout + weight decay, a
narrower trunk; equal weighting) x routing rules :func:`loco_rules` (sparse per response / prompt, with and
without the uncertain-routing fallback ``RoutingRule.fallback``; soft x route_by x :data:`LOCO_TEMPERATURES`).
Choice, fixed before the run (:func:`loco_choose`): the highest mean of (in-distribution validation accuracy,
validation-category accuracy), means over seeds 0..2 and folds. Writes ``docs/mor_router_loco_settings[_quick].json``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import numpy as np
from tqdm.auto import tqdm

from benchmarks.mor_settings_setup import json_path, loco_categories, loco_folds, normalised_scores, setup, write_json
from trainer.rewards.client_router import WEIGHTINGS, ClientRouterData, FederatedRouterTrainer
from trainer.rewards.evaluation import routed_accuracies, routed_reward
from trainer.rewards.reward_models import pairwise_accuracy
from trainer.rewards.routing_rule import RoutingRule

INPUTS = ("pair", "text", "prompt")


def choose(per_seed: list[dict], names: list[str]) -> dict:
    """Mean over seeds of the mean-over-clients validation accuracy of every (inputs, weighting, variant), and
    the choices: ``chosen_router_inputs`` (best variant per inputs, then the best inputs), and for those inputs
    the defaults of :class:`MoRConfig`: ``weighting`` + sparse variant (best sparse), soft variant (best soft for
    that weighting)."""
    keys = list(per_seed[0]["routers"][f"{INPUTS[0]}/{WEIGHTINGS[0]}"][names[0]]["variants"])
    table = {}
    for r in per_seed[0]["routers"]:
        for v in keys:
            accs = [np.mean([s["routers"][r][n]["variants"][v] for n in names]) for s in per_seed]
            table[f"{r}/{v}"] = {"mean": float(np.mean(accs)), "std": float(np.std(accs, ddof=1)),
                                 "per_client": {n: float(np.mean([s["routers"][r][n]["variants"][v] for s in per_seed]))
                                                for n in names}}
        for m in ("routed_away_share", "acc_pairs_home", "acc_pairs_away"):
            table[f"{r}/{m}"] = {n: float(np.mean([s["routers"][r][n][m] for s in per_seed if s["routers"][r][n][m] is not None]
                                                  or [np.nan])) for n in names}
    oracle = {n: float(np.mean([s["own_rm"][n] for s in per_seed])) for n in names}
    scored = {k: v["mean"] for k, v in table.items() if "mean" in v}
    best = {i: max(((k, m) for k, m in scored.items() if k.startswith(i + "/")), key=lambda t: t[1]) for i in INPUTS}
    chosen = max(INPUTS, key=lambda i: best[i][1])
    sparse = max((k for k in scored if k.startswith(chosen + "/") and "/sparse|" in k), key=lambda k: scored[k])
    weighting = sparse.split("/")[1]
    soft = max((k for k in scored if k.startswith(f"{chosen}/{weighting}/soft|")), key=lambda k: scored[k])
    return {"oracle_own_rm_val": oracle, "oracle_mean": float(np.mean(list(oracle.values()))), "table": table,
            "best_per_inputs": best, "chosen_router_inputs": chosen,
            "chosen_defaults": {"router_inputs": chosen, "weighting": weighting, "sparse": sparse.split("/")[2],
                                "soft": soft.split("/")[2], "val_sparse": scored[sparse], "val_soft": scored[soft]}}


def main(argv: list[str]) -> None:
    bench = setup(argv)
    quick, cfg, trainer, names = bench.quick, bench.cfg, bench.trainer, bench.names
    t0 = time.perf_counter()
    per_seed = []
    for seed in tqdm(range(3), desc="seeds"):
        split = trainer.prepare(seed)
        rms = [trainer.train_reward_model(c, "mlp", seed)[0] for c in split.clients]
        train_feats = [trainer.features(c.pairs("train")) for c in split.clients]
        data = [ClientRouterData(fc, fr, k) for k, (fc, fr) in enumerate(train_feats)]
        val = []
        for k, c in enumerate(split.clients):
            s, fc, fr, groups = normalised_scores(trainer, rms, c.pairs("val"))  # s (2, n, K)
            val.append((k, fc, fr, s, groups))
        row = {"seed": seed, "own_rm": {n: pairwise_accuracy(v[3][0, :, v[0]], v[3][1, :, v[0]]) for n, v in zip(names, val)},
               "routers": {}}
        for inputs in INPUTS:
            trainer.args = replace(cfg, router_inputs=inputs)
            cols = trainer.router_input_columns(train_feats[0][0].shape[1])
            for w in WEIGHTINGS:
                router = FederatedRouterTrainer(replace(cfg.router, weighting=w, seed=seed, input_columns=cols)).train(data, names)
                per_client = {}
                for n, (k, fc, fr, s, groups) in zip(names, val):
                    z = np.stack([router.logits(fc), router.logits(fr)]).astype(np.float64)
                    variants = routed_accuracies(s, z, groups)
                    home = (z.argmax(-1) == k)  # (2, n): response routed to its own client
                    both = home.all(0)
                    sparse = routed_reward(s, z, RoutingRule("sparse"), groups)
                    correct = (sparse[0] > sparse[1]) + 0.5 * (sparse[0] == sparse[1])
                    per_client[n] = {"variants": variants, "routed_away_share": float(1 - home.mean()),
                                     "acc_pairs_home": float(correct[both].mean()) if both.any() else None,
                                     "acc_pairs_away": float(correct[~both].mean()) if (~both).any() else None,
                                     "n_pairs_away": int((~both).sum()), "n_pairs": int(len(both))}
                row["routers"][f"{inputs}/{w}"] = per_client
        trainer.args = cfg
        per_seed.append(row)
        print(json.dumps({"seed": seed, "own_rm": row["own_rm"],
                          **{r: {n: round(v["variants"]["sparse|response"], 3) for n, v in pc.items()}
                             for r, pc in row["routers"].items()}}), flush=True)
    out = {"quick": quick, "clients": "every client an MLP", "seeds": [0, 1, 2], "split": "validation",
           **choose(per_seed, names), "per_seed": per_seed, "seconds": time.perf_counter() - t0}
    path = write_json("mor_router_inputs_settings", quick, out)
    report(out)
    print(f"wrote {path} in {out['seconds']:.0f} s")


def report(out: dict) -> None:
    table = out["table"]
    print(f"oracle (own RM) val {out['oracle_mean']:.3f} {out['oracle_own_rm_val']}")
    for k, v in table.items():
        if "mean" in v and (k.endswith("sparse|response") or k.endswith("soft|response|T=1") or k.endswith("sparse|prompt")):
            print(f"{k:40s} {v['mean']:.3f} ± {v['std']:.3f}  {({n: round(a, 3) for n, a in v['per_client'].items()})}")
    for i in INPUTS:
        for w in WEIGHTINGS:
            print(f"{i}/{w}: routed away {table[f'{i}/{w}/routed_away_share']}, acc pairs home "
                  f"{table[f'{i}/{w}/acc_pairs_home']}, away {table[f'{i}/{w}/acc_pairs_away']}")
    print("best per inputs:", out["best_per_inputs"])
    print("chosen:", out["chosen_defaults"])


# ---------------------------------------------------------------- leave-one-category-out (``--loco``)
#
# The held-out category (koala) tests whether routing generalises to an AlpacaEval source the router never saw.
# Settings that matter there are chosen on a *validation category* instead: in fold S, the AlpacaEval subset S
# (never koala, which stays out of every fold) is removed from the helpfulness client (its reward model and the
# router never see it) and its pairs score the rule, next to the usual in-distribution validation pairs. Folds
# run over every other AlpacaEval subset of the pool, seeds 0..2.

#: Router candidates: name -> (router_inputs, RouterConfig overrides); weighting is equal in all (chosen above).
LOCO_ROUTERS = {
    "pair": ("pair", {}),
    "pair/rounds=10": ("pair", {"rounds": 10}),
    "pair/rounds=60": ("pair", {"rounds": 60}),
    "pair/dropout=0.5,wd=1": ("pair", {"dropout": 0.5, "weight_decay": 1.0}),
    "pair/hidden=32": ("pair", {"hidden": 32}),
    "prompt": ("prompt", {}),
    "prompt/dropout=0.5,wd=1": ("prompt", {"dropout": 0.5, "weight_decay": 1.0}),
}
LOCO_TEMPERATURES = (0.25, 0.5, 1.0, 2.0, 4.0)
#: Uncertain-routing fallback (``RoutingRule.fallback``): sparse routing, except rows whose largest weight (T = 1)
#: is below tau get the soft reward (``sparse<tau|<route_by>``).
LOCO_FALLBACK = (0.6, 0.8, 0.95)


def loco_rules() -> list[tuple[str, RoutingRule]]:
    """(variant key, rule) of every routing rule compared: sparse x route_by x (0, LOCO_FALLBACK), soft x route_by x
    LOCO_TEMPERATURES."""
    rules = [RoutingRule("sparse", 1.0, by, f) for by in ("response", "prompt") for f in (0.0, *LOCO_FALLBACK)]
    rules += [RoutingRule("soft", t, by) for by in ("response", "prompt") for t in LOCO_TEMPERATURES]
    return [(r.variant, r) for r in rules]


def _rule_acc(rule: RoutingRule, s: np.ndarray, z: np.ndarray, groups: np.ndarray) -> float:
    """Pairwise accuracy of ``rule`` on scores s (2, n, K) with router logits z (2, n, K) (the evaluation's code path)."""
    r = routed_reward(s, z, rule, groups)
    return pairwise_accuracy(r[0], r[1])


def loco_main(argv: list[str]) -> None:
    bench = setup(argv)
    quick, cfg, trainer, names = bench.quick, bench.cfg, bench.trainer, bench.names
    own, folds = loco_categories(bench)
    rules = loco_rules()
    t0 = time.perf_counter()
    per_seed = []
    for lf in loco_folds(bench):
        seed, cat, data, val = lf.seed, lf.category, lf.data, lf.val
        s_cat, fc_cat, fr_cat, g_cat = lf.cat
        if not per_seed or per_seed[-1]["seed"] != seed:
            per_seed.append({"seed": seed, "folds": {}})
        row = per_seed[-1]
        fold = {"n_cat": int(s_cat.shape[1]), "own_rm_val": {n: pairwise_accuracy(v[0][0, :, k], v[0][1, :, k])
                                                              for k, (n, v) in enumerate(zip(names, val))},
                "own_rm_cat": pairwise_accuracy(s_cat[0, :, own], s_cat[1, :, own]), "routers": {}}
        for rname, (inputs, over) in LOCO_ROUTERS.items():
            trainer.args = replace(cfg, router_inputs=inputs)
            cols = trainer.router_input_columns(data[0].features_chosen.shape[1])
            trainer.args = cfg
            router = FederatedRouterTrainer(replace(cfg.router, weighting="equal", seed=seed, input_columns=cols, **over)).train(data, names)
            zs = [np.stack([router.logits(fc), router.logits(fr)]).astype(np.float64) for _, fc, fr, _ in val]
            z_cat = np.stack([router.logits(fc_cat), router.logits(fr_cat)]).astype(np.float64)
            fold["routers"][rname] = {
                "val": {key: [_rule_acc(rule, v[0], z, v[3]) for v, z in zip(val, zs)] for key, rule in rules},
                "cat": {key: _rule_acc(rule, s_cat, z_cat, g_cat) for key, rule in rules},
                "cat_away_share": float((z_cat.argmax(-1) != own).mean()),
                "val_away_share": [float((z.argmax(-1) != k).mean()) for k, z in enumerate(zs)]}
        row["folds"][cat] = fold
        print(json.dumps({"seed": seed, "fold": cat, "own_rm_cat": round(fold["own_rm_cat"], 3),
                          **{r: [round(float(np.mean(v["val"]["sparse|response"])), 3), round(v["cat"]["sparse|response"], 3),
                                 round(v["cat_away_share"], 3)] for r, v in fold["routers"].items()}}), flush=True)
    out = {"quick": quick, "clients": "every client an MLP", "seeds": [0, 1, 2], "folds": folds,
           "split": "validation pairs + a validation category (never koala)", **loco_choose(per_seed, names),
           "per_seed": per_seed, "seconds": time.perf_counter() - t0}
    path = write_json("mor_router_loco_settings", quick, out)
    loco_report(out)
    print(f"wrote {path} in {out['seconds']:.0f} s")


def loco_choose(per_seed: list[dict], names: list[str]) -> dict:
    """Means over seeds and folds of every (router, rule): ``id`` (mean over clients of validation accuracy),
    ``cat`` (validation-category accuracy), ``score = (id + cat) / 2``; the choice (fixed before the run): the
    router and sparse-like rule (sparse or fallback) with the highest score, then the best soft rule for that router."""
    cells = [f for s in per_seed for f in s["folds"].values()]
    routers, keys = list(cells[0]["routers"]), list(cells[0]["routers"][next(iter(cells[0]["routers"]))]["cat"])
    table = {}
    for r in routers:
        for k in keys:
            ids = np.array([np.mean(f["routers"][r]["val"][k]) for f in cells])
            cats = np.array([f["routers"][r]["cat"][k] for f in cells])
            table[f"{r}/{k}"] = {"id": float(ids.mean()), "cat": float(cats.mean()), "score": float((ids.mean() + cats.mean()) / 2),
                                 "cat_per_fold": {fo: float(np.mean([s["folds"][fo]["routers"][r]["cat"][k] for s in per_seed]))
                                                  for fo in per_seed[0]["folds"]}}
        table[f"{r}/away"] = {"cat": float(np.mean([f["routers"][r]["cat_away_share"] for f in cells])),
                              "val": np.mean([f["routers"][r]["val_away_share"] for f in cells], axis=0).tolist()}
    oracle = {"id": float(np.mean([np.mean(list(f["own_rm_val"].values())) for f in cells])),
              "cat": float(np.mean([f["own_rm_cat"] for f in cells])),
              "cat_per_fold": {fo: float(np.mean([s["folds"][fo]["own_rm_cat"] for s in per_seed])) for fo in per_seed[0]["folds"]}}
    scored = {k: v for k, v in table.items() if "score" in v}
    sparse = max((k for k in scored if k.split("/", 1)[1].split("/")[-1].startswith("sparse")), key=lambda k: scored[k]["score"])
    router = sparse.rsplit("/", 1)[0]
    soft = max((k for k in scored if k.startswith(router + "/soft|") and k.count("/") == sparse.count("/")), key=lambda k: scored[k]["score"])
    return {"table": table, "oracle_own_rm": oracle,
            "chosen": {"router": router, "sparse": sparse.rsplit("/", 1)[1], "soft": soft.rsplit("/", 1)[1],
                       "sparse_scores": scored[sparse], "soft_scores": scored[soft]}}


def loco_report(out: dict) -> None:
    print(f"oracle (own RM): id {out['oracle_own_rm']['id']:.3f}, category {out['oracle_own_rm']['cat']:.3f}")
    for k, v in sorted(out["table"].items(), key=lambda kv: -kv[1].get("score", -1)):
        if "score" in v:
            print(f"{k:45s} id {v['id']:.3f} cat {v['cat']:.3f} score {v['score']:.3f}")
        else:
            print(f"{k:45s} away: category {v['cat']:.3f}, val {np.round(v['val'], 3).tolist()}")
    print("chosen:", out["chosen"])


if __name__ == "__main__":
    if "--summarise" in sys.argv:  # recompute the choice from a written JSON (no training)
        quick = "--quick" in sys.argv
        data = json.loads(json_path("mor_router_inputs_settings", quick).read_text())
        data |= choose(data["per_seed"], list(data["per_seed"][0]["own_rm"]))
        write_json("mor_router_inputs_settings", quick, data)
        report(data)
    elif "--loco" in sys.argv:
        loco_main(sys.argv[1:])
    else:
        main(sys.argv[1:])
