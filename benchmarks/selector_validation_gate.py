"""Which experts of a FedPrism run would `fedroute export --selector RUN/<method>_seed0/expert_<k>` ship alone?

For every expert of the run: its accuracy on pairs of the run's validation prompts (its public prompts when the
run has none, the quick preset) against the label-free length-only baseline fitted on the run's train pairs (the
export's gate, `export.selector_export.check_beats_length_only`) and the per-domain one, overall and per domain.
Writes OUT.json and OUT.md.

    PYTHONPATH=. python benchmarks/selector_validation_gate.py --run runs/prism/fedprism_seed0 --out docs/results/selector_gate
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from export.selector_export import check_beats_length_only, load_trained_selector, validation_for
from trainer import report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True, help="RUN/fedprism_seed0 (or fedbis_seed0)")
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--pairs", type=int, default=300, help="validation pairs, evenly per domain")
    ap.add_argument("--out", type=Path, required=True, help="output stem: writes OUT.json and OUT.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    val, train = validation_for(args.run, args.data, args.pairs)
    experts = sorted(int(p.name.split("_")[1]) for p in args.run.glob("expert_*"))
    selector = load_trained_selector(args.run / f"expert_{experts[0]}")
    rows = []
    for k in experts:
        selector.load_expert(args.run / f"expert_{k}")
        gate = check_beats_length_only(selector, val, train)
        rows.append({"expert": k, **gate})
        print(f"expert {k}: {gate['selector_accuracy']:.3f} vs length-only {gate['length_only_global']:.3f} -> "
              f"{'ships' if gate['passed'] else 'refused'}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(Path(f"{args.out}.json"), json.dumps({"run": str(args.run), "n_pairs": len(val), "experts": rows}, indent=2) + "\n")
    domains = sorted(rows[0]["per_domain"])
    lines = [f"Validation gate of single-expert exports, `{args.run}` ({len(val)} pairs of held-out prompts, evenly per "
             "domain; cells: selector / label-free length-only).", "",
             "| expert | accuracy | length-only (label-free) | length-only (per domain) | " + " | ".join(domains) + " | export |",
             "|---|---|---|---|" + "---|" * len(domains) + "---|"]
    for r in rows:
        cells = " | ".join(f"{r['per_domain'][d]['selector']:.3f} / {r['per_domain'][d]['length_only_global']:.3f}" for d in domains)
        lines.append(f"| expert_{r['expert']} | {r['selector_accuracy']:.3f} | {r['length_only_global']:.3f} | "
                     f"{r['length_only_per_domain']:.3f} | {cells} | {'ships' if r['passed'] else '**refused**'} |")
    report.write_text(Path(f"{args.out}.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
