"""Choose FedVPA-GP's per-client mixture prior on validation users: the prototype variance cap it is trained with
and the evidence scales its read-out tries per C (issue 28; docs/vpa.md, "The client's own mixing weights").

Validation users only, the full preset's clients (:class:`trainer.vpa.trainer.VPAConfig`: 20 clients, 40 rounds,
C in {2, 4, 8, 16, 32}) or ``--quick``'s. Per seed: VPL (N(0, I)) for reference, and FedVPA-GP trained with each
prototype variance cap of ``--caps``; for each, per C, the validation accuracy of every read-out of
:func:`trainer.vpa.experiment.choose_readout` (the global ``pi`` with the z mode chosen over all C, or the
user's client's own ``pi`` with the evidence scaled by ``alpha``) and the agreement of the most responsible
prototype with the user's type (the larger of the two labellings). Reported per cap: per C the read-out a
per-C, per-seed choice would pick (the best on these validation users; optimistic by the selection over
1 + len(alphas) options, equally for every cap), and every read-out used for all C and seeds; the best of
those by the mean over C and seeds is the choice (``VPAConfig.proto_var_cap`` and ``client_scale``). Writes
``--out`` (JSON) and markdown beside it; ``--report`` only rewrites the markdown from ``--out``.

    python benchmarks/vpa_readout_settings.py --data ../shared/data --out docs/results/vpa_readout_settings.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from sdk.atomic_write import write_atomic
from trainer.data.conflicting_users import make_users
from trainer.vpa import evaluation as ev
from trainer.vpa.experiment import _val_score, choose_readout, load_features
from trainer.vpa.features import reduce_embeddings, select_structure
from trainer.vpa.trainer import VPAConfig, VPATrainer

#: The evidence scales tried with the client's ``pi``.
SCALES = (1.0, 0.3, 0.1, 0.03)
#: The read-outs under the client's ``pi`` (:func:`trainer.vpa.evaluation.choose_z`); ``--prototype`` adds
#: ``client_prototype`` (the most responsible prototype's mean).
MODES = ("client",)


@torch.no_grad()
def agreement(tr: VPATrainer, model, protos, c: int, z_mode: str, scale: float) -> float:
    """Share of validation users whose most responsible prototype is their type (the better labelling)."""
    ids = tr.users.users("val")
    p_mu, p_lv, log_pi = ev.prior_tensors(protos)
    if z_mode.startswith("client"):
        log_pi = ev.client_log_pi(tr, model, protos, ids)
    else:
        scale = 1.0
    idx = torch.as_tensor(np.stack([tr.users.context(u, c) for u in ids]))
    mask = torch.ones(idx.shape, dtype=torch.float32)
    logits = model.components(*tr.context_tensors(ids, idx, mask), mask, p_mu, p_lv, log_pi, scale)[2]
    agree = float((logits.argmax(1).numpy() == tr.users.type[ids]).mean())
    return max(agree, 1.0 - agree)


def seed_inputs(pairs, phi_all: np.ndarray, base: VPAConfig, seed: int):
    """The users of ``seed`` and their features (PCA fitted on the seed's training pairs, ``base.structure``)."""
    users = make_users(pairs, base.users, seed=seed)
    phi = select_structure(reduce_embeddings(phi_all, np.flatnonzero(users.part == "train"), base.pca_components),
                           base.structure)
    return users, phi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--out", type=Path, default=Path("docs/results/vpa_readout_settings.json"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--caps", type=float, nargs="+", default=[1.0, 0.1], help="prototype variance caps")
    ap.add_argument("--quick", action="store_true", help="the quick preset's clients")
    ap.add_argument("--report", action="store_true", help="only rewrite the markdown from --out")
    ap.add_argument("--prototype", action="store_true", help="also the client_prototype read-outs")
    ap.add_argument("--no-vpl", action="store_true", help="skip the VPL reference")
    args = ap.parse_args()
    modes = MODES + (("client_prototype",) if args.prototype else ())
    torch.set_num_threads(1)
    make_cfg = VPAConfig.quick if args.quick else VPAConfig
    base = make_cfg(data_dir=args.data)
    if args.report:
        write_atomic(args.out.with_suffix(".md"), markdown(json.loads(args.out.read_text())["runs"], base.contexts).encode())
        return
    pairs, phi_all = load_features(base)
    runs = []
    for s in args.seeds:
        t0 = time.time()
        users, phi = seed_inputs(pairs, phi_all, base, s)
        tr = VPATrainer(users, phi, base)
        ids = users.users("val")
        vpl_acc = {str(c): float("nan") for c in base.contexts}
        if not args.no_vpl:
            vpl, _ = tr.train_vpa("gaussian", base.betas[0], seed=s)
            vpl_acc = {str(c): float(ev.vpa_correct(tr, vpl, ids, ev.posterior(tr, vpl, ids, c)[0]).mean())
                       for c in base.contexts}
        for cap in args.caps:
            tr = VPATrainer(users, phi, make_cfg(data_dir=args.data, proto_var_cap=cap))
            model, protos = tr.train_vpa("mixture", base.betas_for("mixture")[0], seed=s)
            z_mode = max(base.z_modes, key=lambda m: _val_score(tr, model, protos, m))
            choices: dict = {"fedvpa_gp": {}}
            options = [(m, a) for m in modes for a in SCALES]
            readout = choose_readout(tr, model, protos, z_mode, options, choices)
            agree = {str(c): {f"{m}@{a}": agreement(tr, model, protos, c, m, a)
                              for m, a in [(z_mode, 1.0)] + options}
                     for c in base.contexts}
            runs.append({"seed": s, "cap": cap, "z_mode": z_mode, "readout": choices["fedvpa_gp"]["readout"],
                         "val_acc": choices["fedvpa_gp_readout_val_acc"], "type_agreement": agree, "vpl_val_acc": vpl_acc})
            print(f"seed {s} cap {cap}: z mode {z_mode}, read-out {readout} ({time.time() - t0:.0f} s)", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, json.dumps({"seeds": args.seeds, "quick": args.quick, "runs": runs}, indent=1).encode())
    write_atomic(args.out.with_suffix(".md"), markdown(runs, base.contexts).encode())
    print(markdown(runs, base.contexts))


