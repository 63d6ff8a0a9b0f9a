"""FedPrism against the other methods of one ``fedroute prism train`` run, on the same pairs and seeds (issue 29:
"FedPrism > FedBis and random routing by > 1 std").

Reads ``RUN/eval_proba.npz`` (P(A better) per ``<method>_seed<s>`` on the evaluated pairs) and ``RUN/results.json``
(seeds) and the labels of the preset's test split (:func:`trainer.experts.experiment.split_frames`). Per
compared method: the difference of the mean accuracies over seeds, the per-seed differences (same seed's clients and
initialisation), their std over seeds (ddof 1), each method's std over seeds, the paired standard error over pairs
(:func:`trainer.experts.experiment.paired_gain`: per-pair difference averaged over seeds, SE over pairs) and the
difference per domain. ``beats_by_1_std``: the difference exceeds the larger of the two methods' stds over seeds
and the std of the per-seed differences. Nothing is chosen here; it only reads a finished run.

``PYTHONPATH=. python benchmarks/prism_method_gaps.py --data ../shared/data --run RUN --vs fedbis,random_routing
--out DIR`` writes ``DIR/prism_method_gaps.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def method_gaps(run: Path, data: Path, ref: str, versus: list[str], preset: str = "cpu") -> dict:
    """The comparison of the module docstring: ``{"ref", "n_pairs", "seeds", "gaps": {method: {...}}}``."""
    from trainer.experts.experiment import PRESETS, pair_correct, paired_gain, split_frames

    res = json.loads((run / "results.json").read_text())
    test = split_frames(data, PRESETS[preset][0])[2]
    saved = np.load(run / "eval_proba.npz")
    if list(saved["pair_id"]) != list(test.pair_id.astype(str)):
        raise SystemExit(f"{run}/eval_proba.npz does not hold the {preset} preset's test pairs")
    y, dom = test.label.to_numpy(), test.domain.to_numpy().astype(str)
    seeds = res["seeds"]

    def correct(m):
        return [pair_correct(saved[f"{m}_seed{s}"], y) for s in seeds]

    base = correct(ref)
    out = {"ref": ref, "preset": preset, "n_pairs": len(y), "seeds": seeds, "gaps": {}}
    for m in versus:
        other = correct(m)
        per_seed = [float(a.mean() - b.mean()) for a, b in zip(base, other)]
        acc = {k: [float(c.mean()) for c in v] for k, v in ((ref, base), (m, other))}
        std = {k: float(np.std(v, ddof=1)) for k, v in acc.items()}
        gap = float(np.mean(per_seed))
        diff_std = float(np.std(per_seed, ddof=1))
        out["gaps"][m] = {"acc_per_seed": acc, "acc_std": std, "gap": gap, "gap_per_seed": per_seed,
                          "gap_std": diff_std, "paired": paired_gain(base, other),
                          "domains": {d: float(np.mean([(a[dom == d] - b[dom == d]).mean() for a, b in zip(base, other)]))
                                      for d in sorted(set(dom))},
                          "beats_by_1_std": bool(gap > max(*std.values(), diff_std))}
    return out


def markdown(out: dict) -> str:
    ref = out["ref"]
    lines = [f"{ref} against the other methods of the run ({out['n_pairs']} test pairs, seeds {out['seeds']})", "",
             f"| method | {ref} − method | per seed | std of the per-seed gaps | stds over seeds ({ref} / method) | "
             "paired SE over pairs | per domain | > 1 std |", "|---|---|---|---|---|---|---|---|"]
    for m, g in out["gaps"].items():
        lines.append(f"| {m} | {g['gap']:+.4f} | " + " / ".join(f"{x:+.4f}" for x in g["gap_per_seed"])
                     + f" | {g['gap_std']:.4f} | {g['acc_std'][ref]:.4f} / {g['acc_std'][m]:.4f} | {g['paired']['se']:.4f} | "
                     + " / ".join(f"{d} {v:+.3f}" for d, v in g["domains"].items()) + f" | {g['beats_by_1_std']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    from trainer.report import write_json, write_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--run", type=Path, required=True, help="a fedroute prism train --out folder")
    ap.add_argument("--preset", default="cpu", help="the run's preset (its test split)")
    ap.add_argument("--ref", default="fedprism")
    ap.add_argument("--vs", default="fedbis,random_routing", help="comma-separated methods of the run")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    out = method_gaps(args.run, args.data, args.ref, args.vs.split(","), args.preset)
    write_json(args.out / "prism_method_gaps.json", out)
    write_text(args.out / "prism_method_gaps.md", markdown(out))
    print(markdown(out))


if __name__ == "__main__":
    main()
