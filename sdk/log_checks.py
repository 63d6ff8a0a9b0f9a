"""Degenerate-log checks: a client's evaluation log that cannot be trusted must not dominate.

A log whose scores are all one value for a model (a scorer that always answers 1.0, a judge that
broke) or that covers one model only looks, to an estimator fitted on it, like perfect evidence:
fitted on 120 rows of one model all scored 1.0, a local estimator predicts accuracy 1.000 for that
model, its error on those rows is 0, and the paper 002 interpolation weight
``e_global / (e_global + e_local)`` gives it weight 1. The criteria, per client log:

1. **constant scores**: a model whose scores are all one value over at least
   :data:`MIN_CONSTANT_ROWS` rows. That model's rows are degenerate: personalisation uses the
   global estimate for it, and the device does not upload statistics or training rows of it.
   (Below that many rows identical 0/1 scores are common for a strong or weak model, e.g.
   ``0.95 ** 10 = 0.60``; they are not flagged, and criterion 2 covers the smallest samples.)
2. **too few rows**: a model with fewer than :data:`MIN_MODEL_ROWS` rows gets no local estimate
   (personalisation only: the upload's ``min_count`` privacy rule already governs small counts).
3. **one model**: fewer than 2 models remain with usable rows after criterion 1. The log cannot
   compare models: personalisation uses the global estimate for every model. The upload is still
   sent (with the warning): a device pinned to one model holds valid evidence about that model, and
   the server's merge weights it by its sample count among every device's, so it cannot outweigh
   the others the way a local estimator with in-sample error 0 outweighs the global one.

:func:`check_log` reports which criteria hit; the personalisation path
(:func:`sdk.personalisation.personalisation_weights`) and the device round handlers
(:mod:`sdk.device_rounds`) apply them, log a warning (logger ``fedroute.log_checks``) and return
the warnings in their results (``PersonalisationWeights.warnings``; ``PreparedUpload.warnings`` and ``SyncResult.warnings``).

Pure functions, no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sdk.errors import ShapeError

log = logging.getLogger("fedroute.log_checks")

#: A model's scores all one value over at least this many rows make its rows degenerate.
MIN_CONSTANT_ROWS = 30
#: A model needs at least this many rows for a local (personalised) estimate.
MIN_MODEL_ROWS = 10


@dataclass(frozen=True)
class LogCheck:
    """The verdict of :func:`check_log` on one log.

    Attributes
    ----------
    models : tuple of str, the model ids, in the order of every array below.
    n_rows : ndarray of shape (n_models,), int64: rows of each model.
    constant : ndarray of shape (n_models,), bool: criterion 1 (scores one value over >= MIN_CONSTANT_ROWS rows).
    few_rows : ndarray of shape (n_models,), bool: criterion 2 (fewer than MIN_MODEL_ROWS rows, at least one).
    single_model : bool, criterion 3 (fewer than 2 models with rows that are not constant).
    warnings : tuple of str, one line per criterion that hit (what personalisation reports).
    upload_warnings : the lines of criteria 1 and 3 (criterion 2 does not concern the upload).
    """

    models: tuple[str, ...]
    n_rows: np.ndarray
    constant: np.ndarray
    few_rows: np.ndarray
    single_model: bool
    warnings: tuple[str, ...]
    upload_warnings: tuple[str, ...] = ()

    @property
    def personalisable(self) -> np.ndarray:
        """(n_models,) bool: models whose rows may feed a local estimate (no criterion hits)."""
        return (self.n_rows > 0) & ~self.constant & ~self.few_rows & (not self.single_model)

    @property
    def uploadable(self) -> np.ndarray:
        """(n_models,) bool: models whose rows may be uploaded (criterion 1 does not hit)."""
        return (self.n_rows > 0) & ~self.constant

    @property
    def degenerate(self) -> bool:
        """True when criterion 1 or 3 hits (criterion 2 only says a sample is small)."""
        return bool(self.constant.any() or self.single_model)


def check_log(model_index: np.ndarray, score: np.ndarray, models: Sequence[str]) -> LogCheck:
    """Apply the module's criteria to one log.

    Parameters
    ----------
    model_index : ndarray of shape (n_rows,), int: each row's model, an index into ``models``
        (rows with an index outside ``[0, n_models)`` are ignored: models the router does not know).
    score : ndarray of shape (n_rows,), float, in [0, 1].
    models : sequence of str, the model ids.

    Raises
    ------
    ShapeError
        ``model_index`` and ``score`` are not 1-D of one length.
    """
    idx = np.asarray(model_index)
    s = np.asarray(score, dtype=np.float64)
    if idx.ndim != 1 or s.shape != idx.shape:
        raise ShapeError(f"model_index and score must be 1-D of one length, got {idx.shape} and {s.shape}")
    models = tuple(models)
    n_models = len(models)
    keep = (idx >= 0) & (idx < n_models)
    idx, s = idx[keep].astype(np.int64), s[keep]
    n_rows = np.bincount(idx, minlength=n_models).astype(np.int64)
    low = np.full(n_models, np.inf)
    high = np.full(n_models, -np.inf)
    np.minimum.at(low, idx, s)
    np.maximum.at(high, idx, s)
    constant = (n_rows >= MIN_CONSTANT_ROWS) & (low == high)
    few_rows = (n_rows > 0) & (n_rows < MIN_MODEL_ROWS)
    covered = int(((n_rows > 0) & ~constant).sum())
    single_model = covered < 2
    lines = {}
    for j in np.flatnonzero(constant):
        lines[f"constant:{j}"] = (f"model {models[j]!r}: all {n_rows[j]} scores are {low[j]:g} (one value over >= "
                                  f"{MIN_CONSTANT_ROWS} rows): its rows are degenerate, the global estimate stands")
    if few_rows.any():
        names = [f"{models[j]} ({n_rows[j]})" for j in np.flatnonzero(few_rows)]
        lines["few_rows"] = f"fewer than {MIN_MODEL_ROWS} rows for {', '.join(names)}: too few for a local estimate"
    if single_model:
        lines["single_model"] = (f"the log covers {covered} model(s) with usable rows; it needs >= 2 to compare "
                                 "models")
    return LogCheck(models, n_rows, constant, few_rows, single_model,
                    tuple(lines.values()),
                    tuple(v for k, v in lines.items() if k != "few_rows"))


def warn(lines: Sequence[str], where: str) -> None:
    """Log each line (logger ``fedroute.log_checks``, level WARNING), prefixed with ``where``."""
    for line in lines:
        log.warning("%s: degenerate log: %s", where, line)
