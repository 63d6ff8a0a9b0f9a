"""MoR client reward models with or without the pair features of :mod:`sdk.pair_features` (issue 29, items 1-2),
chosen on the **validation** pairs.

Candidates (``MoRConfig.pair_features``): ``length`` (the 3 length columns ``l(y)``; each MLP client with a length
prior starts from its local length-only Bradley-Terry fit) and ``pair_features`` (``DEFAULT_FEATURES``: the appended
columns are ``phi(x, y) / 8``; the prior is the client's local fit on them, i.e. the structure-feature baseline of its
own pairs, federated like the rest: it never leaves the client), both with each client's own prior choice
``length_prior=(True, False, True)``. With ``--full`` (:meth:`MoRConfig.full`: every pair, all-MLP clients) the
pair-feature candidates are ``pair_features_all_priors``, every client with the prior (the harmlessness client's
structure fit too: on the full split the structure features gain most on HH, docs/mor.md), and
``pair_features_all_priors_keep_start``, which also lets early stopping keep that fit untrained (``keep_start=True``)
when training does not lower the client's validation loss. Everything else is the preset's.

Rule: the highest mean validation accuracy of the router + RM (sparse, the seed's chosen weighting and variant, mean
over clients and seeds); ties to ``length``. Without ``--full`` the test figures (ID and the held-out category, paired
gains over per-domain length-only) are reported for every candidate, never used for the choice. With ``--full`` the
candidates may run in separate processes (``--candidates``); each writes its validation figures into
``DIR/mor_pair_features_settings_full.json`` and its whole run into ``--runs`` (not read before the choice); once
every candidate is in, the chosen candidate's run is written as the preset's test result (``--results``:
``results.{json,md,png}``), the only test figures reported.

``PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/mor_pair_features_settings.py [--quick] --out DIR`` writes
``DIR/mor_pair_features_settings.json``; ``... --full --runs RUNS --results DIR2 --out DIR [--candidates a,b]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np


def candidates(full: bool) -> dict:
    from sdk.pair_features import DEFAULT_FEATURES

    prior = (True, False, True)  # each client's own choice (MoRConfig.length_prior)
    out = {"length": {"pair_features": None, "length_prior": prior}}
    if not full:
        return out | {"pair_features": {"pair_features": DEFAULT_FEATURES, "length_prior": prior}}
    everyone = {"pair_features": DEFAULT_FEATURES, "length_prior": (True, True, True)}
    return out | {"pair_features_all_priors": everyone, "pair_features_all_priors_keep_start": everyone | {"keep_start": True}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--candidates", help="comma-separated subset to run in this process (default: all; '': only choose)")
    ap.add_argument("--runs", type=Path, help="--full: folder of each candidate's whole run")
    ap.add_argument("--results", type=Path, help="--full: folder of the chosen candidate's results.{json,md,png}")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.full and (args.quick or args.results is None or args.runs is None):
        ap.error("--full needs --runs and --results and excludes --quick")

    import torch

    from trainer.report import write_json
    from trainer.rewards.evaluation import run_evaluation
    from trainer.rewards.mor_report import write_eval
    from trainer.rewards.mor_trainer import MoRConfig, MoRTrainer

    torch.set_num_threads(1)
    cands = candidates(args.full)
    run = [c.strip() for c in args.candidates.split(",") if c.strip()] if args.candidates is not None else list(cands)
    if set(run) - set(cands):
        ap.error(f"--candidates: choose from {sorted(cands)}")
    preset = MoRConfig.quick if args.quick else MoRConfig.full if args.full else MoRConfig
    path = args.out / f"mor_pair_features_settings{'_full' if args.full else ''}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    config = lambda name: preset(**({"data_dir": args.data, "seeds": args.seeds} | cands[name]))  # noqa: E731
    for name in run:
        t0, load0 = time.time(), os.getloadavg()[0]
        res = run_evaluation(MoRTrainer(config(name), show_progress=False))
        val = [float(s["routing"]["val"][f"{s['weighting']}/{s['routing']['sparse']}"]) for s in res["seeds"]]
        entry = {"overrides": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cands[name].items()},
                 "val_router_rm_sparse": float(np.mean(val)), "val_per_seed": val,
                 "seconds": round(time.time() - t0, 1), "load_1min_start_end": [load0, os.getloadavg()[0]]}
        if args.full:
            args.runs.mkdir(parents=True, exist_ok=True)
            write_json(args.runs / f"{name}.json", res | {"config": config(name).to_json(), "quick": False,
                                                          "command": "mor eval"})
        else:
            entry |= {"test": {m: {k: v for k, v in r.items() if k.endswith(("_mean", "_std"))} for m, r in res["methods"].items()},
                      "paired_vs_length_only": res["paired_vs_length_only"]}
        out = json.loads(path.read_text()) if path.exists() and args.full else {}  # other processes' candidates
        out[name] = entry
        write_json(path, out)
        print(name, entry["val_router_rm_sparse"], entry["seconds"], flush=True)
    out = json.loads(path.read_text())
    if not set(cands) <= set(out):
        print("waiting for", sorted(set(cands) - set(out)))
        return
    chosen = max(cands, key=lambda k: (out[k]["val_router_rm_sparse"], k == "length"))
    out |= {"chosen": chosen, "rule": "highest mean validation accuracy of router + RM (sparse); ties to length"}
    write_json(path, out)
    if args.full:
        write_eval(json.loads((args.runs / f"{chosen}.json").read_text()), args.results)
    print("chosen:", chosen)


if __name__ == "__main__":
    main()
