"""Choose FedVPA-GP's and VPL's settings on validation users (issue 28; docs/vpa.md, "Settings").

Validation users only (their own prompts, never a test prompt): for each seed, the quick preset's clients
(:meth:`trainer.vpa.trainer.VPAConfig.quick`, 12 clients, 30 rounds, C in {2, 8, 32}) and

1. the features: the oracle's validation accuracy with each feature set of :data:`trainer.vpa.features.STRUCTURES`;
2. per prior, the encoder pooling (mean / natural parameters), for FedVPA-GP the federated K-means refits of the
   prototypes (none / at 30 % / at 30 % and 60 % / at 80 % of the rounds), at beta = 0.03;
3. for the best of step 2 per prior: beta in {0.01, 0.1, 0.3} and free bits (1 nat).

The score is the validation accuracy averaged over C and seeds (the ``fedroute vpa train`` criterion); the
type accuracy of a probe on z at C = 2 (fitted on half the validation users, scored on the other half) is
reported beside it. Writes ``--out`` (JSON, and markdown beside it) after every candidate.

    python benchmarks/vpa_settings.py --data ../shared/data --out docs/results/vpa_settings.json --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from sdk.atomic_write import write_atomic
from trainer.data.conflicting_users import make_users
from trainer.vpa import evaluation as ev
from trainer.vpa.experiment import load_features
from trainer.vpa.features import STRUCTURES, reduce_embeddings, select_structure
from trainer.vpa.trainer import VPAConfig, VPATrainer


def _val(tr: VPATrainer, model, protos) -> dict:
    ids = tr.users.users("val")
    accs = {str(c): float(ev.vpa_correct(tr, model, ids, ev.choose_z(tr, model, ids, c, protos, "mean")).mean())
            for c in tr.cfg.contexts}
    mu, _ = ev.posterior(tr, model, ids, min(tr.cfg.contexts), protos)
    t = tr.users.type[ids]
    half = np.arange(len(ids)) % 2 == 0
    probe = ev.type_probe(mu.numpy()[half], t[half], mu.numpy()[~half], t[~half])
    return {"acc": float(np.mean(list(accs.values()))), "per_c": accs, "type_acc_c_min": probe}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--out", type=Path, default=Path("docs/results/vpa_settings.json"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--betas", type=float, nargs="+", default=[0.01, 0.1, 0.3], help="step 3's KL weights")
    ap.add_argument("--resume", action="store_true", help="keep the candidates already in --out (same seeds)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = VPAConfig.quick(data_dir=args.data, structure=None)
    pairs, phi_all = load_features(base)
    seeds = {}
    for s in args.seeds:
        users = make_users(pairs, base.users, seed=s)
        seeds[s] = (users, reduce_embeddings(phi_all, np.flatnonzero(users.part == "train"), base.pca_components))
    out: dict = {"seeds": args.seeds, "config": base.to_json(), "features": {}, "gaussian": [], "mixture": []}
    if args.resume and args.out.exists():
        out = json.loads(args.out.read_text())
        assert out["seeds"] == args.seeds, f"{args.out} holds seeds {out['seeds']}"
    t0 = time.perf_counter()

    def save() -> None:
        out["seconds"] = time.perf_counter() - t0
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, json.dumps(out, indent=1).encode())
        lines = ["| prior | setting | val acc (mean over C, seeds) | type acc from z at C = 2 |", "|---|---|---|---|"]
        for prior in ("gaussian", "mixture"):
            for r in out[prior]:
                lines.append(f"| {prior} | {r['setting']} | {r['acc']:.4f} | {r['type_acc']:.3f} |")
        feats = ", ".join(f"{k} {v:.4f}" for k, v in out["features"].items())
        write_atomic(args.out.with_suffix(".md"),
                     (f"Oracle validation accuracy by feature set: {feats}\n\n" + "\n".join(lines) + "\n").encode())

    # 1. features, by the oracle
    for structure in STRUCTURES:
        if structure in out["features"]:
            continue
        accs = []
        for s, (users, phi) in seeds.items():
            tr = VPATrainer(users, select_structure(phi, structure), base)
            oracle = tr.train_bt(per_type=True, seed=s)
            val_ids = users.users("val")
            accs.append(float(ev.bt_correct(tr, oracle, val_ids, users.type[val_ids]).mean()))
        out["features"][structure] = float(np.mean(accs))
        print(f"features {structure}: oracle val acc {np.mean(accs):.4f}", flush=True)
        save()
    structure = max(out["features"], key=out["features"].get)
    out["structure"] = structure

    def run(prior: str, setting: dict) -> None:
        if any(r["setting"] == json.loads(json.dumps(setting)) for r in out[prior]):
            return
        cfg = replace(base, structure=structure, **{k: v for k, v in setting.items() if k != "beta"})
        rows = []
        for s, (users, phi) in seeds.items():
            tr = VPATrainer(users, select_structure(phi, structure), cfg)
            model, protos = tr.train_vpa(prior, setting["beta"], seed=s)
            rows.append(_val(tr, model, protos))
        row = {"setting": setting, "acc": float(np.mean([r["acc"] for r in rows])),
               "type_acc": float(np.nanmean([r["type_acc_c_min"] for r in rows])), "per_seed": rows}
        out[prior].append(row)
        print(f"{prior} {setting}: val acc {row['acc']:.4f}, type acc {row['type_acc']:.3f}", flush=True)
        save()

    # 2. pooling (and, for the mixture, K-means refits) at beta = 0.03
    for pooling in ("mean", "natural"):
        run("gaussian", {"pooling": pooling, "beta": 0.03})
        for kmeans_at in ((), (0.3,), (0.3, 0.6), (0.8,)):
            run("mixture", {"pooling": pooling, "kmeans_at": kmeans_at, "beta": 0.03})
    # 3. beta and free bits around the best of step 2
    for prior in ("gaussian", "mixture"):
        best = dict(max(out[prior], key=lambda r: r["acc"])["setting"])
        for beta in args.betas:
            run(prior, {**best, "beta": beta})
        run(prior, {**best, "free_bits": 1.0})
    out["chosen"] = {p: max(out[p], key=lambda r: r["acc"])["setting"] for p in ("gaussian", "mixture")}
    save()
    print("chosen:", out["chosen"], f"structure {structure}", flush=True)


if __name__ == "__main__":
    main()
