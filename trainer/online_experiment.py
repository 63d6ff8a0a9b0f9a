"""``fedroute simulate --online`` end to end: tables -> embeddings (cached) -> the online replay of
:mod:`trainer.online` over the seeds -> ``results.json`` (``online.<policy>.*``), ``results.md`` and
``online.png`` (gain vs labels per policy, the dense ceiling drawn)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sdk.errors import InvalidInputError
from trainer import metrics, report
from trainer.data.routerbench import EvalTable
from trainer.embeddings import EmbedderConfig
from trainer.experiments import _evaluation_table, _log, _prepare_out, check_tables, embed_tables
from trainer.online import OnlineConfig, ScoringSet, Stream, run_online
from trainer.results_owner import OWNER_KEY

#: What each policy is, for results.md.
POLICY_NOTES = {
    "fixed": "paper's logging: client i logs m ~ pi_i, pi_i ~ Dir(0.5)",
    "uniform": "a model uniformly at random",
    "thompson": "frontier Thompson sampling (METRICS.md), u ~ U[0, 1]",
    "top_two": "top-two Thompson sampling on the frontier, u uniform on sqrt(cost); chosen on validation",
}


def weak_strong_points(train: EvalTable, test: EvalTable) -> tuple[np.ndarray, np.ndarray] | None:
    """RouteLLM's weak/strong pair chosen on the train split (mean over each model's labelled rows),
    returned as their (mean cost USD, mean accuracy) points on the test split; None when no model
    costs at most a tenth of the most accurate one (:func:`trainer.metrics.weak_strong_pair`): then
    APGR and CPT are not reported, the other figures are."""
    labelled = train.labelled()
    n = labelled.sum(axis=0)
    train_single = np.stack([np.where(labelled, train.cost, 0).sum(axis=0) / n,
                             np.where(labelled, train.accuracy, 0).sum(axis=0) / n], axis=1)
    try:
        weak, strong = metrics.weak_strong_pair(train_single)
    except InvalidInputError:
        return None
    test_single = metrics.single_model_points(test.accuracy, test.cost)
    return test_single[weak], test_single[strong]


def _shown(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _saved(median: float | None, se: float | None) -> str:
    """The median saving ± its bootstrap SE; None = most seeds never reach the accuracy (no median), or a
    resample's median is such a seed (no SE)."""
    if median is None:
        return "never (median)"
    return f"{median:.1%} ± " + ("n/a" if se is None else f"{se:.1%}")


