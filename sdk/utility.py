"""Utility and the routing decision rule (paper 002, Sec. "Overall framework"; METRICS.md step 2).

``U_lam(x, m) = A(x, m) - lam * C(x, m)`` with ``A`` the expected accuracy in [0, 1], ``C`` the expected
cost in USD per query and ``lam`` in USD^-1. The router picks ``argmax_m U``; ties go to the lower
predicted cost, then the lower model index. A NaN prediction means "no estimate": never chosen.
"""

from __future__ import annotations

import numbers

import numpy as np
import numpy.typing as npt

from sdk.arrays import real_array
from sdk.errors import InvalidInputError, InvalidLambdaError, ShapeError
from sdk.real_numbers import finite_float, is_real_number, shown

_Floats = npt.NDArray[np.float64]
_Ints = npt.NDArray[np.int64]


def check_lambda(lam: object) -> float:
    """``lam`` (USD^-1) as a float; InvalidLambdaError unless it is a finite real number >= 0 (bools refused)."""
    value = finite_float(lam)
    if value is None or value < 0:
        why = ("a real number" if not is_real_number(lam) else ">= 0 (0 = ignore cost)" if value is not None
               else "finite (an integer too large for a float)" if isinstance(lam, numbers.Rational) else "finite")
        raise InvalidLambdaError(f"lam must be {why}, in USD^-1, got {shown(lam)}")
    return value + 0.0  # -0.0 -> 0.0: the lam a Choice reports is never negative


def utility(accuracy: npt.ArrayLike, cost: npt.ArrayLike, lam: float) -> _Floats:
    """Utility ``A - lam * C`` (paper 002, Eq. for U_lambda).

    ``accuracy``, ``cost``: (n_queries, n_models) float, in [0, 1] and USD per query (NaN: no estimate);
    ``lam``: USD^-1, finite, >= 0. Returns (n_queries, n_models) float64, NaN where a prediction is NaN.
    Raises ShapeError (shapes differ, not 2-D, inf values) and InvalidLambdaError.
    """
    a, c = real_array(accuracy, "accuracy"), real_array(cost, "cost")
    if a.ndim != 2 or a.shape != c.shape or np.isinf(a).any() or np.isinf(c).any():
        raise ShapeError("accuracy and cost must both have shape (n_queries, n_models) without inf (NaN: no "
                         f"estimate); got accuracy {a.shape} and cost {c.shape}")
    return a - check_lambda(lam) * c  # NaN propagates on purpose


def decide(accuracy: npt.ArrayLike, cost: npt.ArrayLike, lam: float) -> _Ints:
    """Index of the chosen model per query, ``argmax_m A - lam * C`` with the METRICS.md tie-break.

    Takes :func:`utility`'s arguments; returns (n_queries,) int64 in ``[0, n_models)``. Raises what
    :func:`utility` raises, and InvalidInputError for a query with no estimate (every column NaN).
    """
    u = utility(accuracy, cost, lam)
    return _decide_unchecked(u, np.asarray(cost, dtype=np.float64))


def _decide_unchecked(u: _Floats, cost: _Floats) -> _Ints:
    """:func:`decide` on a precomputed utility (inputs validated by the caller, but for all-NaN rows)."""
    unknown = (np.isnan(u) | np.isnan(cost)).all(axis=1)
    if unknown.any():
        raise InvalidInputError(f"query {int(np.flatnonzero(unknown)[0])} has no model with an estimate "
                                "(all predictions NaN)")
    return _rank_unchecked(u, cost)[:, 0]


def _rank_unchecked(u: _Floats, cost: _Floats) -> _Ints:
    """(n_queries, n_models) model indices per query, best first by :func:`decide`'s rule, NaN last."""
    unknown = np.isnan(u) | np.isnan(cost)
    index = np.broadcast_to(np.arange(u.shape[1]), u.shape)
    # lexsort: the last key is primary -> (-u, cost, index) ascending along each row.
    return np.lexsort((index, np.where(unknown, np.inf, cost), np.where(unknown, np.inf, -u)), axis=-1).astype(np.int64)
