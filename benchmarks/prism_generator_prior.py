"""FedPrism and the baselines with and without the generator prior (issue 29, item 3; :mod:`trainer.generator_prior`).

Data: the splits of ``fedroute prism train`` (:func:`trainer.experts.experiment.split_frames` of the preset).
The clients of each seed (:func:`trainer.data.preferences.dirichlet_clients`) upload their win/loss counts per
generator pair; the server sums them and fits the Bradley-Terry strengths (C = 1). HH-RLHF pairs have no
generator and get no prior; a generator missing from the counts neither.

Rule for the prior's weight ``lambda`` (grid :data:`LAMBDAS`): the highest **validation** accuracy of the
structure-feature baseline (per-domain logistic regression on :data:`sdk.pair_features.DEFAULT_FEATURES`,
fitted on the train pairs) with the prior; the same ``lambda`` is then applied to every method's test
probabilities. Test pairs are never used for a choice.

``PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/prism_generator_prior.py --run RUN --out DIR`` reads
``RUN/eval_proba.npz`` and ``RUN/results.json`` of ``fedroute prism train --out RUN`` and writes
``DIR/prism_generator_prior.{json,md}``. Without ``--run`` only the logistic baselines are scored.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

LAMBDAS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--run", type=Path, default=None)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from sdk.pair_features import DEFAULT_FEATURES
    from trainer.data.preferences import dirichlet_clients
    from trainer.experts.experiment import PRESETS, pair_correct, paired_gain, split_frames
    from trainer.generator_prior import aggregate_win_counts, apply_prior, client_win_counts, fit_bradley_terry, generator_logit
    from trainer.length_baseline import STRUCTURE_C, LengthBaseline
    from trainer.report import write_json, write_text

    preset = PRESETS[args.preset][0]
    train, val, test, _ = split_frames(args.data, preset)
    seeds = json.loads((args.run / "results.json").read_text())["seeds"] if args.run else [0, 1, 2]
    saved = np.load(args.run / "eval_proba.npz") if args.run else None
    if saved is not None and list(saved["pair_id"]) != list(test.pair_id.astype(str)):
        raise SystemExit(f"{args.run}/eval_proba.npz does not hold this preset's test pairs")
    y, dom = test.label.to_numpy(), test.domain.to_numpy().astype(str)

    structure = LengthBaseline(per_domain=True, C=STRUCTURE_C, features=DEFAULT_FEATURES).fit(train)
    baselines = {"length_only": LengthBaseline(per_domain=True).fit(train),
                 "length_only_global": LengthBaseline(per_domain=False).fit(train), "structure_only": structure}
    # the counts of every seed's clients sum to the pooled counts (aggregation is a sum): checked, then one fit
    uploads = []
    for seed in seeds:
        client = dirichlet_clients(train, preset.n_clients, preset.alpha, seed=seed)
        uploads.append(aggregate_win_counts(client_win_counts(train[client == i]) for i in range(preset.n_clients)))
    pooled = client_win_counts(train)
    if any(u != pooled for u in uploads):
        raise SystemExit("federated counts differ from the pooled counts")
    beta = fit_bradley_terry(pooled)
    val_acc = {lam: float(pair_correct(apply_prior(structure.predict_proba(val), generator_logit(val, beta), lam),
                                       val.label.to_numpy()).mean()) for lam in LAMBDAS}
    lam = max(LAMBDAS, key=lambda v: (val_acc[v], -v))
    g_test = generator_logit(test, beta)

    probas = {m: [b.predict_proba(test)] * len(seeds) for m, b in baselines.items()}
    if saved is not None:
        for key in saved.files:
            if key != "pair_id":
                m = key.rsplit("_seed", 1)[0]
                probas.setdefault(m, [])
                if m not in baselines:
                    probas[m].append(saved[key])
    base = [pair_correct(p, y) for p in probas["length_only"]]
    rows = {}
    for m, ps in probas.items():
        for tag, lam_m in (("", 0.0), ("+generator_prior", lam)):
            c = [pair_correct(apply_prior(p, g_test, lam_m), y) for p in ps]
            mean = np.mean(c, axis=0)
            rows[m + tag] = {"acc": float(mean.mean()), "acc_per_seed": [float(x.mean()) for x in c],
                             "domains": {d: float(mean[dom == d].mean()) for d in sorted(set(dom))},
                             "vs_length_only": paired_gain(c, base)}
    result = {"lambda": lam, "val_accuracy_by_lambda": {str(k): v for k, v in val_acc.items()},
              "n_generators": len(beta), "n_pairs": {"train": len(train), "val": len(val), "test": len(test)},
              "test_pairs_with_prior": int((g_test != 0).sum()), "seeds": seeds, "methods": rows,
              "beta_top": dict(sorted(beta.items(), key=lambda kv: -kv[1])[:5])}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "prism_generator_prior.json", result)
    doms = sorted(set(dom))
    lines = [f"Test accuracy with and without the generator prior (lambda = {lam} chosen on validation; "
             f"{len(test)} test pairs, {len(seeds)} seeds; gain over per-domain length-only +- paired SE)", "",
             "| method | overall | " + " | ".join(doms) + " | vs length_only |", "|---|---|" + "---|" * len(doms) + "---|"]
    for m, r in rows.items():
        g = r["vs_length_only"]
        lines.append(f"| {m} | {r['acc']:.4f} | " + " | ".join(f"{r['domains'][d]:.4f}" for d in doms)
                     + f" | {g['gain']:+.4f} +- {g['se']:.4f} |")
    write_text(args.out / "prism_generator_prior.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
