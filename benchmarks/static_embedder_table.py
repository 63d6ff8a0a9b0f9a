"""Routing quality of the static (model2vec) embedder against the 32-token MiniLM encoder (issue 13).

Reads two ``results.json`` of the main job's protocol (``fedroute simulate``: 5 seeds, N = 10,
alpha = 0.6, both routers), one run per embedder, on the same seeds (so the same client splits and
sparse logs: per-seed differences are paired), and writes a table of the normalised AUC
(METRICS.md) per router and setting, with the zero router (best single model, the simple baseline),
random and oracle references, and the paired per-seed difference static - MiniLM.

    fedroute simulate --data ../shared/data/routerbench --out results/minilm32 --max-tokens 32
    fedroute simulate --data ../shared/data/routerbench --out results/static --embedder static:all-MiniLM-L6-v2
    python benchmarks/static_embedder_table.py --minilm results/minilm32/results.json \
        --static results/static/results.json --out docs/results

Writes ``static_embedder.json``, ``static_embedder.md``, ``static_embedder.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SETTINGS = ("federated", "centralised", "local")
NAMES = {"mlp": "MLP", "kmeans": "K-means"}
#: Issue 13: the static embedder's federated AUC within this of the 32-token MiniLM routers. The
#: check is one-sided (a static router may be better by any amount): static >= MiniLM - MAX_GAP.
MAX_GAP = 0.005


def compare(minilm: dict, static: dict) -> dict:
    """Per router and setting: both AUCs (mean, std over seeds), the paired per-seed difference
    (static - MiniLM; mean, std) and, for federated, whether the mean difference is >= -MAX_GAP
    (``no_worse``) and whether |mean difference| <= MAX_GAP (``within_gap``)."""
    if minilm["config"]["seeds"] != static["config"]["seeds"]:
        raise SystemExit(f"runs use different seeds: {minilm['config']['seeds']} vs {static['config']['seeds']}")
    out = {"seeds": minilm["config"]["seeds"], "references": static["references"], "routers": {}}
    for kind in static["routers"]:
        out["routers"][kind] = {}
        for setting in SETTINGS:
            a, b = minilm["routers"][kind][setting], static["routers"][kind][setting]
            diff = np.asarray(b["auc_per_seed"]) - np.asarray(a["auc_per_seed"])
            row = {"minilm32": {"auc_mean": a["auc_mean"], "auc_std": a["auc_std"], "per_seed": a["auc_per_seed"]},
                   "static": {"auc_mean": b["auc_mean"], "auc_std": b["auc_std"], "per_seed": b["auc_per_seed"]},
                   "diff_mean": float(diff.mean()), "diff_std": float(diff.std(ddof=0))}
            if setting == "federated":
                row["no_worse"] = bool(row["diff_mean"] >= -MAX_GAP)
                row["within_gap"] = bool(abs(row["diff_mean"]) <= MAX_GAP)
            out["routers"][kind][setting] = row
    return out


def markdown(c: dict) -> str:
    ref = c["references"]
    lines = [f"Normalised AUC on the RouterBench test split (754 rows), {len(c['seeds'])} seeds (mean ± std; local: "
             "over all clients and seeds), N = 10, alpha = 0.6. Difference: static - MiniLM, paired by seed.", "",
             "| router | setting | MiniLM, last 32 tokens | static (model2vec), whole prompt | difference | static >= MiniLM - 0.005 |",
             "|---|---|---|---|---|---|"]
    for kind, rows in c["routers"].items():
        for setting, r in rows.items():
            ok = {True: "yes", False: "no"}.get(r.get("no_worse"), "")
            lines.append(f"| {NAMES.get(kind, kind)} | {setting} | {r['minilm32']['auc_mean']:.4f} ± {r['minilm32']['auc_std']:.4f} | "
                         f"{r['static']['auc_mean']:.4f} ± {r['static']['auc_std']:.4f} | "
                         f"{r['diff_mean']:+.4f} ± {r['diff_std']:.4f} | {ok} |")
    lines += ["", f"References (same test split): zero router (best single model) {ref['zero']['auc']:.4f}, "
              f"random {ref['random']['auc']:.4f}, oracle {ref['oracle']['auc']:.4f}."]
    return "\n".join(lines) + "\n"


def plot(c: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.report import save_figure

    labels, m_mean, m_std, s_mean, s_std = [], [], [], [], []
    for kind, rows in c["routers"].items():
        for setting in ("federated", "centralised"):
            r = rows[setting]
            labels.append(f"{NAMES.get(kind, kind)}\n{setting}")
            m_mean.append(r["minilm32"]["auc_mean"])
            m_std.append(r["minilm32"]["auc_std"])
            s_mean.append(r["static"]["auc_mean"])
            s_std.append(r["static"]["auc_std"])
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.bar(x - 0.2, m_mean, 0.4, yerr=m_std, capsize=3, label="MiniLM, last 32 tokens (ONNX)")
    ax.bar(x + 0.2, s_mean, 0.4, yerr=s_std, capsize=3, label="static model2vec, whole prompt")
    ax.axhline(c["references"]["zero"]["auc"], color="k", ls="--", lw=1, label="zero router (best single model)")
    ax.set_xticks(x, labels)
    lo = min(min(m_mean), min(s_mean), c["references"]["zero"]["auc"]) - 0.02
    ax.set_ylim(lo, max(max(m_mean), max(s_mean)) + 0.02)
    ax.set_ylabel("normalised AUC (test)")
    ax.set_title(f"Static vs MiniLM embedder, {len(c['seeds'])} seeds")
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minilm", type=Path, required=True, help="results.json of the --max-tokens 32 run")
    parser.add_argument("--static", type=Path, required=True, help="results.json of the --embedder static:... run")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args(argv)
    c = compare(json.loads(args.minilm.read_text()), json.loads(args.static.read_text()))
    c["runs"] = {"minilm32": {"embedder": json.loads(args.minilm.read_text())["config"]["embedder"]},
                 "static": {"embedder": json.loads(args.static.read_text())["config"]["embedder"]}}
    from trainer.report import write_text  # atomic: a killed run leaves the old file

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "static_embedder.json", json.dumps(c, indent=2) + "\n")
    write_text(args.out / "static_embedder.md", markdown(c))
    plot(c, args.out / "static_embedder.png")
    print(markdown(c))
    return c


if __name__ == "__main__":
    main()
