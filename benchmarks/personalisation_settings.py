"""Choose the personalisation prior's strength kappa (``sdk.personalisation.PRIOR_ROWS``) on validation.

Each seed cuts the RouterBench TRAIN split in two (per task 75/25, seeded) and runs the main job's
protocol (``trainer.simulation``: Dirichlet task split over N = 10 clients, one logged model per
query, federated MLP and K-means routers) on the 75%; the fully labelled rows of the other 25% are
the validation set. Each client's local estimators are fitted once (80% of its log, errors on the
other 20%, as the simulation does), then every candidate kappa re-weights the same predictions, so
the candidates differ only by the rule. The test split is never read.

Scored per seed: the mean over clients of the personalised router's AUC on the validation set and
on validation rows drawn to match the client's task mix (``client view``: where personalisation is
meant to help), next to the federated router's. Reported: mean ± standard error over seeds, and
the paired difference personalised - federated. References: ``paper 002`` (kappa -> 0: no
shrinkage) and ``thresholds`` (paper 002 with the degenerate-log thresholds this rule replaced:
weight 0 for a model with < 10 rows, with one score over >= 30 rows, or in a log with < 2 usable
models). Beside AUC, the hijack sweep (:func:`hijack_sweep`, on train rows, ``SWEEP_DRAWS`` draws)
gives each rule's worst excess share routed to the model of a small degenerate log.

Choice (:func:`choose`): among the kappas within one standard error of the best client-view AUC, the
one with the smallest worst hijack excess, then the smallest kappa.

    python benchmarks/personalisation_settings.py --data ../shared/data/routerbench --seeds 20 --workers 3 --out docs/results

Writes ``personalisation_settings.{json,md,png}`` under ``--out`` (``--replay`` that JSON to redo
the table and choice without rerunning); the chosen kappa is copied by hand into
``sdk/personalisation.py`` (``PRIOR_ROWS``).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from sdk.personalisation import holdout_split, personalisation_weights, personalise

KAPPAS = (10.0, 30.0, 100.0, 300.0, 1000.0, 2000.0, 3000.0, 10000.0)
LAM = 30.0  # USD^-1, the lambda for the hijack sweep
SWEEP_N = (5, 10, 20, 29, 50, 100, 120, 200)  # rows of a one-model log
SWEEP_EXCEPTIONS = (0, 1, 2)  # scores of the other class among them
SWEEP_DRAWS = 10  # draws of the global router's rows, the queries and the logged prompts
MAX_EXCESS = 0.05  # a degenerate log may add at most this share of queries to its model
KINDS = ("mlp", "kmeans")
VIEWS = ("validation", "client view")


def carve(train, rng: np.random.Generator, share: float = 0.75) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (fit, validation) of ``train``, cut per task."""
    fit, val = [], []
    for task in sorted(set(train.tasks)):
        rows = rng.permutation(np.flatnonzero(train.tasks == task))
        cut = int(round(share * rows.size))
        fit.append(rows[:cut])
        val.append(rows[cut:])
    return np.sort(np.concatenate(fit)), np.sort(np.concatenate(val))


def threshold_weights(data, fit_rows, held_rows, global_held, local_held,
                      n_models: int) -> tuple[np.ndarray, np.ndarray]:
    """Paper 002's weights with the removed thresholds (MIN_MODEL_ROWS 10, MIN_CONSTANT_ROWS 30, >= 2 models)."""
    n = np.bincount(data.model, minlength=n_models)
    low, high = np.full(n_models, np.inf), np.full(n_models, -np.inf)
    np.minimum.at(low, data.model, data.accuracy)
    np.maximum.at(high, data.model, data.accuracy)
    constant = (n >= 30) & (low == high)
    usable = (n >= 10) & ~constant & (((n > 0) & ~constant).sum() >= 2)
    w = personalisation_weights(global_held, local_held, data.model[held_rows], data.accuracy[held_rows],
                                data.cost[held_rows], np.bincount(data.model[fit_rows], minlength=n_models),
                                prior_rows=1e-300)  # c = 1 wherever n > 0: paper 002 alone
    return np.where(usable, w.accuracy, 0.0), np.where(usable, w.cost, 0.0)


