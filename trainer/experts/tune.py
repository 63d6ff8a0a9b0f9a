"""Choose FedPrism's expert learning rate on the **validation** pairs (never on test).

``PYTHONPATH=. python -m trainer.experts.tune --data ../shared/data --out results/prism_tune``

Grid: ``expert_lr`` in {1e-3, 3e-3} for FedPrism and FedBis (the two main methods, so the
choice does not favour one), seed 0, the CPU preset's data and schedule with ``eval_split='val'``.
The chosen value maximises the mean validation accuracy of the two; it is written to
``tune.json`` and is the ``expert_lr`` of :class:`trainer.experts.fedprism.FedPrismConfig`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

GRID = (1e-3, 3e-3)


def main(argv: list[str]) -> None:
    import argparse

    import torch

    from trainer.experts.experiment import PRESETS, prepare_data, run_experiment
    from trainer.experts.selector import PairSelector
    from trainer.report import write_text

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--out", type=Path, default=Path("results/prism_tune"))
    ap.add_argument("--preset", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    data_preset, base = PRESETS[args.preset]
    model = PairSelector(base.selector)
    prep = prepare_data(args.data, data_preset, model)
    scores = {}
    for lr in GRID:
        r = run_experiment(prep, model, data_preset, replace(base, expert_lr=lr), [0], None,
                           methods=("fedprism", "fedbis"), eval_split="val")
        scores[lr] = {m: r["methods"][m]["acc_mean"] for m in ("fedprism", "fedbis")}
        print(f"expert_lr={lr:g}: " + ", ".join(f"{m} {v:.3f}" for m, v in scores[lr].items()), flush=True)
    best = max(scores, key=lambda lr: sum(scores[lr].values()))
    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "tune.json", json.dumps({"preset": args.preset, "split": "val", "grid": {str(k): v for k, v in scores.items()},
                                                   "chosen_expert_lr": best}, indent=2))
    print(f"chosen expert_lr = {best:g}")


if __name__ == "__main__":
    main(sys.argv[1:])
