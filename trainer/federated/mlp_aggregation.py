"""Server-side aggregation of federated MLP-router updates: FedAvg on deltas, robust and private options.

Design notes: docs/privacy-and-dp.md (Module notes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from sdk.errors import InvalidInputError, ShapeError
from trainer.config_fields import check_int, check_real
from trainer.routers.fedavg import fedavg
from trainer.federated.gaussian_privacy import gaussian_epsilon

Parameters = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class MLPUpdate:
    """One client's upload: ``parameters`` (name -> float32 array), ``n_samples`` > 0, and the
    parameters it started from (``base``, the global parameters of the round it was computed for)."""

    parameters: Parameters
    n_samples: int
    base: Parameters


@dataclass(frozen=True)
class MLPAggregationConfig:
    """clip_count : C, largest weight of one client (None: n_i). trim_fraction : beta in [0, 0.5).
    clip_norm : S, L2 bound of each delta (needed with noise). noise_multiplier : z >= 0.
    expected_clients : W, the fixed denominator of DP-FedAvg (needed with noise).
    delta : the delta of the DP guarantee.

    Raises
    ------
    InvalidInputError
        Values out of range, noise without clip_norm, or noise with trimming (the sensitivity
        argument holds for the plain clipped sum).
    """

    clip_count: float | None = None
    trim_fraction: float = 0.0
    clip_norm: float | None = None
    noise_multiplier: float = 0.0
    delta: float = 1e-5
    expected_clients: int | None = None

    def __post_init__(self) -> None:
        for name in ("clip_count", "clip_norm"):
            check_real(self, name, 0, low_open=True, optional=True)
        check_real(self, "trim_fraction", 0, 0.5, high_open=True)
        check_real(self, "noise_multiplier", 0)
        check_real(self, "delta", 0, 1, low_open=True, high_open=True)
        check_int(self, "expected_clients", 1, optional=True)  # a NaN W would make every parameter NaN
        if self.noise_multiplier > 0 and (self.clip_norm is None or self.trim_fraction > 0
                                          or not self.expected_clients or self.expected_clients < 1):
            raise InvalidInputError("DP-FedAvg noise needs clip_norm, expected_clients >= 1 and no trimming")


@dataclass(frozen=True)
class MLPAggregate:
    """parameters : the next global parameters (name -> float32). clients : ids aggregated (sorted).
    n_samples : total samples behind them. epsilon : of this release (inf without noise)."""

    parameters: dict[str, np.ndarray]
    clients: tuple[str, ...]
    n_samples: int
    epsilon: float


def aggregate_mlp(global_params: Parameters, updates: Mapping[str, MLPUpdate], config: MLPAggregationConfig,
                  rng: np.random.Generator) -> MLPAggregate:
    """The next global parameters from the clients' updates (design notes).

    Parameters
    ----------
    global_params : the current round's parameters, name -> float32 array of any shape.
    updates : client id -> MLPUpdate (finite parameters and base of the same names and shapes, ``n_samples``
        >= 1), at least one; validated by the caller (:func:`trainer.server.validation.validate_mlp_update`).
    config : the robust and private options.
    rng : source of the DP noise (unused without noise).

    Returns
    -------
    MLPAggregate, the new parameters as float32 arrays of the same shapes.

    Raises
    ------
    ShapeError
        The aggregate overflows float32 (extreme client parameters).
    """
    ids = tuple(sorted(updates))
    names = sorted(global_params)
    deltas, weights = [], []
    for cid in ids:
        u = updates[cid]
        deltas.append({k: np.asarray(u.parameters[k], np.float64) - np.asarray(u.base[k], np.float64) for k in names})
        weights.append(float(u.n_samples if config.clip_count is None else min(u.n_samples, config.clip_count)))
    epsilon = math.inf
    if config.noise_multiplier > 0:
        clipped = []
        for d in deltas:
            norm = math.sqrt(sum(float((v * v).sum()) for v in d.values()))
            scale = min(1.0, config.clip_norm / norm) if norm > 0 else 1.0
            clipped.append({k: v * scale for k, v in d.items()})
        sigma = config.noise_multiplier * config.clip_norm
        mean = {k: (sum(c[k] for c in clipped) + rng.normal(0.0, sigma, np.shape(global_params[k])))
                / config.expected_clients for k in names}
        epsilon = gaussian_epsilon(config.noise_multiplier, config.delta)
    elif config.trim_fraction > 0 and len(ids) >= 3:
        n_trim = int(math.floor(config.trim_fraction * len(ids)))
        mean = {}
        for k in names:
            stacked = np.sort(np.stack([d[k] for d in deltas]), axis=0)
            mean[k] = stacked[n_trim:len(ids) - n_trim].mean(axis=0)
    else:
        mean = fedavg(list(zip(deltas, weights)))
    new = {k: (np.asarray(global_params[k], np.float64) + mean[k]).astype(np.float32) for k in names}
    if not all(np.isfinite(v).all() for v in new.values()):
        raise ShapeError("the aggregate overflowed float32 (extreme client parameters)")
    return MLPAggregate(new, ids, int(sum(updates[c].n_samples for c in ids)), epsilon)


__all__ = ["MLPAggregate", "MLPAggregationConfig", "MLPUpdate", "aggregate_mlp"]
