"""Training-free personalisation: paper 002's error-weighted interpolation of a Beta-posterior local estimate.

Paper 002 ("Adaptive personalised mixing") predicts ``w A^{i,m} + (1 - w) A^m`` from the global estimate
``A^m`` (fitted on ``N`` rows of model m) and client i's local one ``A^{i,m}`` (on its ``n`` rows), with
``w = e(A^m) / (e(A^m) + e(A^{i,m}))``, ``e`` a mean absolute error on the client's held-out rows
(:func:`holdout_split`). That weight ignores how many rows back each estimate (29 rows all scored 1.0
give ``w ~ 1``), so the local estimate is first shrunk to its empirical-Bayes posterior mean under a
``Beta(kappa A^m, kappa (1 - A^m))`` prior, weighting by inverse variance::

    c = (1/kappa + 1/N) / (1/kappa + 1/N + 1/n)                    (credibility of the local estimate)
    A~^{i,m} = A^m + c (A^{i,m} - A^m)                             (= (n A^{i,m} + kappa A^m) / (n + kappa), N -> inf)
    w' = e(A^m) / (e(A^m) + e(A~^{i,m}))                           (paper 002, errors on held-out rows)
    A_personalised = A^m + w' c (A^{i,m} - A^m),  weight of the local estimator  w = c w'   (the same for cost)

``w -> w'`` for ``n >> kappa`` and ``w -> 0`` as ``n -> 0``. ``kappa`` (:data:`PRIOR_ROWS`) is chosen on
validation (``benchmarks/personalisation_settings.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sdk.arrays import real_array
from sdk.errors import ShapeError
from sdk.log_checks import LogCheck, warn

#: Share of each model's rows held out to measure the errors (at least one row per model with >= 2 rows).
HOLDOUT_FRACTION = 0.2
#: kappa, the prior's strength in rows (between-client spread of a mean over kappa rows).
PRIOR_ROWS = 10000.0


_Floats = npt.NDArray[np.float64]


def credibility(n_local: npt.ArrayLike, n_global: npt.ArrayLike = np.inf, prior_rows: float = PRIOR_ROWS) -> _Floats:
    """``c = (1/kappa + 1/N) / (1/kappa + 1/N + 1/n)`` per model, (n_models,) in [0, 1), from the rows
    ``n >= 0`` behind each local estimate, ``N > 0`` behind each global one (inf: many) and ``kappa``."""
    n = np.asarray(n_local, dtype=np.float64)
    prior_precision = 1.0 / prior_rows + 1.0 / np.asarray(n_global, dtype=np.float64)  # in 1 / rows
    return n * prior_precision / (n * prior_precision + 1.0)


def interpolation_weights(global_error: npt.ArrayLike, local_error: npt.ArrayLike) -> _Floats:
    """Paper 002's weight of the local estimator per model, ``w = e_global / (e_global + e_local)``.

    ``global_error``, ``local_error``: (n_models,) mean absolute errors >= 0, NaN: not measurable.
    Returns (n_models,) float64 in [0, 1]: 0 where an error is NaN, 0.5 where both are 0. Raises
    ShapeError when shapes differ or an error is negative or inf.
    """
    eg = real_array(global_error, "global_error")
    el = real_array(local_error, "local_error")
    if eg.shape != el.shape or eg.ndim != 1 or np.isinf(eg).any() or np.isinf(el).any() or (eg < 0).any() \
            or (el < 0).any():
        raise ShapeError(f"global_error and local_error must be 1-D of one shape, finite (or NaN) and >= 0, got "
                         f"shapes {eg.shape} and {el.shape}")
    scale = np.maximum(eg, el)  # both divided by the larger first: eg + el cannot overflow (1e308 + 1e308)
    with np.errstate(invalid="ignore", divide="ignore"):
        g, loc = eg / scale, el / scale
        w = np.where(scale > 0, g / (g + loc), 0.5)
    return np.where(np.isnan(eg) | np.isnan(el), 0.0, w)


def personalise(global_pred: npt.ArrayLike, local_pred: npt.ArrayLike, weights: npt.ArrayLike) -> _Floats:
    """Interpolated prediction ``w * local + (1 - w) * global`` per model.

    ``global_pred``, ``local_pred``: (n_queries, n_models) float (NaN in ``local_pred`` falls back to the
    global prediction); ``weights``: (n_models,) in [0, 1] (:func:`interpolation_weights`). Returns
    (n_queries, n_models) float64; ShapeError for other shapes or weights.
    """
    g = real_array(global_pred, "global_pred")
    loc = real_array(local_pred, "local_pred")
    w = real_array(weights, "weights")
    if g.shape != loc.shape or g.ndim != 2 or w.shape != (g.shape[1],) or ((w < 0) | (w > 1) | np.isnan(w)).any():
        raise ShapeError(f"global_pred and local_pred must be (n_queries, n_models) and weights (n_models,) in "
                         f"[0, 1], got shapes {g.shape}, {loc.shape}, {w.shape}")
    mixed = w[None, :] * loc + (1.0 - w[None, :]) * g
    return np.where(np.isnan(loc), g, mixed)


def holdout_split(model_index: npt.NDArray[np.int64], rng: np.random.Generator,
                  fraction: float = HOLDOUT_FRACTION) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(fit_rows, held_rows), sorted disjoint int64 indices covering the log whose rows' models are
    ``model_index`` (n_rows,): per model with ``n >= 2`` rows, ``max(1, round(fraction * n))`` random
    rows (at most ``n - 1``) are held out to measure errors; inputs validated by the caller."""
    idx = np.asarray(model_index)
    held: list[npt.NDArray[np.int64]] = []
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
    """Per-model weights ``w = c w'`` (n_models,) of the local estimator for ``accuracy`` and ``cost``,
    their ``credibility`` ``c``, the held-out MAEs (n_models, 2) of the global and the posterior local
    estimate (columns accuracy, cost USD; NaN: no held-out row) and the degenerate-log ``warnings``."""

    accuracy: _Floats
    cost: _Floats
    credibility: _Floats
    global_error: _Floats
    local_error: _Floats
    warnings: tuple[str, ...]


