"""Writing ``fedroute vpa train`` results: ``results.json``, ``results.md``, ``accuracy_vs_context.png`` and
``latent.png`` (atomic writes of :mod:`trainer.report`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainer.data.conflicting_users import TYPES
from trainer.report import save_figure, write_json, write_text
from trainer.vpa.experiment import METHODS


def _cell(m: dict) -> str:
    return "n/a" if m["acc_mean"] is None else f"{m['acc_mean']:.3f} ± {m['acc_std']:.3f}"


def _num(x, fmt: str = "{:.3f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def markdown(res: dict) -> str:
    """Accuracy per method and C (mean ± std over seeds), per type at the largest C, headroom, collapse, switching."""
    cs = list(res["methods"]["oracle_type"])
    n = len(res["seeds"])
    lines = [f"Held-out pairwise accuracy on test users (HH-RLHF harmless pairs; helpful users' labels are the HH "
             f"labels flipped), mean ± std over {n} seed(s); C = the user's context pairs.", "",
             "| method | " + " | ".join(f"C = {c}" for c in cs) + " |", "|---|" + "---|" * len(cs)]
    lines += [f"| {m} | " + " | ".join(_cell(res["methods"][m][c]) for c in cs) + " |" for m in METHODS]
    lines += ["", "Per type (mean over seeds):", "", "| method | C | " + " | ".join(TYPES) + " |",
              "|---|---|" + "---|" * len(TYPES)]
    for m in METHODS:
        for c in (cs[0], cs[-1]):
            lines.append(f"| {m} | {c} | " + " | ".join(_num(res["methods"][m][c]["per_type"][t]) for t in TYPES) + " |")
    lines += ["", "Headroom H = oracle_type - monolithic_bt and the share FedVPA-GP recovers:", "",
              "| C | H | recovered |", "|---|---|---|"]
    lines += [f"| {c} | {_num(h['H'])} | {_num(h['fedvpa_gp_recovered'], '{:.0%}')} |" for c, h in res["headroom"].items()]
    lines += ["", "Posterior collapse: mean KL(q(z|C) || prior) in nats / type accuracy of a probe on z "
              "(two_stage: its classifier's accuracy):", "", "| method | " + " | ".join(f"C = {c}" for c in cs) + " |",
              "|---|" + "---|" * len(cs)]
    for m in ("fedvpa_gp", "fedvpa_gp_global_pi", "vpl_gaussian", "local_vpl", "two_stage"):
        cells = [f"{_num(res['collapse'][m][c]['kl_mean'], '{:.2f}')} / {_num(res['collapse'][m][c]['type_acc_from_z'])}"
                 for c in cs]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "Switching: share of a user's held-out pairs whose prediction flips under the z of a user of the other "
              "type / flips with both predictions right:", "", "| method | " + " | ".join(f"C = {c}" for c in cs) + " |",
              "|---|" + "---|" * len(cs)]
    for m, by_c in res["switching_rate"].items():
        lines.append(f"| {m} | " + " | ".join(f"{_num(by_c[c]['flip'])} / {_num(by_c[c]['both_right'])}" for c in cs) + " |")
    return "\n".join(lines) + "\n"


def plot_accuracy(res: dict, path: Path) -> None:
    """Accuracy vs C, one line per method, error bars = std over seeds."""
    import matplotlib  # matplotlib: heavy, imported when a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in METHODS:
        cs = [int(c) for c in res["methods"][m]]
        mean = [res["methods"][m][str(c)]["acc_mean"] for c in cs]
        std = [res["methods"][m][str(c)]["acc_std"] for c in cs]
        ax.errorbar(cs, mean, yerr=std, marker="o", capsize=3, label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context pairs C")
    ax.set_ylabel("held-out pairwise accuracy")
    ax.set_title(f"Users who disagree (HH-RLHF), {len(res['seeds'])} seed(s)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path)
    plt.close(fig)


def plot_latent(res: dict, path: Path) -> None:
    """Test users' posterior means (seed 0, first two principal axes) per method and C, coloured by true type."""
    import matplotlib  # matplotlib: heavy, imported when a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    lat = res["latent_seed0"]
    types = np.array(lat["types"])
    methods = [m for m in ("fedvpa_gp", "vpl_gaussian") if m in lat]
    cs = list(lat[methods[0]])
    fig, axes = plt.subplots(len(methods), len(cs), figsize=(3 * len(cs), 3 * len(methods)), squeeze=False)
    for i, m in enumerate(methods):
        for j, c in enumerate(cs):
            z = np.array(lat[m][c])
            centred = z - z.mean(0)
            _, _, vt = np.linalg.svd(centred, full_matrices=False)
            p = centred @ vt[:2].T
            ax = axes[i, j]
            for t, name in enumerate(TYPES):
                ax.scatter(p[types == t, 0], p[types == t, 1], s=10, alpha=0.7, label=name)
            if m == "fedvpa_gp" and "prototypes" in lat:
                q = (np.array(lat["prototypes"]) - z.mean(0)) @ vt[:2].T
                ax.scatter(q[:, 0], q[:, 1], marker="*", s=150, c="k", label="prototypes")
            ax.set_title(f"{m}, C = {c}", fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
    axes[0, 0].legend(fontsize=7)
    save_figure(fig, path)
    plt.close(fig)


def write_results(res: dict, out: Path) -> None:
    """results.json, results.md and the two PNGs into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", res)
    write_text(out / "results.md", markdown(res))
    plot_accuracy(res, out / "accuracy_vs_context.png")
    plot_latent(res, out / "latent.png")
