"""The predicted spend of a router as an exact step function of ``lam``, and its randomised inversion.

For one query with predictions ``A_m`` (accuracy) and ``C_m`` (USD) the decision ``argmax_m A_m -
lam * C_m`` (METRICS.md tie-break, :func:`sdk.utility.decide`) is piecewise constant in ``lam``: it
walks down the upper convex hull of the points ``(C_m, A_m)`` from the most accurate model to the
cheapest. From the decision ``m`` the next change happens at

    lam' = min_{j : C_j < C_m} (A_m - A_j) / (C_m - C_j)

and goes to the minimising ``j`` (ties: lower cost, then lower index, as the decision rule breaks
them). :func:`decision_steps` lists these breakpoints and the cost change at each, per query.

Over a sample of ``n`` queries, the mean predicted cost of the decisions, ``S(lam)``, is then a
non-increasing right-continuous step function with breakpoints ``B_0 < B_1 < ...`` (the union of
the queries' breakpoints) and levels ``L_0 = S(0) > L_1 > ...`` (:class:`SpendCurve`). A K-means
router gives few distinct breakpoints (every query of a Voronoi cell has the same ones), so a spend
target usually falls *between* two levels, where no deterministic ``lam`` meets it.

:meth:`SpendCurve.mix_for` meets it in expectation with a *randomised threshold policy*, the
optimal policy of a budget-constrained decision problem (a mix of the two deterministic policies
on either side of the constraint, as in Neyman-Pearson randomised tests; E. Altman, *Constrained
Markov Decision Processes*, 1999: one constraint needs at most one randomised choice): route at ``lam_low`` (step with level ``L_hi >= s``) with probability
``p_low = (s - L_lo) / (L_hi - L_lo)`` and at ``lam_high`` (the next step, level ``L_lo <= s``)
otherwise, so that ``p_low * L_hi + (1 - p_low) * L_lo = s``. ``lam_low`` and ``lam_high`` are
interior points (geometric midpoints) of their steps, so float rounding at a breakpoint cannot flip
a decision.

Pure functions, no I/O.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from sdk.arrays import real_array
from sdk.errors import InvalidInputError, ShapeError
from sdk.real_numbers import finite_float
from sdk.utility import check_lambda

#: Breakpoints closer than this relative distance are one breakpoint (float rounding of equal ratios).
MERGE_RTOL = 1e-9


@dataclass(frozen=True)
class DecisionSteps:
    """The decisions of ``n_queries`` queries as functions of ``lam``.

    Attributes
    ----------
    base_cost : ndarray of shape (n_queries,), float64, USD: predicted cost of the decision at ``lam = 0``.
    row : ndarray of shape (n_steps,), int64: the query each breakpoint belongs to.
    lam : ndarray of shape (n_steps,), float64, USD^-1, >= 0: where the query's decision changes
        (from that ``lam`` on, the cheaper model is chosen).
    delta_cost : ndarray of shape (n_steps,), float64, USD, < 0: change of the predicted cost there.
    """

    base_cost: np.ndarray
    row: np.ndarray
    lam: np.ndarray
    delta_cost: np.ndarray


def decision_steps(accuracy: np.ndarray, cost: np.ndarray) -> DecisionSteps:
    """Breakpoints in ``lam`` of each query's decision ``argmax_m A - lam * C`` (module docstring).

    Parameters
    ----------
    accuracy, cost : ndarray of shape (n_queries, n_models), float; cost in USD per query, >= 0.
        NaN in either means "no estimate": that model is never chosen (as in :func:`sdk.utility.decide`).

    Raises
    ------
    ShapeError
        Shapes differ or are not 2-D, inf values, or a negative cost.
    InvalidInputError
        A query has no model with an estimate.
    """
    a = real_array(accuracy, "accuracy")
    c = real_array(cost, "cost")
    if a.ndim != 2 or a.shape != c.shape:
        raise ShapeError(f"accuracy and cost must both have shape (n_queries, n_models), got {a.shape} and {c.shape}")
    if np.isinf(a).any() or np.isinf(c).any():
        raise ShapeError("accuracy and cost must not contain inf (use NaN for 'no estimate')")
    valid = ~(np.isnan(a) | np.isnan(c))
    if (c[valid] < 0).any():
        raise ShapeError("predicted costs must be >= 0 USD")
    if a.shape[0] and (~valid.any(axis=1)).any():
        row = int(np.flatnonzero(~valid.any(axis=1))[0])
        raise InvalidInputError(f"query {row} has no model with an estimate (all predictions NaN)")
    return _decision_steps_unchecked(a, c, valid)


def _decision_steps_unchecked(a: np.ndarray, c: np.ndarray, valid: np.ndarray) -> DecisionSteps:
    """Kernel of :func:`decision_steps`; validates nothing."""
    n, n_models = a.shape
    rows = np.arange(n)
    index = np.broadcast_to(np.arange(n_models), a.shape)
    # lam = 0: highest accuracy, ties to the lower cost, then the lower index.
    neg_a = np.where(valid, -a, np.inf)
    cur = np.lexsort((index, np.where(valid, c, np.inf), neg_a), axis=-1)[:, 0] if n else np.zeros(0, np.int64)
    base = c[rows, cur]
    prev = np.zeros(n)
    out_row, out_lam, out_delta = [], [], []
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
    cat = (lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype))
    return DecisionSteps(base.astype(np.float64), cat(out_row, np.int64), cat(out_lam, np.float64),
                         cat(out_delta, np.float64))


def row_steps(accuracy: np.ndarray, cost: np.ndarray) -> tuple[float, list[float], list[float]]:
    """:func:`decision_steps` of one query, in plain Python (a few microseconds for a dozen models).

    Parameters
    ----------
    accuracy, cost : ndarray of shape (n_models,), float; NaN = no estimate. Not validated
        (:func:`decision_steps` validates); at least one model must have both estimates.

    Returns
    -------
    (base_cost, lams, delta_costs): the predicted cost at ``lam = 0`` (USD), and the breakpoints
    (USD^-1, increasing) with the cost change at each (USD, < 0), as lists.
    """
    models = [(float(a), float(c), j) for j, (a, c) in enumerate(zip(accuracy.tolist(), cost.tolist()))
              if a == a and c == c]  # a == a: not NaN
    cur = min(models, key=lambda m: (-m[0], m[1], m[2]))
    base = cur[1]
    lams: list[float] = []
    deltas: list[float] = []
    prev = 0.0
    while True:
        best = None
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
    """A randomised threshold policy: route at ``lam_low`` with probability ``p_low``, else at ``lam_high``.

    Attributes
    ----------
    lam_low, lam_high : float, USD^-1, ``0 <= lam_low <= lam_high``.
    p_low : float in [0, 1].
    expected_cost : float, USD per query: ``p_low * S(lam_low) + (1 - p_low) * S(lam_high)`` on the sample.
    reachable : bool, False when the target is below ``S`` of the cheapest decisions (then
        ``lam_high`` routes every sample query to its cheapest model and ``p_low = 0``).
    """

    lam_low: float
    lam_high: float
    p_low: float
    expected_cost: float
    reachable: bool


@dataclass(frozen=True)
class SpendCurve:
    """Mean predicted cost ``S(lam)`` of a sample's decisions, a non-increasing step function.

    Attributes
    ----------
    breakpoints : ndarray of shape (n_breaks,), float64, USD^-1, strictly increasing.
    levels : ndarray of shape (n_breaks + 1,), float64, USD per query: ``levels[0] = S(0)`` and
        ``levels[i + 1] = S(lam)`` for ``breakpoints[i] <= lam < breakpoints[i + 1]``.
    """

    breakpoints: np.ndarray
    levels: np.ndarray

    @classmethod
    def from_steps(cls, steps: DecisionSteps) -> SpendCurve:
        """The curve of the queries in ``steps`` (breakpoints within :data:`MERGE_RTOL` merged).

        Raises
        ------
        InvalidInputError
            ``steps`` holds no query.
        """
        return cls.from_arrays(steps.base_cost, steps.lam, steps.delta_cost)

    @classmethod
    def from_arrays(cls, base_cost: np.ndarray, lam: np.ndarray, delta_cost: np.ndarray) -> SpendCurve:
        """The curve of ``n`` queries given as arrays (as in :class:`DecisionSteps`, without ``row``).

        Parameters
        ----------
        base_cost : ndarray of shape (n,), float64, USD.
        lam, delta_cost : ndarrays of one shape, float64; entries with ``lam = inf`` are padding
            and ignored (so a (n, n_models - 1) table of steps padded with inf can be passed as it is).

        Raises
        ------
        InvalidInputError
            No query (``n = 0``).
        ShapeError
            An argument that is not an array of real numbers, ``base_cost`` not 1-D, ``lam`` and
            ``delta_cost`` of different shapes, a NaN ``lam``, or a NaN/inf cost (padding aside).
        """
        base_cost = real_array(base_cost, "base_cost")
        lam, delta = real_array(lam, "lam"), real_array(delta_cost, "delta_cost")
        if base_cost.ndim != 1:
            raise ShapeError(f"base_cost must be 1-D (one cost per query), got shape {base_cost.shape}")
        if lam.shape != delta.shape:
            raise ShapeError(f"lam and delta_cost must have one shape, got {lam.shape} and {delta.shape}")
        n = base_cost.shape[0]
        if n == 0:
            raise InvalidInputError("a spend curve needs at least one query")
        lam, delta = np.ravel(lam), np.ravel(delta)
        if np.isnan(lam).any():
            raise ShapeError("lam holds NaN (padding is lam = inf)")
        keep = np.isfinite(lam)
        if not (np.isfinite(base_cost).all() and np.isfinite(delta[keep]).all()):
            raise ShapeError("base_cost and delta_cost must be finite (USD), padding aside")
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
        """``S(lam)``, USD per query.

        Parameters
        ----------
        lam : real number, USD^-1, finite and >= 0 (:func:`sdk.utility.check_lambda`).

        Raises
        ------
        InvalidLambdaError
            ``lam`` is not a real number (bools and strings included), is NaN or inf, or is negative.
        """
        lam = check_lambda(lam)
        return float(self.levels[np.searchsorted(self.breakpoints, lam, side="right")])

    def step_lam(self, i: int) -> float:
        """An interior ``lam`` (USD^-1) of step ``i`` (level ``levels[i]``): 0 for step 0, the geometric
        mean of its two breakpoints, or twice the last breakpoint for the last step.

        Parameters
        ----------
        i : int, ``0 <= i <= breakpoints.size`` (``len(levels) - 1``); numpy integers too, not bools.

        Raises
        ------
        InvalidInputError
            ``i`` is not an integer or is out of that range (a negative ``i`` is not counted from the end).
        """
        last = self.breakpoints.size
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, numbers.Integral) or not 0 <= i <= last:
            raise InvalidInputError(f"i must be a step index, an int in [0, {last}] (len(levels) - 1), "
                                    f"got {type(i).__name__} {i!r}")
        return self._step_lam(int(i))

    def _step_lam(self, i: int) -> float:
        """:meth:`step_lam` without the check of ``i``."""
        if i == 0:
            return 0.0
        lo = float(self.breakpoints[i - 1])
        if i == self.breakpoints.size:
            return 2.0 * lo if lo > 0 else 1.0
        hi = float(self.breakpoints[i])
        return math.sqrt(lo * hi) if lo > 0 else 0.5 * hi

    def mix_for(self, target: float) -> Mix:
        """The randomised threshold policy whose expected spend on the sample equals ``target``.

        ``target >= S(0)``: ``lam = 0`` (nothing to save). ``target`` below the last level: the
        cheapest decisions (``reachable=False``). Otherwise the first step ``k`` with level ``<=
        target`` and the one before it, mixed as the module docstring says.

        Parameters
        ----------
        target : real number, USD per query, finite and >= 0.

        Raises
        ------
        InvalidInputError
            ``target`` is not a real number (bools and strings included), is NaN or inf, or is negative.
        """
        value = finite_float(target)
        if value is None or value < 0:
            raise InvalidInputError(f"target must be a finite spend >= 0 USD per query (a real number), got "
                                    f"{type(target).__name__} {target!r}")
        target = value
        levels = self.levels
        if target >= levels[0]:
            return Mix(0.0, 0.0, 0.0, float(levels[0]), True)
        if target < levels[-1]:
            lam = self._step_lam(levels.size - 1)
            return Mix(lam, lam, 0.0, float(levels[-1]), False)
        k = int(np.argmax(levels <= target))  # first step at or under the target; k >= 1
        high, low = float(levels[k - 1]), float(levels[k])
        p_low = (target - low) / (high - low) if high > low else 0.0
        return Mix(self._step_lam(k - 1), self._step_lam(k), float(min(max(p_low, 0.0), 1.0)), float(target), True)
