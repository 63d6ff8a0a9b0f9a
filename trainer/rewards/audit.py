"""The MoR privacy audit (paper 001, Table 5 analogue): membership inference on reward margins of
each client's reward MLP, trained naively and with a defence; communication per round.

Members are a client's training pairs, non-members its validation + test pairs (never trained on),
drawn 1 : 1 (:func:`trainer.rewards.privacy.membership_attack`). The server of MoR sees only the
scores a client returns, i.e. normalised (and possibly clipped) rewards; we attack raw margins,
normalised margins and normalised + clipped margins. Per client, z-normalisation is an increasing
affine map, so it cannot change the AUC; pooled over clients (the server mixes all clients'
answers) it can, and clipping can (it ties the largest margins).

Defence (default, :data:`DEFENDED`): DP-SGD through Opacus (per-pair gradient clipping at 1.0,
Gaussian noise multiplier 1.0, 30 epochs, Poisson-sampled batches of 64; the RDP accountant's
epsilon at delta = 1 / n_pairs is reported). Chosen on validation pairs by
``benchmarks/mor_defence_settings.py``: early stopping on a validation split with weight decay and
dropout (the MoR default training) cut the naive AUC but left the helpfulness client at ~0.70 and
stronger weight decay / dropout did not bring it under 0.60, while DP-SGD bounds what any one pair
can change in the model (a formal guarantee, not only an empirical one) and reached ~0.53 there
at no loss of validation accuracy. The naive setting trains for a fixed 200 epochs without weight
decay, dropout or validation, as a client that fits its data to the end. The cost is reported as
test accuracy of both.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from trainer.rewards.client_router import ClientRouter
from trainer.rewards.mor_trainer import MoRTrainer
from trainer.rewards.privacy import communication_per_round, membership_attack
from trainer.rewards.reward_models import (
    PreferencePairs,
    RewardModelConfig,
    RewardModelTrainer,
    ScoreNormaliser,
    pairwise_accuracy,
)

NAIVE = RewardModelConfig(arch="mlp", epochs=200, weight_decay=0.0, dropout=0.0, early_stopping=False)
DEFENDED = RewardModelConfig(arch="mlp", epochs=30, lr=3e-3, weight_decay=0.0, dropout=0.0, dp_noise_multiplier=1.0,
                             dp_max_grad_norm=1.0)
VARIANTS = ("raw", "normalised", "normalised_clipped")


def _margins(rm, feats_c, feats_r, variant: str, clip: float) -> np.ndarray:
    rc, rr = rm.raw_scores_from_features(feats_c), rm.raw_scores_from_features(feats_r)
    if variant == "raw":
        return (rc - rr).astype(np.float64)
    norm = ScoreNormaliser(rm.normaliser_.mean, rm.normaliser_.std, rm.normaliser_.eps,
                           clip if variant == "normalised_clipped" else None)
    return (norm(rc) - norm(rr)).astype(np.float64)


def _train(trainer: MoRTrainer, client, config: RewardModelConfig):
    """(reward model, history, epsilon or None) of one client's reward MLP under ``config``."""
    pairs = client.pairs("train")
    rt = RewardModelTrainer(config, trainer.encoder)
    return rt.train(pairs), rt.history_, getattr(rt, "epsilon_", None)


def run_audit(trainer: MoRTrainer, defended: RewardModelConfig | None = None, naive: RewardModelConfig = NAIVE,
              clip: float = 1.0, queries_per_round: int = 256) -> dict:
    """Attack every client's reward MLP, naive and defended, for the trainer's seeds.

    Returns {"per_client": {setting: {client: {variant: attack dict (mean over seeds), "test_acc"}}},
    "pooled": {setting: {variant: attack dict}}, "communication": {...}, "settings": {...}}.
    """
    defended = defended or DEFENDED
    settings = {"naive": replace(naive, arch="mlp"), "defended": replace(defended, arch="mlp")}
    per: dict = {s: {} for s in settings}
    pooled: dict = {s: {v: [] for v in VARIANTS} for s in settings}
    n_router = n_rm = None
    prompts, responses = [], []
    for seed in range(trainer.args.seeds):
        split = trainer.prepare(seed)
        rng = np.random.default_rng(seed)
        pool_m = {s: {v: [] for v in VARIANTS} for s in settings}
        pool_n = {s: {v: [] for v in VARIANTS} for s in settings}
        for c in split.clients:
            members = c.pairs("train")
            non = PreferencePairs.from_frame(pd.concat([c.val, c.test], ignore_index=True))
            fm, fn = trainer.features(members), trainer.features(non)
            ft = trainer.features(c.pairs("test"))
            n_take = min(members.n_pairs, non.n_pairs)  # members : non-members = 1 : 1
            take_m = np.sort(rng.choice(members.n_pairs, n_take, replace=False))
            take_n = np.sort(rng.choice(non.n_pairs, n_take, replace=False))
            if seed == 0:
                prompts += list(non.prompts)
                responses += list(non.chosen)
            for s, cfg in settings.items():
                rm, _, eps = _train(trainer, c, replace(cfg, seed=seed))
                n_rm = rm.n_parameters()
                entry = per[s].setdefault(c.name, {v: [] for v in VARIANTS} | {"test_acc": [], "epsilon": []})
                entry["epsilon"].append(eps)
                entry["test_acc"].append(pairwise_accuracy(rm.raw_scores_from_features(ft[0]), rm.raw_scores_from_features(ft[1])))
                for v in VARIANTS:  # the same members and non-members for every variant
                    mm, mn = _margins(rm, *fm, v, clip)[take_m], _margins(rm, *fn, v, clip)[take_n]
                    entry[v].append(membership_attack(mm, mn, rng).as_dict())
                    pool_m[s][v].append(mm)
                    pool_n[s][v].append(mn)
        for s in settings:
            for v in VARIANTS:
                pooled[s][v].append(membership_attack(np.concatenate(pool_m[s][v]), np.concatenate(pool_n[s][v]), rng).as_dict())
        if n_router is None:
            d_in = fm[0].shape[1]
            r = trainer.args.router
            n_router = r.ensemble * ClientRouter(d_in, len(split.clients), r.hidden, r.dropout).n_parameters()  # every member of the ensemble travels

    def mean_attacks(rows: list[dict]) -> dict:
        return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}

    per_out = {s: {c: {v: mean_attacks(e[v]) for v in VARIANTS} | {"test_acc": float(np.mean(e["test_acc"])),
                                                                   "epsilon": float(np.mean(e["epsilon"])) if e["epsilon"][0] is not None else None}
                   for c, e in cl.items()} for s, cl in per.items()}
    pooled_out = {s: {v: mean_attacks(rows) for v, rows in d.items()} for s, d in pooled.items()}
    k = len(trainer.args.client_names)
    take = np.arange(min(queries_per_round, len(prompts)))
    comm = communication_per_round(n_router, k, [prompts[i] for i in take], [responses[i] for i in take])
    comm |= {"router_parameters": n_router, "reward_mlp_parameters": n_rm,
             "fedavg_of_reward_mlps_bytes": int(2 * k * n_rm * 4),
             "queries_per_round": int(len(take)),
             "note": "router: download + upload of float32 parameters by each of K clients; reward queries: "
                     "UTF-8 prompt + response per sparse query (one client each), 4 bytes per answer"}
    return {"per_client": per_out, "pooled": pooled_out, "communication": comm, "clip": clip,
            "settings": {s: vars(c) for s, c in settings.items()}, "seeds": trainer.args.seeds}
