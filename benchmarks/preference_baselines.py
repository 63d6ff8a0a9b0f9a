"""The three logistic baselines of every preference table (issue 29, item 6) on the splits the docs' FedPrism
tables were measured on: per-domain length-only, label-free (global) length-only and the structure-feature
baseline (per domain, :data:`sdk.pair_features.DEFAULT_FEATURES`, C = :data:`trainer.length_baseline.STRUCTURE_C`),
each fitted on the split's train pairs (all client pairs), scored on its validation and test pairs, with the
paired standard error of the gain over per-domain length-only.

Splits (:func:`trainer.experts.experiment.split_frames`, data seed 0): ``cpu_2400`` (the CPU preset before
issue 29: 2,400 / 450 / 600 pairs, the split of the older tables of docs/prism.md), ``quick`` and ``cpu``
(every pair) of :data:`trainer.experts.experiment.PRESETS`.

``PYTHONPATH=. python benchmarks/preference_baselines.py --out docs/results`` writes
``preference_baselines.{json,md}``.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from sdk.pair_features import DEFAULT_FEATURES
    from trainer.experts.experiment import PRESETS, pair_correct, paired_gain, split_frames
    from trainer.length_baseline import STRUCTURE_C, LengthBaseline
    from trainer.report import write_json, write_text

    models = {"length_only": {"per_domain": True}, "length_only_global": {"per_domain": False},
              "structure_only": {"per_domain": True, "C": STRUCTURE_C, "features": DEFAULT_FEATURES}}
    cpu = PRESETS["cpu"][0]
    splits = {"cpu_2400": replace(cpu, n_train=2400, n_val=450, n_test=600), "quick": PRESETS["quick"][0], "cpu": cpu}
    result, lines = {}, ["Logistic baselines on the splits of the FedPrism tables (fit on the train pairs; accuracy, "
                         "gain over per-domain length-only +- paired SE)", ""]
    for name, preset in splits.items():
        train, val, test, _ = split_frames(args.data, preset)
        result[name] = {"n_pairs": {"train": len(train), "val": len(val), "test": len(test)}}
        fitted = {m: LengthBaseline(**kw).fit(train) for m, kw in models.items()}
        for part, df in (("val", val), ("test", test)):
            if not len(df):
                continue
            y, dom = df.label.to_numpy(), df.domain.to_numpy().astype(str)
            c = {m: pair_correct(f.predict_proba(df), y) for m, f in fitted.items()}
            block = {m: {"overall": float(v.mean()), **{d: float(v[dom == d].mean()) for d in sorted(set(dom))},
                         "vs_length_only": paired_gain([v], [c["length_only"]])} for m, v in c.items()}
            result[name][part] = block
            doms = sorted(set(dom))
            lines += [f"**{name}, {part}** ({len(df)} pairs)", "",
                      "| baseline | overall | " + " | ".join(doms) + " | vs length_only |",
                      "|---|---|" + "---|" * len(doms) + "---|"]
            for m, b in block.items():
                g = b["vs_length_only"]
                lines.append(f"| {m} | {b['overall']:.3f} | " + " | ".join(f"{b[d]:.3f}" for d in doms)
                             + f" | {g['gain']:+.3f} +- {g['se']:.3f} |")
            lines.append("")
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "preference_baselines.json", result)
    write_text(args.out / "preference_baselines.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
