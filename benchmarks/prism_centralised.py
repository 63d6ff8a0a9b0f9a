"""Upper reference for the CPU preset: one selector trained *centrally* on all client pairs.

Same data, selector and optimiser as ``fedroute prism train`` (CPU preset, expert_lr 1e-3, batch 16),
but every train pair every epoch, no federation, no routing. Test accuracy after each epoch, beside the
per-domain length-only regression. It separates "the federated CPU budget is too small" (the
central selector beats length-only) from "the data leave nothing beyond length" (it does not).

``PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/prism_centralised.py --data ../shared/data --out results/prism_central``
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    from tqdm.auto import tqdm

    from trainer.experts.experiment import PRESETS, prepare_data
    from trainer.experts.selector import PairSelector
    from trainer.length_baseline import LengthBaseline
    from trainer.preference_metrics import pairwise_accuracy
    from trainer.report import save_figure, write_json

    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--out", type=Path, default=Path("results/prism_central"))
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    preset, base = PRESETS["cpu"]
    model = PairSelector(base.selector, seed=0)
    prep = prepare_data(args.data, preset, model, progress=False)
    n_tr, n_va = len(prep.train), len(prep.val)
    test = np.arange(n_tr + n_va, n_tr + n_va + len(prep.test))
    y = prep.test.label.to_numpy()
    dom = prep.test.domain.to_numpy()
    length = LengthBaseline().fit(prep.train).predict_proba(prep.test)

    def evaluate() -> dict:
        model.train(False)
        with torch.no_grad():
            p = np.concatenate([model.pair_proba(*prep.store.batch(model, test[s:s + 128])[:3]).numpy()
                                for s in range(0, len(test), 128)])
        return {"overall": pairwise_accuracy(p, y), **{d: pairwise_accuracy(p[dom == d], y[dom == d]) for d in sorted(set(dom))}}

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=base.expert_lr)
    rng = np.random.default_rng(0)
    steps, curve = 0, [(0, evaluate())]
    for _ in range(args.epochs):
        order = rng.permutation(n_tr)
        for s in tqdm(range(0, n_tr, base.batch_size), desc="central epoch"):
            model.train()
            ha, hb, f, lab = prep.store.batch(model, order[s:s + base.batch_size])
            loss = model.pair_loss(ha, hb, f, lab)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += len(order[s:s + base.batch_size])
            if steps % 800 < base.batch_size or s + base.batch_size >= n_tr:
                curve.append((steps, evaluate()))
                print(steps, curve[-1][1], flush=True)
    lo = {"overall": pairwise_accuracy(length, y), **{d: pairwise_accuracy(length[dom == d], y[dom == d]) for d in sorted(set(dom))}}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "central.json", {"pair_steps": [c[0] for c in curve], "accuracy": [c[1] for c in curve],
                                           "length_only": lo, "n_train": n_tr, "federated_pair_steps_per_run":
                                           base.rounds * base.clients_per_round * base.local_pairs})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot([c[0] for c in curve], [c[1]["overall"] for c in curve], marker="o", label="central selector (test)")
    ax.axhline(lo["overall"], color="k", ls="--", label="length-only (per domain)")
    ax.axvline(base.rounds * base.clients_per_round * base.local_pairs, color="grey", ls=":",
               label="pair-steps of one federated CPU run")
    ax.set_xlabel("training pair-steps")
    ax.set_ylabel("test pairwise accuracy")
    ax.legend(fontsize=8)
    save_figure(fig, args.out / "central.png")


if __name__ == "__main__":
    main()
