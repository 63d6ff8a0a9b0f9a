"""What a client-level mixing weight adds to FedVPA-GP's inference of a user's type (issue 28; docs/vpa.md).

Validation users only, the quick preset's clients (:meth:`trainer.vpa.trainer.VPAConfig.quick`), seeds 0 and 1:
FedVPA-GP is trained with the chosen settings and prototype variances capped at ``--caps``; then, per C, the
mixture posterior of each validation user is computed under the global ``pi`` and under its client's ``pi``
(:func:`trainer.vpa.evaluation.client_log_pi`), with the encoder's evidence ``(h, Lambda)`` scaled by ``alpha``
(``alpha < 1`` tempers a per-pair precision the encoder may have learnt too large, so that the prior weighs in).
Reported: the held-out accuracy with ``z`` = the posterior mean, the agreement of the most responsible
prototype with the user's type (the larger of the two labellings), the mean evidence precision ``Lambda`` (over
users and latent dimensions, before tempering) and, per seed and cap, the correlation over validation users of
their client's ``pi_1`` with the share of type 1 among the client's training users. Writes ``--out`` (JSON) and markdown beside it.

    python benchmarks/vpa_client_prior.py --data ../shared/data --out docs/results/vpa_client_prior.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from sdk.atomic_write import write_atomic
from trainer.data.conflicting_users import make_users
from trainer.vpa import evaluation as ev
from trainer.vpa.experiment import load_features
from trainer.vpa.features import reduce_embeddings, select_structure
from trainer.vpa.model import mixture_moments, mixture_posterior
from trainer.vpa.trainer import VPAConfig, VPATrainer

ALPHAS = (1.0, 0.3, 0.1, 0.03)


@torch.no_grad()
def scores(tr: VPATrainer, model, protos, c: int, alpha: float, client: bool) -> tuple[float, float, float]:
    """(accuracy, prototype-type agreement, mean Lambda) of the validation users from c context pairs."""
    ids = tr.users.users("val")
    t = tr.users.type[ids]
    idx = torch.as_tensor(np.stack([tr.users.context(u, c) for u in ids]))
    mask = torch.ones(idx.shape, dtype=torch.float32)
    h, lam = model.evidence(*tr.context_tensors(ids, idx, mask), mask)
    p_mu, p_lv, log_pi = ev.prior_tensors(protos)
    if client:
        log_pi = ev.client_log_pi(tr, model, protos, ids)
    m, lv, logits = mixture_posterior(alpha * h, alpha * lam, p_mu, p_lv, log_pi)
    gamma = torch.softmax(logits, 1)
    z = mixture_moments(m, lv, gamma)[0]
    agree = float((gamma.argmax(1).numpy() == t).mean())
    return float(ev.vpa_correct(tr, model, ids, z).mean()), max(agree, 1.0 - agree), float(lam.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--out", type=Path, default=Path("docs/results/vpa_client_prior.json"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--caps", type=float, nargs="+", default=[1.0, 0.1], help="prototype variance caps")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = VPAConfig.quick(data_dir=args.data)
    pairs, phi_all = load_features(base)
    rows, corr = [], []
    for s in args.seeds:
        users = make_users(pairs, base.users, seed=s)
        phi = select_structure(reduce_embeddings(phi_all, np.flatnonzero(users.part == "train"), base.pca_components),
                               base.structure)
        for cap in args.caps:
            tr = VPATrainer(users, phi, VPAConfig.quick(data_dir=args.data, proto_var_cap=cap))
            model, protos = tr.train_vpa("mixture", base.betas[0], seed=s)
            for c in base.contexts:
                for alpha in ALPHAS:
                    for client in (False, True):
                        acc, agree, lam = scores(tr, model, protos, c, alpha, client)
                        rows.append({"seed": s, "cap": cap, "C": c, "alpha": alpha, "pi": "client" if client else "global",
                                     "acc": acc, "type_agreement": agree, "lambda_mean": lam})
            ids = users.users("val")
            pi_1 = ev.client_log_pi(tr, model, protos, ids).exp().numpy()[:, 1]
            share = np.array([users.type[users.users("train", int(i))].mean() for i in users.client[ids]])
            corr.append({"seed": s, "cap": cap, "corr_pi_share": float(np.corrcoef(pi_1, share)[0, 1])})
            print(f"seed {s} cap {cap}: corr(client pi_1, type-1 share) {corr[-1]['corr_pi_share']:+.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps({"seeds": args.seeds, "rows": rows, "client_pi": corr}, indent=1).encode())
    lines = ["| cap | C | alpha | pi | val acc | prototype = type | mean Lambda |", "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["cap"], r["C"], r["alpha"], r["pi"]) for r in rows}, key=lambda k: (-k[0], k[1], -k[2], k[3]))
    for cap, c, alpha, pi in keys:
        sel = [r for r in rows if (r["cap"], r["C"], r["alpha"], r["pi"]) == (cap, c, alpha, pi)]
        lines.append(f"| {cap} | {c} | {alpha} | {pi} | {np.mean([r['acc'] for r in sel]):.4f} | "
                     f"{np.mean([r['type_agreement'] for r in sel]):.3f} | {np.mean([r['lambda_mean'] for r in sel]):.1f} |")
    corr_line = ", ".join(f"seed {r['seed']} cap {r['cap']}: {r['corr_pi_share']:+.2f}" for r in corr)
    write_atomic(args.out.with_suffix(".md"), (f"Mean over seeds {args.seeds}. Correlation of the client's pi_1 with its "
                                               f"type-1 share: {corr_line}\n\n" + "\n".join(lines) + "\n").encode())
    print("\n".join(lines))


if __name__ == "__main__":
    main()
