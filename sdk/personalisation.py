"""Training-free personalisation by error-weighted interpolation (paper 002, "Adaptive personalised mixing").

Per model m, client i measures on its own data the mean absolute error of the global estimator,
``e(A^m)``, and of its local estimator, ``e(A^{i,m})``, and predicts::

    w = e(A^m) / (e(A^m) + e(A^{i,m}))
    A_personalised = w * A^{i,m} + (1 - w) * A^m          (the same for cost)

so the estimator with the smaller error gets the larger weight.
"""

from __future__ import annotations

import numpy as np

from sdk.errors import ShapeError


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
    eg = np.asarray(global_error, dtype=np.float64)
    el = np.asarray(local_error, dtype=np.float64)
    if eg.shape != el.shape or eg.ndim != 1:
        raise ShapeError(f"errors must be 1-D of one shape, got {eg.shape} and {el.shape}")
    if np.isinf(eg).any() or np.isinf(el).any() or (eg < 0).any() or (el < 0).any():
        raise ShapeError("errors must be finite (or NaN) and >= 0")
    total = eg + el
    with np.errstate(invalid="ignore", divide="ignore"):
        w = np.where(total > 0, eg / total, 0.5)
    return np.where(np.isnan(total), 0.0, w)


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
    g = np.asarray(global_pred, dtype=np.float64)
    loc = np.asarray(local_pred, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if g.shape != loc.shape or g.ndim != 2 or w.shape != (g.shape[1],):
        raise ShapeError(
            f"expected global/local of one shape (n_queries, n_models) and weights (n_models,), "
            f"got {g.shape}, {loc.shape}, {w.shape}"
        )
    if ((w < 0) | (w > 1) | np.isnan(w)).any():
        raise ShapeError("weights must lie in [0, 1]")
    mixed = w[None, :] * loc + (1.0 - w[None, :]) * g
    return np.where(np.isnan(loc), g, mixed)
