"""Choose the MoR clients' length prior on VALIDATION pairs only (never test, never the held-out category).

Candidates: no length term (the old default) and ``RewardModelConfig.length_prior`` with the local
length-only fit's inverse L2 strength ``C`` in {0.1, 1, 10}. For seeds 0..2 of the pool of
:class:`MoRConfig` (``--quick``: the quick pool), each client trains its reward model on its train pairs
and is scored by pairwise accuracy on its own validation pairs; the table gives the mean over seeds per
client and the mean over clients. Every client is an MLP here (a LoRA client costs ~1 s per pair on
this CPU; the knob is the same for both architectures). The untrained length-only start (the local fit
alone) is reported too, as the reference the residual must beat.
Run: ``PYTHONPATH=. HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/mor_length_prior_settings.py [--quick]``;
writes ``docs/mor_length_prior_settings[_quick].json``.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
from tqdm.auto import tqdm

from benchmarks.mor_settings_setup import setup, write_json
from trainer.rewards.pair_features import response_lengths
from trainer.rewards.reward_models import fit_length_prior, pairwise_accuracy

CANDIDATES = (("off", None), ("prior C=0.1", 0.1), ("prior C=1", 1.0), ("prior C=10", 10.0))


def main(argv: list[str]) -> None:
    bench = setup(argv)
    quick, cfg, trainer, names = bench.quick, bench.cfg, bench.trainer, bench.names
    scores: dict[str, list[list[float]]] = {n: [] for n, _ in CANDIDATES}
    scores["length fit alone (C=1)"] = []
    for seed in tqdm(range(3), desc="seeds"):
        split = trainer.prepare(seed)
        for label, c in CANDIDATES:
            row = []
            for client in split.clients:
                rm_cfg = replace(cfg.mlp_rm, length_prior=c is not None, length_prior_C=c or 1.0)
                rm, _ = trainer.train_reward_model(client, "mlp", seed, rm_cfg)
                val = client.pairs("val")
                row.append(pairwise_accuracy(rm.score(val.prompts, val.chosen), rm.score(val.prompts, val.rejected)))
            scores[label].append(row)
            print(seed, label, np.round(row, 3), flush=True)
        row = []
        for client in split.clients:
            tr, val = client.pairs("train"), client.pairs("val")
            w = fit_length_prior(response_lengths(tr.chosen), response_lengths(tr.rejected), 1.0)
            row.append(pairwise_accuracy(response_lengths(val.chosen) @ w, response_lengths(val.rejected) @ w))
        scores["length fit alone (C=1)"].append(row)
    rows = [{"setting": k, "val_acc_mean": float(np.mean(v)), "val_acc_std_over_seeds": float(np.std(np.mean(v, axis=1))),
             "val_acc_per_client": dict(zip(names, np.mean(v, axis=0).tolist()))} for k, v in scores.items()]
    write_json("mor_length_prior_settings", quick,
               {"pool": "quick" if quick else "default", "archs": "all mlp", "seeds": [0, 1, 2], "rows": rows})
    for d in rows:
        print(d)


if __name__ == "__main__":
    main(sys.argv[1:])
