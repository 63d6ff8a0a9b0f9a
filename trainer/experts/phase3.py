"""FedPrism Phase III: routed experts label candidate pairs -> a synthetic preference set for DPO.

Design notes: docs/prism.md (Module notes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from sdk.atomic_write import commit_file, temporary_path, write_atomic
from sdk.errors import InvalidInputError, ShapeError
from trainer.data.preferences import ALPACA_REFERENCE, PAIR_COLUMNS
from trainer.preference_metrics import pairwise_accuracy
from trainer.experts.length_init import saved_length_prior
from sdk.routed_selector import role_counts
from trainer.embeddings import EmbedderConfig, embed_texts
from trainer.report import save_figure, write_json, write_text

SYNTHETIC_COLUMNS = ("prompt", "chosen", "rejected", "p_chosen", "expert", "judge_agrees", "pair_id",
                     "prompt_id", "subset")


def heldout_alpaca_pairs(test_pairs: pd.DataFrame) -> pd.DataFrame:
    """The model-vs-model AlpacaEval pairs of a held-out (test) pairs frame.

    Parameters
    ----------
    test_pairs : pairs frame (:data:`trainer.data.preferences.PAIR_COLUMNS`) of prompts no client holds.

    Returns
    -------
    DataFrame, the rows with ``domain == 'alpacaeval'`` whose two sources are generators (neither is the
    reference ``gpt4_1106_preview``), index reset.

    Raises
    ------
    InvalidInputError
        A needed column is missing or no such pair is left.
    """
    missing = [c for c in PAIR_COLUMNS if c not in test_pairs.columns]
    if missing:
        raise InvalidInputError(f"test_pairs lacks columns {missing}")
    keep = ((test_pairs["domain"] == "alpacaeval") & (test_pairs["source_a"] != ALPACA_REFERENCE)
            & (test_pairs["source_b"] != ALPACA_REFERENCE))
    out = test_pairs[keep].reset_index(drop=True)
    if out.empty:
        raise InvalidInputError("no held-out model-vs-model AlpacaEval pair in test_pairs")
    return out


def symmetric_proba(logit_ab: np.ndarray, logit_ba: np.ndarray) -> np.ndarray:
    """P(A better) from a binary selector's logits in both orders (paper 000 §3.3, Phase III):
    ``sigmoid((l_ab - l_ba) / 2)``, the same rule as ``PairSelector.pair_proba`` and ``sdk.Selector.prefer``.

    Parameters
    ----------
    logit_ab, logit_ba : ndarray of shape (n_pairs,), float: logit of "first better" for (A, B) and (B, A).

    Returns
    -------
    ndarray of shape (n_pairs,), float64, in [0, 1]; swapping the inputs gives ``1 - P``.

    Raises
    ------
    ShapeError
        Different shapes or non-finite logits.
    """
    a = np.asarray(logit_ab, dtype=np.float64)
    b = np.asarray(logit_ba, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ShapeError(f"logit_ab {a.shape} and logit_ba {b.shape} must be equal 1-D shapes")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ShapeError("logits hold NaN or inf")
    return 0.5 * (1.0 + np.tanh(0.25 * (a - b)))  # sigmoid((a - b) / 2) without overflow


def synthetic_preferences(pairs: pd.DataFrame, proba_a: np.ndarray, expert: np.ndarray | None = None) -> pd.DataFrame:
    """One synthetic preference row per pair: the labeller's winner is ``chosen``.

    Parameters
    ----------
    pairs : pairs frame with ``prompt``, ``response_a``, ``response_b``, ``label`` (judge: 1 = A), ``pair_id``,
        ``prompt_id``, ``subset``.
    proba_a : ndarray of shape (n_pairs,), float in [0, 1]: the labeller's P(response_a better).
        A pair at exactly 0.5 takes response_a as chosen (and counts 0.5 in agreement, not here).
    expert : ndarray of shape (n_pairs,), int, routed expert per pair, or None (-1: a single selector).

    Returns
    -------
    DataFrame with :data:`SYNTHETIC_COLUMNS`.

    Raises
    ------
    ShapeError
        Lengths differ, or probabilities outside [0, 1] / non-finite.
    """
    p = np.asarray(proba_a, dtype=np.float64)
    if p.shape != (len(pairs),):
        raise ShapeError(f"proba_a has shape {p.shape}, expected ({len(pairs)},)")
    if not np.isfinite(p).all() or (p < 0).any() or (p > 1).any():
        raise ShapeError("proba_a must hold finite probabilities in [0, 1]")
    e = np.full(len(pairs), -1, dtype=np.int64) if expert is None else np.asarray(expert, dtype=np.int64)
    if e.shape != p.shape:
        raise ShapeError(f"expert has shape {e.shape}, expected {p.shape}")
    a_wins = p >= 0.5
    resp_a, resp_b = pairs["response_a"].to_numpy(), pairs["response_b"].to_numpy()
    return pd.DataFrame({
        "prompt": pairs["prompt"].to_numpy(),
        "chosen": np.where(a_wins, resp_a, resp_b),
        "rejected": np.where(a_wins, resp_b, resp_a),
        "p_chosen": np.where(a_wins, p, 1.0 - p),
        "expert": e,
        "judge_agrees": a_wins == (pairs["label"].to_numpy() == 1),
        "pair_id": pairs["pair_id"].to_numpy(),
        "prompt_id": pairs["prompt_id"].to_numpy(),
        "subset": pairs["subset"].to_numpy(),
    }, columns=list(SYNTHETIC_COLUMNS))


def agreement_table(pairs: pd.DataFrame, labellers: Mapping[str, np.ndarray]) -> dict:
    """Agreement of each labeller with the held-out judge, overall and per AlpacaEval subset.

    Parameters
    ----------
    pairs : pairs frame with ``label`` and ``subset``.
    labellers : name -> ndarray of shape (n_pairs,), float, P(response_a better).

    Returns
    -------
    dict name -> {"overall": float, "per_subset": {subset: float}, "n_pairs": int}; agreement is
    :func:`trainer.preference_metrics.pairwise_accuracy` (a 0.5 counts 0.5).
    """
    label = pairs["label"].to_numpy()
    subsets = pairs["subset"].to_numpy()
    table = {}
    for name, proba in labellers.items():
        proba = np.asarray(proba, dtype=np.float64)
        table[name] = {
            "overall": pairwise_accuracy(proba, label),
            "per_subset": {s: pairwise_accuracy(proba[subsets == s], label[subsets == s])
                           for s in sorted(set(subsets))},
            "n_pairs": int(len(label)),
        }
    return table


def agreement_markdown(table: Mapping[str, Mapping]) -> str:
    """The agreement table as markdown: one row per labeller, columns overall + each subset.

    ``table`` maps name -> {"overall", "per_subset"} (one seed) or name -> {"overall_mean",
    "overall_std", "per_subset": {s: mean}} (several seeds)."""
    subsets = sorted({s for row in table.values() for s in row["per_subset"]})
    lines = ["| labeller | overall | " + " | ".join(subsets) + " |",
             "|---|---|" + "---|" * len(subsets)]
    for name, row in table.items():
        overall = (f"{row['overall_mean']:.3f} ± {row['overall_std']:.3f}" if "overall_mean" in row
                   else f"{row['overall']:.3f}")
        cells = " | ".join(f"{row['per_subset'].get(s, float('nan')):.3f}" for s in subsets)
        lines.append(f"| {name} | {overall} | {cells} |")
    return "\n".join(lines) + "\n"


def write_preference_set(rows: pd.DataFrame, out_dir: str | os.PathLike[str], stem: str = "synthetic_preferences"
                         ) -> tuple[Path, Path]:
    """Write ``rows`` as ``<stem>.jsonl`` and ``<stem>.parquet`` in ``out_dir`` (each atomically, with
    :mod:`sdk.atomic_write`: an interrupted write leaves the old file and no temporary file).

    Returns
    -------
    (jsonl path, parquet path)

    Raises
    ------
    InvalidInputError
        ``rows`` lacks a column of :data:`SYNTHETIC_COLUMNS`.
    """
    missing = [c for c in SYNTHETIC_COLUMNS if c not in rows.columns]
    if missing:
        raise InvalidInputError(f"rows lack columns {missing}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jsonl, parquet = out / f"{stem}.jsonl", out / f"{stem}.parquet"
    records = rows[list(SYNTHETIC_COLUMNS)].to_dict("records")
    text = "".join(json.dumps({k: (v.item() if isinstance(v, np.generic) else v) for k, v in r.items()}) + "\n"
                   for r in records)
    write_atomic(jsonl, text.encode("utf-8"))
    tmp = temporary_path(parquet)  # pandas writes the file itself: committed (or removed) by commit_file
    try:
        rows[list(SYNTHETIC_COLUMNS)].to_parquet(tmp, index=False)
    except BaseException:  # a Ctrl-C or a full disk mid-write left <stem>.parquet.tmp in the output
        tmp.unlink(missing_ok=True)
        raise
    commit_file(tmp, parquet)
    return jsonl, parquet


# ----------------------------------------------------------------------------- running Phase III


def load_saved_method(folder: str | os.PathLike[str]):
    """A saved FedPrism/FedBis run folder (layout in :mod:`trainer.experts.experiment`).

    Returns
    -------
    (model, experts, router, config, splits): the :class:`~trainer.experts.selector.PairSelector`
    (holding no particular expert), the list of expert states, the
    :class:`~trainer.experts.prompt_router.PromptRouter` (None for one expert), the FedPrismConfig as a
    dict, and ``splits.json`` as a dict.

    Raises
    ------
    InvalidInputError
        A missing, unreadable or corrupt file of the layout (the message names it).
    """
    from safetensors.numpy import load_file  # safetensors: optional heavy dependency, imported on use

    from trainer.experts.prompt_router import PromptRouter  # trainer.experts.prompt_router imports torch: on use only
    from trainer.experts.selector import PairSelector, load_selector_config  # trainer.experts.selector imports torch: on use only

    folder = Path(folder)
    for name in ("selector_config.json", "fedprism_config.json", "splits.json", "expert_0"):
        if not (folder / name).exists():
            raise InvalidInputError(f"{folder} lacks {name}: give a fedprism_seed0/ or fedbis_seed0/ folder "
                                    "written by `fedroute prism train`")
    config = _layout_json(folder / "fedprism_config.json")
    splits = _layout_json(folder / "splits.json")
    n_experts = config.get("n_experts")
    if type(n_experts) is not int or n_experts < 1:
        raise InvalidInputError(f"{folder / 'fedprism_config.json'}: n_experts should be an int >= 1, got {n_experts!r}; "
                                "rerun `fedroute prism train`")
    lacking = [k for k in ("train", "test") if not isinstance(splits.get(k), list)]
    if lacking:
        raise InvalidInputError(f"{folder / 'splits.json'}: no list of prompt ids under {lacking}; rerun `fedroute prism train`")
    model = PairSelector(load_selector_config(folder / "selector_config.json"))
    try:
        experts = [model.load_expert(folder / f"expert_{k}") for k in range(n_experts)]
        router = None
        if len(experts) > 1:
            state = load_file(str(folder / "router.safetensors"))
            router = PromptRouter(state["net.0.weight"].shape[1], len(experts), hidden=state["net.0.weight"].shape[0])
            router.load_state(state)
    except Exception as exc:  # noqa: BLE001 - missing files, safetensors/peft/shape errors: one clear message
        raise InvalidInputError(f"{folder}: cannot load its {n_experts} experts and router ({type(exc).__name__}: {exc}); "
                                "an interrupted `fedroute prism train`? rerun it") from exc
    return model, experts, router, config, splits


def _layout_json(path: Path) -> dict:
    """A JSON object file of a saved run; InvalidInputError naming the file when unreadable or not an object."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidInputError(f"{path}: unreadable ({type(exc).__name__}: {exc}); rerun `fedroute prism train`") from exc
    if not isinstance(obj, dict):
        raise InvalidInputError(f"{path}: expected a JSON object, got {type(obj).__name__}; rerun `fedroute prism train`")
    return obj


