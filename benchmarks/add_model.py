"""A new model without retraining: add-model with 10, 50, 200 calibration queries vs retraining.

The main job's protocol (METRICS.md, :func:`trainer.simulation.simulate_clients`: N = 10 clients,
alpha = 0.6, one logged model per query) on RouterBench, per seed and router kind:

1. **retrained**: the federated router trained from scratch on the full pool (the main job's router);
2. **no new model**: the federated router trained on the *same* sparse logs without the rows of the
   held-out model M (M never existed for the clients); it never chooses M;
3. **add-model, n**: router 2 plus M added by :mod:`trainer.routers.add_model` from n calibration
   queries (n = 0: the prior only, price = M's mean cost on the train split; n = 10, 50, 200: the
   first n of a per-seed random order of the *train* split's rows labelled for M, price = their mean
   cost, as ``fedroute add-model`` does without ``--price``).

All are scored on the same fully labelled test split with the METRICS.md AUC
(:func:`trainer.metrics.evaluate_router`), next to the zero router of the full pool and of the pool
without M. ``share_new`` is the share of test queries routed to M, averaged over the METRICS.md lambda
grid. The held-out models are chosen on the train split only, unless ``--held-out`` names them: the
model the train oracle picks most often over the lambda grid (the pool's most useful model; on
RouterBench the cheapest) and the most accurate model on the train split (the priciest), two
opposite cases: a new model that wins on price, and one whose accuracy must be learned.

    python benchmarks/add_model.py --data ../shared/data/routerbench --seeds 3 --out docs/results

Writes ``add_model.json``, ``add_model.md``, ``add_model.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

SIZES = (0, 10, 50, 200)


def oracle_favourite(train) -> str:
    """The model the oracle (true accuracy and cost) picks most often on the train split's fully
    labelled rows, averaged over the METRICS.md lambda grid."""
    from sdk.utility import decide
    from trainer.metrics import lambda_grid

    full = train.complete_rows()
    shares = np.zeros(full.n_models)
    for lam in lambda_grid():
        shares += np.bincount(decide(full.accuracy, full.cost, lam), minlength=full.n_models)
    return full.models[int(np.argmax(shares))]


def most_accurate(train) -> str:
    """The model with the highest mean accuracy over its labelled train rows."""
    return train.models[int(np.argmax(np.nanmean(train.accuracy, axis=0)))]


def without_model(clients, held: int):
    """The clients' logs with the rows logged for model index ``held`` removed and indices above it shifted."""
    from trainer.data.client_data import ClientData

    out = []
    for c in clients:
        keep = c.model != held
        m = c.model[keep]
        out.append(ClientData(c.embeddings[keep], np.where(m > held, m - 1, m), c.accuracy[keep], c.cost[keep]))
    return out


