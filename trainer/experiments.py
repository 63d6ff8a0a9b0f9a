"""The main job (``fedroute simulate``) and the ablations (``fedroute ablate``) end to end:
load logs -> embed (cached) -> simulate seeds -> metrics -> results.json / results.md / PNG ->
trained federated routers under ``out/routers/{mlp,kmeans}`` for ``export``."""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sdk.errors import InvalidInputError
from trainer import metrics, report
from trainer.data.routerbench import EvalTable
from trainer.embeddings import EmbedderConfig, embed_texts
from trainer.kinds import display_name
from trainer.out_folder import check_out_folder
from trainer.results_owner import OWNER_KEY
from trainer.simulation import SimulationConfig, reference_reports, run_seed, summarise

ABLATION_N = (5, 10, 20, 40)
ABLATION_ALPHA = (0.03, 0.1, 0.6, 5.0)


def _log(msg: str) -> None:
    from rich.console import Console  # trainer extra (rich), imported on use

    Console(stderr=True, soft_wrap=True).print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {msg}")


def check_tables(train: EvalTable, test: EvalTable) -> None:
    """Refuse, before any embedding, a pair of tables the protocol cannot score.

    Raises
    ------
    InvalidInputError
        Fewer than 2 models; different model lists; an empty train table; no test row labelled
        for every model. Warns (log line) about models without any train label.
    """
    if train.n_models < 2:
        raise InvalidInputError(f"{train.source}: routing needs at least 2 models, found {list(train.models)}")
    if tuple(train.models) != tuple(test.models):
        missing = [m for m in train.models if m not in test.models]
        extra = [m for m in test.models if m not in train.models]
        detail = "; ".join(
            part for part in (f"{test.source} lacks {missing}" if missing else "",
                              f"{test.source} adds {extra}" if extra else "",
                              "same models in another column order" if not (missing or extra) else "")
            if part
        )
        raise InvalidInputError(f"train and test must name the same models in the same order: {detail}")
    if not train.labelled().any(axis=1).any():
        raise InvalidInputError(f"{train.source}: no row has any labelled model ({train.n_queries} rows)")
    scorable = int(test.labelled().all(axis=1).sum())
    if scorable == 0:
        raise InvalidInputError(
            f"{test.source}: no row has labels for every model (0 of {test.n_queries} scorable); "
            "the metrics need each model's outcome on each test query"
        )
    unlabelled = [m for m, any_label in zip(train.models, train.labelled().any(axis=0)) if not any_label]
    if unlabelled:
        _log(f"[yellow]warning[/yellow]: {train.source} has no label for {unlabelled}; no router can learn them")


def _prepare_out(out: Path) -> None:
    check_out_folder(out)
    out.mkdir(parents=True, exist_ok=True)


def _warn_empty_clients(results: Sequence) -> None:
    empty = [sum(1 for n in r.n_samples_per_client if n == 0) for r in results]
    if any(empty):
        _log(f"[yellow]warning[/yellow]: clients without any query per seed: {empty} "
             "(more clients than the data or a very small alpha); they are left out")


def embed_tables(train: EvalTable, test: EvalTable, embedder: EmbedderConfig, cache_dir: Path | None):
    """Embeddings of both tables' prompts, shape (n, d_emb) float32 each (one cached pass)."""
    _log(f"embedding {train.n_queries + test.n_queries} prompts with {embedder.model} "
         f"({embedder.kind.reading(embedder)}; cached)")
    emb = embed_texts(list(train.prompts) + list(test.prompts), embedder, cache_dir)
    return emb[: train.n_queries], emb[train.n_queries :]


def _evaluation_table(test: EvalTable, test_emb: np.ndarray) -> tuple[EvalTable, np.ndarray]:
    keep = test.labelled().all(axis=1)
    dropped = int((~keep).sum())
    if dropped:
        _log(f"test: {dropped} of {test.n_queries} rows lack a label for some model; scored on the other {int(keep.sum())}")
    return test.subset(np.flatnonzero(keep)), test_emb[keep]


