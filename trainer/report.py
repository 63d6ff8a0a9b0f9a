"""Writing simulation results: ``results.json``, a markdown table and a PNG of the curves."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from trainer import metrics

ROW_NAMES = {"local": "local", "federated": "federated", "centralised": "centralised",
             "personalised": "federated + personalised"}
KIND_NAMES = {"mlp": "MLP", "kmeans": "K-means"}


def write_json(path: Path, payload: dict) -> None:
    """Atomic write (temp file + rename) of a JSON document; inf/NaN written as strings."""

    def clean(obj):
        if isinstance(obj, float) and not math.isfinite(obj):
            return str(obj)
        if isinstance(obj, dict):
            return {k: clean(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [clean(v) for v in obj]
        if isinstance(obj, np.generic):
            return clean(obj.item())
        return obj

    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(clean(payload), indent=2))
    os.replace(tmp, path)


def _fmt_ratio(x: float) -> str:
    return "never" if not math.isfinite(x) else f"{x:.3f}"


def markdown_table(summary: dict) -> str:
    """Rows: each router kind x setting, then oracle / zero router / random; METRICS.md columns."""
    lines = [
        "| router | setting | AUC (mean ± std) | gain | acc@best_cost | cost@best_acc |",
        "|---|---|---|---|---|---|",
    ]
    for kind, settings in summary["routers"].items():
        for setting, m in settings.items():
            lines.append(
                f"| {KIND_NAMES.get(kind, kind)} | {ROW_NAMES.get(setting, setting)} | "
                f"{m['auc_mean']:.4f} ± {m['auc_std']:.4f} | {m['gain']:+.3f} | "
                f"{m['acc_at_best_cost']:.4f} | {_fmt_ratio(m['cost_at_best_acc'])} |"
            )
    names = {"oracle": "oracle", "zero": "zero router", "random": "random"}
    for name, r in summary["references"].items():
        lines.append(
            f"| {names.get(name, name)} | reference | {r['auc']:.4f} | {r['gain']:+.3f} | "
            f"{r['acc_at_best_cost']:.4f} | {_fmt_ratio(r['cost_at_best_acc'])} |"
        )
    return "\n".join(lines) + "\n"


def plot_curves(path: Path, curves: dict[str, np.ndarray], single_models: np.ndarray,
                model_names: list[str], title: str) -> None:
    """Accuracy-cost frontiers (METRICS.md hull) on a log cost axis, single models as points.

    curves : name -> points of shape (n_points, 2) (mean cost USD, mean accuracy).
    single_models : ndarray of shape (n_models, 2).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    for name, pts in curves.items():
        h = metrics.frontier(pts)
        xs = np.append(h[:, 0], single_models[:, 0].max() * 1.05)
        ys = np.append(h[:, 1], h[-1, 1])
        style = "--" if name in ("oracle", "zero router", "random") else "-"
        ax.plot(xs, ys, style, drawstyle="default", label=name, linewidth=1.6)
    ax.scatter(single_models[:, 0], single_models[:, 1], c="k", s=18, zorder=5)
    for (c, a), label in zip(single_models, model_names):
        ax.annotate(label.split("/")[-1], (c, a), fontsize=7, xytext=(3, -8), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("mean cost per query (USD, log scale)")
    ax.set_ylabel("mean accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
