"""Bradley-Terry prior over generators, aggregated federatedly as win/loss counts (issue 29, item 3).

Design notes: docs/prism.md (Module notes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np
import pandas as pd

from sdk.errors import InvalidInputError

__all__ = ["NO_GENERATOR", "aggregate_win_counts", "apply_prior", "client_win_counts", "fit_bradley_terry",
           "generator_logit"]

#: Domains whose ``source_a`` / ``source_b`` are not generators (HH-RLHF: "chosen" / "rejected", the label).
NO_GENERATOR = ("hh_harmless",)


def client_win_counts(frame: pd.DataFrame) -> Counter:
    """One client's upload: ``Counter({(winner, loser): count})`` over its pairs with known generators.

    frame : pairs frame (``domain``, ``source_a``, ``source_b``, ``label``: 1 = A better).
    """
    keep = ~frame["domain"].isin(NO_GENERATOR).to_numpy() & (frame["source_a"] != frame["source_b"]).to_numpy()
    f = frame[keep]
    a_won = f["label"].to_numpy() == 1
    winners = np.where(a_won, f["source_a"], f["source_b"])
    losers = np.where(a_won, f["source_b"], f["source_a"])
    return Counter(zip(winners.tolist(), losers.tolist()))


def aggregate_win_counts(uploads: Iterable[Counter]) -> Counter:
    """Server side: the sum of the clients' counts (pure; equals the counts of the pooled pairs)."""
    total: Counter = Counter()
    for u in uploads:
        total.update(u)
    return total


def fit_bradley_terry(counts: Counter, C: float = 1.0) -> dict[str, float]:
    """Bradley-Terry strengths ``{generator: beta}`` (float, logit units) from win counts.

    L2-regularised MLE (inverse strength ``C``, scikit-learn ``LogisticRegression``, no intercept) on rows
    ``e_winner - e_loser`` (label 1) and their negation (label 0), each weighted by its count; the L2 term
    also centres the strengths (sum 0 up to the regularisation) and keeps a generator that never lost finite.

    Raises
    ------
    InvalidInputError
        No counts, a count <= 0, or ``C <= 0``.
    """
    from sklearn.linear_model import LogisticRegression  # sklearn: optional heavy dependency, imported on use

    if not counts or min(counts.values()) <= 0:
        raise InvalidInputError("fit_bradley_terry needs at least one positive win count")
    if not C > 0:
        raise InvalidInputError(f"C must be > 0, got {C!r}")
    names = sorted({g for pair in counts for g in pair})
    index = {g: i for i, g in enumerate(names)}
    x = np.zeros((2 * len(counts), len(names)))
    w = np.zeros(2 * len(counts))
    for r, ((g, h), n) in enumerate(counts.items()):
        x[2 * r, index[g]], x[2 * r, index[h]] = 1.0, -1.0
        x[2 * r + 1] = -x[2 * r]
        w[2 * r] = w[2 * r + 1] = n
    y = np.tile([1, 0], len(counts))
    coef = LogisticRegression(C=C, fit_intercept=False, max_iter=2000).fit(x, y, sample_weight=w).coef_[0]
    return {g: float(coef[index[g]]) for g in names}


def generator_logit(frame: pd.DataFrame, beta: dict[str, float]) -> np.ndarray:
    """``beta_gA - beta_gB`` per pair: ndarray (n,), float64; 0 where a generator is unknown (absent from
    ``beta``) or the domain has none (:data:`NO_GENERATOR`)."""
    known = ~frame["domain"].isin(NO_GENERATOR).to_numpy()
    ba = frame["source_a"].map(beta).to_numpy(dtype=np.float64)
    bb = frame["source_b"].map(beta).to_numpy(dtype=np.float64)
    out = ba - bb
    return np.where(known & np.isfinite(out), out, 0.0)


def apply_prior(proba: np.ndarray, prior_logit: np.ndarray, lam: float) -> np.ndarray:
    """``sigmoid(logit(proba) + lam * prior_logit)``: (n,) float64 (probabilities clipped to [1e-6, 1 - 1e-6])."""
    p = np.clip(np.asarray(proba, dtype=np.float64), 1e-6, 1 - 1e-6)
    return 1.0 / (1.0 + np.exp(-(np.log(p / (1 - p)) + lam * np.asarray(prior_logit, dtype=np.float64))))
