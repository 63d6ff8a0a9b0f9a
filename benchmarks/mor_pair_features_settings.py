"""MoR client reward models with or without the pair features of :mod:`sdk.pair_features` (issue 29, items 1-2),
chosen on the **validation** pairs.

Candidates (``MoRConfig.pair_features``): ``None`` (the 3 length columns ``l(y)``; each MLP client with a length
prior starts from its local length-only Bradley-Terry fit) and ``DEFAULT_FEATURES`` (the appended columns are
``phi(x, y) / 8``; the prior is the client's local fit on them, i.e. the structure-feature baseline of its own
pairs, federated like the rest: it never leaves the client). Everything else is the preset's. With ``--full``
(:meth:`MoRConfig.full`: every pair, all-MLP clients) a third candidate gives every client the prior
(``length_prior=(True, True, True)``: the harmlessness client's structure fit too; the default leaves it off) and a
fourth also lets early stopping keep that fit untrained (``keep_start=True``) when training does not lower the
client's validation loss.

Rule: the higher mean validation accuracy of the router + RM (sparse, the seed's chosen weighting and variant,
mean over clients and seeds). Without ``--full`` the test figures (ID and the held-out category, paired gains over
per-domain length-only) are reported for both candidates, never used for the choice. With ``--full`` only the
candidates' validation figures are written; the chosen candidate's run is the preset's test run (once, its
``results.{json,md,png}`` in ``--results``).

``PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/mor_pair_features_settings.py [--quick | --full --results DIR2] --out DIR``
writes ``DIR/mor_pair_features_settings[_full].json``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--results", type=Path, help="--full: folder of the chosen candidate's results.{json,md,png}")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.full and (args.quick or args.results is None):
        ap.error("--full needs --results and excludes --quick")

    import torch

    from sdk.pair_features import DEFAULT_FEATURES
    from trainer.report import write_json
    from trainer.rewards.evaluation import run_evaluation
    from trainer.rewards.mor_report import write_eval
    from trainer.rewards.mor_trainer import MoRConfig, MoRTrainer

    torch.set_num_threads(1)
    prior = (True, False, True)  # each client's own choice (MoRConfig.length_prior)
    candidates = {"length": {"pair_features": None, "length_prior": prior},
                  "pair_features": {"pair_features": DEFAULT_FEATURES, "length_prior": prior}}
    if args.full:
        everyone = {"pair_features": DEFAULT_FEATURES, "length_prior": (True, True, True)}
        candidates |= {"pair_features_all_priors": everyone, "pair_features_all_priors_keep_start": everyone | {"keep_start": True}}
    preset = MoRConfig.quick if args.quick else MoRConfig.full if args.full else MoRConfig
    path = args.out / f"mor_pair_features_settings{'_full' if args.full else ''}.json"
    out, runs = {}, {}
    for name, over in candidates.items():
        cfg = preset(**({"data_dir": args.data, "seeds": args.seeds} | over))
        t0, load0 = time.time(), os.getloadavg()[0]
        res = runs[name] = run_evaluation(MoRTrainer(cfg, show_progress=False))
        val = [float(s["routing"]["val"][f"{s['weighting']}/{s['routing']['sparse']}"]) for s in res["seeds"]]
        out[name] = {"overrides": {k: (list(v) if isinstance(v, tuple) else v) for k, v in over.items()},
                     "val_router_rm_sparse": float(np.mean(val)), "val_per_seed": val,
                     "seconds": round(time.time() - t0, 1), "load_1min_start_end": [load0, os.getloadavg()[0]]}
        if not args.full:
            out[name] |= {"test": {m: {k: v for k, v in r.items() if k.endswith(("_mean", "_std"))} for m, r in res["methods"].items()},
                          "paired_vs_length_only": res["paired_vs_length_only"]}
        print(name, out[name]["val_router_rm_sparse"], out[name]["seconds"], flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(path, out)
    chosen = max(candidates, key=lambda k: (out[k]["val_router_rm_sparse"], k == "length"))
    out["chosen"] = chosen
    out["rule"] = "higher mean validation accuracy of router + RM (sparse); ties to length"
    write_json(path, out)
    if args.full:
        res = runs[chosen]
        cfg = preset(**({"data_dir": args.data, "seeds": args.seeds} | candidates[chosen]))
        write_eval(res | {"config": cfg.to_json(), "quick": False, "command": "mor eval"}, args.results)
    print("chosen:", chosen)


if __name__ == "__main__":
    main()
