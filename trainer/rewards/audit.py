"""The MoR privacy audit (paper 001, Table 5 analogue): membership inference on reward margins of
each client's reward model, as shipped and as a naive worst case; communication per round.

Design notes: docs/mor.md (Module notes).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from trainer.rewards.client_router import ClientRouter
from sdk.errors import InvalidInputError
from trainer.rewards.mor_trainer import DP_RM, MoRTrainer
from trainer.rewards.privacy import communication_per_round, membership_attack
from trainer.rewards.reward_models import (
    PreferencePairs,
    RewardModelConfig,
    ScoreNormaliser,
    pairwise_accuracy,
)

NAIVE = RewardModelConfig(arch="mlp", epochs=200, weight_decay=0.0, dropout=0.0, early_stopping=False)
SETTINGS = ("shipped", "shipped_dp", "naive")
VARIANTS = ("raw", "normalised", "normalised_clipped")


def _raw(rm, pairs: PreferencePairs, feats: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Raw rewards of (chosen, rejected): from the cached pair features for an MLP, from the texts otherwise."""
    if hasattr(rm, "raw_scores_from_features"):
        return rm.raw_scores_from_features(feats[0]), rm.raw_scores_from_features(feats[1])
    return rm.raw_scores(list(pairs.prompts), list(pairs.chosen)), rm.raw_scores(list(pairs.prompts), list(pairs.rejected))


def _margins(rc: np.ndarray, rr: np.ndarray, rm, variant: str, clip: float) -> np.ndarray:
    if variant == "raw":
        return (rc - rr).astype(np.float64)
    norm = ScoreNormaliser(rm.normaliser_.mean, rm.normaliser_.std, rm.normaliser_.eps,
                           clip if variant == "normalised_clipped" else None)
    return (norm(rc) - norm(rr)).astype(np.float64)


def _settings(trainer: MoRTrainer, dp: RewardModelConfig, naive: RewardModelConfig) -> dict:
    """setting -> (arch of each client, config or None = the client's own as shipped)."""
    a = trainer.args
    return {"shipped": (tuple(a.client_archs), None),
            "shipped_dp": (("mlp",) * len(a.client_archs), replace(dp, clip=a.clip)),
            "naive": (("mlp",) * len(a.client_archs), replace(naive, arch="mlp"))}


def _summary(rows: list[dict]) -> dict:
    """Mean over seeds of each attack figure, the per-seed AUCs and SEs, and the SE of the mean AUC."""
    out = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    se = np.array([r["auc_se"] for r in rows])
    out |= {"auc_per_seed": [r["auc"] for r in rows], "auc_se_per_seed": se.tolist(),
            "auc_se": float(np.sqrt(np.sum(se ** 2)) / len(se)), "n_members": int(min(r["n_members"] for r in rows))}
    return out


def dp_cost(trainer, split, models) -> dict:
    """The privacy and accuracy of the DP-SGD reward models ``fedroute mor train --dp`` ships.

    trainer : MoRTrainer with ``args.dp_rm`` set; split : its MoRSplit; models : its MoRModels.
    Each client's non-DP reward model (the one ``mor train`` ships without ``--dp``: its own architecture
    and config) is trained on the same split for the comparison and then dropped.

    Returns {client: {"epsilon", "delta", "noise_multiplier", "max_grad_norm", "epochs", "n_pairs",
    "test_acc_dp", "test_acc_non_dp", "cost" (= dp - non-DP test pairwise accuracy)}}.
    """
    plain = MoRTrainer(replace(trainer.args, dp_rm=None), show_progress=trainer.show_progress)
    plain.pool_, plain.encoder = trainer.pool_, trainer.encoder
    out = {}
    for c, arch, rm in zip(split.clients, trainer.args.client_archs, models.reward_models):
        test = c.pairs("test")
        ft = trainer.features(test)
        base, _ = plain.train_reward_model(c, arch, split.seed)
        dp, non = (pairwise_accuracy(*_raw(m, test, ft)) for m in (rm, base))
        out[c.name] = dict(rm.privacy_) | {"test_acc_dp": dp, "test_acc_non_dp": non, "cost": dp - non}
    return out


