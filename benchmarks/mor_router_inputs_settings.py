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
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from trainer.rewards.client_router import WEIGHTINGS, ClientRouterData, FederatedRouterTrainer
from trainer.rewards.evaluation import routed_accuracies, routed_reward
from trainer.rewards.mor_trainer import MoRConfig, MoRTrainer
from trainer.rewards.reward_models import pairwise_accuracy
from trainer.rewards.routing_rule import RoutingRule

INPUTS = ("pair", "text", "prompt")


def _scores(trainer, rm, pairs, fc, fr):
    rc, rr = rm.raw_scores_from_features(fc), rm.raw_scores_from_features(fr)
    return np.stack([rm.normaliser_(rc), rm.normaliser_(rr)]).astype(np.float64)


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
    torch.set_num_threads(1)
    quick = "--quick" in argv
    cfg = MoRConfig.quick() if quick else MoRConfig()
    cfg = replace(cfg, client_archs=tuple("mlp" for _ in cfg.client_names))
    trainer = MoRTrainer(cfg, show_progress=False)
    names = list(cfg.client_names)
    t0 = time.perf_counter()
    per_seed = []
    for seed in tqdm(range(3), desc="seeds"):
        split = trainer.prepare(seed)
        rms = [trainer.train_reward_model(c, "mlp", seed)[0] for c in split.clients]
        train_feats = [trainer.features(c.pairs("train")) for c in split.clients]
        data = [ClientRouterData(fc, fr, k) for k, (fc, fr) in enumerate(train_feats)]
        val = []
        for k, c in enumerate(split.clients):
            pairs = c.pairs("val")
            fc, fr = trainer.features(pairs)
            s = np.stack([_scores(trainer, rm, pairs, fc, fr) for rm in rms], -1)  # (2, n, K)
            groups = np.unique(np.asarray(pairs.prompts), return_inverse=True)[1]
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
    path = Path(__file__).resolve().parents[1] / "docs" / f"mor_router_inputs_settings{'_quick' if quick else ''}.json"
    path.write_text(json.dumps(out, indent=1))
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


if __name__ == "__main__":
    if "--summarise" in sys.argv:  # recompute the choice from a written JSON (no training)
        path = Path(__file__).resolve().parents[1] / "docs" / f"mor_router_inputs_settings{'_quick' if '--quick' in sys.argv else ''}.json"
        data = json.loads(path.read_text())
        data |= choose(data["per_seed"], list(data["per_seed"][0]["own_rm"]))
        path.write_text(json.dumps(data, indent=1))
        report(data)
    else:
        main(sys.argv[1:])
