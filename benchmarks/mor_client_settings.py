"""Choose the MoR clients' reward-model settings and the routed reward's softmax temperature on
VALIDATION pairs only (never test, never the held-out category).

For seeds 0..2 of :class:`MoRConfig`'s default pool (``--quick``: the quick pool) the router is trained
once per seed (the default: equal weighting), then every candidate setting of the clients' reward models
is trained and scored on each client's own validation pairs:

- ``own``: each client's reward model on its own validation pairs (what a client can pick locally);
- ``sparse``: router + RM, top-1 client per (x, y) (mean over clients of validation accuracy);
- ``soft T``: ``sum_k softmax(z / T)_k R_bar_k(x, y)`` for temperatures T;
- ``prompt-sparse`` / ``prompt-soft``: both responses of a pair routed together, by the mean of their
  router probabilities (top-1 client, or those mean probabilities as soft weights).

Candidates (``RewardModelConfig``): the length prior as before (``prior``), the prior with early stopping
that may keep the untrained length-only start (``prior+keep``), and no length term (``off``).
Run: ``PYTHONPATH=. HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/mor_client_settings.py [--quick] [--mlp-only]``;
writes ``docs/mor_client_settings[_quick][_mlp].json`` (the defaults were chosen from ``--mlp-only``: a LoRA
candidate costs ~1 s per pair on this CPU).
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

from trainer.report import write_text
from trainer.rewards.client_router import ClientRouterData, FederatedRouterTrainer
from trainer.rewards.mixture import softmax
from trainer.rewards.mor_trainer import MoRConfig, MoRTrainer
from trainer.rewards.reward_models import pairwise_accuracy

CANDIDATES = {"prior": dict(length_prior=True, keep_start=False),
              "prior+keep": dict(length_prior=True, keep_start=True),
              "off": dict(length_prior=False, keep_start=False)}
TEMPERATURES = (0.25, 0.5, 1.0, 2.0)


def _scores(trainer, rm, pairs):
    fc, fr = trainer.features(pairs)
    if hasattr(rm, "raw_scores_from_features"):
        rc, rr = rm.raw_scores_from_features(fc), rm.raw_scores_from_features(fr)
    else:
        rc, rr = rm.raw_scores(pairs.prompts, pairs.chosen), rm.raw_scores(pairs.prompts, pairs.rejected)
    return np.stack([rm.normaliser_(rc), rm.normaliser_(rr)]).astype(np.float64)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    quick = "--quick" in argv
    cfg = MoRConfig.quick() if quick else MoRConfig()
    if "--mlp-only" in argv:
        cfg = replace(cfg, client_archs=tuple("mlp" for _ in cfg.client_names))
    trainer = MoRTrainer(cfg, show_progress=False)
    names = list(cfg.client_names)
    rows: dict[str, dict] = {}
    t0 = time.perf_counter()
    for seed in tqdm(range(3), desc="seeds"):
        split = trainer.prepare(seed)
        feats = [trainer.features(c.pairs("train")) for c in split.clients]
        data = [ClientRouterData(fc, fr, k) for k, (fc, fr) in enumerate(feats)]
        router = FederatedRouterTrainer(replace(cfg.router, seed=seed)).train(data, names)
        vals = [c.pairs("val") for c in split.clients]
        logits = [np.stack([router.logits(f) for f in trainer.features(v)]) for v in vals]  # (2, n, K)
        for label, over in CANDIDATES.items():
            rms = []
            for client, arch in zip(split.clients, cfg.client_archs):
                base = cfg.mlp_rm if arch == "mlp" else cfg.lora_rm
                rm_cfg = replace(base, length_prior_C=cfg.length_prior_C, clip=cfg.clip, **over)
                rms.append(trainer.train_reward_model(client, arch, seed, rm_cfg)[0])
            row = rows.setdefault(label, {})
            for k, (v, z) in enumerate(zip(vals, logits)):
                s = np.stack([_scores(trainer, rm, v) for rm in rms], -1)  # (2, n, K)
                acc = lambda a: pairwise_accuracy(a[0], a[1])  # noqa: E731
                row.setdefault("own", {}).setdefault(names[k], []).append(acc(s[..., k]))
                pick = np.take_along_axis(s, z.argmax(-1)[..., None], -1)[..., 0]
                row.setdefault("sparse", {}).setdefault(names[k], []).append(acc(pick))
                for t in TEMPERATURES:
                    w = softmax(z.reshape(-1, len(names)) / t).reshape(z.shape)
                    row.setdefault(f"soft T={t}", {}).setdefault(names[k], []).append(acc((w * s).sum(-1)))
                # per-prompt routing: both responses of a pair go to the client of the mean probabilities
                p = softmax(z.reshape(-1, len(names))).reshape(z.shape).mean(0)  # (n, K)
                g = np.take_along_axis(s, np.broadcast_to(p.argmax(-1)[None, :, None], (2, p.shape[0], 1)), -1)[..., 0]
                row.setdefault("prompt-sparse", {}).setdefault(names[k], []).append(acc(g))
                row.setdefault("prompt-soft", {}).setdefault(names[k], []).append(acc((p[None] * s).sum(-1)))
            print(seed, label, {m: round(float(np.mean([v[-1] for v in d.values()])), 3) for m, d in row.items()},
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
    table = []
    for label, row in rows.items():
        for metric, per in row.items():
            per_seed = np.mean([per[n] for n in names], axis=0)
            table.append({"setting": label, "metric": metric, "val_acc_mean": float(per_seed.mean()),
                          "val_acc_std_over_seeds": float(per_seed.std(ddof=1)),
                          "per_client": {n: float(np.mean(per[n])) for n in names}})
    out = Path(f"docs/mor_client_settings{'_quick' if quick else ''}{'_mlp' if '--mlp-only' in argv else ''}.json")
    write_text(out, json.dumps({"pool": "quick" if quick else "default", "archs": list(cfg.client_archs),
                                "seeds": [0, 1, 2], "seconds": time.perf_counter() - t0, "rows": table}, indent=2))
    for d in table:
        print(f"{d['setting']:12s} {d['metric']:12s} {d['val_acc_mean']:.3f} ± {d['val_acc_std_over_seeds']:.3f} "
              + " ".join(f"{v:.3f}" for v in d["per_client"].values()))


if __name__ == "__main__":
    main(sys.argv[1:])