def run_seed(train, train_emb: np.ndarray, seed: int, rules: dict) -> dict:
    """AUCs of one seed: {kind: {rule or "federated": {view: mean over clients}}}."""
    from trainer import kinds, metrics
    from trainer.simulation import SimulationConfig, client_test_indices, simulate_clients

    rng = np.random.default_rng(seed)
    fit_idx, val_idx = carve(train, rng)
    fit, val = train.subset(fit_idx), train.subset(val_idx)
    keep = val.labelled().all(axis=1)
    val, val_emb = val.subset(np.flatnonzero(keep)), train_emb[val_idx][keep]
    config = SimulationConfig()
    clients, client_tasks = simulate_clients(fit, train_emb[fit_idx], config, rng)
    active = [(c, t) for c, t in zip(clients, client_tasks) if c.n_samples > 0]
    sets = [client_test_indices(val.tasks, t, rng) for _, t in active]
    models, n_models = fit.models, fit.n_models
    n_global = np.bincount(np.concatenate([c.model for c in clients]), minlength=n_models)

    def auc(rows, acc, cost):
        return metrics.evaluate_router(acc[rows], cost[rows], val.accuracy[rows], val.cost[rows]).auc

    out = {}
    all_rows = np.arange(val.n_queries)
    for kind in KINDS:
        trainer_kind = kinds.get(kind)
        fed = trainer_kind.fit_federated(clients, models, config, rng)
        g_val = fed.predict(val_emb)
        scores = {name: {v: [] for v in VIEWS} for name in ("federated", *rules)}
        pers_rng = np.random.default_rng([seed, 1 + KINDS.index(kind)])
        for (data, _), rows in zip(active, sets):
            fit_rows, held_rows = holdout_split(data.model, pers_rng)
            local = trainer_kind.fit_local(data.subset(fit_rows), models, config, pers_rng)
            held = data.embeddings[held_rows]
            g_held, l_held, l_val = fed.predict(held), local.predict(held), local.predict(val_emb)
            for name, rule in rules.items():
                w_acc, w_cost = _weights(rule, data, fit_rows, held_rows, g_held, l_held, n_models, n_global)
                acc, cost = personalise(g_val[0], l_val[0], w_acc), personalise(g_val[1], l_val[1], w_cost)
                scores[name]["validation"].append(auc(all_rows, acc, cost))
                scores[name]["client view"].append(auc(rows, acc, cost))
            scores["federated"]["validation"].append(auc(all_rows, *g_val))
            scores["federated"]["client view"].append(auc(rows, *g_val))
        out[kind] = {name: {v: float(np.mean(x)) for v, x in views.items()} for name, views in scores.items()}
    return out


