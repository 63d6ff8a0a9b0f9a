"""FedAvg: the sample-weighted mean of client parameters (McMahan et al. 2017; paper 002, Sec. 1).

Pure functions in the style of Flower's strategies: ``(list of (parameters, n_examples)) ->
parameters``, no I/O, no clock, no sampling. :func:`validate_updates` runs first and raises
:class:`sdk.errors.ShapeError` naming the offending client and tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from sdk.errors import InvalidInputError, ShapeError

Parameters = Mapping[str, np.ndarray]


def validate_updates(updates: Sequence[tuple[Parameters, float]]) -> None:
    """Check that client updates can be averaged.

    Raises
    ------
    InvalidInputError
        No updates, or a sample count that is not finite and > 0.
    ShapeError
        Parameter names or shapes differ from the first update's, or a value is not finite.
    """
    if not updates:
        raise InvalidInputError("FedAvg needs at least one client update, got 0")
    ref_params, _ = updates[0]
    ref = {k: np.shape(v) for k, v in ref_params.items()}
    for i, (params, n) in enumerate(updates):
        try:  # a str count makes np.isfinite raise TypeError; a bool is a caller's bug, not 1 sample
            ok = not isinstance(n, (bool, np.bool_)) and bool(np.isfinite(n)) and n > 0
        except TypeError:
            ok = False
        if not ok:
            raise InvalidInputError(f"update {i}: n_examples must be finite and > 0, got {n!r}")
        if set(params) != set(ref):
            raise ShapeError(
                f"update {i}: parameter names {sorted(set(params) ^ set(ref))} differ from update 0"
            )
        for k, v in params.items():
            if np.shape(v) != ref[k]:
                raise ShapeError(f"update {i}: '{k}' has shape {np.shape(v)}, expected {ref[k]}")
            if not np.isfinite(v).all():
                raise ShapeError(f"update {i}: '{k}' holds NaN or inf")


def fedavg(updates: Sequence[tuple[Parameters, float]]) -> dict[str, np.ndarray]:
    """Sample-weighted mean of client parameters: ``sum_i n_i theta_i / sum_i n_i``.

    Parameters
    ----------
    updates : sequence of (parameters, n_examples); parameters map names to arrays of equal shapes.

    Returns
    -------
    dict name -> ndarray (float64 for float inputs).

    Raises
    ------
    InvalidInputError, ShapeError (see :func:`validate_updates`).
    """
    validate_updates(updates)
    weights = np.array([float(n) for _, n in updates])
    weights = weights / weights.max()  # first to (0, 1]: the sum of huge finite counts must not overflow to inf
    weights = weights / weights.sum()
    return {
        k: np.tensordot(weights, np.stack([np.asarray(p[k], dtype=np.float64) for p, _ in updates]), axes=1)
        for k in updates[0][0]
    }
