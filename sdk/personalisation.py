"""Training-free personalisation: paper 002's error-weighted interpolation of a Beta-posterior local estimate.

Per model m, client i holds the global estimate ``A^m`` (fitted on the federation's ``N`` rows of m)
and a local estimate ``A^{i,m}`` fitted on its own ``n`` rows of m. Paper 002 ("Adaptive
personalised mixing") predicts ``w A^{i,m} + (1 - w) A^m`` with ``w = e(A^m) / (e(A^m) + e(A^{i,m}))``,
``e`` a mean absolute error on the client's data. That weight ignores how many rows back each
estimate: a local estimator fitted on 29 rows all scored 1.0 is exact on its held-out rows, gets
``w ~ 1`` and predicts accuracy 1.0 for every query.

Here the local estimate is first replaced by its empirical-Bayes posterior mean. The client's true
accuracy ``theta`` deviates from the federation's with a spread of ``kappa`` pseudo-rows (prior
``Beta(kappa A^m, kappa (1 - A^m))``, i.e. a between-client variance ``A(1-A) / kappa``); the global
estimate has, besides, its own sampling variance ``A(1-A) / N`` and the local one ``A(1-A) / n``.
Weighting the two by inverse variance (the Bernoulli variance ``A(1-A)`` cancels, so a log that
makes its own variance look like 0 cannot inflate its weight)::

    c = (1/kappa + 1/N) / (1/kappa + 1/N + 1/n)                    (credibility of the local estimate)
    A~^{i,m} = A^m + c (A^{i,m} - A^m)                             (Beta posterior mean; for N -> inf
                                                                   = (n A^{i,m} + kappa A^m) / (n + kappa))
    w' = e(A^m) / (e(A^m) + e(A~^{i,m}))                           (paper 002, errors on held-out rows)
    A_personalised = A^m + w' c (A^{i,m} - A^m),  weight of the local estimator  w = c w'   (the same for cost)

So ``w -> w'``, paper 002's rule, when the local estimate is well supported (``n >> kappa``: ``c -> 1``;
a poorly supported global estimate, small ``N``, raises ``c`` further), and ``w -> 0`` (the global
estimate) as ``n -> 0``. A small or near-constant log (29 rows of 1.0, or 119
of 1.0 and one 0.0) moves the prediction by at most ``c`` of the way: what the degenerate-log
thresholds used to do, now a consequence of how few rows back it. ``kappa`` (:data:`PRIOR_ROWS`) is
chosen on validation (``benchmarks/personalisation_settings.py``).

The errors are measured on **held-out** rows of the client's log (:func:`holdout_split`): the local
estimator is fitted on the other rows, so its error is not the in-sample error of an estimator on
its own training data (which is near 0 for any flexible estimator).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sdk.arrays import real_array
from sdk.errors import InvalidInputError, ShapeError
from sdk.log_checks import LogCheck, warn

#: Share of each model's rows held out to measure the errors (at least one row per model with >= 2 rows).
HOLDOUT_FRACTION = 0.2
#: kappa, the prior's strength in rows: the between-client spread of a model's accuracy is that of
#: a mean over kappa rows. Chosen on validation (benchmarks/personalisation_settings.py).
PRIOR_ROWS = 10000.0


def credibility(n_local: np.ndarray, n_global: np.ndarray | float = np.inf,
                prior_rows: float = PRIOR_ROWS) -> np.ndarray:
    """Weight ``c = (1/kappa + 1/N) / (1/kappa + 1/N + 1/n)`` of the local estimate in its posterior mean.

    Parameters
    ----------
    n_local : ndarray of shape (n_models,), rows ``n >= 0`` behind each local estimate.
    n_global : ndarray of shape (n_models,) or float, rows ``N > 0`` behind each global estimate (inf: many).
    prior_rows : float ``kappa > 0``, the prior's strength in rows (:data:`PRIOR_ROWS`).

    Returns
    -------
    ndarray of shape (n_models,), float64 in [0, 1): 0 where ``n = 0``; ``n / (n + kappa)`` for ``N = inf``.
    """
    n = np.asarray(n_local, dtype=np.float64)
    prior_precision = 1.0 / prior_rows + 1.0 / np.asarray(n_global, dtype=np.float64)  # in 1 / rows
    return n * prior_precision / (n * prior_precision + 1.0)


def interpolation_weights(global_error: np.ndarray, local_error: np.ndarray) -> np.ndarray:
    """Paper 002's weight of the local estimator per model, ``w = e_global / (e_global + e_local)``.

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
    accuracy, cost : ndarray of shape (n_models,), float64 in [0, 1): weights ``w = c w'`` for the
        accuracy and the cost predictions (0 = global estimate only).
    credibility : ndarray of shape (n_models,), float64: ``c`` of :func:`credibility`.
    global_error, local_error : ndarray of shape (n_models, 2), float64: held-out mean absolute
        errors of the global and of the posterior local estimate (column 0 accuracy, column 1 cost
        USD); NaN where the model has no held-out row.
    warnings : tuple of str, the degenerate-log warnings of the ``check`` given (also logged).
    """

    accuracy: np.ndarray
    cost: np.ndarray
    credibility: np.ndarray
    global_error: np.ndarray
    local_error: np.ndarray
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
                            n_local: np.ndarray, n_global: np.ndarray | float = np.inf,
                            prior_rows: float = PRIOR_ROWS, check: LogCheck | None = None,
                            where: str = "personalisation") -> PersonalisationWeights:
    """Weights ``w = c w'`` of the module's equations, from errors on held-out rows.

    Parameters
    ----------
    global_held, local_held : (accuracy, cost) predictions of the global and of the local estimator
        (the latter fitted on the *other* rows, see :func:`holdout_split`) for the held-out rows,
        each ndarray of shape (n_held, n_models), float (cost USD); NaN = no estimate.
    held_model : ndarray of shape (n_held,), int: the model each held-out row was sent to.
    held_accuracy, held_cost : ndarray of shape (n_held,), float: its observed score and cost (USD).
    n_local : ndarray of shape (n_models,), int: rows of each model the local estimator was fitted on.
    n_global, prior_rows : as in :func:`credibility`.
    check : :func:`sdk.log_checks.check_log` of the client's log, whose warnings are logged and
        returned (they do not change the weights).
    where : prefix of the logged warnings.

    Returns
    -------
    PersonalisationWeights.

    Raises
    ------
    ShapeError
        Inconsistent shapes.
    """
    ga, gc = (np.asarray(x, dtype=np.float64) for x in global_held)
    la, lc = (np.asarray(x, dtype=np.float64) for x in local_held)
    idx = np.asarray(held_model, dtype=np.int64)
    n_models = np.shape(n_local)[0]
    if not (ga.shape == gc.shape == la.shape == lc.shape == (idx.size, n_models)):
        raise ShapeError(f"held-out predictions must have shape ({idx.size}, {n_models}), got "
                         f"{ga.shape}, {gc.shape}, {la.shape}, {lc.shape}")
    c = credibility(n_local, n_global, prior_rows)
    truth = (np.asarray(held_accuracy, dtype=np.float64), np.asarray(held_cost, dtype=np.float64))
    eg = np.stack([_held_out_mae(g, idx, t, n_models) for g, t in zip((ga, gc), truth)], axis=1)
    el = np.stack([_held_out_mae(g + c * (loc - g), idx, t, n_models) for g, loc, t in zip((ga, gc), (la, lc), truth)],
                  axis=1)
    w_acc, w_cost = (c * interpolation_weights(eg[:, j], el[:, j]) for j in (0, 1))
    lines = check.warnings if check is not None else ()
    warn(lines, where)
    return PersonalisationWeights(w_acc, w_cost, c, eg, el, lines)