def hijack_sweep(train, train_emb: np.ndarray, rules: dict, draw: int) -> dict:
    """Worst excess share routed at ``LAM`` to the model of a degenerate one-model log, per rule.

    In draw ``draw`` of train rows, a K-means router (6 cells) is fitted on every label of 300 rows
    (the global estimate); for each model and each (n, exceptions) of the sweep, a log of n other
    train rows sent to that model, all scored 1.0 but ``exceptions`` of 0.0, is personalised (80/20
    held-out split, as the simulation); the excess is its model's share of 300 further train queries
    minus the global router's share. The worst over models and logs is returned."""
    from sdk.utility import decide
    from trainer import kinds
    from trainer.data.client_data import ClientData
    from trainer.routers.kmeans_router import KMeansRouterConfig, fit_kmeans_router
    from trainer.simulation import SimulationConfig

    n_models, models = train.n_models, train.models
    config, kind = SimulationConfig(), kinds.get("kmeans")
    worst = {name: 0.0 for name in rules}
    rows = np.random.default_rng(draw).permutation(np.flatnonzero(train.labelled().all(axis=1)))
    fit, query, logged = rows[:300], rows[300:600], rows[600:600 + max(SWEEP_N)]
    r, c = np.nonzero(np.ones((fit.size, n_models), bool))
    dense = ClientData(train_emb[fit][r], c.astype(np.int64), train.accuracy[fit][r, c], train.cost[fit][r, c])
    glob = fit_kmeans_router(dense, models, KMeansRouterConfig(n_clusters=6), seed=draw)
    g_acc, g_cost = glob.predict(train_emb[query])
    global_share = np.bincount(decide(g_acc, g_cost, LAM), minlength=n_models) / query.size
    for m in range(n_models):
        for n in SWEEP_N:
            for k in SWEEP_EXCEPTIONS:
                emb = train_emb[logged[:n]]
                scores = (np.arange(n) >= k).astype(np.float64)
                log = ClientData(emb, np.full(n, m), scores, train.cost[logged[:n], m])
                rng = np.random.default_rng([draw, m, n, k])
                fit_rows, held_rows = holdout_split(log.model, rng)
                local = kind.fit_local(log.subset(fit_rows), models, config, rng)
                l_acc, l_cost = local.predict(train_emb[query])
                g_held, l_held = glob.predict(emb[held_rows]), local.predict(emb[held_rows])
                for name, rule in rules.items():
                    w_acc, w_cost = _weights(rule, log, fit_rows, held_rows, g_held, l_held, n_models, np.inf)
                    routed = decide(personalise(g_acc, l_acc, w_acc), personalise(g_cost, l_cost, w_cost), LAM)
                    worst[name] = max(worst[name], float(np.mean(routed == m) - global_share[m]))
    return worst


def _weights(rule, data, fit_rows, held_rows, g_held, l_held, n_models: int, n_global) -> tuple[np.ndarray, np.ndarray]:
    """(accuracy, cost) weights of one rule: a kappa, or "thresholds"."""
    if rule == "thresholds":
        return threshold_weights(data, fit_rows, held_rows, g_held, l_held, n_models)
    w = personalisation_weights(g_held, l_held, data.model[held_rows], data.accuracy[held_rows], data.cost[held_rows],
                                np.bincount(data.model[fit_rows], minlength=n_models), n_global, prior_rows=rule)
    return w.accuracy, w.cost


def _se(x: np.ndarray) -> float:
    return float(x.std(ddof=1) / np.sqrt(x.size)) if x.size > 1 else float("nan")


def summarise(per_seed: list[dict], names: list[str]) -> dict:
    """Mean, SE over seeds, and the paired difference to federated, per kind, rule and view."""
    table = {}
    for kind in KINDS:
        table[kind] = {}
        for name in names:
            table[kind][name] = {}
            for view in VIEWS:
                x = np.array([s[kind][name][view] for s in per_seed])
                d = x - np.array([s[kind]["federated"][view] for s in per_seed])
                table[kind][name][view] = {"auc": float(x.mean()), "auc_se": _se(x),
                                           "minus_federated": float(d.mean()), "minus_federated_se": _se(d)}
    return table


def choose(per_seed: list[dict], worst: dict) -> str:
    """Among the kappas whose client-view AUC (mean of both routers, per seed) is within one standard
    error (of the paired per-seed difference) of the best kappa's, the one with the smallest worst
    hijack excess, then the smallest kappa: validation cannot tell them apart on AUC, so the safer wins."""
    names = [f"kappa={k:g}" for k in KAPPAS]
    score = {name: np.array([np.mean([s[kind][name]["client view"] for kind in KINDS]) for s in per_seed])
             for name in names}
    best = max(names, key=lambda name: score[name].mean())
    tied = [name for name in names if (score[best] - score[name]).mean() <= _se(score[best] - score[name])]
    return min(tied, key=lambda name: (worst[name], KAPPAS[names.index(name)]))


