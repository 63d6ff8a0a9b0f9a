"""Training-free personalisation by error-weighted interpolation (paper 002, "Adaptive personalised mixing").

Per model m, client i measures on its own data the mean absolute error of the global estimator,
``e(A^m)``, and of its local estimator, ``e(A^{i,m})``, and predicts::

    w = e(A^m) / (e(A^m) + e(A^{i,m}))
    A_personalised = w * A^{i,m} + (1 - w) * A^m          (the same for cost)

so the estimator with the smaller error gets the larger weight.

The errors are measured on **held-out** rows of the client's log (:func:`holdout_split`): the local
estimator is fitted on the other rows, so its error is not the in-sample error of an estimator on
its own training data (which is near 0 for any flexible estimator and would give it weight ~1).
:func:`personalisation_weights` also applies the degenerate-log criteria of :mod:`sdk.log_checks`:
a model whose rows are degenerate, or too few, gets weight 0 (the global estimate), with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sdk.arrays import real_array
from sdk.errors import InvalidInputError, ShapeError
from sdk.log_checks import LogCheck, warn

#: Share of each model's rows held out to measure the errors (at least one row per model with >= 2 rows).
HOLDOUT_FRACTION = 0.2


def interpolation_weights(global_error: np.ndarray, local_error: np.ndarray) -> np.ndarray:
    """Weight of the local estimator per model, ``w = e_global / (e_global + e_local)``.

    Parameters
    ----------
    global_error, local_error : ndarray of shape (n_models,), float, mean absolute errors >= 0.
        NaN means "not measurable" (no local sample of that model).

    Returns
    -------
    ndarray of shape (n_models,), float64 in [0, 1]. Where either error is NaN the weight is 0
    (no local evidence: use the global estimator); where both errors are 0 it is 0.5.

    Raises
    ------
    ShapeError
        Shapes differ or an error is negative or inf.
    """
    eg = real_array(global_error, "global_error")
    el = real_array(local_error, "local_error")
    if eg.shape != el.shape or eg.ndim != 1:
        raise ShapeError(f"errors must be 1-D of one shape, got {eg.shape} and {el.shape}")
    if np.isinf(eg).any() or np.isinf(el).any() or (eg < 0).any() or (el < 0).any():
        raise ShapeError("errors must be finite (or NaN) and >= 0")
    scale = np.maximum(eg, el)  # both divided by the larger first: eg + el cannot overflow (1e308 + 1e308)
    with np.errstate(invalid="ignore", divide="ignore"):
        g, loc = eg / scale, el / scale
        w = np.where(scale > 0, g / (g + loc), 0.5)
    return np.where(np.isnan(eg) | np.isnan(el), 0.0, w)


def personalise(global_pred: np.ndarray, local_pred: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Interpolated prediction ``w * local + (1 - w) * global`` per model.

    Parameters
    ----------
    global_pred, local_pred : ndarray of shape (n_queries, n_models), float. NaN in ``local_pred``
        (the local router has no estimate) falls back to the global prediction.
    weights : ndarray of shape (n_models,), float in [0, 1], from :func:`interpolation_weights`.

    Returns
    -------
    ndarray of shape (n_queries, n_models), float64.

    Raises
    ------
    ShapeError
    """
    g = real_array(global_pred, "global_pred")
    loc = real_array(local_pred, "local_pred")
    w = real_array(weights, "weights")
    if g.shape != loc.shape or g.ndim != 2 or w.shape != (g.shape[1],):
        raise ShapeError(
            f"expected global/local of one shape (n_queries, n_models) and weights (n_models,), "
            f"got {g.shape}, {loc.shape}, {w.shape}"
        )
    if ((w < 0) | (w > 1) | np.isnan(w)).any():
        raise ShapeError("weights must lie in [0, 1]")
    mixed = w[None, :] * loc + (1.0 - w[None, :]) * g
    return np.where(np.isnan(loc), g, mixed)