def share_of(pred_acc: np.ndarray, pred_cost: np.ndarray, column: int) -> float:
    """Share of queries routed to ``column``, averaged over the METRICS.md lambda grid."""
    from sdk.utility import _decide_unchecked, check_lambda
    from trainer.metrics import lambda_grid

    shares = [float((_decide_unchecked(pred_acc - check_lambda(float(lam)) * pred_cost, pred_cost) == column).mean())
              for lam in lambda_grid()]
    return float(np.mean(shares))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/routerbench"))
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--routers", default="mlp,kmeans")
    parser.add_argument("--held-out", action="append", default=None,
                        help="model to hold out (repeat for several; default: the train oracle's favourite and the "
                             "most accurate train model)")
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args(argv)

    import torch

    from trainer import report
    from trainer.data.routerbench import load_routerbench_dir
    from trainer.embeddings import EmbedderConfig
    from trainer.experiments import _evaluation_table, check_tables, embed_tables
    from trainer.simulation import SimulationConfig

    torch.set_num_threads(1)
    started = time.time()
    train, test = load_routerbench_dir(args.data)
    check_tables(train, test)
    train_emb, test_emb = embed_tables(train, test, EmbedderConfig(max_tokens=args.max_tokens), None)
    test, test_emb = _evaluation_table(test, test_emb)
    config = SimulationConfig(routers=tuple(r.strip() for r in args.routers.split(",") if r.strip()))
    if args.held_out:
        chosen = [(name, "--held-out") for name in args.held_out]
    else:
        chosen = [(oracle_favourite(train), "train-split oracle's favourite"),
                  (most_accurate(train), "most accurate on the train split")]
    runs = [run_held_out(train, train_emb, test, test_emb, config, name, args.seeds, rule) for name, rule in chosen]
    summary = {"runs": runs, "seeds": list(range(args.seeds)), "sizes": list(SIZES), "max_tokens": args.max_tokens,
               "seconds": round(time.time() - started, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_json(args.out / "add_model.json", summary)
    report.write_text(args.out / "add_model.md", markdown(summary))
    plot(args.out / "add_model.png", summary)
    print(markdown(summary))
    return summary


def run_held_out(train, train_emb, test, test_emb, config, held_name: str, n_seeds: int, rule: str) -> dict:
    """One held-out model over ``n_seeds`` seeds: the rows of the module docstring."""
    from tqdm.auto import tqdm

    from trainer import kinds, metrics
    from trainer.simulation import simulate_clients

    models = list(train.models)
    held = models.index(held_name)
    rest = [m for m in models if m != held_name]
    order_added = [rest.index(m) if m != held_name else len(rest) for m in models]  # test column -> added column
    order_rest = [rest.index(m) for m in rest]
    labelled = np.flatnonzero(np.isfinite(train.accuracy[:, held]))
    true_acc, true_cost = test.accuracy, test.cost
    rest_cols = [models.index(m) for m in rest]
    refs = {"oracle": metrics.oracle_report(true_acc, true_cost).auc,
            "zero": metrics.zero_router_report(true_acc, true_cost).auc,
            "zero_without_new": metrics.zero_router_report(true_acc[:, rest_cols], true_cost[:, rest_cols]).auc}
    train_price = float(np.mean(train.cost[labelled, held]))

    rows: dict[str, dict[str, list]] = {k: {} for k in config.routers}
    for seed in tqdm(range(n_seeds), desc=f"seeds, held out {held_name}"):
        clients, _ = simulate_clients(train, train_emb, config, np.random.default_rng(seed))
        reduced = without_model(clients, held)
        calib = np.random.default_rng([seed, 3]).permutation(labelled)
        for kind in config.routers:
            tk = kinds.get(kind)
            full = tk.fit_federated(clients, models, config, np.random.default_rng([seed, 1]))
            base = tk.fit_federated(reduced, rest, config, np.random.default_rng([seed, 2]))
            acc, cost = full.predict(test_emb)
            out = rows[kind]
            out.setdefault("retrained", []).append(
                {"auc": metrics.evaluate_router(acc, cost, true_acc, true_cost).auc, "share_new": share_of(acc, cost, held)})
            acc, cost = base.predict(test_emb)
            wide_acc = np.full(true_acc.shape, np.nan)
            wide_cost = np.full(true_acc.shape, np.nan)
            wide_acc[:, rest_cols], wide_cost[:, rest_cols] = acc[:, order_rest], cost[:, order_rest]
            out.setdefault("no new model", []).append(
                {"auc": metrics.evaluate_router(wide_acc, wide_cost, true_acc, true_cost).auc, "share_new": 0.0})
            for n in SIZES:
                idx = calib[:n]
                price = float(train.cost[idx, held].mean()) if n else train_price
                t0 = time.perf_counter()
                added = tk.add_model(base, held_name, train_emb[idx], train.accuracy[idx, held], train.cost[idx, held],
                                     price)
                seconds = time.perf_counter() - t0
                acc, cost = added.predict(test_emb)
                acc, cost = acc[:, order_added], cost[:, order_added]
                out.setdefault(f"add-model, n={n}", []).append(
                    {"auc": metrics.evaluate_router(acc, cost, true_acc, true_cost).auc,
                     "share_new": share_of(acc, cost, held), "seconds": seconds})

    return {
        "held_out": held_name, "held_out_rule": rule, "references": refs,
        "oracle_share_new": share_of(true_acc, true_cost, held),
        "train_price_usd": train_price,
        "routers": {kind: {name: {"auc_mean": float(np.mean([r["auc"] for r in runs])),
                                  "auc_std": float(np.std([r["auc"] for r in runs])),
                                  "auc_per_seed": [r["auc"] for r in runs],
                                  "share_new_mean": float(np.mean([r["share_new"] for r in runs])),
                                  "share_new_std": float(np.std([r["share_new"] for r in runs])),
                                  **({"add_seconds_median": float(np.median([r["seconds"] for r in runs]))}
                                     if "seconds" in runs[0] else {})}
                           for name, runs in by_row.items()} for kind, by_row in rows.items()},
        "n_test": int(test.n_queries), "n_train_labelled_new": int(labelled.size),
    }


def markdown(summary: dict) -> str:
    return "\n".join(markdown_run(run, summary["seeds"]) for run in summary["runs"])


def markdown_run(s: dict, seeds: list) -> str:
    from trainer.kinds import display_name

    refs = s["references"]
    lines = [f"### Held-out model `{s['held_out']}` ({s['held_out_rule']})", "",
             f"Seeds {seeds}; {s['n_test']} test queries; price prior at n = 0: its train mean cost "
             f"{s['train_price_usd']:.3g} USD per query. AUC: METRICS.md normalised AUC, mean ± std over seeds; "
             "share new: share of test queries routed to the new model, mean over the lambda grid.", "",
             "| router | setting | AUC | share new |", "|---|---|---|---|",
             f"| zero router (full pool) | - | {refs['zero']:.4f} | - |",
             f"| zero router (pool without the new model) | - | {refs['zero_without_new']:.4f} | 0 |",
             f"| oracle | - | {refs['oracle']:.4f} | {s['oracle_share_new']:.3f} |"]
    for kind, by_row in s["routers"].items():
        for name, r in by_row.items():
            lines.append(f"| {display_name(kind)} | {name} | {r['auc_mean']:.4f} ± {r['auc_std']:.4f} | "
                         f"{r['share_new_mean']:.3f} ± {r['share_new_std']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(path: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer import report

    runs = summary["runs"]
    fig, grid = plt.subplots(len(runs), 2, figsize=(11, 4.2 * len(runs)), dpi=120, squeeze=False)
    for axes, s in zip(grid, runs):
        plot_run(axes, s, summary["sizes"])
    fig.suptitle(f"add-model vs retraining (mean ± std over seeds {summary['seeds']})", fontsize=10)
    report.save_figure(fig, path)


def plot_run(axes, s: dict, sizes: list) -> None:
    from trainer.kinds import display_name

    xs = [max(n, 3) for n in sizes]  # n = 0 drawn at 3 on the log axis
    for i, (kind, by_row) in enumerate(s["routers"].items()):
        colour = f"C{i}"
        for ax, key in zip(axes, ("auc", "share_new")):
            ys = [by_row[f"add-model, n={n}"][f"{key}_mean"] for n in sizes]
            es = [by_row[f"add-model, n={n}"][f"{key}_std"] for n in sizes]
            ax.errorbar(xs, ys, yerr=es, fmt="-o", color=colour, capsize=3, label=f"{display_name(kind)} add-model")
            ax.axhline(by_row["retrained"][f"{key}_mean"], color=colour, linestyle="--",
                       label=f"{display_name(kind)} retrained")
            if key == "auc":
                ax.axhline(by_row["no new model"]["auc_mean"], color=colour, linestyle=":",
                           label=f"{display_name(kind)} no new model")
    axes[0].axhline(s["references"]["zero"], color="gray", linestyle="-.", label="zero router")
    axes[1].axhline(s["oracle_share_new"], color="gray", linestyle="-.", label="oracle")
    for ax, label in zip(axes, ("normalised AUC", f"share of queries routed to {s['held_out']}")):
        ax.set_xscale("log")
        ax.set_xticks(xs, ["0 (prior)" if n == 0 else str(n) for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel("calibration queries")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title(f"held out: {s['held_out']}", fontsize=9)


if __name__ == "__main__":
    main()
