"""Degenerate-log checks: which rows of a client's evaluation log are not uploaded, and what is warned about.

A log whose scores are all one value for a model (a scorer that always answers 1.0, a judge that
broke) or that covers one model only looks, to an estimator fitted on it, like perfect evidence.
Personalisation needs no threshold for it: its weights shrink with the rows behind the local
estimate (:mod:`sdk.personalisation`), so a small or near-constant log moves a prediction only a
little. Two criteria remain, per client log:

1. **constant scores**: a model whose scores are all one value over at least
   :data:`MIN_CONSTANT_ROWS` rows. The device does not upload statistics or training rows of it (the
   server's merge would count them as that many real outcomes). Below that many rows identical 0/1
   scores are common for a strong or weak model (``0.95 ** 10 = 0.60``); they are not flagged.
2. **one model**: fewer than 2 models remain with rows after criterion 1. A warning only: a device
   pinned to one model holds valid evidence about that model, and the server's merge weights it by
   its sample count among every device's.

:func:`check_log` reports which criteria hit; personalisation
(:func:`sdk.personalisation.personalisation_weights`) and the device round handlers
(:mod:`sdk.device_rounds`) log a warning (logger ``fedroute.log_checks``) and return the warnings in
their results (``PersonalisationWeights.warnings``; ``PreparedUpload.warnings`` and ``SyncResult.warnings``).

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


@dataclass(frozen=True)
class LogCheck:
    """The verdict of :func:`check_log` on one log.

    Attributes
    ----------
    models : tuple of str, the model ids, in the order of every array below.
    n_rows : ndarray of shape (n_models,), int64: rows of each model.
    constant : ndarray of shape (n_models,), bool: criterion 1 (scores one value over >= MIN_CONSTANT_ROWS rows).
    single_model : bool, criterion 2 (fewer than 2 models with rows that are not constant).
    warnings : tuple of str, one line per criterion that hit.
    """

    models: tuple[str, ...]
    n_rows: np.ndarray
    constant: np.ndarray
    single_model: bool
    warnings: tuple[str, ...]

    @property
    def uploadable(self) -> np.ndarray:
        """(n_models,) bool: models whose rows may be uploaded (criterion 1 does not hit)."""
        return (self.n_rows > 0) & ~self.constant


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
    covered = int(((n_rows > 0) & ~constant).sum())
    single_model = covered < 2
    lines = [f"model {models[j]!r}: all {n_rows[j]} scores are {low[j]:g} (one value over >= {MIN_CONSTANT_ROWS} "
             "rows): its rows are degenerate and not uploaded" for j in np.flatnonzero(constant)]
    if single_model:
        lines.append(f"the log covers {covered} model(s) with usable rows; it needs >= 2 to compare models")
    return LogCheck(models, n_rows, constant, single_model, tuple(lines))


def warn(lines: Sequence[str], where: str) -> None:
    """Log each line (logger ``fedroute.log_checks``, level WARNING), prefixed with ``where``."""
    for line in lines:
        log.warning("%s: degenerate log: %s", where, line)
