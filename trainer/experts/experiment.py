"""The FedPrism experiment: every method on the same clients and test pairs (docs/prism.md).

:func:`prepare_data` loads and splits the preference pairs by prompt (60/20/20 within each domain, data
seed 0), keeps ``public_fraction`` of the train prompts as text-only *public* prompts, subsamples to the
preset, embeds the prompts and caches the selector's frozen lower layers and the pair features.
:func:`run_experiment` draws N = 20 Dirichlet(0.5) clients per seed and trains every method of
:data:`trainer.experts.fedprism.METHODS` plus the length-only baseline; all are scored on the same
held-out pairs. The output folder's layout is in docs/prism.md (Output folder).
"""

from __future__ import annotations

import io
import json
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from sdk.atomic_write import replace_dir, write_atomic
from sdk.errors import InvalidInputError
from trainer.data.preferences import DOMAINS, dirichlet_clients, load_preference_pairs, split_by_prompt
from trainer.experts.selector import SelectorConfig
from trainer.experts.fedprism import METHODS, FederatedPairs, FedPrismConfig, FedPrismTrainer, method_config, state_bytes
from sdk.pair_features import DEFAULT_FEATURES
from sdk.routed_selector import role_counts
from trainer.length_baseline import STRUCTURE_C, LengthBaseline
from trainer.preference_metrics import expert_utilisation, pairwise_accuracy
from trainer.embeddings import EmbedderConfig, default_cache_dir, embed_texts
from trainer.report import save_figure, write_json, write_text
from trainer.results_owner import OWNER_KEY

# the baselines of issues 10 and 29 (logistic regression on pair features, trainer.length_baseline): length only
# per domain (the domain label is read at prediction time), one global model (label-free), and the
# structure-feature baseline (sdk.pair_features.DEFAULT_FEATURES, per domain, C chosen on validation)
LENGTH_ONLY = {"length_only": {"per_domain": True}, "length_only_global": {"per_domain": False},
               "structure_only": {"per_domain": True, "C": STRUCTURE_C, "features": DEFAULT_FEATURES}}
ALL_METHODS = METHODS + tuple(LENGTH_ONLY)


@dataclass(frozen=True)
class DataPreset:
    """Sizes of the parts (pairs, stratified by domain; None = every pair of the part) and the client simulation."""

    n_train: int | None = None
    n_val: int | None = None
    n_test: int | None = None
    public_fraction: float = 0.15
    n_public: int = 300
    n_clients: int = 20
    alpha: float = 0.5


#: The experts' head features (sdk.pair_features.DEFAULT_FEATURES, chosen on validation by
#: benchmarks/pair_features_settings.py) and the clients' local regressions' C: the structure-feature
#: baseline's C = 10 halved, since the local fits also see each pair's swapped copy (trainer.experts.length_init)
_STRUCTURE = {"selector": SelectorConfig(pair_features=DEFAULT_FEATURES), "length_C": STRUCTURE_C / 2}
# the feature path's start: exact federated fits per routed expert pulled towards the global fit (length_pool_C = 1),
# the router distilled onto the public K-means centroids over the clients' prompts for 3 rounds; chosen on the
# validation pairs by benchmarks/prism_prior_fit_settings.py (docs/results/prism_prior_fit_settings_cpu.md)
_START = {"length_init": "pooled", "length_pool_C": 1.0, "router_init_rounds": 3}