def markdown(table: dict, names: list[str], n_seeds: int, chosen: str, worst: dict) -> str:
    lines = [f"Validation AUC (train split cut 75/25 per seed; {n_seeds} seeds; mean ± SE over seeds of the mean over "
             f"clients; diff = personalised - federated, paired by seed); hijack = worst excess share routed at "
             f"lam = {LAM:g} to the model of a one-model log of n in {list(SWEEP_N)} rows all 1.0 but "
             f"{list(SWEEP_EXCEPTIONS)} (every model, K-means, worst of {SWEEP_DRAWS} draws). Chosen: {chosen}.", "",
             "| router | rule | validation AUC | diff | client-view AUC | diff | hijack |",
             "|---|---|---|---|---|---|---|"]
    for kind in KINDS:
        fed = [table[kind][names[0]][v]["auc"] - table[kind][names[0]][v]["minus_federated"] for v in VIEWS]
        lines.append(f"| {kind} | federated | {fed[0]:.4f} | | {fed[1]:.4f} | | |")
        for name in names:
            cells = [table[kind][name][v] for v in VIEWS]
            lines.append(f"| {kind} | {name} | " + " | ".join(
                f"{c['auc']:.4f} ± {c['auc_se']:.4f} | {c['minus_federated']:+.4f} ± {c['minus_federated_se']:.4f}"
                for c in cells) + f" | {worst[name]:.3f} |")
    return "\n".join(lines) + "\n"


def plot(path: Path, table: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.report import save_figure

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in KINDS:
        for view, style in zip(VIEWS, ("-", "--")):
            d = [table[kind][f"kappa={k:g}"][view] for k in KAPPAS]
            ax.errorbar(KAPPAS, [x["minus_federated"] for x in d], yerr=[x["minus_federated_se"] for x in d],
                        ls=style, marker="o", capsize=3, label=f"{kind}, {view}")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("kappa (prior rows)")
    ax.set_ylabel("AUC personalised - federated (± SE)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/routerbench"))
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2, help="processes (one torch thread each)")
    parser.add_argument("--replay", type=Path, default=None,
                        help="a personalisation_settings.json: recompute the table, choice and figure from its runs")
    args = parser.parse_args(argv)

    from tqdm.auto import tqdm  # trainer extra

    from trainer.data.routerbench import load_routerbench_dir
    from trainer.embeddings import EmbedderConfig, embed_texts
    from trainer.torch_device import set_cpu_threads

    set_cpu_threads(1)
    started = time.time()
    rules = {"paper 002": 1e-300, "thresholds": "thresholds", **{f"kappa={k:g}": k for k in KAPPAS}}
    if args.replay:
        saved = json.loads(args.replay.read_text())
        return report(args, saved["per_seed"], saved["hijack_per_draw"], list(rules), saved["seconds"])
    train, _test = load_routerbench_dir(args.data)
    train_emb = embed_texts(list(train.prompts), EmbedderConfig(), None)
    with ProcessPoolExecutor(args.workers, initializer=set_cpu_threads, initargs=(1,)) as pool:
        sweeps = [pool.submit(hijack_sweep, train, train_emb, rules, draw) for draw in range(SWEEP_DRAWS)]
        seeds = [pool.submit(run_seed, train, train_emb, seed, rules) for seed in range(args.seeds)]
        per_seed = []
        for future in tqdm(seeds, desc="seeds"):
            per_seed.append(future.result())
            tqdm.write(f"seed {len(per_seed) - 1}: " + json.dumps(per_seed[-1]))
        per_draw = [f.result() for f in sweeps]
    return report(args, per_seed, per_draw, list(rules), round(time.time() - started, 1))


def report(args, per_seed: list[dict], per_draw: list[dict], names: list[str], seconds: float) -> dict:
    """Summarise, choose, and write ``personalisation_settings.{json,md,png}`` under ``args.out``."""
    from trainer.report import write_json, write_text

    worst = {name: max(d[name] for d in per_draw) for name in names}
    table = summarise(per_seed, names)
    chosen = choose(per_seed, worst)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"seeds": len(per_seed), "kappas": list(KAPPAS), "chosen": chosen, "table": table, "hijack": worst,
               "hijack_per_draw": per_draw, "per_seed": per_seed, "seconds": seconds}
    write_json(args.out / "personalisation_settings.json", payload)
    write_text(args.out / "personalisation_settings.md", markdown(table, names, len(per_seed), chosen, worst))
    plot(args.out / "personalisation_settings.png", table)
    print(markdown(table, names, len(per_seed), chosen, worst))
    return payload


if __name__ == "__main__":
    main()
