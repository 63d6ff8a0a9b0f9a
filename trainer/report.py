"""Writing simulation results: ``results.json``, a markdown table and a PNG of the curves."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np

from sdk.atomic_write import write_atomic
from trainer import metrics
from trainer.kinds import display_name

ROW_NAMES = {"local": "local", "federated": "federated", "centralised": "centralised",
             "personalised": "federated + personalised"}


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

    write_text(path, json.dumps(clean(payload), indent=2))


def write_text(path: Path, text: str) -> None:
    """Atomic write of a UTF-8 text file (:func:`sdk.atomic_write.write_atomic`)."""
    write_atomic(Path(path), text.encode("utf-8"))


def save_figure(fig, path: Path, dpi: int | None = None) -> None:
    """Lay out, save atomically as PNG (:func:`sdk.atomic_write.write_atomic`), and close a matplotlib figure."""
    import matplotlib.pyplot as plt  # trainer extra (matplotlib), only when plotting

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    plt.close(fig)
    write_atomic(Path(path), buf.getvalue())


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
                f"| {display_name(kind)} | {ROW_NAMES.get(setting, setting)} | "
                f"{m['auc_mean']:.4f} ± {m['auc_std']:.4f} | {m['gain']:+.3f} | "
                f"{m['acc_at_best_cost']:.4f} | {_fmt_ratio(m['cost_at_best_acc'])} |"
            )
    names = {"oracle": "oracle", "zero": "zero router", "random": "random"}
    for name, r in summary["references"].items():
        lines.append(
            f"| {names.get(name, name)} | reference | {r['auc']:.4f} | {r['gain']:+.3f} | "
            f"{r['acc_at_best_cost']:.4f} | {_fmt_ratio(r['cost_at_best_acc'])} |"
        )
    if summary.get("client_distribution"):
        lines += [
            "",
            "On each client's own task mix (test rows drawn to match the client's tasks; mean ± std over "
            "(seed, client); gain against that set's own zero router and oracle):",
            "",
            "| router | local | federated | federated + personalised | zero router | oracle |",
            "|---|---|---|---|---|---|",
        ]
        for kind, by_setting in summary["client_distribution"].items():
            cells = [
                f"{by_setting[s]['auc_mean']:.4f} ± {by_setting[s]['auc_std']:.4f} (gain {by_setting[s]['gain_mean']:+.3f})"
                for s in ("local", "federated", "personalised")
            ] + [f"{by_setting[s]['auc_mean']:.4f}" for s in ("zero", "oracle")]
            lines.append(f"| {display_name(kind)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _frontier_line(points: np.ndarray, x_max: float, n: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """The frontier of ``points`` sampled densely (straight in linear cost, so it draws right on a
    log axis), flat from its last vertex to ``x_max``."""
    h = metrics.frontier(points)
    xs = [h[0, 0]] if h.shape[0] == 1 else []
    for (x0, _), (x1, _) in zip(h[:-1], h[1:]):
        xs.extend(np.linspace(x0, x1, n, endpoint=False))
    xs = np.append(xs, [h[-1, 0], max(x_max, h[-1, 0])])
    return xs, np.interp(xs, h[:, 0], h[:, 1])


def plot_curves(path: Path, curves: dict[str, np.ndarray], single_models: np.ndarray,
                model_names: list[str], title: str) -> None:
    """Accuracy-cost frontiers (METRICS.md hull): left on a log USD axis, right on the normalised
    cost ``u`` in [0, 1] that the AUC integrates. Single models are drawn as points.

    curves : name -> points of shape (n_points, 2) (mean cost USD, mean accuracy).
    single_models : ndarray of shape (n_models, 2).
    """
    import matplotlib  # trainer extra (matplotlib), only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # trainer extra (matplotlib), only when plotting

    c_lo, c_hi = float(single_models[:, 0].min()), float(single_models[:, 0].max())
    fig, axes = plt.subplots(1, 2, figsize=(14, 6), dpi=110)
    for ax, normalised in zip(axes, (False, True)):
        for name, pts in curves.items():
            pts = np.asarray(pts, dtype=np.float64).copy()
            if normalised:
                pts[:, 0] = np.maximum(metrics.normalise_cost(pts[:, 0], c_lo, c_hi), 0.0)
            xs, ys = _frontier_line(pts, 1.0 if normalised else c_hi * 1.05)
            reference = name in ("oracle", "zero router", "random")
            ax.plot(xs, ys, "--" if reference else "-", label=name, linewidth=2.2 if name == "zero router" else 1.5)
        sx = metrics.normalise_cost(single_models[:, 0], c_lo, c_hi) if normalised else single_models[:, 0]
        ax.scatter(sx, single_models[:, 1], c="k", s=16, zorder=5)
        for x, a, label in zip(sx, single_models[:, 1], model_names):
            ax.annotate(label.split("/")[-1], (x, a), fontsize=7, xytext=(3, -9), textcoords="offset points")
        ax.grid(True, alpha=0.3)
        ax.set_ylabel("mean accuracy")
        if normalised:
            ax.set_xlabel("normalised cost u = (c - c_lo) / (c_hi - c_lo)  (AUC is the area under these)")
            ax.set_xlim(0, 1)
        else:
            ax.set_xscale("log")
            ax.set_xlabel("mean cost per query (USD, log scale)")
    axes[1].legend(fontsize=8, loc="lower center", ncol=2)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)