PRESETS: dict[str, tuple[DataPreset, FedPrismConfig]] = {
    # quick: the CPU preset's M and head (not tuned separately); 2 rounds = 1 warm-up + 1 PGPD round; no validation
    # pairs (nothing is tuned on it); every test pair (4,376) so that a 0.01 difference is resolvable (paired SE
    # <= 0.005); 2,400 training pairs: the fewest of 600 / 1,200 / 2,400 / 4,800 whose start is not below
    # length-only on the validation pairs in any domain (benchmarks/prism_start_gap.py --part quick_size); the router
    # reads the role-tag counts x 0.5 beside the embedding, as cpu (the same grid on the quick preset's training pairs,
    # validation only: benchmarks/prism_start_gap.py --part roles_quick)
    "quick": (DataPreset(n_train=2400, n_val=0, n_test=None, n_public=300),
              FedPrismConfig(n_experts=6, rounds=2, warmup_rounds=1, router_every=1, clients_per_round=2,
                             local_pairs=24, batch_size=12, router_epochs=3, eval_every=2, length_lr_scale=0.0,
                             router_role_scale=0.5, expert_lr=1e-2, **_STRUCTURE, **_START)),
    # every pair of the shared data (train 10.9k / val 4.3k / test 4.4k pairs); length_init = 'fedavg_lr' chosen on
    # the validation pairs (trainer.experts.tune), then n_experts = 6 (grid 3, 4, 5, 6, 8) by
    # benchmarks/prism_experts_settings.py, also on validation, then the head variant 'residual_lr1e-2' (feature path
    # frozen at the federated prior, LoRA + content head at lr 1e-2) by benchmarks/prism_residual_settings.py, on
    # validation (3 seeds); the pair features by benchmarks/pair_features_settings.py. Label-free
    # (length_prior='expert'): sdk.Selector.prefer(x, y_a, y_b) has no domain input ('domain' is opt-in, docs/prism.md)
    # ... and the router reads the prompts' role-tag counts beside the embedding (router_role_scale 0.5, chosen on the
    # validation pairs by benchmarks/prism_start_gap.py --part roles)
    "cpu": (DataPreset(), FedPrismConfig(n_experts=6, rounds=8, warmup_rounds=3, router_every=2, clients_per_round=4,
                                         local_pairs=40, eval_every=4, router_role_scale=0.5,
                                         length_lr_scale=0.0, expert_lr=1e-2, **{**_STRUCTURE, **_START})),
    "gpu": (DataPreset(n_train=12000, n_val=1500, n_test=3000, n_public=1500), FedPrismConfig.gpu_preset()),
}


def _sample(df: pd.DataFrame, n: int | None, seed: int) -> pd.DataFrame:
    """At most n rows (None: all), the same share from each domain (stratified), seeded."""
    if n is None or len(df) <= n:
        return df.reset_index(drop=True)
    per = {d: int(round(n * (df.domain == d).mean())) for d in df.domain.unique()}
    parts = [g.sample(min(per[d], len(g)), random_state=seed) for d, g in df.groupby("domain")]
    return pd.concat(parts).reset_index(drop=True)


@dataclass
class PreparedData:
    train: pd.DataFrame
    val: pd.DataFrame
    test: pd.DataFrame
    public_prompts: list[str]
    splits: dict[str, list[str]]
    store: object
    prompt_emb: np.ndarray
    public_emb: np.ndarray


