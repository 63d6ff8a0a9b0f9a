"""Issue 28's targets, read from the ``results.json`` of ``fedroute vpa train`` (prints a markdown table).

    python benchmarks/vpa_targets.py runs/vpa/results.json

Targets (H = oracle_type - monolithic_bt): FedVPA-GP recovers >= 50 % of H at C = 8 and >= 80 % at C = 32;
beats vpl_gaussian at every C <= 8 by more than one std (the larger of the two methods' standard deviations
over seeds; the paired per-seed differences are shown too); within 0.01 of two_stage; beats length_per_user by
>= 0.02 at C = 8; at C = 2 its type accuracy from z exceeds vpl_gaussian's by >= 0.05; oracle above length-only.

Then the decomposition by type inference (:func:`decomposition`): the two types' labels are mirror images, so a
model that scores a user with the oracle's reward of the type it infers, right with probability ``p``, has accuracy
``0.5 + (2 p - 1)(a - 0.5)``, ``a`` the oracle's accuracy. Per method and C it prints ``p`` (the type probe on z;
two_stage: its classifier), that prediction beside the measured accuracy, and the ``p`` that beating vpl_gaussian
by one std would take (to set against two_stage's ``p``, a classifier trained with type labels).
"""

from __future__ import annotations

import json
import sys

import numpy as np


def targets(res: dict) -> list[tuple[str, str, bool]]:
    """(target, measured, met) rows."""
    m, col, head = res["methods"], res["collapse"], res["headroom"]
    cs = [c for c in m["fedvpa_gp"]]
    rows = []
    for c, need in (("8", 0.5), ("32", 0.8)):
        if c in head:
            r = head[c]["fedvpa_gp_recovered"]
            rows.append((f"recovers >= {need:.0%} of H at C = {c}", f"{r:.0%} of H = {head[c]['H']:.3f}", r >= need))
    for c in (c for c in cs if int(c) <= 8):
        gp, vpl = m["fedvpa_gp"][c], m["vpl_gaussian"][c]
        std = max(gp["acc_std"], vpl["acc_std"])
        diffs = [s["methods"]["fedvpa_gp"][c]["acc"] - s["methods"]["vpl_gaussian"][c]["acc"] for s in res["seeds"]]
        rows.append((f"beats vpl_gaussian by > 1 std at C = {c}",
                     f"{gp['acc_mean'] - vpl['acc_mean']:+.3f} vs std {std:.3f} (per-seed differences "
                     f"{', '.join(f'{d:+.3f}' for d in diffs)})", gp["acc_mean"] - vpl["acc_mean"] > std))
    for c in cs:
        d = m["fedvpa_gp"][c]["acc_mean"] - m["two_stage"][c]["acc_mean"]
        rows.append((f"within 0.01 of two_stage at C = {c}", f"{d:+.3f}", d >= -0.01))
    if "8" in cs:
        d = m["fedvpa_gp"]["8"]["acc_mean"] - m["length_per_user"]["8"]["acc_mean"]
        rows.append(("beats length_per_user by >= 0.02 at C = 8", f"{d:+.3f}", d >= 0.02))
    if "2" in cs:
        gp, vpl = col["fedvpa_gp"]["2"]["type_acc_from_z"], col["vpl_gaussian"]["2"]["type_acc_from_z"]
        rows.append(("type accuracy from z at C = 2 exceeds vpl_gaussian's by >= 0.05",
                     f"{gp:.3f} vs {vpl:.3f} ({gp - vpl:+.3f})", gp - vpl >= 0.05))
    worst = min(m["oracle_type"][c]["acc_mean"] - m["length_per_user"][c]["acc_mean"] for c in cs)
    rows.append(("oracle above length_per_user at every C", f"smallest margin {worst:+.3f}", worst > 0))
    return rows


def decomposition(res: dict) -> list[str]:
    """Markdown rows: per C, for two_stage, vpl_gaussian and fedvpa_gp, p / predicted / measured accuracy, and the
    p needed to beat vpl_gaussian by one std (module docstring)."""
    m, col = res["methods"], res["collapse"]
    rows = ["| C | method | type acc p | 0.5 + (2p - 1)(a - 0.5) | measured | p to beat vpl_gaussian by 1 std |",
            "|---|---|---|---|---|---|"]
    for c in m["fedvpa_gp"]:
        a = m["oracle_type"][c]["acc_mean"]
        vpl = m["vpl_gaussian"][c]
        need = 0.5 + (vpl["acc_mean"] + max(vpl["acc_std"], m["fedvpa_gp"][c]["acc_std"]) - 0.5) / (2 * (a - 0.5))
        for name in [n for n in ("two_stage", "vpl_gaussian", "fedvpa_gp_global_pi", "fedvpa_gp") if n in m]:
            p = col[name][c]["type_acc_from_z"]
            rows.append(f"| {c} | {name} | {p:.3f} | {0.5 + (2 * p - 1) * (a - 0.5):.3f} | {m[name][c]['acc_mean']:.3f} | "
                        + (f"{need:.3f} |" if name == "fedvpa_gp" else "|"))
    return rows


def main(path: str) -> None:
    res = json.loads(open(path).read())
    n = len(res["seeds"])
    print(f"| target ({n} seeds) | measured | met |\n|---|---|---|")
    for name, value, ok in targets(res):
        print(f"| {name} | {value} | {'yes' if ok else 'no'} |")
    print(f"\nper-seed choices: {[s['choices'].get('fedvpa_gp') for s in res['seeds']]}; "
          f"structure {[s['choices']['structure'] for s in res['seeds']]}; "
          f"seconds {res.get('seconds', float('nan')):.0f}, mean acc std {np.mean([v['acc_std'] for v in res['methods']['fedvpa_gp'].values()]):.3f}")
    print(f"\nBy type inference (a = oracle_type accuracy):\n\n" + "\n".join(decomposition(res)))


if __name__ == "__main__":
    main(sys.argv[1])
