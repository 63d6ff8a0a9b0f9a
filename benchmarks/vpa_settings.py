"""Choose FedVPA-GP's and VPL's settings on validation users (issue 28; docs/vpa.md, "Settings").

Validation users only (their own prompts, never a test prompt): for each seed, the quick preset's clients
(:meth:`trainer.vpa.trainer.VPAConfig.quick`, 12 clients, 30 rounds, C in {2, 8, 32}) and

1. the features: the oracle's validation accuracy with each feature set of :data:`trainer.vpa.features.STRUCTURES`;
2. per prior, the encoder pooling (mean / natural parameters), for FedVPA-GP the federated K-means refits of the
   prototypes (none / at 30 % / at 30 % and 60 % / at 80 % of the rounds), at beta = 0.03;
3. for the best of step 2 per prior: beta in {0.01, 0.1, 0.3} and free bits (1 nat);
4. ``--mixture-structure``: around the best of step 3, one change at a time of what the mixture prior adds
   (K = 4 prototypes, orthogonality weight 0 / 10, a colder Gumbel-softmax end temperature, tighter prototype
   variances, prototypes further apart, uniform ``pi``, d_z = 2 for both priors), every z mode of
   :data:`trainer.vpa.trainer.Z_MODES` scored; then the two best changes together. Beside them, the label-trained
   reference on the same validation users: the two-stage model's accuracy and type accuracy per C (the
   type inference a model told the types at training reaches from C pairs), and the type accuracy of the
   user's client's training majority (what a client-level prior could know).

The score is the validation accuracy averaged over C and seeds (the ``fedroute vpa train`` criterion); the
type accuracy of a probe on z at C = 2 (fitted on half the validation users, scored on the other half) is
reported beside it (step 4 adds a 4-fold cross-validated probe over all validation users, ``type_acc_cv``, and
per C). Writes ``--out`` (JSON, and markdown beside it) after every candidate.

    python benchmarks/vpa_settings.py --data ../shared/data --out docs/results/vpa_settings.json --seeds 0 1
    python benchmarks/vpa_settings.py --data ../shared/data --out docs/results/vpa_settings.json --seeds 0 1 --resume --mixture-structure
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, cross_val_score

from sdk.atomic_write import write_atomic
from trainer.data.conflicting_users import make_users
from trainer.vpa import evaluation as ev
from trainer.vpa.experiment import load_features
from trainer.vpa.features import STRUCTURES, reduce_embeddings, select_structure
from trainer.vpa.trainer import Z_MODES, VPAConfig, VPATrainer

#: Step 4's single changes (mixture prior); ``latent_dim`` is tried for VPL too.
MIXTURE_CHANGES = ({"n_prototypes": 4}, {"lambda_orth": 0.0}, {"lambda_orth": 10.0}, {"tau_end": 0.05},
                   {"proto_var_cap": 0.1}, {"proto_var_cap": 0.3}, {"proto_scale": 4.0}, {"learn_pi": False},
                   {"latent_dim": 2})


def _cv_probe(z: np.ndarray, t: np.ndarray) -> float:
    return float(cross_val_score(LogisticRegression(), z, t, cv=StratifiedKFold(4, shuffle=True, random_state=0)).mean())


def _val_modes(tr: VPATrainer, model, protos) -> dict:
    """Validation accuracy per z mode and C, and the type probes per C (step 4)."""
    ids = tr.users.users("val")
    t = tr.users.type[ids]
    modes = Z_MODES if protos is not None else ("mean",)
    acc = {m: {str(c): float(ev.vpa_correct(tr, model, ids, ev.choose_z(tr, model, ids, c, protos, m)).mean())
               for c in tr.cfg.contexts} for m in modes}
    type_acc = {str(c): _cv_probe(ev.posterior(tr, model, ids, c, protos)[0].numpy(), t) for c in tr.cfg.contexts}
    return {"acc_by_z_mode": acc, "type_acc_cv": type_acc}


def _reference(tr: VPATrainer, seed: int) -> dict:
    """The two-stage model (trained with type labels) on the validation users: accuracy and type accuracy per C; and
    the type accuracy of guessing a user's type as the majority type of its client's training users (what a
    client-level prior could know before any pair)."""
    ids = tr.users.users("val")
    t = tr.users.type[ids]
    oracle = tr.train_bt(per_type=True, seed=seed)
    shares = np.bincount(tr.users.type[tr.users.users("train")], minlength=2) + 1.0
    majority = np.array([tr.users.type[tr.users.users("train", int(i))].mean() > 0.5 for i in tr.users.client[ids]])
    out = {"oracle": float(ev.bt_correct(tr, oracle, ids, t).mean()), "two_stage": {}, "two_stage_type_acc": {},
           "client_majority_type_acc": float((majority == t).mean())}
    for c in tr.cfg.contexts:
        guess = ev.two_stage_types(tr, oracle, ids, c, np.log(shares / shares.sum()))
        out["two_stage"][str(c)] = float(ev.bt_correct(tr, oracle, ids, guess).mean())
        out["two_stage_type_acc"][str(c)] = float((guess == t).mean())
    return out


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
    ap.add_argument("--mixture-structure", action="store_true", help="run step 4 (what the mixture prior adds)")
    ap.add_argument("--shard", type=int, nargs=2, metavar=("I", "N"),
                    help="step 4: only changes I, I + N, ... (runs in parallel; a later --resume run over the merged "
                         "step4 rows adds the combination)")
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
        text = f"Oracle validation accuracy by feature set: {feats}\n\n" + "\n".join(lines) + "\n"
        if out.get("step4"):
            cs = list(out["step4"][0]["acc_by_z_mode"]["mean"])
            head = " | ".join(f"C = {c}" for c in cs)
            rows = [f"| prior | setting | z mode | val acc (mean over C) | {head} | type acc (4-fold CV) at {head} |",
                    "|---|---|---|---|" + "---|" * 2 * len(cs)]
            ref = out.get("reference") or []
            if ref:
                rows.append("| two_stage (type labels) | - | - | "
                            f"{np.mean([np.mean(list(r['two_stage'].values())) for r in ref]):.4f} | "
                            + " | ".join(f"{np.mean([r['two_stage'][c] for r in ref]):.4f}" for c in cs) + " | "
                            + " | ".join(f"{np.mean([r['two_stage_type_acc'][c] for r in ref]):.3f}" for c in cs) + " |")
            for r in out["step4"]:
                for mode, acc in r["acc_by_z_mode"].items():
                    rows.append(f"| {r['prior']} | {r['setting']} | {mode} | {np.mean(list(acc.values())):.4f} | "
                                + " | ".join(f"{acc[c]:.4f}" for c in cs) + " | "
                                + " | ".join(f"{r['type_acc_cv'][c]:.3f}" for c in cs) + " |")
            text += ("\nStep 4 (what the mixture prior adds; mean over seeds; z mode = how z is read from the posterior):\n\n"
                     + "\n".join(rows) + "\n")
            if ref and all("client_majority_type_acc" in r for r in ref):
                text += ("\nType accuracy of the client's training majority on validation users, per seed: "
                         + ", ".join(f"{r['client_majority_type_acc']:.3f}" for r in ref) + "\n")
        write_atomic(args.out.with_suffix(".md"), text.encode())

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
    if args.mixture_structure:
        step4(out, seeds, structure, base, dict(out["chosen"]["gaussian"]), dict(out["chosen"]["mixture"]), save,
              args.shard)
    print("chosen:", out["chosen"], f"structure {structure}", flush=True)


def step4(out: dict, seeds: dict, structure: str, base: VPAConfig, gaussian: dict, mixture: dict, save,
          shard: tuple[int, int] | None = None) -> None:
    """Step 4 (module docstring): one change at a time around the chosen settings, then the two best together."""
    out.setdefault("step4", [])
    if not out.get("reference") or "client_majority_type_acc" not in out["reference"][0]:
        out["reference"] = [_reference(VPATrainer(users, select_structure(phi, structure), base), s)
                            for s, (users, phi) in seeds.items()]
        save()

    def run(prior: str, change: dict) -> dict:
        setting = {**(mixture if prior == "mixture" else gaussian), **change}
        key = json.loads(json.dumps(setting))
        for r in out["step4"]:
            if r["prior"] == prior and r["setting"] == key:
                return r
        cfg = replace(base, structure=structure, **{k: v for k, v in setting.items() if k != "beta"})
        per_seed = []
        for s, (users, phi) in seeds.items():
            tr = VPATrainer(users, select_structure(phi, structure), cfg)
            model, protos = tr.train_vpa(prior, setting["beta"], seed=s)
            per_seed.append(_val_modes(tr, model, protos))
        modes = per_seed[0]["acc_by_z_mode"]
        row = {"prior": prior, "setting": key, "change": change,
               "acc_by_z_mode": {m: {c: float(np.mean([p["acc_by_z_mode"][m][c] for p in per_seed])) for c in modes[m]}
                                 for m in modes},
               "type_acc_cv": {c: float(np.mean([p["type_acc_cv"][c] for p in per_seed])) for c in per_seed[0]["type_acc_cv"]},
               "per_seed": per_seed}
        row["acc"], row["z_mode"] = max((float(np.mean(list(a.values()))), m) for m, a in row["acc_by_z_mode"].items())
        out["step4"].append(row)
        print(f"{prior} {change}: val acc {row['acc']:.4f} ({row['z_mode']}), type acc at C = "
              + ", ".join(f"{c}: {v:.3f}" for c, v in row["type_acc_cv"].items()), flush=True)
        save()
        return row

    if shard is not None:
        i, n = shard
        for change in MIXTURE_CHANGES[i::n]:
            run("mixture", change)
        return
    run("gaussian", {})
    run("gaussian", {"latent_dim": 2})
    ref = run("mixture", {})
    rows = [run("mixture", change) for change in MIXTURE_CHANGES]
    better = sorted((r for r in rows if r["acc"] > ref["acc"]), key=lambda r: -r["acc"])
    if len(better) >= 2 and better[0]["change"].keys() != better[1]["change"].keys():
        run("mixture", {**better[0]["change"], **better[1]["change"]})
    best = max([r for r in out["step4"] if r["prior"] == "mixture"], key=lambda r: r["acc"])
    out["chosen_step4"] = {"mixture": best["setting"], "z_mode": best["z_mode"], "val_acc": best["acc"]}
    save()
    print("step 4 chosen:", out["chosen_step4"], flush=True)


if __name__ == "__main__":
    main()
