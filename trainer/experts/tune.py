"""Choose FedPrism's settings on the **validation** pairs (never on test).

``PYTHONPATH=. python -m trainer.experts.tune --data ../shared/data --out results/prism_tune [--part lr|M3|M5]``
then ``--choose`` to pick from the parts written.

Grids, all at seed 0 with the CPU preset's data and schedule and ``eval_split='val'``:

- ``lr`` (first round of tuning): ``expert_lr`` in {1e-3, 3e-3} for FedPrism and FedBis (the two
  main methods, so the choice does not favour one); chosen by the mean of the two: 1e-3
  (0.782 / 0.676 vs 0.782 / 0.671).
- ``M3``, ``M5`` (second round, after the federated length start of
  :mod:`trainer.experts.length_init`): ``n_experts`` = M in {3, 5} x ``length_init`` in
  {``'zero'``, ``'fedavg_lr'``} for FedPrism, plus FedBis under both ``length_init`` values in part
  ``M3`` (FedBis has one expert, so M does not apply to it). ``length_init`` is chosen by the mean
  of FedPrism (at its best M) and FedBis, then M by FedPrism's validation accuracy under that
  ``length_init`` among the M whose utilisation max share is <= 0.6 (the issue's target; all M when
  none meets it).

Each part writes ``tune_<part>.json``; ``--choose`` writes ``tune.json`` with the chosen values.
``length_init`` is still this script's choice; M was chosen again afterwards over a wider grid
(3, 4, 5, 6, 8), also on validation, by ``benchmarks/prism_experts_settings.py``: M = 6 is the CPU
preset's.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
import argparse
from trainer.report import write_text

LR_GRID = (1e-3, 3e-3)
PARTS = {"M3": 3, "M5": 5}
LENGTH_INITS = ("zero", "fedavg_lr")
MAX_SHARE = 0.6


def _run_lr(prep, model, data_preset, base) -> dict:
    from trainer.experts.experiment import run_experiment  # trainer.experts.experiment imports pandas, torch: on use only

    scores = {}
    for lr in LR_GRID:
        r = run_experiment(prep, model, data_preset, replace(base, expert_lr=lr), [0], None,
                           methods=("fedprism", "fedbis"), eval_split="val")
        scores[str(lr)] = {m: r["methods"][m]["acc_mean"] for m in ("fedprism", "fedbis")}
        print(f"expert_lr={lr:g}: {scores[str(lr)]}", flush=True)
    return {"grid": scores, "chosen_expert_lr": float(max(scores, key=lambda k: sum(scores[k].values())))}


def _run_m(prep, model, data_preset, base, m: int, with_fedbis: bool) -> dict:
    from trainer.experts.experiment import run_experiment  # trainer.experts.experiment imports pandas, torch: on use only

    out = {}
    for li in LENGTH_INITS:
        methods = ("fedprism", "fedbis") if with_fedbis else ("fedprism",)
        r = run_experiment(prep, model, data_preset, replace(base, n_experts=m, length_init=li), [0], None,
                           methods=methods, eval_split="val")
        out[li] = {"fedprism": r["methods"]["fedprism"]["acc_mean"],
                   "fedprism_domains": {d: v["acc_mean"] for d, v in r["methods"]["fedprism"]["domains"].items()},
                   "max_share": r["utilisation"]["max_share"]}
        if with_fedbis:
            out[li]["fedbis"] = r["methods"]["fedbis"]["acc_mean"]
        print(f"M={m} length_init={li}: {out[li]}", flush=True)
    return {"n_experts": m, "grid": out}


def choose(folder: Path) -> dict:
    """Pick ``length_init`` and M from ``tune_M*.json`` in ``folder`` (rules in the module docstring)."""
    parts = {p: json.loads((folder / f"tune_{p}.json").read_text()) for p in PARTS if (folder / f"tune_{p}.json").exists()}
    if "M3" not in parts:
        raise FileNotFoundError(f"{folder / 'tune_M3.json'} is needed (it holds FedBis)")
    fedbis = {li: parts["M3"]["grid"][li]["fedbis"] for li in LENGTH_INITS}
    best_fp = {li: max(p["grid"][li]["fedprism"] for p in parts.values()) for li in LENGTH_INITS}
    li = max(LENGTH_INITS, key=lambda k: best_fp[k] + fedbis[k])
    ok = [p for p in parts.values() if p["grid"][li]["max_share"] <= MAX_SHARE] or list(parts.values())
    m = max(ok, key=lambda p: p["grid"][li]["fedprism"])["n_experts"]
    return {"split": "val", "parts": parts, "chosen_length_init": li, "chosen_n_experts": int(m)}


def main(argv: list[str]) -> None:

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--out", type=Path, default=Path("results/prism_tune"))
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--part", choices=("lr",) + tuple(PARTS), default="M3")
    ap.add_argument("--choose", action="store_true", help="pick from the tune_*.json already written")
    args = ap.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    if args.choose:
        res = choose(args.out)
        write_text(args.out / "tune.json", json.dumps(res, indent=2))
        print(f"chosen length_init = {res['chosen_length_init']}, n_experts = {res['chosen_n_experts']}")
        return

    import torch  # torch: optional heavy dependency, imported on use

    from trainer.experts.experiment import PRESETS, prepare_data  # trainer.experts.experiment imports pandas, torch: on use only
    from trainer.experts.selector import PairSelector  # trainer.experts.selector imports torch: on use only

    torch.set_num_threads(1)
    data_preset, base = PRESETS[args.preset]
    base = replace(base, router_role_scale=0.0)  # the embedding-only router its recorded figures used
    model = PairSelector(base.selector)
    prep = prepare_data(args.data, data_preset, model)
    if args.part == "lr":
        res = _run_lr(prep, model, data_preset, base)
    else:
        res = _run_m(prep, model, data_preset, base, PARTS[args.part], with_fedbis=args.part == "M3")
    write_text(args.out / f"tune_{args.part}.json", json.dumps({"preset": args.preset, "split": "val", **res}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