def split_frames(data_dir: Path, preset: DataPreset, data_seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(train, val, test, public) pairs frames of :func:`prepare_data` (no embedding): the split by prompt, the
    public prompts (one row per prompt) and the preset's stratified subsamples."""
    pairs = load_preference_pairs(data_dir, seed=data_seed)
    train, val, test = split_by_prompt(pairs, (0.6, 0.2, 0.2), seed=data_seed)
    rng = np.random.default_rng(data_seed)
    ids = np.array(sorted(train.prompt_id.unique()))
    public_ids = set(rng.choice(ids, size=int(round(preset.public_fraction * len(ids))), replace=False).tolist())
    public = train[train.prompt_id.isin(public_ids)].drop_duplicates("prompt_id")
    public = public.sample(min(preset.n_public, len(public)), random_state=data_seed)
    train = train[~train.prompt_id.isin(public_ids)]
    train, val, test = (_sample(x, n, data_seed) for x, n in ((train, preset.n_train), (val, preset.n_val),
                                                              (test, preset.n_test)))
    return train, val, test, public


def prepare_data(data_dir: Path, preset: DataPreset, model, embedder_config=None, cache_dir: Path | None = None,
                 data_seed: int = 0, progress: bool = True) -> PreparedData:
    """Pairs, splits, public prompts, prompt embeddings and the segment store (module docstring)."""
    from trainer.experts.selector import build_segment_store  # trainer.experts.selector imports torch: on use only

    train, val, test, public = split_frames(data_dir, preset, data_seed)
    allp = pd.concat([train, val, test], ignore_index=True)
    config = embedder_config or EmbedderConfig()
    prompts = list(allp.prompt) + list(public.prompt)
    emb = embed_texts(prompts, config, cache_dir, show_progress=progress)
    store = build_segment_store(model, list(allp.prompt), list(allp.response_a), list(allp.response_b),
                                list(allp.label), show_progress=progress,
                                cache_dir=(cache_dir or default_cache_dir()) / "prism")
    splits = {"train": sorted(train.prompt_id.unique()), "public": sorted(public.prompt_id.unique()),
              "val": sorted(val.prompt_id.unique()), "test": sorted(test.prompt_id.unique())}
    return PreparedData(train, val, test, list(public.prompt), splits, store, emb[: len(allp)], emb[len(allp):])


def _federated(prep: PreparedData, preset: DataPreset, seed: int, eval_split: str) -> FederatedPairs:
    client = dirichlet_clients(prep.train, preset.n_clients, preset.alpha, seed=seed)
    clients = [np.flatnonzero(client == i) for i in range(preset.n_clients)]
    clients = [c for c in clients if len(c)]
    n_tr, n_va = len(prep.train), len(prep.val)
    eval_pairs = np.arange(n_tr, n_tr + n_va) if eval_split == "val" else np.arange(n_tr + n_va, n_tr + n_va + len(prep.test))
    domain = np.concatenate([prep.train.domain, prep.val.domain, prep.test.domain]).astype(str)
    generators = pd.concat([f[["domain", "source_a", "source_b"]] for f in (prep.train, prep.val, prep.test)],
                           ignore_index=True)
    prompts = [p for f in (prep.train, prep.val, prep.test) for p in f.prompt]
    return FederatedPairs(prep.store, prep.prompt_emb, domain, clients, prep.public_emb, eval_pairs, generators,
                          role_counts(prompts), role_counts(prep.public_prompts))


def _summary(values: list[float]) -> dict:
    v = np.asarray(values, dtype=np.float64)
    return {"acc_mean": float(v.mean()), "acc_std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "acc_per_seed": [float(x) for x in v]}


def run_experiment(prep: PreparedData, model, preset: DataPreset, base: FedPrismConfig, seeds, out: Path | None,
                   methods=ALL_METHODS, eval_split: str = "test", progress: bool = True) -> dict:
    """Train every method for every seed; return (and, with ``out``, write) the results.

    Raises
    ------
    InvalidInputError
        Unknown method, fewer than 1 seed, or a bad eval_split.
    """
    seeds = list(seeds)
    if not seeds:
        raise InvalidInputError("give at least one seed")
    if eval_split not in ("val", "test"):
        raise InvalidInputError(f"eval_split must be 'val' or 'test', got {eval_split!r}")
    if len(prep.val if eval_split == "val" else prep.test) == 0:
        raise InvalidInputError(f"no {eval_split} pairs in this preset (the quick preset has no validation pairs)")
    bad = [m for m in methods if m not in ALL_METHODS]
    if bad:
        raise InvalidInputError(f"unknown methods {bad}; valid: {', '.join(ALL_METHODS)}")
    start = time.time()
    acc: dict[str, dict[str, list[float]]] = {m: {} for m in methods}
    history: dict[str, dict[int, list]] = {m: {} for m in methods}
    bytes_per_round: dict[str, list[float]] = {m: [] for m in methods}
    util = {"max_share": [], "entropy": [], "share": []}
    dense, length_up, gammas, counts_up = [], [], [], []
    correct: dict[str, list[np.ndarray]] = {m: [] for m in methods}
    probas: dict[str, np.ndarray] = {}
    for seed in seeds:
        data = _federated(prep, preset, seed, eval_split)
        eval_df = (prep.val if eval_split == "val" else prep.test)
        for m in methods:
            if m in LENGTH_ONLY:
                tr = prep.train.iloc[np.concatenate(data.clients)]
                proba = LengthBaseline(**LENGTH_ONLY[m]).fit(tr).predict_proba(eval_df)
                y = eval_df.label.to_numpy()
                res = {"overall": pairwise_accuracy(proba, y)}
                for d in sorted(eval_df.domain.unique()):
                    sel = eval_df.domain.to_numpy() == d
                    res[d] = pairwise_accuracy(proba[sel], y[sel])
            else:
                cfg = replace(method_config(m, base), seed=seed)
                trainer = FedPrismTrainer(model, data, cfg, progress=progress).train()
                res = trainer.history_[-1]["accuracy"]
                proba = trainer.last_eval_["proba"]
                history[m][seed] = trainer.history_
                bytes_per_round[m].append(float(np.mean([h["downlink_bytes"] for h in trainer.history_])))
                if m == "fedprism_generator_prior":
                    gammas.append(trainer.generator_weights_.tolist())
                    counts_up.append(float(trainer.generator_upload_bytes_))
                if m == "fedprism":
                    share, mx, ent = expert_utilisation(trainer.last_eval_["assignment"], cfg.n_experts)
                    util["max_share"].append(mx)
                    util["entropy"].append(ent)
                    util["share"].append(share.tolist())
                    one = state_bytes(trainer.experts_[0])
                    router = state_bytes(trainer.router_.state())
                    dense.append(float(cfg.clients_per_round * (cfg.n_experts * one + router)))
                    length_up.append(float(trainer.length_init_upload_bytes_))
                if m in SAVED_METHODS and seed == seeds[0] and out is not None:
                    # Phase III (trainer.experts.phase3) compares FedPrism's routed experts with FedBis's selector;
                    # staged beside the folder and swapped in with the results (_publish_saved)
                    staged = _staging(out, m)
                    shutil.rmtree(staged, ignore_errors=True)
                    trainer.save(staged)
                    write_text(staged / "splits.json", json.dumps(prep.splits))
            for k, v in res.items():
                acc[m].setdefault(k, []).append(float(v))
            correct[m].append(pair_correct(proba, eval_df.label.to_numpy()))
            probas[f"{m}_seed{seed}"] = np.asarray(proba, dtype=np.float64)
    result = {
        "eval_split": eval_split,
        "methods": {m: {**_summary(acc[m]["overall"]),
                        "domains": {d: {k: v for k, v in _summary(acc[m][d]).items()} for d in DOMAINS if d in acc[m]}}
                    for m in methods},
        "seeds": seeds,
        "config": {"fedprism": base.to_dict(), "data": preset.__dict__},
        "data": {"n_train": len(prep.train), "n_val": len(prep.val), "n_test": len(prep.test),
                 "n_public": len(prep.public_prompts),
                 "train_domains": prep.train.domain.value_counts().to_dict(),
                 "test_domains": prep.test.domain.value_counts().to_dict()},
        "seconds": round(time.time() - start, 1),
        OWNER_KEY: "prism train",  # trainer.results_owner
    }
    if "length_only" in methods:
        result["paired_vs_length_only"] = {m: paired_gain(correct[m], correct["length_only"])
                                           for m in methods if m != "length_only"}
    if {"fedprism", "fedprism_generator_prior"} <= set(methods):
        # issue 29 item 3: the same FedPrism with and without the generator prior, side by side
        result["generator_prior"] = {
            "without": result["methods"]["fedprism"]["acc_mean"], "with": result["methods"]["fedprism_generator_prior"]["acc_mean"],
            "paired_with_vs_without": paired_gain(correct["fedprism_generator_prior"], correct["fedprism"]),
            "expert_weights_per_seed": gammas, "count_upload_bytes": float(np.mean(counts_up))}
    if "fedprism" in methods:
        result["utilisation"] = {"max_share": float(np.mean(util["max_share"])), "max_share_per_seed": util["max_share"],
                                 "entropy": float(np.mean(util["entropy"])), "share": util["share"]}
        result["bytes"] = {"downlink_per_round": float(np.mean(bytes_per_round["fedprism"])),
                           "dense_downlink_per_round": float(np.mean(dense)),
                           "length_init_upload_total": float(np.mean(length_up)),
                           "per_method": {m: float(np.mean(v)) for m, v in bytes_per_round.items() if v}}
    if out is not None:
        write_results(out, result, history)
        write_eval_proba(out / "eval_proba.npz", eval_df.pair_id.to_numpy().astype(str), probas)
        publish_saved_methods(out, methods)
    return result


def write_eval_proba(path: Path, pair_ids: np.ndarray, probas: dict[str, np.ndarray]) -> None:
    """``eval_proba.npz``: ``pair_id`` (n,) str and, per ``<method>_seed<s>``, P(A better) (n,) float64 on the
    evaluated pairs (for paired comparisons and post-hoc priors); atomic."""
    buf = io.BytesIO()
    np.savez_compressed(buf, pair_id=pair_ids, **probas)
    write_atomic(path, buf.getvalue())


def pair_correct(proba: np.ndarray, label: np.ndarray) -> np.ndarray:
    """Per-pair correctness of P(A better) against labels (1 = A better): 1, 0, or 1/2 for a tie at 0.5,
    as :func:`trainer.preference_metrics.pairwise_accuracy` counts it; ndarray (n,), float64."""
    return np.where(proba == 0.5, 0.5, ((proba > 0.5) == (label == 1)).astype(np.float64))


def paired_gain(correct: list[np.ndarray], base: list[np.ndarray]) -> dict:
    """Accuracy gain over a baseline on the same pairs, with its paired standard error.

    ``correct``, ``base`` : one per-pair correctness array (n,) per seed. The per-pair difference is averaged
    over the seeds first; ``se`` is the standard error of that mean over the n pairs (the pairs are the unit
    of sampling; seeds vary the training, not the test set).
    """
    d = np.mean(correct, axis=0) - np.mean(base, axis=0)
    return {"gain": float(d.mean()), "se": float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0,
            "n_pairs": int(len(d))}


def _staging(out: Path, method: str) -> Path:
    """Where ``<method>_seed0/`` is written during the run (hidden; a run killed midway leaves it, not a
    half-written ``<method>_seed0/`` beside an earlier run's results)."""
    return out / f".{method}_seed0.partial"


#: the methods whose seed-0 run is saved as ``<method>_seed0/`` (phase3 and ``fedroute export --selector`` read them)
SAVED_METHODS = ("fedprism", "fedprism_generator_prior", "fedbis")


def publish_saved_methods(out: Path, methods) -> None:
    """After ``results.json``: swap in ``<method>_seed0/`` of the :data:`SAVED_METHODS` that ran, and remove
    those an earlier run left in ``out`` when they did not (with ``utilisation_per_round.png`` when FedPrism
    did not run): ``prism train --methods fedprism`` over a full run kept the old ``fedbis_seed0/``, which
    ``prism label`` then compared with the new experts as if one run had trained both."""
    for m in SAVED_METHODS:
        if m in methods:
            _publish_saved(out, m)
        else:
            shutil.rmtree(out / f"{m}_seed0", ignore_errors=True)
    if "fedprism" not in methods:
        (out / "utilisation_per_round.png").unlink(missing_ok=True)


def _publish_saved(out: Path, method: str) -> None:
    """Replace ``<method>_seed0/`` by the complete staged folder: no file of an earlier run (e.g. its
    ``expert_5/`` when this run has fewer experts) survives next to these results."""
    replace_dir(_staging(out, method), out / f"{method}_seed0")


def markdown(result: dict) -> str:
    """The results table (accuracy mean +- std over seeds, overall and per domain)."""
    doms = [d for d in DOMAINS if any(d in r["domains"] for r in result["methods"].values())]
    lines = [f"Held-out pairwise accuracy ({result['eval_split']} pairs: {result['data']['n_test']} test, "
             f"{len(result['seeds'])} seeds; mean +- std over seeds)", "",
             "| method | overall | " + " | ".join(doms) + " | vs length_only (paired SE) |",
             "|---|---|" + "---|" * len(doms) + "---|"]
    for m, r in result["methods"].items():
        cells = [f"{r['acc_mean']:.3f} +- {r['acc_std']:.3f}"]
        cells += [f"{r['domains'][d]['acc_mean']:.3f} +- {r['domains'][d]['acc_std']:.3f}" if d in r["domains"] else "-"
                  for d in doms]
        gain = result.get("paired_vs_length_only", {}).get(m)
        cells.append("-" if gain is None else f"{gain['gain']:+.3f} +- {gain['se']:.3f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if "generator_prior" in result:
        g = result["generator_prior"]["paired_with_vs_without"]
        lines += ["", f"Generator prior (Bradley-Terry strengths from the clients' summed win counts): FedPrism "
                      f"{result['generator_prior']['without']:.4f} without, {result['generator_prior']['with']:.4f} with "
                      f"({g['gain']:+.4f} +- {g['se']:.4f} paired)."]
    if "utilisation" in result:
        u, b = result["utilisation"], result["bytes"]
        lines += ["", f"FedPrism expert utilisation (final round, test pairs): max share {u['max_share']:.3f} "
                      f"(per seed {', '.join(f'{x:.2f}' for x in u['max_share_per_seed'])}), normalised entropy "
                      f"{u['entropy']:.3f}.",
                  f"Downlink per round: {b['downlink_per_round'] / 1e6:.2f} MB with sparse retrieval vs "
                  f"{b['dense_downlink_per_round'] / 1e6:.2f} MB if every client downloaded all experts."]
    return "\n".join(lines) + "\n"


def write_results(out: Path, result: dict, history: dict) -> None:
    """results.json, results.md, history.json and the two PNGs (atomic writes)."""
    import matplotlib  # matplotlib: optional heavy dependency, imported on use

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: optional heavy dependency, imported on use


    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", result)
    write_text(out / "results.md", markdown(result))
    write_json(out / "history.json", {m: {str(s): h for s, h in hs.items()} for m, hs in history.items()})
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for m, hs in history.items():
        if not hs:
            continue
        rounds = [h["round"] for h in next(iter(hs.values())) if "accuracy" in h]
        vals = np.array([[h["accuracy"]["overall"] for h in run if "accuracy" in h] for run in hs.values()])
        ax.errorbar(rounds, vals.mean(0), yerr=vals.std(0), label=m, marker="o", capsize=3)
    for m, ls in (("length_only", "--"), ("length_only_global", ":"), ("structure_only", "-.")):
        if m in result["methods"]:
            ax.axhline(result["methods"][m]["acc_mean"], color="k", ls=ls, label=m)
    ax.set_xlabel("round")
    ax.set_ylabel(f"{result['eval_split']} pairwise accuracy")
    ax.set_title("Held-out accuracy per round (mean +- std over seeds)")
    ax.legend(fontsize=8)
    save_figure(fig, out / "accuracy_per_round.png")
    if history.get("fedprism"):
        runs = list(history["fedprism"].values())
        fig, axes = plt.subplots(1, len(runs), figsize=(4 * len(runs), 3.4), squeeze=False)
        for ax, (seed, run) in zip(axes[0], history["fedprism"].items()):
            share = np.array([h["utilisation"] for h in run])
            ax.stackplot([h["round"] for h in run], share.T, labels=[f"expert {k}" for k in range(share.shape[1])])
            ax.set_title(f"FedPrism seed {seed}")
            ax.set_xlabel("round")
            ax.set_ylim(0, 1)
        axes[0][0].set_ylabel("share of test pairs routed")
        axes[0][-1].legend(fontsize=7, loc="upper right")
        save_figure(fig, out / "utilisation_per_round.png")
