"""Choose the membership-inference defence of the client reward MLPs on VALIDATION pairs only.

For each candidate RewardModelConfig, every client's reward MLP is trained on its train pairs (seeds
0..2 of the MoR pool) and attacked with members = train pairs, non-members = validation pairs (1:1);
its validation accuracy is the cost. Test pairs are not touched. Writes
docs/mor_defence_settings[_quick].json.
Run: ``PYTHONPATH=. HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/mor_defence_settings.py [--quick]``.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import torch

from benchmarks.mor_settings_setup import write_json
from trainer.rewards.audit import NAIVE
from trainer.rewards.mor_trainer import MoRConfig, MoRTrainer
from trainer.rewards.privacy import membership_attack
from trainer.rewards.reward_models import RewardModelConfig, pairwise_accuracy

CANDIDATES = {
    "naive (200 epochs, no regularisation)": NAIVE,
    "early stop, wd 1e-2, dropout 0.1 (MoR default)": RewardModelConfig(),
    "early stop, wd 1, dropout 0.1": RewardModelConfig(weight_decay=1.0),
    "early stop, wd 1, dropout 0.5": RewardModelConfig(weight_decay=1.0, dropout=0.5),
    "early stop, wd 5, dropout 0.5": RewardModelConfig(weight_decay=5.0, dropout=0.5),
    "early stop, wd 1, dropout 0.5, hidden 32, val 0.3": RewardModelConfig(weight_decay=1.0, dropout=0.5, hidden=32, val_fraction=0.3),
    "DP-SGD noise 0.6, clip 1, 30 epochs": RewardModelConfig(epochs=30, lr=3e-3, weight_decay=0.0, dropout=0.0, dp_noise_multiplier=0.6),
    "DP-SGD noise 1.0, clip 1, 30 epochs": RewardModelConfig(epochs=30, lr=3e-3, weight_decay=0.0, dropout=0.0, dp_noise_multiplier=1.0),
}


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    cfg = MoRConfig.quick() if "--quick" in argv else MoRConfig()
    trainer = MoRTrainer(cfg, show_progress=False)
    rows = {name: {"auc": [], "val_acc": []} for name in CANDIDATES}
    for seed in range(3):
        split = trainer.prepare(seed)
        rng = np.random.default_rng(seed)
        for c in split.clients:
            fm, fv = trainer.features(c.pairs("train")), trainer.features(c.pairs("val"))
            for name, rc in CANDIDATES.items():
                rm, _ = trainer.train_reward_model(c, "mlp", seed, replace(rc, seed=seed))
                mm = rm.raw_scores_from_features(fm[0]) - rm.raw_scores_from_features(fm[1])
                mv = rm.raw_scores_from_features(fv[0]) - rm.raw_scores_from_features(fv[1])
                rows[name]["auc"].append(membership_attack(mm, mv, rng).auc)
                rows[name]["val_acc"].append(pairwise_accuracy(rm.raw_scores_from_features(fv[0]), rm.raw_scores_from_features(fv[1])))
                print(seed, c.name, name, round(rows[name]["auc"][-1], 3), round(rows[name]["val_acc"][-1], 3), flush=True)
    clients = list(cfg.client_names)
    out = []
    for name, r in rows.items():
        auc = np.array(r["auc"]).reshape(3, len(clients))
        acc = np.array(r["val_acc"]).reshape(3, len(clients))
        out.append({"setting": name, "config": vars(CANDIDATES[name]),
                    "val_auc_per_client": dict(zip(clients, auc.mean(0).tolist())), "val_auc_max": float(auc.mean(0).max()),
                    "val_acc_per_client": dict(zip(clients, acc.mean(0).tolist())), "val_acc_mean": float(acc.mean())})
    write_json("mor_defence_settings", "--quick" in argv, {"quick": "--quick" in argv, "rows": out})
    for o in out:
        print(o["setting"], round(o["val_auc_max"], 3), {k: round(v, 3) for k, v in o["val_auc_per_client"].items()},
              round(o["val_acc_mean"], 3))


if __name__ == "__main__":
    main(sys.argv[1:])
