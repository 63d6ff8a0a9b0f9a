"""MoR client reward models with or without the pair features of :mod:`sdk.pair_features` (issue 29, item 1),
chosen on the **validation** pairs.

Candidates (``MoRConfig.pair_features``): ``None`` (the 3 length columns ``l(y)``; each MLP client with a length
prior starts from its local length-only Bradley-Terry fit) and ``DEFAULT_FEATURES`` (the appended columns are
``phi(x, y) / 8``; the prior is the client's local fit on them, i.e. the structure-feature baseline of its own
pairs, federated like the rest: it never leaves the client). Everything else is the preset's.

Rule: the higher mean validation accuracy of the router + RM (sparse, the seed's chosen weighting and variant,
mean over clients and seeds). The test figures (ID and the held-out category, paired gains over per-domain
length-only) are reported for both, never used for the choice.

``PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/mor_pair_features_settings.py [--quick] --out DIR`` writes
``DIR/mor_pair_features_settings.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch

    from sdk.pair_features import DEFAULT_FEATURES
    from trainer.report import write_json
    from trainer.rewards.evaluation import run_evaluation
    from trainer.rewards.mor_trainer import MoRConfig, MoRTrainer

    torch.set_num_threads(1)
    out = {}
    for name, feats in (("length", None), ("pair_features", DEFAULT_FEATURES)):
        over = {"data_dir": args.data, "seeds": args.seeds, "pair_features": feats}
        cfg = MoRConfig.quick(**over) if args.quick else MoRConfig(**over)
        t0 = time.time()
        res = run_evaluation(MoRTrainer(cfg, show_progress=False))
        val = [float(np.mean([s["routing"]["val"][f"{s['weighting']}/{s['routing']['sparse']}"]])) for s in res["seeds"]]
        out[name] = {"val_router_rm_sparse": float(np.mean(val)), "val_per_seed": val,
                     "test": {m: {k: v for k, v in r.items() if k.endswith(("_mean", "_std"))} for m, r in res["methods"].items()},
                     "paired_vs_length_only": res["paired_vs_length_only"], "seconds": round(time.time() - t0, 1)}
        print(name, out[name]["val_router_rm_sparse"], {m: round(r["id_acc_mean"], 4) for m, r in res["methods"].items()}, flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "mor_pair_features_settings.json", out)
    chosen = max(out, key=lambda k: (out[k]["val_router_rm_sparse"], k == "length"))
    out["chosen"] = chosen
    out["rule"] = "higher mean validation accuracy of router + RM (sparse); ties to length"
    write_json(args.out / "mor_pair_features_settings.json", out)
    print("chosen:", chosen)


if __name__ == "__main__":
    main()
