"""Preference metrics of ``shared/METRICS.md`` (section "Preferences"), one function per metric."""

from __future__ import annotations

import numpy as np

from sdk.errors import ShapeError


def pairwise_accuracy(proba_a: np.ndarray, label: np.ndarray) -> float:
    """Pairwise ranking accuracy: share of pairs whose preferred response scores higher; a tie counts 0.5.

    Parameters
    ----------
    proba_a : ndarray of shape (n_pairs,), float, P(response_a better) (or any score of A minus B
        centred at 0.5: only the side of 0.5 matters).
    label : ndarray of shape (n_pairs,), int, 1 = response_a preferred, 0 = response_b preferred.

    Returns
    -------
    float in [0, 1].

    Raises
    ------
    ShapeError
        Shapes differ, no pairs, non-finite scores, or labels outside {0, 1}.
    """
    p = np.asarray(proba_a, dtype=np.float64)
    y = np.asarray(label)
    if p.ndim != 1 or p.shape != y.shape or p.size == 0:
        raise ShapeError(f"proba_a {p.shape} and label {y.shape} must be equal non-empty 1-D shapes")
    if not np.isfinite(p).all():
        raise ShapeError("proba_a holds NaN or inf")
    if not np.isin(y, (0, 1)).all():
        raise ShapeError(f"label must hold only 0 and 1, got {np.unique(y)[:5]}")
    correct = np.where(p == 0.5, 0.5, ((p > 0.5) == (y == 1)).astype(np.float64))
    return float(correct.mean())


def expert_utilisation(assignment: np.ndarray, n_experts: int) -> tuple[np.ndarray, float, float]:
    """Share of samples routed to each expert, its maximum and its normalised entropy.

    Parameters
    ----------
    assignment : ndarray of shape (n_samples,), int, expert index in [0, n_experts).
    n_experts : int >= 1.

    Returns
    -------
    (share, max_share, entropy): share of shape (n_experts,) float64 summing to 1; entropy =
    ``-sum s log s / log n_experts`` in [0, 1] (1.0 when n_experts == 1).

    Raises
    ------
    ShapeError
        Empty assignment or an index out of range.
    """
    a = np.asarray(assignment)
    if a.ndim != 1 or a.size == 0 or (a < 0).any() or (a >= n_experts).any():
        raise ShapeError(f"assignment must be a non-empty 1-D array of ints in [0, {n_experts})")
    share = np.bincount(a, minlength=n_experts) / a.size
    nz = share[share > 0]
    entropy = float(-(nz * np.log(nz)).sum() / np.log(n_experts)) if n_experts > 1 else 1.0
    return share, float(share.max()), entropy