def holdout_split(model_index: np.ndarray, rng: np.random.Generator,
                  fraction: float = HOLDOUT_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """Split a client's log into rows to fit the local estimator on and rows to measure errors on.

    Per model with ``n >= 2`` rows, ``max(1, round(fraction * n))`` rows (at most ``n - 1``) drawn
    at random are held out; a model with one row keeps it for fitting.

    Parameters
    ----------
    model_index : ndarray of shape (n_rows,), int: each row's model.
    rng : numpy Generator.
    fraction : float in (0, 1).

    Returns
    -------
    (fit_rows, held_rows): sorted int64 indices into the log, disjoint, together every row.

    Raises
    ------
    InvalidInputError
        ``fraction`` is not in (0, 1).
    ShapeError
        ``model_index`` is not 1-D.
    """
    if not 0 < fraction < 1:
        raise InvalidInputError(f"fraction must lie in (0, 1), got {fraction!r}")
    idx = np.asarray(model_index)
    if idx.ndim != 1:
        raise ShapeError(f"model_index must be 1-D, got shape {idx.shape}")
    held = []
    for m in np.unique(idx):
        rows = np.flatnonzero(idx == m)
        if rows.size >= 2:
            k = min(max(1, int(round(fraction * rows.size))), rows.size - 1)
            held.append(rng.choice(rows, size=k, replace=False))
    held_rows = np.sort(np.concatenate(held)).astype(np.int64) if held else np.zeros(0, np.int64)
    fit_rows = np.setdiff1d(np.arange(idx.size), held_rows).astype(np.int64)
    return fit_rows, held_rows


@dataclass(frozen=True)
class PersonalisationWeights:
    """Per-model interpolation weights of the local estimator, with the evidence behind them.

    Attributes
    ----------
    accuracy, cost : ndarray of shape (n_models,), float64 in [0, 1]: weights for the accuracy and
        the cost predictions (0 = global estimate only).
    global_error, local_error : ndarray of shape (n_models, 2), float64: held-out mean absolute
        errors (column 0 accuracy, column 1 cost USD); NaN where the model has no held-out row.
    check : the :class:`sdk.log_checks.LogCheck` of the client's log.
    warnings : tuple of str, the degenerate-log warnings (also logged).
    """

    accuracy: np.ndarray
    cost: np.ndarray
    global_error: np.ndarray
    local_error: np.ndarray
    check: LogCheck
    warnings: tuple[str, ...]


def _held_out_mae(pred: np.ndarray, model_index: np.ndarray, truth: np.ndarray, n_models: int) -> np.ndarray:
    """Mean |pred[row, model] - truth| per model; NaN for models without rows (or NaN predictions)."""
    rows = np.arange(model_index.size)
    err = np.abs(pred[rows, model_index] - truth)
    n = np.bincount(model_index, minlength=n_models).astype(np.float64)
    nan = np.bincount(model_index, weights=np.isnan(err).astype(np.float64), minlength=n_models) > 0
    total = np.bincount(model_index, weights=np.nan_to_num(err, nan=0.0), minlength=n_models)
    with np.errstate(invalid="ignore", divide="ignore"):
        mae = total / n
    return np.where(nan | (n == 0), np.nan, mae)


def personalisation_weights(global_held: tuple[np.ndarray, np.ndarray], local_held: tuple[np.ndarray, np.ndarray],
                            held_model: np.ndarray, held_accuracy: np.ndarray, held_cost: np.ndarray,
                            check: LogCheck, where: str = "personalisation") -> PersonalisationWeights:
    """Paper 002 weights from errors on held-out rows, with the degenerate-log fallback.

    Parameters
    ----------
    global_held, local_held : (accuracy, cost) predictions of the global and of the local estimator
        (the latter fitted on the *other* rows, see :func:`holdout_split`) for the held-out rows,
        each ndarray of shape (n_held, n_models), float (cost USD); NaN = no estimate.
    held_model : ndarray of shape (n_held,), int: the model each held-out row was sent to.
    held_accuracy, held_cost : ndarray of shape (n_held,), float: its observed score and cost (USD).
    check : :func:`sdk.log_checks.check_log` of the client's whole log.
    where : prefix of the logged warnings.

    Returns
    -------
    PersonalisationWeights; a model that ``check`` does not find personalisable gets weight 0.

    Raises
    ------
    ShapeError
        Inconsistent shapes.
    """
    ga, gc = (np.asarray(x, dtype=np.float64) for x in global_held)
    la, lc = (np.asarray(x, dtype=np.float64) for x in local_held)
    idx = np.asarray(held_model, dtype=np.int64)
    held_accuracy = np.asarray(held_accuracy, dtype=np.float64)
    held_cost = np.asarray(held_cost, dtype=np.float64)
    n_models = len(check.models)
    if not (ga.shape == gc.shape == la.shape == lc.shape == (idx.size, n_models)):
        raise ShapeError(f"held-out predictions must have shape ({idx.size}, {n_models}), got "
                         f"{ga.shape}, {gc.shape}, {la.shape}, {lc.shape}")
    eg = np.stack([_held_out_mae(ga, idx, held_accuracy, n_models), _held_out_mae(gc, idx, held_cost, n_models)], axis=1)
    el = np.stack([_held_out_mae(la, idx, held_accuracy, n_models), _held_out_mae(lc, idx, held_cost, n_models)], axis=1)
    usable = check.personalisable
    w_acc = np.where(usable, interpolation_weights(eg[:, 0], el[:, 0]), 0.0)
    w_cost = np.where(usable, interpolation_weights(eg[:, 1], el[:, 1]), 0.0)
    if check.degenerate:
        warn(check.warnings, where)
    return PersonalisationWeights(w_acc, w_cost, eg, el, check, check.warnings)