def run_audit(trainer: MoRTrainer, dp: RewardModelConfig | None = None, naive: RewardModelConfig = NAIVE,
              clip: float = 1.0, queries_per_round: int = 256, include_lora: bool = False,
              settings: tuple[str, ...] = SETTINGS, on_seed=None) -> dict:
    """Attack every client's reward model in each of :data:`SETTINGS` for the trainer's seeds.

    trainer : MoRTrainer whose ``args.dp_rm`` is None (its configs are the non-DP ``shipped`` setting).
    dp : the DP-SGD config of ``shipped_dp`` (default :data:`trainer.rewards.mor_trainer.DP_RM`).
    include_lora : attack the LoRA client of ``shipped`` too (else it is left out of that setting).
    settings : the settings to run, a subset of :data:`SETTINGS` in any order.
    on_seed : called with the result of the seeds done so far after each seed but the last (e.g. to write it).

    Returns {"per_client": {setting: {client: {variant: attack summary (mean over seeds, ``auc_per_seed``,
    ``auc_se_per_seed``, ``auc_se`` of the mean), "test_acc", "test_acc_per_seed", "epsilon", "delta",
    "n_members"}}}, "pooled": {setting: {variant: attack summary}}, "communication": {...}, "settings": {...}}.

    Raises
    ------
    InvalidInputError
        ``trainer.args.dp_rm`` is set (audit a non-DP trainer: both settings are built here), or a setting
        is not one of :data:`SETTINGS`.
    """
    if trainer.args.dp_rm is not None:
        raise InvalidInputError("run_audit needs the non-DP trainer (args.dp_rm None); the DP setting is built from `dp`")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown or not settings:
        raise InvalidInputError(f"settings must be a non-empty subset of {SETTINGS}, got {list(settings)}")
    settings = {s: v for s, v in _settings(trainer, dp or DP_RM, naive).items() if s in settings}
    per: dict = {s: {} for s in settings}
    pooled: dict = {s: {v: [] for v in VARIANTS} for s in settings}
    n_router = n_rm = None
    prompts, responses = [], []

    def client_out(e: dict) -> dict:
        eps = [x for x in e["epsilon"] if x is not None]
        return ({v: _summary(e[v]) for v in VARIANTS}
                | {"test_acc": float(np.mean(e["test_acc"])), "test_acc_per_seed": [float(x) for x in e["test_acc"]],
                   "epsilon": float(np.mean(eps)) if eps else None, "epsilon_per_seed": eps or None,
                   "delta": float(np.mean(e["delta"])) if eps else None})

    def result(n_seeds: int) -> dict:
        """The audit of the first ``n_seeds`` seeds (design notes' layout)."""
        per_out = {s: {c: client_out(e) for c, e in cl.items()} for s, cl in per.items()}
        pooled_out = {s: {v: _summary(rows) for v, rows in d.items() if rows} for s, d in pooled.items()}
        k = len(trainer.args.client_names)
        take = np.arange(min(queries_per_round, len(prompts)))
        comm = communication_per_round(n_router, k, [prompts[i] for i in take], [responses[i] for i in take])
        comm |= {"router_parameters": n_router, "reward_mlp_parameters": n_rm,
                 "fedavg_of_reward_mlps_bytes": int(2 * k * n_rm * 4),
                 "queries_per_round": int(len(take)),
                 "note": "router: download + upload of float32 parameters by each of K clients; reward queries: "
                         "UTF-8 prompt + response per sparse query (one client each), 4 bytes per answer"}
        return {"per_client": per_out, "pooled": pooled_out, "communication": comm, "clip": clip,
                "settings": {s: ({"archs": list(archs)} | (vars(cfg) if cfg is not None else {"config": "client's own (MoRConfig)"}))
                             for s, (archs, cfg) in settings.items()},
                "include_lora": include_lora, "seeds": n_seeds}

    for seed in range(trainer.args.seeds):
        split = trainer.prepare(seed)
        rng = np.random.default_rng(seed)
        pool_m = {s: {v: [] for v in VARIANTS} for s in settings}
        pool_n = {s: {v: [] for v in VARIANTS} for s in settings}
        for c in split.clients:
            non = PreferencePairs.from_frame(pd.concat([c.val, c.test], ignore_index=True))
            test = c.pairs("test")
            fn, ft = trainer.features(non), trainer.features(test)
            if seed == 0:
                prompts += list(non.prompts)
                responses += list(non.chosen)
            for s, (archs, cfg) in settings.items():
                arch = archs[list(trainer.args.client_names).index(c.name)]
                if arch == "lora" and not include_lora:
                    continue
                members = trainer.training_pairs(c, arch, seed)
                fm = trainer.features(members)
                n_take = min(members.n_pairs, non.n_pairs)  # members : non-members = 1 : 1
                take_m = np.sort(rng.choice(members.n_pairs, n_take, replace=False))
                take_n = np.sort(rng.choice(non.n_pairs, n_take, replace=False))
                rm, _ = trainer.train_reward_model(c, arch, seed, cfg)
                if arch == "mlp":
                    n_rm = rm.n_parameters()
                entry = per[s].setdefault(c.name, {v: [] for v in VARIANTS} | {"test_acc": [], "epsilon": [], "delta": []})
                privacy = rm.privacy_ or {}
                entry["epsilon"].append(privacy.get("epsilon"))
                entry["delta"].append(privacy.get("delta"))
                entry["test_acc"].append(pairwise_accuracy(*_raw(rm, test, ft)))
                (mc, mr), (nc, nr) = _raw(rm, members, fm), _raw(rm, non, fn)
                for v in VARIANTS:  # the same members and non-members for every variant
                    mm, mn = _margins(mc, mr, rm, v, clip)[take_m], _margins(nc, nr, rm, v, clip)[take_n]
                    entry[v].append(membership_attack(mm, mn, rng).as_dict())
                    pool_m[s][v].append(mm)
                    pool_n[s][v].append(mn)
        for s in settings:
            for v in VARIANTS:
                if pool_m[s][v]:
                    pooled[s][v].append(membership_attack(np.concatenate(pool_m[s][v]), np.concatenate(pool_n[s][v]), rng).as_dict())
        if n_router is None:
            d_in = fn[0].shape[1]
            r = trainer.args.router
            n_router = r.ensemble * ClientRouter(d_in, len(split.clients), r.hidden, r.dropout).n_parameters()  # every member of the ensemble travels
        if on_seed is not None and seed + 1 < trainer.args.seeds:
            on_seed(result(seed + 1))
    return result(trainer.args.seeds)
