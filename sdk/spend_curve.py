"""The predicted spend of a router as an exact step function of ``lam``, and its randomised inversion.

One query's decision ``argmax_m A_m - lam * C_m`` (:func:`sdk.utility.decide`) walks down the upper
convex hull of ``(C_m, A_m)`` as ``lam`` grows; from decision ``m`` the next change is at
``lam' = min_{j : C_j < C_m} (A_m - A_j) / (C_m - C_j)`` (ties: lower cost, then lower index). Over a
sample, the mean predicted cost ``S(lam)`` is a non-increasing step function (:class:`SpendCurve`), and
a target between two levels is met in expectation by a randomised threshold policy (:meth:`SpendCurve.mix_for`:
``lam_low`` with probability ``p_low = (s - L_lo) / (L_hi - L_lo)``, else ``lam_high``), the optimal
policy under one constraint (E. Altman, *Constrained Markov Decision Processes*, 1999). docs/budgets.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from sdk.arrays import real_array
from sdk.errors import InvalidInputError, ShapeError
from sdk.utility import check_lambda

#: Breakpoints closer than this relative distance are one breakpoint (float rounding of equal ratios).
MERGE_RTOL = 1e-9
_F64 = npt.NDArray[np.float64]
_T = TypeVar("_T", bound=np.generic)


@dataclass(frozen=True)
class DecisionSteps:
    """The decisions of ``n_queries`` queries as functions of ``lam``: ``base_cost`` (n_queries,) USD at
    ``lam = 0``; per breakpoint (n_steps,): its query ``row`` (int64), ``lam`` (USD^-1, from there on the
    cheaper model is chosen) and ``delta_cost`` (USD, < 0)."""

    base_cost: _F64
    row: npt.NDArray[np.int64]
    lam: _F64
    delta_cost: _F64


def decision_steps(accuracy: npt.ArrayLike, cost: npt.ArrayLike) -> DecisionSteps:
    """Breakpoints in ``lam`` of each query's decision ``argmax_m A - lam * C`` (module docstring).
    ``accuracy``, ``cost``: (n_queries, n_models), cost USD per query >= 0, NaN = no estimate.

    Raises
    ------
    ShapeError
        Shapes differ or are not 2-D, inf values, or a negative cost.
    InvalidInputError
        A query has no model with an estimate.
    """
    a = real_array(accuracy, "accuracy")
    c = real_array(cost, "cost")
    if a.ndim != 2 or a.shape != c.shape or np.isinf(a).any() or np.isinf(c).any() \
            or (c[~(np.isnan(a) | np.isnan(c))] < 0).any():
        raise ShapeError(f"accuracy and cost must both have shape (n_queries, n_models) without inf (use NaN for "
                         f"'no estimate'), and predicted costs must be >= 0 USD, got shapes {a.shape} and {c.shape}")
    valid = ~(np.isnan(a) | np.isnan(c))
    if a.shape[0] and (~valid.any(axis=1)).any():
        row = int(np.flatnonzero(~valid.any(axis=1))[0])
        raise InvalidInputError(f"query {row} has no model with an estimate (all predictions NaN)")
    return _decision_steps_unchecked(a, c, valid)


def _decision_steps_unchecked(a: _F64, c: _F64, valid: npt.NDArray[np.bool_]) -> DecisionSteps:
    """Inputs validated by the caller."""
    n, n_models = a.shape
    rows = np.arange(n)
    index = np.broadcast_to(np.arange(n_models), a.shape)
    # lam = 0: highest accuracy, ties to the lower cost, then the lower index.
    neg_a = np.where(valid, -a, np.inf)
    cur = np.lexsort((index, np.where(valid, c, np.inf), neg_a), axis=-1)[:, 0] if n else np.zeros(0, np.int64)
    base = c[rows, cur]
    prev = np.zeros(n)
    out_row: list[npt.NDArray[np.int64]] = []
    out_lam: list[_F64] = []
    out_delta: list[_F64] = []
    active = np.ones(n, dtype=bool)
    for _ in range(n_models):
        if not active.any():
            break
        ac, cc = a[rows, cur], c[rows, cur]
        cheaper = valid & (c < cc[:, None]) & active[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(cheaper, (ac[:, None] - a) / (cc[:, None] - c), np.inf)
        best = ratio.min(axis=1)
        active = np.isfinite(best)
        if not active.any():
            break
        # Among the models reaching the smallest ratio, the cheapest wins (then the lower index).
        tied = ratio == best[:, None]
        nxt = np.lexsort((index, np.where(tied, c, np.inf)), axis=-1)[:, 0]
        lam = np.maximum(best, prev)  # >= the previous breakpoint up to rounding
        hit = np.flatnonzero(active)
        out_row.append(hit)
        out_lam.append(lam[hit])
        out_delta.append(c[hit, nxt[hit]] - cc[hit])
        prev = np.where(active, lam, prev)
        cur = np.where(active, nxt, cur)
    return DecisionSteps(base.astype(np.float64), _cat(out_row, np.int64), _cat(out_lam, np.float64),
                         _cat(out_delta, np.float64))


def _cat(parts: Sequence[npt.NDArray[Any]], dtype: type[_T]) -> npt.NDArray[_T]:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def row_steps(accuracy: _F64, cost: _F64) -> tuple[float, list[float], list[float]]:
    """:func:`decision_steps` of one query (shape (n_models,), NaN = no estimate, at least one model with
    both; inputs validated by the caller) in plain Python: base cost (USD), breakpoints (USD^-1) and cost
    changes (USD) as lists."""
    models = [(float(a), float(c), j) for j, (a, c) in enumerate(zip(accuracy.tolist(), cost.tolist()))
              if a == a and c == c]  # a == a: not NaN
    cur = min(models, key=lambda m: (-m[0], m[1], m[2]))
    base = cur[1]
    lams: list[float] = []
    deltas: list[float] = []
    prev = 0.0
    while True:
        best: tuple[tuple[float, float, int], tuple[float, float, int]] | None = None
        for m in models:
            if m[1] < cur[1]:
                key = ((cur[0] - m[0]) / (cur[1] - m[1]), m[1], m[2])
                if best is None or key < best[0]:
                    best = (key, m)
        if best is None:
            return base, lams, deltas
        prev = max(best[0][0], prev)
        lams.append(prev)
        deltas.append(best[1][1] - cur[1])
        cur = best[1]


@dataclass(frozen=True)
class Mix:
    """Route at ``lam_low`` with probability ``p_low``, else at ``lam_high`` (USD^-1); ``expected_cost`` USD per
    query on the sample; ``reachable`` False when the target is below the cheapest decisions' spend."""

    lam_low: float
    lam_high: float
    p_low: float
    expected_cost: float
    reachable: bool


