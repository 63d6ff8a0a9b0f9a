"""Choose on validation users whether FedVPA-GP is trained under each client's own mixing weights, the prior it is
read out with (issue 28; docs/vpa.md, "Training under the client's prior").

Validation users only, the full preset's clients (:class:`trainer.vpa.trainer.VPAConfig`: 20 clients, 40 rounds,
C in {2, 4, 8, 16, 32}) or ``--quick``'s. Per seed: VPL (N(0, I), the reference the issue's targets compare with),
FedVPA-GP as trained before this study (``client_prior=False``: the ELBO under the global ``pi``) and each candidate of
``--variants`` (``client_prior=True``: in a client's round a user's prior is its client's leave-one-out ``pi_c``,
:meth:`trainer.vpa.trainer.VPATrainer.client_gamma`). Every FedVPA-GP model is read out under the client's ``pi``
with the evidence scaled by each ``alpha`` of ``--alphas`` (:func:`trainer.vpa.evaluation.choose_z`, ``'client'``).
Per model, read-out and C: validation accuracy (per type too) and the type accuracy of a 5-fold cross-validated
logistic probe on the ``z`` scored with. The default at the start was ``client_prior=False`` read at ``alpha = 0.1``;
a candidate (variant, alpha) replaces it only if its validation accuracy, mean over C and seeds, is higher.
Reported with the per-seed paired differences to the default and to VPL (mean, SE over seeds). Writes ``--out``
(JSON, rewritten after each seed) and markdown beside it; ``--report`` only rewrites the markdown.

    python benchmarks/vpa_train_prior_settings.py --data ../shared/data --out docs/results/vpa_train_prior_settings.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import cross_val_predict

from benchmarks.vpa_readout_settings import seed_inputs
from sdk.atomic_write import write_atomic
from trainer.data.conflicting_users import TYPES
from trainer.vpa import evaluation as ev
from trainer.vpa.experiment import load_features
from trainer.vpa.trainer import VPAConfig, VPATrainer

#: Training variants of FedVPA-GP: name -> VPAConfig overrides (``default``: the training before this study, the ELBO
#: under the global ``pi``; ``client_prior`` is ``VPAConfig``'s default since).
VARIANTS = {"default": {"client_prior": False}, "client_prior": {"client_prior": True},
            "client_prior_beta0.03": {"client_prior": True, "betas_mixture": (0.03,)},
            "client_prior_beta0.1": {"client_prior": True, "betas_mixture": (0.1,)}}
DEFAULT = ("default", 0.1)


def probe(z: np.ndarray, types: np.ndarray) -> float:
    """5-fold cross-validated accuracy of a logistic regression from z (U, d_z) to the type (U,)."""
    pred = cross_val_predict(LogisticRegression(), z, types, cv=5)
    return float((pred == types).mean())


def scores(tr: VPATrainer, model, protos, ids: np.ndarray, c: int, mode: str, alpha: float) -> dict:
    """Validation accuracy (overall, per type) and type probe of users ``ids`` read out from c pairs."""
    z = ev.choose_z(tr, model, ids, c, protos, mode, alpha)
    types = tr.users.type[ids]
    s = ev.summarise(ev.vpa_correct(tr, model, ids, z), types)
    return {"acc": s["acc"], "per_type": s["per_type"], "type_probe": probe(z.numpy(), types)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--out", type=Path, default=Path("docs/results/vpa_train_prior_settings.json"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=["client_prior", "client_prior_beta0.03", "client_prior_beta0.1"], choices=sorted(set(VARIANTS) - {"default"}))
    ap.add_argument("--alphas", type=float, nargs="+", default=[1.0, 0.3, 0.1])
    ap.add_argument("--quick", action="store_true", help="the quick preset's clients")
    ap.add_argument("--report", action="store_true", help="only rewrite the markdown from --out")
    ap.add_argument("--parts", type=Path, nargs="+", help="with --report: merge the runs of these JSON files into --out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    make_cfg = VPAConfig.quick if args.quick else VPAConfig
    base = make_cfg(data_dir=args.data)
    if args.report:
        runs = [r for p in args.parts or [args.out] for r in json.loads(p.read_text())["runs"]]
        if args.parts:
            write_atomic(args.out, json.dumps({"seeds": [r["seed"] for r in runs], "quick": args.quick, "runs": runs},
                                              indent=1).encode())
        write_atomic(args.out.with_suffix(".md"), markdown(runs, base.contexts).encode())
        return
    pairs, phi_all = load_features(base)
    runs = []
    for s in args.seeds:
        t0 = time.time()
        users, phi = seed_inputs(pairs, phi_all, base, s)
        ids = users.users("val")
        tr = VPATrainer(users, phi, base)
        vpl, _ = tr.train_vpa("gaussian", base.betas[0], seed=s)
        run = {"seed": s, "vpl": {str(c): scores(tr, vpl, None, ids, c, "mean", 1.0) for c in base.contexts}}
        for name in ["default"] + args.variants:
            tr = VPATrainer(users, phi, make_cfg(data_dir=args.data, **VARIANTS[name]))
            model, protos = tr.train_vpa("mixture", tr.cfg.betas_for("mixture")[0], seed=s)
            alphas = sorted(set(args.alphas) | {DEFAULT[1]}, reverse=True)
            run[name] = {f"client@{a}": {str(c): scores(tr, model, protos, ids, c, "client", a) for c in base.contexts}
                         for a in alphas}
            print(f"seed {s} {name}: " + ", ".join(
                f"@{a} {np.mean([run[name][f'client@{a}'][str(c)]['acc'] for c in base.contexts]):.4f}" for a in alphas)
                  + f" ({time.time() - t0:.0f} s)", flush=True)
        runs.append(run)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, json.dumps({"seeds": args.seeds, "quick": args.quick, "runs": runs}, indent=1).encode())
    write_atomic(args.out.with_suffix(".md"), markdown(runs, base.contexts).encode())
    print(markdown(runs, base.contexts))


def _paired(a: list[float], b: list[float]) -> str:
    d = np.asarray(a) - np.asarray(b)
    se = d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
    return f"{d.mean():+.4f} ± {se:.4f}"


def markdown(runs: list[dict], contexts: tuple[int, ...]) -> str:
    """Per (variant, read-out): validation accuracy per C and mean, paired differences, type probe, per type."""
    cs = [str(c) for c in contexts]
    seeds = [r["seed"] for r in runs]

    def per_seed(name: str, key: str | None, c: str, field: str = "acc") -> list[float]:
        return [(r[name][key][c] if key else r[name][c])[field] for r in runs]

    rows = [("VPL", "vpl", None)] + [(f"{n}, client `pi`, alpha {k.split('@')[1]}", n, k)
                                     for n in runs[0] if n not in ("seed", "vpl") for k in runs[0][n]]
    lines = [f"Validation users, seeds {seeds} (40 per seed on the full preset); mean over seeds. Paired differences: "
             "mean ± SE over seeds of the per-seed difference of the mean over C.", "",
             "| FedVPA-GP training, read-out | " + " | ".join(f"C = {c}" for c in cs)
             + " | mean | vs default | vs VPL | type probe C = 2 | harmless / helpful C = 2 |",
             "|---|" + "---|" * (len(cs) + 5)]
    mean_of = {lab: [float(np.mean(z)) for z in zip(*[per_seed(n, k, c) for c in cs])] for lab, n, k in rows}
    default_lab = next(lab for lab, n, k in rows if n == DEFAULT[0] and k == f"client@{DEFAULT[1]}")
    for lab, n, k in rows:
        accs = [np.mean(per_seed(n, k, c)) for c in cs]
        pt = [np.mean([t[name] for t in per_seed(n, k, cs[0], "per_type")]) for name in TYPES]
        lines.append(f"| {lab} | " + " | ".join(f"{a:.4f}" for a in accs) + f" | {np.mean(mean_of[lab]):.4f} | "
                     f"{_paired(mean_of[lab], mean_of[default_lab]) if n != 'vpl' else ''} | "
                     f"{_paired(mean_of[lab], mean_of['VPL']) if n != 'vpl' else ''} | "
                     f"{np.mean(per_seed(n, k, cs[0], 'type_probe')):.3f} | {pt[0]:.3f} / {pt[1]:.3f} |")
    best = max((r for r in rows if r[1] != "vpl"), key=lambda r: np.mean(mean_of[r[0]]))
    lines += ["", f"Best by the mean over C and seeds: {best[0]} (current default: {default_lab})."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