def _held_out_mae(pred: _Floats, model_index: npt.NDArray[np.int64], truth: _Floats, n_models: int) -> _Floats:
    """Mean |pred[row, model] - truth| per model; NaN for models without rows (or NaN predictions)."""
    rows = np.arange(model_index.size)
    err = np.abs(pred[rows, model_index] - truth)
    n = np.bincount(model_index, minlength=n_models).astype(np.float64)
    nan = np.bincount(model_index, weights=np.isnan(err).astype(np.float64), minlength=n_models) > 0
    total = np.bincount(model_index, weights=np.nan_to_num(err, nan=0.0), minlength=n_models)
    with np.errstate(invalid="ignore", divide="ignore"):
        mae = total / n
    return np.where(nan | (n == 0), np.nan, mae)


def personalisation_weights(global_held: tuple[npt.ArrayLike, npt.ArrayLike], local_held: tuple[npt.ArrayLike, npt.ArrayLike],
                            held_model: npt.ArrayLike, held_accuracy: npt.ArrayLike, held_cost: npt.ArrayLike,
                            n_local: npt.ArrayLike, n_global: npt.ArrayLike = np.inf,
                            prior_rows: float = PRIOR_ROWS, check: LogCheck | None = None,
                            where: str = "personalisation") -> PersonalisationWeights:
    """Weights ``w = c w'`` of the module's equations from errors on held-out rows; inputs validated by the caller.

    ``global_held``, ``local_held``: (accuracy, cost USD) predictions, each (n_held, n_models), of the global
    and of the local estimator (fitted on the other rows) for the held-out rows; ``held_model`` (n_held,)
    int and the observed ``held_accuracy``, ``held_cost``; ``n_local`` (n_models,) rows the local estimator
    was fitted on; ``n_global``, ``prior_rows`` as in :func:`credibility`; ``check``'s warnings are logged
    with the prefix ``where`` and returned.
    """
    ga, gc = (np.asarray(x, dtype=np.float64) for x in global_held)
    la, lc = (np.asarray(x, dtype=np.float64) for x in local_held)
    idx = np.asarray(held_model, dtype=np.int64)
    n_models = np.shape(n_local)[0]
    c = credibility(n_local, n_global, prior_rows)
    truth = (np.asarray(held_accuracy, dtype=np.float64), np.asarray(held_cost, dtype=np.float64))
    eg = np.stack([_held_out_mae(g, idx, t, n_models) for g, t in zip((ga, gc), truth)], axis=1)
    el = np.stack([_held_out_mae(g + c * (loc - g), idx, t, n_models) for g, loc, t in zip((ga, gc), (la, lc), truth)],
                  axis=1)
    w_acc, w_cost = (c * interpolation_weights(eg[:, j], el[:, j]) for j in (0, 1))
    lines = check.warnings if check is not None else ()
    warn(lines, where)
    return PersonalisationWeights(w_acc, w_cost, c, eg, el, lines)