def markdown(summary: dict) -> str:
    on = summary["online"]
    cfg = summary["config"]
    lines = [
        f"Online replay: {cfg['n_labels']} labels per seed ({cfg['online']['passes']:g} pass(es) over "
        f"{cfg['train']['n_queries']} train queries), a statistics round every {cfg['online']['round_labels']} labels, "
        f"K = {cfg['online']['kmeans']['n_clusters']}, prior strength {cfg['online']['kmeans']['prior_strength']:g}; "
        f"{len(cfg['seeds'])} seeds, scored on {cfg['test']['n_queries_scored']} test rows. "
        + (f"Weak/strong pair (RouteLLM): {cfg['weak_strong'][0]} / {cfg['weak_strong'][1]}." if cfg["weak_strong"] else
           "Equal costs: quality only, gain = (accuracy - best single model's) / (oracle's - best single model's)."
           if cfg["quality_only"] else
           "No weak/strong pair (RouteLLM: no model costs at most 0.1 x the most accurate one): no APGR or CPT."),
        "",
        "| logging policy | gain (mean ± SE) | gain − fixed (paired) | APGR | CPT(50%) | CPT(80%) | cost saved at best acc (median ± bootstrap SE) | never reaches best | served acc | served cost (USD/query) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for policy, r in on.items():
        if policy == "dense_ceiling":
            continue
        diff = (f"{r['gain_minus_fixed_mean']:+.3f} ± {r['gain_minus_fixed_se']:.3f}"
                if "gain_minus_fixed_mean" in r else "")
        savings = (f"{_shown(r['apgr_mean'], '.3f')} | {_shown(r['cpt50_median'], '.2f')} | {_shown(r['cpt80_median'], '.2f')} | "
                   f"{_saved(r['cost_saved_at_best_acc_median'], r['cost_saved_at_best_acc_median_se'])} | "
                   f"{r['never_reaches_best_share']:.0%}") if "apgr_mean" in r else "— | — | — | — | —"
        lines.append(
            f"| {policy} ({POLICY_NOTES[policy]}) | {r['gain_mean']:.3f} ± {r['gain_se']:.3f} | {diff} | {savings} | "
            f"{r['served_acc']:.3f} | {r['served_cost_usd']:.2e} |")
    c = on["dense_ceiling"]
    lines += ["", f"Dense ceiling (every train query labelled by every model, same router): gain {c['gain_mean']:.3f} ± "
              f"{c['gain_se']:.3f}. Gain = share of the oracle's AUC headroom over the zero router (METRICS.md); "
              "the zero router scores 0.", ""]
    return "\n".join(lines)


def plot(path: Path, summary: dict) -> None:
    import matplotlib  # trainer extra (matplotlib), only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # trainer extra (matplotlib), only when plotting

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for policy, r in summary["online"].items():
        if policy == "dense_ceiling":
            continue
        x = np.array([int(k) for k in r["curve"]])
        y = np.array(list(r["curve"].values()))
        se = np.array(list(r["curve_se"].values()))
        ax.plot(x, y, marker=".", label=f"{policy} ({r['gain_mean']:.3f})")
        ax.fill_between(x, y - se, y + se, alpha=0.2)
    ceiling = summary["online"]["dense_ceiling"]["gain_mean"]
    ax.axhline(ceiling, color="black", linestyle="--", label=f"dense labels ({ceiling:.3f})")
    ax.axhline(0.0, color="gray", linestyle=":", label="zero router")
    ax.set_xlabel("labels logged (all clients)")
    ax.set_ylabel("gain on test (share of oracle headroom)")
    ax.set_title(f"Online replay: gain vs labels, mean ± SE over {len(summary['config']['seeds'])} seeds", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    report.save_figure(fig, path)


def run_online_simulation(train: EvalTable, test: EvalTable, out: Path, config: OnlineConfig, seeds: Sequence[int],
                          embedder: EmbedderConfig, cache_dir: Path | None = None) -> dict:
    """The online protocol over ``seeds``; writes ``out/results.json``, ``results.md``, ``online.png``.

    Raises
    ------
    InvalidInputError
        See :func:`trainer.experiments.check_tables`; no train query labelled for two models or more;
        ``out`` cannot be written.
    """
    check_tables(train, test)
    if train.labelled().sum(axis=1).max() < 2:  # every policy could only log that one model: nothing to compare
        raise InvalidInputError(f"{train.source}: no train query has an outcome for more than one model; the online "
                                "replay reveals the outcome of the model each policy chooses, so each query needs "
                                "the outcomes of the models it may choose (a log of served calls is not enough)")
    _prepare_out(out)
    started = time.time()
    train_emb, test_emb = embed_tables(train, test, embedder, cache_dir)
    test, test_emb = _evaluation_table(test, test_emb)
    keep = train.labelled().any(axis=1)
    stream = Stream(train_emb[keep], train.tasks[keep], np.where(train.labelled(), train.accuracy, np.nan)[keep],
                    np.asarray(train.cost)[keep], train.labelled()[keep])
    scoring = ScoringSet(test_emb, test.accuracy, test.cost)
    mean_cost = test.cost.mean(axis=0)
    quality_only = bool(mean_cost.max() == mean_cost.min())
    ws = None if quality_only else weak_strong_points(train, test)
    from tqdm.auto import tqdm  # trainer extra (tqdm), imported on use

    summary: dict = {"online": run_online(stream, scoring, config, seeds, ws, progress=lambda s: tqdm(s, desc="seeds"))}
    single = metrics.single_model_points(test.accuracy, test.cost)
    ws_idx = [] if ws is None else [int(np.flatnonzero((single == p).all(axis=1))[0]) for p in ws]
    summary["config"] = {
        "online": dataclasses.asdict(config),
        "seeds": list(seeds),
        "n_labels": int(round(config.passes * int(keep.sum()))),
        "embedder": dataclasses.asdict(embedder),
        "train": {"source": train.source, "n_queries": int(keep.sum())},
        "test": {"source": test.source, "n_queries_scored": test.n_queries},
        "models": list(train.models),
        "weak_strong": [train.models[i] for i in ws_idx] or None,
        "quality_only": quality_only,
    }
    summary["seconds"] = round(time.time() - started, 1)
    summary[OWNER_KEY] = "simulate"
    report.write_json(out / "results.json", summary)
    report.write_text(out / "results.md", markdown(summary))
    plot(out / "online.png", summary)
    _log(f"wrote {out / 'results.json'}, results.md, online.png in {summary['seconds']} s")
    return summary
