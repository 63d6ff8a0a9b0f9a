"""Privacy audit of MoR (paper 001, Sec. "Privacy Analysis", Table 5): a query-only threshold
membership-inference attack on reward margins, and the communication of a round.

Attack (METRICS.md): the server queries a client's reward model on a preference pair and sees the
margin ``m = R(x, y+) - R(x, y-)``; it guesses "member" (the pair was in the client's training set)
when ``m`` exceeds a threshold. Over all thresholds this is the ROC of the score ``m`` on members
(label 1) against as many non-members (label 0) from the same distribution; we report its AUC and
the TPR at 1 %, 5 % and 10 % FPR (:func:`membership_attack`). AUC 0.5 is a random guess.

Communication (:func:`communication_per_round`): router training uploads and downloads the router's
float32 parameters per participating client; a reward query sends the (prompt, response) text (UTF-8)
and returns one float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sdk.errors import InvalidInputError

FPR_LEVELS = (0.01, 0.05, 0.10)


@dataclass(frozen=True)
class AttackResult:
    """auc : ROC AUC of the margin as a membership score; auc_se : its standard error (:func:`auc_standard_error`);
    tpr_at_fpr : {0.01: tpr, 0.05: ..., 0.10: ...}; n_members, n_non_members : sample counts (equal by construction)."""

    auc: float
    tpr_at_fpr: dict
    n_members: int
    n_non_members: int
    auc_se: float = float("nan")

    def as_dict(self) -> dict:
        return {"auc": self.auc, "auc_se": self.auc_se,
                **{f"tpr_at_{int(round(f * 100))}pct_fpr": t for f, t in self.tpr_at_fpr.items()},
                "n_members": self.n_members, "n_non_members": self.n_non_members}


def auc_standard_error(auc: float, n_pos: int, n_neg: int) -> float:
    """Standard error of a ROC AUC from ``n_pos`` positives and ``n_neg`` negatives (Hanley & McNeil 1982,
    Radiology 143, Eq. 2): ``sqrt((A(1-A) + (n_pos-1)(Q1-A^2) + (n_neg-1)(Q2-A^2)) / (n_pos n_neg))`` with
    ``Q1 = A / (2 - A)``, ``Q2 = 2 A^2 / (1 + A)``. At A = 0.5 and 500 + 500 it is 0.0183.

    Raises InvalidInputError: a count below 1 or an AUC outside [0, 1]."""
    if n_pos < 1 or n_neg < 1 or not 0.0 <= auc <= 1.0:
        raise InvalidInputError(f"need n_pos, n_neg >= 1 and auc in [0, 1], got {n_pos}, {n_neg}, {auc}")
    q1, q2 = auc / (2.0 - auc), 2.0 * auc * auc / (1.0 + auc)
    var = (auc * (1 - auc) + (n_pos - 1) * (q1 - auc * auc) + (n_neg - 1) * (q2 - auc * auc)) / (n_pos * n_neg)
    return float(np.sqrt(max(var, 0.0)))


def tpr_at_fpr(labels: np.ndarray, scores: np.ndarray, fpr_levels: Sequence[float] = FPR_LEVELS) -> dict:
    """Highest TPR of a threshold on ``scores`` whose FPR is <= each level (sklearn ``roc_curve``)."""
    from sklearn.metrics import roc_curve  # sklearn: optional heavy dependency, imported on use

    fpr, tpr, _ = roc_curve(labels, scores)
    return {float(f): float(tpr[fpr <= f + 1e-12].max()) for f in fpr_levels}


def membership_attack(member_margins: np.ndarray, non_member_margins: np.ndarray, rng: np.random.Generator | None = None,
                      fpr_levels: Sequence[float] = FPR_LEVELS) -> AttackResult:
    """Threshold attack on reward margins with members : non-members = 1 : 1.

    Parameters
    ----------
    member_margins : (n_m,) float, ``R(x, y+) - R(x, y-)`` on training pairs.
    non_member_margins : (n_n,) float, the same on pairs the model never saw.
    rng : draws the larger group down to the smaller one's size (default seed 0).

    Returns AttackResult. Raises InvalidInputError: a group is empty or holds NaN/inf.
    """
    from sklearn.metrics import roc_auc_score  # sklearn: optional heavy dependency, imported on use

    mem = np.asarray(member_margins, dtype=np.float64).ravel()
    non = np.asarray(non_member_margins, dtype=np.float64).ravel()
    if mem.size == 0 or non.size == 0:
        raise InvalidInputError(f"need members and non-members, got {mem.size} and {non.size}")
    if not (np.isfinite(mem).all() and np.isfinite(non).all()):
        raise InvalidInputError("margins must be finite")
    rng = rng or np.random.default_rng(0)
    n = min(mem.size, non.size)
    mem = mem if mem.size == n else rng.choice(mem, n, replace=False)
    non = non if non.size == n else rng.choice(non, n, replace=False)
    labels = np.r_[np.ones(n), np.zeros(n)]
    scores = np.r_[mem, non]
    auc = float(roc_auc_score(labels, scores))
    return AttackResult(auc, tpr_at_fpr(labels, scores, fpr_levels), n, n, auc_standard_error(auc, n, n))


def communication_per_round(n_router_parameters: int, n_participants: int, query_prompts: Sequence[str],
                            query_responses: Sequence[str], bytes_per_value: int = 4) -> dict:
    """Bytes moved in one round.

    n_router_parameters : router parameter count; n_participants : clients in the round.
    query_prompts, query_responses : the reward queries of one round (sparse: one client per pair).

    Returns {"router_update_bytes": 2 * n_participants * n_params * 4 (download + upload),
    "reward_query_bytes": sum of UTF-8 bytes of prompt + response, "reward_answer_bytes": 4 per query,
    "n_queries": int}.
    """
    if n_router_parameters < 0 or n_participants < 0 or len(query_prompts) != len(query_responses):
        raise InvalidInputError("counts must be >= 0 and prompts and responses of equal length")
    q = sum(len(p.encode()) + len(r.encode()) for p, r in zip(query_prompts, query_responses))
    return {"router_update_bytes": int(2 * n_participants * n_router_parameters * bytes_per_value),
            "reward_query_bytes": int(q), "reward_answer_bytes": int(bytes_per_value * len(query_prompts)),
            "n_queries": len(query_prompts)}

