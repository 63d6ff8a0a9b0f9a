"""Utility and the routing decision rule (paper 002, Sec. "Overall framework"; METRICS.md step 2).

``U_lam(x, m) = A(x, m) - lam * C(x, m)`` with ``A`` the expected accuracy in [0, 1] and ``C`` the
expected cost in USD per query; ``lam`` is in USD^-1. The router picks ``argmax_m U``; ties go to
the model with the lower predicted cost, then to the lower model index.

A prediction of NaN (in ``accuracy`` or ``cost``) means "no estimate for this model" (e.g. a local
router that never observed it): such a model is never chosen.
"""

from __future__ import annotations

import numbers

import numpy as np

from sdk.arrays import real_array
from sdk.errors import InvalidInputError, InvalidLambdaError, ShapeError
from sdk.real_numbers import finite_float, is_real_number


def check_lambda(lam: object) -> float:
    """Validate the cost trade-off and return it as a float.

    Parameters
    ----------
    lam : real number, USD^-1, finite and >= 0.

    Raises
    ------
    InvalidLambdaError
        If ``lam`` is not a real number (bools included), is NaN or inf, or is negative.
    """
    if not is_real_number(lam):
        raise InvalidLambdaError(
            f"lam must be a real number in USD^-1, got {type(lam).__name__} {lam!r}"
        )
    value = finite_float(lam)
    if value is None:  # a rational (int, Fraction) is never NaN or inf: it is beyond the float range
        shown = "an integer too large for a float" if isinstance(lam, numbers.Rational) else repr(float(lam))
        raise InvalidLambdaError(f"lam must be finite, got {shown}")
    if value < 0:
        raise InvalidLambdaError(f"lam must be >= 0 (0 = ignore cost), got {value!r}")
    return value + 0.0  # -0.0 -> 0.0: the lam a Choice reports (and an app may log) is never negative


def _check_predictions(accuracy: np.ndarray, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    accuracy = real_array(accuracy, "accuracy")
    cost = real_array(cost, "cost")
    if accuracy.ndim != 2 or accuracy.shape != cost.shape:
        raise ShapeError(
            "accuracy and cost must both have shape (n_queries, n_models); "
            f"got accuracy {accuracy.shape} and cost {cost.shape}"
        )
    if np.isinf(accuracy).any() or np.isinf(cost).any():
        raise ShapeError("accuracy and cost must not contain inf (use NaN for 'no estimate')")
    return accuracy, cost


def utility(accuracy: np.ndarray, cost: np.ndarray, lam: float) -> np.ndarray:
    """Utility ``A - lam * C`` (paper 002, Eq. for U_lambda).

    Parameters
    ----------
    accuracy : ndarray of shape (n_queries, n_models), float, expected accuracy in [0, 1].
    cost : ndarray of shape (n_queries, n_models), float, expected cost in USD per query.
    lam : float, USD^-1, finite and >= 0.

    Returns
    -------
    ndarray of shape (n_queries, n_models), float64; NaN where either prediction is NaN.

    Raises
    ------
    ShapeError, InvalidLambdaError
    """
    accuracy, cost = _check_predictions(accuracy, cost)
    lam = check_lambda(lam)
    # lam * cost with lam == 0 must stay 0 even for huge costs; NaN propagates on purpose.
    return accuracy - lam * cost


def decide(accuracy: np.ndarray, cost: np.ndarray, lam: float) -> np.ndarray:
    """Index of the chosen model per query: ``argmax_m A - lam * C`` with the METRICS.md tie-break.

    Ties in utility go to the lower predicted cost, then to the lower model index. Models whose
    accuracy or cost prediction is NaN are never chosen.

    Parameters
    ----------
    accuracy : ndarray of shape (n_queries, n_models), float, expected accuracy in [0, 1].
    cost : ndarray of shape (n_queries, n_models), float, expected cost in USD per query.
    lam : float, USD^-1, finite and >= 0.

    Returns
    -------
    ndarray of shape (n_queries,), int64, model indices in ``[0, n_models)``.

    Raises
    ------
    ShapeError
        Shapes differ or are not 2-D, or values are inf.
    InvalidLambdaError
        ``lam`` is negative, NaN, inf or not a number.
    InvalidInputError
        A query has no model with an estimate (every column NaN).
    """
    u = utility(accuracy, cost, lam)
    cost = np.asarray(cost, dtype=np.float64)
    return _decide_unchecked(u, cost)


def _decide_unchecked(u: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Kernel of :func:`decide` on a precomputed utility; validates nothing but all-NaN rows."""
    unknown = np.isnan(u) | np.isnan(cost)
    if unknown.all(axis=1).any():
        row = int(np.flatnonzero(unknown.all(axis=1))[0])
        raise InvalidInputError(f"query {row} has no model with an estimate (all predictions NaN)")
    return _rank_unchecked(u, cost)[:, 0]


def _rank_unchecked(u: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Models per query from best to worst by the decision rule of :func:`decide` (utility, then the
    lower predicted cost, then the lower index); models with a NaN prediction come last. Column 0 is
    :func:`decide`'s choice, column 1 the next best (the first fallback of :mod:`sdk.routed_chat`).

    ``u`` and ``cost`` : ndarray of shape (n_queries, n_models), float64. Validates nothing.
    Returns ndarray of shape (n_queries, n_models), int64.
    """
    unknown = np.isnan(u) | np.isnan(cost)
    neg_u = np.where(unknown, np.inf, -u)
    safe_cost = np.where(unknown, np.inf, cost)
    index = np.broadcast_to(np.arange(u.shape[1]), u.shape)
    # lexsort: last key is primary -> (-u, cost, index) ascending along each row.
    return np.lexsort((index, safe_cost, neg_u), axis=-1).astype(np.int64)