def run_simulation(
    train: EvalTable,
    test: EvalTable,
    out: Path,
    config: SimulationConfig,
    seeds: Sequence[int],
    embedder: EmbedderConfig,
    cache_dir: Path | None = None,
    save_routers: bool = True,
) -> dict:
    """The default protocol over ``seeds``; writes results under ``out`` and returns the summary.

    Raises
    ------
    InvalidInputError
        See :func:`check_tables`; also when ``out`` cannot be written (:func:`trainer.out_folder.check_out_folder`:
        an existing file, a path under a file, an unwritable folder).
    """
    check_tables(train, test)
    _prepare_out(out)
    started = time.time()
    train_emb, test_emb = embed_tables(train, test, embedder, cache_dir)
    test, test_emb = _evaluation_table(test, test_emb)
    references = reference_reports(test)
    results = []
    from tqdm.auto import tqdm  # trainer extra (tqdm), imported on use

    for seed in tqdm(list(seeds), desc="seeds"):
        results.append(run_seed(train, train_emb, test, test_emb, config, seed, progress=_log, show_rounds=True))
    _warn_empty_clients(results)
    summary = summarise(results, references)
    summary["config"] = {
        "simulation": dataclasses.asdict(config),
        "seeds": list(seeds),
        "embedder": dataclasses.asdict(embedder),
        "train": {"source": train.source, "n_queries": train.n_queries},
        "test": {"source": test.source, "n_queries_scored": test.n_queries},
        "models": list(train.models),
    }
    summary["seconds"] = round(time.time() - started, 1)
    summary[OWNER_KEY] = "simulate"  # trainer.results_owner
    report.write_json(out / "results.json", summary)
    report.write_text(out / "results.md", report.markdown_table(summary))
    first = results[0]
    curves = {
        "oracle": references["oracle"].points,
        "zero router": references["zero"].points,
        "random": references["random"].points,
    }
    for kind, by_setting in first.reports.items():
        name = display_name(kind)
        curves[f"{name} federated"] = by_setting["federated"][0].points
        curves[f"{name} centralised"] = by_setting["centralised"][0].points
        by_auc = sorted(by_setting["local"], key=lambda r: r.auc)
        curves[f"{name} local (median client)"] = by_auc[len(by_auc) // 2].points
    report.plot_curves(
        out / "curves.png", curves, metrics.single_model_points(test.accuracy, test.cost), list(test.models),
        f"Accuracy-cost frontiers on {Path(test.source).name} (seed {first.seed}, N={config.n_clients}, alpha={config.alpha})",
    )
    if save_routers:
        # Write all routers beside the old folder, then swap: no stale router of an earlier run
        # survives next to these results, and a crash never leaves a half-written folder.
        staging = out / "routers.new"
        shutil.rmtree(staging, ignore_errors=True)
        for kind, router in first.federated_routers.items():
            router.embedder = embedder.router_entry(router.d_emb, cache_dir)
            router.provenance = {"train": train.source, "test": test.source, "seed": first.seed}
            router.save(staging / kind)
        shutil.rmtree(out / "routers", ignore_errors=True)
        staging.rename(out / "routers")
    _log(f"wrote {out / 'results.json'}, results.md, curves.png in {summary['seconds']} s")
    return summary


def run_ablation(
    train: EvalTable,
    test: EvalTable,
    out: Path,
    base: SimulationConfig,
    seeds: Sequence[int],
    embedder: EmbedderConfig,
    cache_dir: Path | None = None,
    n_values: Sequence[int] = ABLATION_N,
    alpha_values: Sequence[float] = ABLATION_ALPHA,
) -> dict:
    """N and alpha ablations of METRICS.md: one simulation per value, the other at its default."""
    check_tables(train, test)
    _prepare_out(out)
    train_emb, test_emb = embed_tables(train, test, embedder, cache_dir)
    test, test_emb = _evaluation_table(test, test_emb)
    references = reference_reports(test)
    table: dict = {"n_clients": {}, "alpha": {}}
    for axis, values in (("n_clients", n_values), ("alpha", alpha_values)):
        for value in values:
            cfg = dataclasses.replace(base, **{axis: value})
            _log(f"ablation {axis}={value}")
            results = [run_seed(train, train_emb, test, test_emb, cfg, s) for s in seeds]
            table[axis][str(value)] = summarise(results, references)["routers"]
    payload = {"references": {k: v.auc for k, v in references.items()}, "ablations": table, "seeds": list(seeds)}
    report.write_json(out / "ablation.json", payload)
    report.write_text(out / "ablation.md", ablation_markdown(payload))
    plot_ablation(out / "ablation.png", payload)
    return payload


def ablation_markdown(payload: dict) -> str:
    lines = []
    for axis, rows in payload["ablations"].items():
        kinds = list(next(iter(rows.values())).keys())
        header = " | ".join(f"{display_name(k)} {s}" for k in kinds for s in ("federated", "local"))
        lines += [f"\n### {axis}\n", f"| {axis} | {header} |", "|---" * (1 + 2 * len(kinds)) + "|"]
        for value, by_kind in rows.items():
            cells = " | ".join(
                f"{by_kind[k][s]['auc_mean']:.4f} ± {by_kind[k][s]['auc_std']:.4f}"
                for k in kinds for s in ("federated", "local")
            )
            lines.append(f"| {value} | {cells} |")
    refs = payload["references"]
    lines.append(f"\nReferences: oracle {refs['oracle']:.4f}, zero router {refs['zero']:.4f}, random {refs['random']:.4f}.\n")
    return "\n".join(lines)


def plot_ablation(path: Path, payload: dict) -> None:

    import matplotlib  # trainer extra (matplotlib), only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # trainer extra (matplotlib), only when plotting

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120)
    for ax, (axis, rows) in zip(axes, payload["ablations"].items()):
        xs = [float(v) for v in rows]
        for kind in next(iter(rows.values())):
            for setting, style in (("federated", "-o"), ("local", "--s")):
                ys = [rows[v][kind][setting]["auc_mean"] for v in rows]
                es = [rows[v][kind][setting]["auc_std"] for v in rows]
                ax.errorbar(xs, ys, yerr=es, fmt=style, capsize=3, label=f"{display_name(kind)} {setting}")
        ax.axhline(payload["references"]["zero"], color="gray", linestyle=":", label="zero router")
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.minorticks_off()
        ax.set_xlabel(axis)
        ax.set_ylabel("normalised AUC")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Ablations: normalised AUC, mean ± std over seeds {payload['seeds']}", fontsize=10)
    report.save_figure(fig, path)