def routed_proba(model, experts, router, store, prompt_emb: np.ndarray | None,
                 prior: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """P(A better) of every pair of ``store`` by the routed expert (paper 000 §3.3): ``k* = argmax R(h_x)``,
    then ``E_k*``'s symmetric probability (``PairSelector.pair_proba``).

    Parameters
    ----------
    store : SegmentStore of the pairs.
    prompt_emb : ndarray of shape (n_pairs, d_emb), float32 (MiniLM prompt embeddings), or None when
        ``router`` is None (a single selector).
    prior : ndarray (3,) float32, the length prior of a ``length_prior='domain'`` run for the pairs'
        domain (:func:`saved_length_prior`), added to every expert's logit; None for none.

    Returns
    -------
    (proba, expert): ndarrays of shape (n_pairs,), float64 and int64.
    """
    import torch  # torch: optional heavy dependency, imported on use

    n = store.n_pairs
    assign = np.zeros(n, dtype=np.int64) if router is None else router.route(prompt_emb)
    proba = np.zeros(n, dtype=np.float64)
    model.train(False)
    with torch.no_grad():
        for k in np.unique(assign):
            model.load_expert_state(experts[k])
            idx = np.flatnonzero(assign == k)
            for s in range(0, len(idx), 128):
                ha, hb, f, _ = store.batch(model, idx[s:s + 128])
                pw = None if prior is None else torch.from_numpy(np.asarray(prior, np.float32)).expand(len(f), -1)
                proba[idx[s:s + 128]] = model.pair_proba(ha, hb, f, pw).double().numpy()
    return proba, assign


def _bootstrap_std(proba: np.ndarray, label: np.ndarray, groups: np.ndarray, n_boot: int, seed: int) -> float:
    """Std of the agreement over ``n_boot`` resamples of the prompts (pairs of one prompt move together)."""
    rng = np.random.default_rng(seed)
    uniq, inv = np.unique(groups, return_inverse=True)
    correct = np.where(proba == 0.5, 0.5, ((proba > 0.5) == (label == 1)).astype(np.float64))
    sums = np.bincount(inv, weights=correct, minlength=len(uniq))
    counts = np.bincount(inv, minlength=len(uniq))
    draws = rng.integers(0, len(uniq), size=(n_boot, len(uniq)))
    return float(np.std(sums[draws].sum(1) / counts[draws].sum(1), ddof=1))


def run_phase3(run_dir: str | os.PathLike[str], data_dir: str | os.PathLike[str], out: str | os.PathLike[str], *,
               max_pairs: int | None = 600, seed: int = 0, n_boot: int = 1000, cache_dir=None,
               progress: bool = True) -> dict:
    """Label held-out AlpacaEval pairs with a trained run's experts; write the agreement table and the
    synthetic preference set.

    Parameters
    ----------
    run_dir : the ``--out`` folder of ``fedroute prism train`` (holding ``fedprism_seed0/`` and, when the
        run saved it, ``fedbis_seed0/``).
    data_dir : the shared data folder.
    out : output folder: ``phase3.json``, ``phase3.md``, ``phase3_agreement.png``,
        ``synthetic_preferences.{jsonl,parquet}`` (FedPrism's labels).
    max_pairs : at most this many held-out pairs (a seeded sample of the test prompts' model-vs-model
        pairs), or None for all.
    n_boot : bootstrap resamples of the test prompts for the agreement's std.

    Returns
    -------
    dict, the content of ``phase3.json``.

    Raises
    ------
    InvalidInputError
        A run folder without ``fedprism_seed0/`` (or a method folder such as ``fedprism_seed0/`` itself).
    """
    from trainer.data.preferences import load_preference_pairs  # trainer.data.preferences imports pandas: on use only
    from trainer.experts.selector import build_segment_store  # trainer.experts.selector imports torch: on use only
    from trainer.length_baseline import LengthBaseline  # trainer.length_baseline imports pandas: on use only

    run_dir, out = Path(run_dir), Path(out)
    prism_dir = run_dir / "fedprism_seed0"
    if not prism_dir.is_dir():
        if (run_dir / "fedprism_config.json").is_file():  # the advice was to train again into the method folder
            raise InvalidInputError(f"{run_dir} is a method folder of a run ({run_dir.name}/), not the run: give "
                                    f"--run {run_dir.parent} (the --out of `fedroute prism train`)")
        raise InvalidInputError(f"{run_dir} has no fedprism_seed0/: run `fedroute prism train --out {run_dir}` first")
    model, experts, router, config, splits = load_saved_method(prism_dir)
    pairs = load_preference_pairs(data_dir, seed=int(config.get("data_seed", 0)))
    test = heldout_alpaca_pairs(pairs[pairs["prompt_id"].isin(set(splits["test"]))])
    if max_pairs is not None and len(test) > max_pairs:
        test = test.sample(max_pairs, random_state=seed).reset_index(drop=True)
    train = pairs[pairs["prompt_id"].isin(set(splits["train"]))]
    label = test["label"].to_numpy()

    store = build_segment_store(model, list(test.prompt), list(test.response_a), list(test.response_b),
                                list(label), show_progress=progress)
    emb = embed_texts(list(test.prompt), EmbedderConfig(), cache_dir, show_progress=progress)
    scale = float(config.get("router_role_scale", 0.0))
    if scale:  # the router's input of FedPrismConfig.router_role_scale: the role-tag counts beside the embedding
        emb = np.c_[emb, scale * role_counts(list(test.prompt))].astype(np.float32)
    labellers: dict[str, np.ndarray] = {}
    p_prism, expert = routed_proba(model, experts, router, store, emb, saved_length_prior(prism_dir, "alpacaeval"))
    labellers["fedprism"] = p_prism
    fedbis_dir = run_dir / "fedbis_seed0"
    if fedbis_dir.is_dir():
        bis_model, bis_experts, _, _, _ = load_saved_method(fedbis_dir)
        labellers["fedbis"], _ = routed_proba(bis_model, bis_experts, None, store, None,
                                              saved_length_prior(fedbis_dir, "alpacaeval"))
    labellers["length_only"] = LengthBaseline(per_domain=True).fit(train[train.domain == "alpacaeval"]).predict_proba(test)
    labellers["always_first"] = np.full(len(test), 0.5)

    table = agreement_table(test, labellers)
    groups = test["prompt_id"].to_numpy()
    for name, proba in labellers.items():
        table[name]["bootstrap_std"] = _bootstrap_std(np.asarray(proba), label, groups, n_boot, seed)
    share = np.bincount(expert, minlength=len(experts)) / len(expert)
    rows = synthetic_preferences(test, p_prism, expert)
    (out / "phase3.json").unlink(missing_ok=True)  # a kill before the new one is written leaves no stale table
    jsonl, parquet = write_preference_set(rows, out)
    result = {
        "n_pairs": int(len(test)), "n_prompts": int(len(set(groups))),
        "agreement": table, "expert_share": share.tolist(),
        "synthetic_set": {"jsonl": str(jsonl), "parquet": str(parquet), "n_rows": int(len(rows)),
                          "judge_agreement": float(rows["judge_agrees"].mean())},
        "fedbis_missing": "fedbis" not in labellers,
        "run_dir": str(run_dir),
        "metric": "agreement = pairwise ranking accuracy of the labeller's P(A better) against the AlpacaEval "
                  "judge's label (METRICS.md; 0.5 counts 0.5); bootstrap_std over test prompts",
    }
    write_json(out / "phase3.json", result)
    md = ["# FedPrism Phase III: agreement with the held-out AlpacaEval judge", "",
          f"{len(test)} model-vs-model pairs of {len(set(groups))} held-out instructions (test split of the run).", "",
          agreement_markdown(table), "",
          "| labeller | overall ± bootstrap std (prompts) |", "|---|---|"]
    md += [f"| {n} | {r['overall']:.3f} ± {r['bootstrap_std']:.3f} |" for n, r in table.items()]
    md += ["", f"Expert share (FedPrism routing of these prompts): {', '.join(f'{s:.2f}' for s in share)}", ""]
    write_text(out / "phase3.md", "\n".join(md))

    import matplotlib  # matplotlib: optional heavy dependency, imported on use

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: optional heavy dependency, imported on use

    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = list(table)
    ax.bar(names, [table[n]["overall"] for n in names], yerr=[table[n]["bootstrap_std"] for n in names],
           color=["C0" if n == "fedprism" else "C7" for n in names], capsize=4)
    ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    ax.set_ylim(0.3, 1.0)
    ax.set_ylabel("agreement with the judge")
    ax.set_title(f"Phase III labels on {len(test)} held-out AlpacaEval pairs", fontsize=9)
    save_figure(fig, out / "phase3_agreement.png")
    return result
