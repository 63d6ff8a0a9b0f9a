"""Server side of FedVPA-GP: what a client uploads and the pure aggregation of one round.

A client's upload (:class:`ClientUpdate`) holds its encoder + reward-head parameters with its number of
training users (FedAvg weight, :func:`trainer.routers.fedavg.fedavg`) and, under the mixture prior, its
**prototype statistics** (:class:`PrototypeStats`): per prototype k the soft-assignment mass
``n_k = sum_u gamma_uk`` of its users and the gamma-weighted sums of their posterior means and second moments,
``sum_u gamma_uk mu_u`` and ``sum_u gamma_uk (mu_u^2 + sigma_u^2)``. No context pair, label, feature or
per-user latent is in it (a client of one user reveals that user's posterior moments, an aggregate of its labels).

The server's prototypes (:func:`aggregate_prototypes`) are the moment-matched (EM M-step) mass-weighted means
over clients: ``mu_k = sum_i S_ik / sum_i n_ik``, ``sigma_k^2 = sum_i Q_ik / sum_i n_ik - mu_k^2`` (at least
``VAR_FLOOR``, at most ``VAR_CAP``: a prototype as wide as two clusters would swallow both) and ``pi_k = sum_i n_ik / sum_{i,l} n_il``; a prototype no client gave mass to keeps its previous
value (and a floor ``PI_FLOOR`` on ``pi_k`` keeps it reachable). Pure functions: no I/O, clock or sampling.
:func:`validate_prototype_stats` runs first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sdk.errors import InvalidInputError, ShapeError
from trainer.routers.fedavg import fedavg, validate_updates

#: Smallest mixing weight a prototype keeps after aggregation (renormalised).
PI_FLOOR = 1e-3
#: Smallest and largest prototype variance per latent dimension.
VAR_FLOOR, VAR_CAP = 1e-2, 1.0


@dataclass(frozen=True)
class Prototypes:
    """The mixture prior ``p(z) = sum_k pi_k N(mu_k, diag(exp(logvar_k)))``.

    mu, logvar : ndarray of shape (K, d_z), float64. pi : ndarray of shape (K,), float64, sums to 1.
    """

    mu: np.ndarray
    logvar: np.ndarray
    pi: np.ndarray


@dataclass(frozen=True)
class PrototypeStats:
    """One client's soft-assignment statistics.

    mass : ndarray of shape (K,), float64, ``sum_u gamma_uk`` over the client's training users (>= 0).
    sum_mu, sum_sq : ndarray of shape (K, d_z), float64, ``sum_u gamma_uk mu_u`` / ``sum_u gamma_uk (mu_u^2 + sigma_u^2)``.
    """

    mass: np.ndarray
    sum_mu: np.ndarray
    sum_sq: np.ndarray


@dataclass(frozen=True)
class ClientUpdate:
    """Everything a client sends in one round: parameters, FedAvg weight, prototype statistics (or None)."""

    params: dict[str, np.ndarray]
    n_examples: float
    prototypes: PrototypeStats | None


def validate_prototype_stats(stats: Sequence[PrototypeStats], k: int, d_z: int) -> None:
    """Raise ShapeError (shape or non-finite value) or InvalidInputError (negative mass), naming the client."""
    for i, s in enumerate(stats):
        for name, arr, shape in (("mass", s.mass, (k,)), ("sum_mu", s.sum_mu, (k, d_z)),
                                 ("sum_sq", s.sum_sq, (k, d_z))):
            if np.shape(arr) != shape or not np.all(np.isfinite(arr)):
                raise ShapeError(f"client {i}: {name} must be finite of shape {shape}, got shape {np.shape(arr)}")
        if np.any(s.mass < 0):
            raise InvalidInputError(f"client {i}: mass must be >= 0, got {s.mass.tolist()}")


def aggregate_prototypes(stats: Sequence[PrototypeStats], previous: Prototypes, var_cap: float = VAR_CAP) -> Prototypes:
    """Mass-weighted prototype means and mixing weights (module docstring); variances at most ``var_cap`` (a tighter
    prior per prototype). Prior validation is assumed."""
    mass = np.sum([s.mass for s in stats], axis=0)
    sum_mu = np.sum([s.sum_mu for s in stats], axis=0)
    sum_sq = np.sum([s.sum_sq for s in stats], axis=0)
    seen = mass > 0
    safe = np.where(seen, mass, 1.0)[:, None]
    mu = np.where(seen[:, None], sum_mu / safe, previous.mu)
    var = np.clip(sum_sq / safe - mu ** 2, VAR_FLOOR, var_cap)
    logvar = np.where(seen[:, None], np.log(var), previous.logvar)
    pi = np.maximum(mass / mass.sum(), PI_FLOOR) if mass.sum() > 0 else previous.pi
    return Prototypes(mu=mu, logvar=logvar, pi=pi / pi.sum())


def aggregate_round(updates: Sequence[ClientUpdate], previous: Prototypes | None, var_cap: float = VAR_CAP
                    ) -> tuple[dict[str, np.ndarray], Prototypes | None]:
    """One round at the server: FedAvg of the parameters, and (mixture prior) the prototypes (variances <= ``var_cap``).

    Raises the validators' errors (:func:`trainer.routers.fedavg.validate_updates`, :func:`validate_prototype_stats`).
    """
    pairs = [(u.params, u.n_examples) for u in updates]
    validate_updates(pairs)
    params = fedavg(pairs)
    if previous is None:
        return params, None
    stats = [u.prototypes for u in updates]
    if any(s is None for s in stats):
        raise InvalidInputError("under the mixture prior every update must carry prototype statistics")
    validate_prototype_stats(stats, *previous.mu.shape)
    return params, aggregate_prototypes(stats, previous, var_cap)
