"""FedPrism Phase III: routed experts label candidate pairs -> a synthetic preference set for DPO.

Paper 000, §3.3 "Phase III: LLM Fine-tuning with RLHF", step 1 (synthetic preference dataset
construction): for each public prompt ``x`` with two candidate responses ``(y1, y2)``, the global router
picks ``k* = argmax_k R(h_x)_k``, expert ``E_k*`` scores the pair in **both orders**, and the response
with the higher probability is the winner. Step 2 (DPO on the resulting set) is
:mod:`trainer.alignment.dpo`.

Here the public prompts are **held-out AlpacaEval instructions** (prompts of the test split: no client
holds them) and the candidates are **two generators' outputs** for the same instruction (model-vs-model
pairs, no reference pairs). AlpacaEval's judge (weighted GPT-4-turbo annotator) also ranked those two
outputs, so every synthetic label can be checked: **agreement** = share of pairs where the labeller's
winner is the judge's winner (METRICS.md pairwise ranking accuracy; P = 0.5 counts 0.5). The table
compares FedPrism's routed experts with FedBis's single global selector, the length-only baseline
(:class:`trainer.length_baseline.LengthBaseline`, fitted on the training pairs) and "always the
first response" (0.5 by construction: sides are balanced by the loader).

The synthetic set (:func:`synthetic_preferences`) has one row per pair: ``prompt``, ``chosen``,
``rejected`` (what DPO reads), ``p_chosen`` (the labeller's probability for its winner, >= 0.5),
``expert`` (routed expert index, -1 for a single selector), ``judge_agrees`` (bool), ``pair_id``,
``prompt_id``, ``subset``. Written as JSON lines and parquet (:func:`write_preference_set`, atomic).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from sdk.errors import InvalidInputError, ShapeError
from trainer.data.preferences import ALPACA_REFERENCE, PAIR_COLUMNS
from trainer.preference_metrics import pairwise_accuracy

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
    """Write ``rows`` as ``<stem>.jsonl`` and ``<stem>.parquet`` in ``out_dir`` (each atomically).

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
    tmp = jsonl.with_name(jsonl.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, jsonl)
    tmp = parquet.with_name(parquet.name + ".tmp")
    rows[list(SYNTHETIC_COLUMNS)].to_parquet(tmp, index=False)
    os.replace(tmp, parquet)
    return jsonl, parquet