def markdown(runs: list[dict], contexts: tuple[int, ...]) -> str:
    """Per cap and C: mean validation accuracy of the global read-out, of the picked read-out, the picks, VPL."""
    seeds = sorted({r["seed"] for r in runs})
    lines = [f"Validation users, seeds {seeds}; accuracy mean over seeds. 'global': the z mode under the global pi; "
             "'picked': the per-C read-out `fedroute vpa train` picks (optimistic: chosen on these users); "
             "prototype = type: the most responsible prototype under the picked read-out.", "",
             "| cap | C | global | picked | picks (per seed) | prototype = type, global / picked | VPL |",
             "|---|---|---|---|---|---|---|"]
    for cap in sorted({r["cap"] for r in runs}, reverse=True):
        sel = [r for r in runs if r["cap"] == cap]
        means = {"global": [], "picked": [], "vpl": []}
        for c in map(str, contexts):
            glob = [r["val_acc"][c][f"{r['z_mode']}@1.0"] for r in sel]
            pick = [max(r["val_acc"][c].values()) for r in sel]
            keys = [f"{r['readout'][c][0]}@{r['readout'][c][1]}" for r in sel]
            ag_g = np.mean([r["type_agreement"][c][f"{r['z_mode']}@1.0"] for r in sel])
            ag_p = np.mean([r["type_agreement"][c][k] for r, k in zip(sel, keys)])
            vpl = [r["vpl_val_acc"][c] for r in sel]
            means["global"].append(np.mean(glob))
            means["picked"].append(np.mean(pick))
            means["vpl"].append(np.mean(vpl))
            lines.append(f"| {cap} | {c} | {np.mean(glob):.4f} | {np.mean(pick):.4f} | {', '.join(keys)} | "
                         f"{ag_g:.3f} / {ag_p:.3f} | {np.mean(vpl):.4f} |")
        lines.append(f"| {cap} | mean | {np.mean(means['global']):.4f} | {np.mean(means['picked']):.4f} | | | "
                     f"{np.mean(means['vpl']):.4f} |")
    lines += ["", "One read-out for every C and seed (no per-C, per-seed pick; 'global': the z mode chosen per seed):", "",
              "| cap | read-out | " + " | ".join(f"C = {c}" for c in contexts) + " | mean |", "|---|---|" + "---|" * (len(contexts) + 1)]
    for cap, key, accs in fixed_readouts(runs, contexts):
        lines.append(f"| {cap} | {key} | " + " | ".join(f"{a:.4f}" for a in accs) + f" | {np.mean(accs):.4f} |")
    cap, key, _ = max(fixed_readouts(runs, contexts), key=lambda r: np.mean(r[2]))
    lines += ["", f"Chosen (best mean over C and seeds): cap {cap}, {key}."]
    return "\n".join(lines) + "\n"


def fixed_readouts(runs: list[dict], contexts: tuple[int, ...]) -> list[tuple[float, str, list[float]]]:
    """(cap, read-out, validation accuracy per C averaged over seeds) of every read-out used for all C."""
    out = []
    for cap in sorted({r["cap"] for r in runs}, reverse=True):
        sel = [r for r in runs if r["cap"] == cap]
        for key in ["global"] + [k for k in sel[0]["val_acc"][str(contexts[0])] if "@" in k and k.startswith("client")]:
            out.append((cap, key, [float(np.mean([r["val_acc"][str(c)][f"{r['z_mode']}@1.0" if key == "global" else key]
                                                  for r in sel])) for c in contexts]))
    return out


if __name__ == "__main__":
    main()
