"""Choose the MoR router's training settings on VALIDATION pairs only (never test, never held-out).

For each candidate (rounds, local lr, local steps, weighting) the router is trained federatedly on the clients'
train pairs of seeds 0..2 (the default pool of MoRConfig) and scored by the share of validation
responses routed to their own client (the router's BCE target), mean over clients and seeds.
Run: ``PYTHONPATH=. HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/mor_router_settings.py [--quick]``;
writes ``docs/mor_router_settings[_quick].json`` (atomically; ``--quick`` never overwrites the default pool's file).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace

import numpy as np
import torch

from benchmarks.mor_settings_setup import write_json
from trainer.rewards.client_router import ClientRouterData, FederatedRouterTrainer
from trainer.rewards.mor_trainer import MoRConfig, MoRTrainer


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    cfg = MoRConfig.quick() if "--quick" in argv else MoRConfig()
    trainer = MoRTrainer(cfg, show_progress=False)
    grid = list(itertools.product((30, 60), (1e-3, 3e-3), (None, 4), ("samples", "equal")))
    scores = {g: [] for g in grid}
    for seed in range(3):
        split = trainer.prepare(seed)
        train = [ClientRouterData(*trainer.features(c.pairs("train")), k) for k, c in enumerate(split.clients)]
        val = [trainer.features(c.pairs("val")) for c in split.clients]
        for rounds, lr, steps, w in grid:
            router = FederatedRouterTrainer(replace(cfg.router, rounds=rounds, lr=lr, local_steps=steps, weighting=w,
                                                    seed=seed)).train(train)
            share = [float(np.mean([(router.logits(f).argmax(1) == k).mean() for f in fs])) for k, fs in enumerate(val)]
            scores[(rounds, lr, steps, w)].append(share)
            print(seed, rounds, lr, steps, w, np.round(share, 3), flush=True)
    rows = [{"rounds": r, "lr": lr, "local_steps": st, "weighting": w, "val_own_share_mean": float(np.mean(s)),
             "val_own_share_min_client": float(np.mean(s, axis=0).min()),
             "val_own_share_per_client": np.mean(s, axis=0).tolist()} for (r, lr, st, w), s in scores.items()]
    rows.sort(key=lambda d: (-round(d["val_own_share_mean"], 3), -d["val_own_share_min_client"]))
    write_json("mor_router_settings", "--quick" in argv, {"clients": list(cfg.client_names), "quick": "--quick" in argv, "rows": rows})
    for d in rows:
        print(d)


if __name__ == "__main__":
    main(sys.argv[1:])
