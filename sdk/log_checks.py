"""Degenerate-log checks: which rows of a client's evaluation log are not uploaded, and what is warned about.

1. **constant scores**: a model whose scores are all one value over at least :data:`MIN_CONSTANT_ROWS`
   rows; its rows are not uploaded (the server's merge would count them as real outcomes). Fewer
   identical 0/1 scores are common (``0.95 ** 10 = 0.60``) and not flagged.
2. **one model**: fewer than 2 models keep rows after 1. A warning only.

Personalisation needs no threshold: its weights shrink with the rows behind the local estimate.
Warnings go to the logger ``fedroute.log_checks`` and into the callers' results.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

log = logging.getLogger("fedroute.log_checks")

#: A model's scores all one value over at least this many rows make its rows degenerate.
MIN_CONSTANT_ROWS = 30


@dataclass(frozen=True)
class LogCheck:
    """The verdict of :func:`check_log` on one log: per model (in ``models`` order) its ``n_rows`` and
    whether criterion 1 hits (``constant``); criterion 2 (``single_model``); one warning line per hit."""

    models: tuple[str, ...]
    n_rows: npt.NDArray[np.int64]
    constant: npt.NDArray[np.bool_]
    single_model: bool
    warnings: tuple[str, ...]

    @property
    def uploadable(self) -> npt.NDArray[np.bool_]:
        """(n_models,) bool: models whose rows may be uploaded (criterion 1 does not hit)."""
        return (self.n_rows > 0) & ~self.constant


def check_log(model_index: npt.NDArray[np.int64], score: npt.NDArray[np.float64], models: Sequence[str]) -> LogCheck:
    """The criteria on one log: ``model_index`` (n_rows,) int indexes ``models`` (rows outside
    ``[0, n_models)`` are ignored), ``score`` (n_rows,) float in [0, 1]; inputs validated by the caller."""
    idx, s = np.asarray(model_index), np.asarray(score, dtype=np.float64)
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