@dataclass(frozen=True)
class SpendCurve:
    """Mean predicted cost ``S(lam)`` of a sample's decisions: ``breakpoints`` (n_breaks,) USD^-1 increasing,
    ``levels`` (n_breaks + 1,) USD per query, ``levels[i + 1] = S(lam)`` from ``breakpoints[i]`` on."""

    breakpoints: _F64
    levels: _F64

    @classmethod
    def from_steps(cls, steps: DecisionSteps) -> SpendCurve:
        """The curve of the queries (at least one) in ``steps``, breakpoints within :data:`MERGE_RTOL` merged."""
        return cls.from_arrays(steps.base_cost, steps.lam, steps.delta_cost)

    @classmethod
    def from_arrays(cls, base_cost: _F64, lam: _F64, delta_cost: _F64) -> SpendCurve:
        """The curve of ``n >= 1`` queries: ``base_cost`` (n,) USD; ``lam``, ``delta_cost`` of one shape, entries
        with ``lam = inf`` padding (a (n, n_models - 1) table padded with inf as it is). Inputs validated by
        the caller."""
        n = base_cost.shape[0]
        lam, delta = np.ravel(lam), np.ravel(delta_cost)
        keep = np.isfinite(lam)
        lam, delta = lam[keep], delta[keep]
        order = np.argsort(lam, kind="stable")
        lam, delta = lam[order], delta[order]
        base = float(base_cost.mean())
        if lam.size == 0:
            return cls(np.zeros(0), np.array([base]))
        new_group = np.ones(lam.size, dtype=bool)
        new_group[1:] = lam[1:] > lam[:-1] * (1.0 + MERGE_RTOL)
        group = np.cumsum(new_group) - 1
        breaks = lam[new_group]
        jump = np.bincount(group, weights=delta, minlength=breaks.size) / n
        return cls(breaks, base + np.concatenate([[0.0], np.cumsum(jump)]))

    def spend_at(self, lam: float) -> float:
        """``S(lam)``, USD per query; raises :class:`InvalidLambdaError` unless ``lam`` is finite >= 0."""
        return float(self.levels[np.searchsorted(self.breakpoints, check_lambda(lam), side="right")])

    def step_lam(self, i: int) -> float:
        """An interior ``lam`` (USD^-1) of step ``i`` in ``[0, breakpoints.size]``: 0 for step 0, the geometric
        mean of its two breakpoints, or twice the last breakpoint for the last step."""
        if i == 0:
            return 0.0
        lo = float(self.breakpoints[i - 1])
        if i == self.breakpoints.size:
            return 2.0 * lo if lo > 0 else 1.0
        hi = float(self.breakpoints[i])
        return math.sqrt(lo * hi) if lo > 0 else 0.5 * hi

    def mix_for(self, target: float) -> Mix:
        """The randomised threshold policy whose expected spend on the sample is ``target`` (USD per query,
        finite >= 0): ``lam = 0`` at or above ``S(0)``, the cheapest decisions (``reachable=False``) below the
        last level, else the first step at or under ``target`` mixed with the one before it."""
        levels = self.levels
        if target >= levels[0]:
            return Mix(0.0, 0.0, 0.0, float(levels[0]), True)
        if target < levels[-1]:
            lam = self.step_lam(levels.size - 1)
            return Mix(lam, lam, 0.0, float(levels[-1]), False)
        k = int(np.argmax(levels <= target))  # first step at or under the target; k >= 1
        high, low = float(levels[k - 1]), float(levels[k])
        p_low = (target - low) / (high - low) if high > low else 0.0
        return Mix(self.step_lam(k - 1), self.step_lam(k), float(min(max(p_low, 0.0), 1.0)), float(target), True)
