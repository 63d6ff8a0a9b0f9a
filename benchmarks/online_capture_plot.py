"""Plot the savings capture share (± SE over seeds) of every ``benchmarks/online_settings.py --stage targets``
candidate on validation, from its one-pass JSON files, and of ``benchmarks/online_capture_ceiling.py``'s oracle
label allocations, against the target (> 0.5) and dense labels.
Run: ``PYTHONPATH=. python benchmarks/online_capture_plot.py``; writes ``docs/results/online_settings_capture.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from trainer.report import save_figure  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def captures() -> dict[str, tuple[float, float]]:
    """{candidate: (capture share, SE)} over the one-pass targets JSONs (a candidate run twice: its first run)."""
    out: dict[str, tuple[float, float]] = {}
    for path in sorted(RESULTS.glob("online_settings_targets*.json")):
        d = json.loads(path.read_text())
        if d["passes"] != 1:
            continue
        for name, row in zip(["fixed (paper)"] + d["candidates"], d["rows"]):
            r = row["results"][row["policies"][0]]
            out.setdefault(name, (r["resampled_capture_share"], r["resampled_capture_share_se"]))
    ceiling = RESULTS / "online_capture_ceiling.json"  # benchmarks/online_capture_ceiling.py: oracle label allocations
    for row in json.loads(ceiling.read_text())["rows"] if ceiling.exists() else []:
        if row["labels"] != "top_two" and row["final_prior_strength"] == 32.0:
            out[f"ceiling (oracle mbpp labels): {row['labels']}"] = (row["resampled_capture_share"],
                                                                   row["resampled_capture_share_se"])
    return out


def main() -> None:
    data = sorted(captures().items(), key=lambda kv: kv[1][0])
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(data) + 1.2))
    ax.errorbar([v for _, (v, _) in data], range(len(data)), xerr=[se for _, (_, se) in data], fmt="o", ms=3)
    ax.set_yticks(range(len(data)), [name for name, _ in data], fontsize=6)
    ax.axvline(0.5, color="k", ls="--", lw=0.8, label="target (> 0.5)")
    ax.axvline(0.70, color="g", ls=":", lw=0.8, label="dense labels (0.70)")
    ax.set_xlabel("capture share: pairs (seed, resample) saving >= 20% at gpt-4's accuracy, ± SE", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    out = RESULTS / "online_settings_capture.png"
    save_figure(fig, out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
