"""Federated K-means of the clients' posterior means: where FedVPA-GP's prototypes start (issue 28).

Random prototype directions are not where the users' latents lie, and moment matching alone does not move
them there. So at chosen rounds the server re-fits the prototypes to the users' posterior means ``mu_u``
(computed on each client from its own users' pairs; they never leave it) by federated Lloyd iterations:

1. **Start** (first time): every client sends ``(n_i, sum_u mu_u, sum_u mu_u mu_u^T)`` (:func:`moment_stats`);
   the server splits the pooled mean along the leading principal axes, ``m +- sqrt(lambda_j) v_j``
   (:func:`principal_split`, the deterministic start of divisive / PCA-split K-means, Ding and He 2004).
   Later refits start from the current prototypes.
2. **Lloyd step**: every client hard-assigns its users to the nearest centre and sends per centre the count,
   the sum of ``mu_u`` and of ``mu_u^2`` (:func:`lloyd_stats`: a :class:`~trainer.vpa.aggregation.PrototypeStats`
   with one-hot ``gamma``, the upload of a normal round); the server's
   :func:`~trainer.vpa.aggregation.aggregate_prototypes` gives the new centres (means), variances and weights.

Pure numpy; :func:`federated_kmeans` runs both sides on per-client arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trainer.vpa.aggregation import PrototypeStats, Prototypes, aggregate_prototypes


def moment_stats(mu: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """A client's ``(n, sum_u mu_u (d,), sum_u mu_u mu_u^T (d, d))`` of its users' posterior means ``mu`` (n, d)."""
    mu = np.asarray(mu, dtype=np.float64)
    return float(len(mu)), mu.sum(0), mu.T @ mu


def principal_split(moments: Sequence[tuple[float, np.ndarray, np.ndarray]], k: int) -> np.ndarray:
    """K centres (K, d): the pooled mean plus / minus ``sqrt(lambda_j) v_j`` for the leading eigenpairs of the pooled
    covariance, alternating signs (``j = 0, 0, 1, 1, ...``); ``k <= 2 d``."""
    n = sum(m[0] for m in moments)
    mean = sum(m[1] for m in moments) / n
    cov = sum(m[2] for m in moments) / n - np.outer(mean, mean)
    lam, vec = np.linalg.eigh(cov)
    order = np.argsort(lam)[::-1]
    return np.stack([mean + (1 if j % 2 == 0 else -1) * np.sqrt(max(lam[order[j // 2]], 0.0)) * vec[:, order[j // 2]]
                     for j in range(k)])


def lloyd_stats(mu: np.ndarray, centres: np.ndarray) -> PrototypeStats:
    """A client's hard-assignment statistics of its users' means ``mu`` (n, d) to ``centres`` (K, d)."""
    mu = np.asarray(mu, dtype=np.float64)
    nearest = ((mu[:, None] - centres[None]) ** 2).sum(-1).argmin(1)
    onehot = np.eye(len(centres))[nearest]
    return PrototypeStats(mass=onehot.sum(0), sum_mu=onehot.T @ mu, sum_sq=onehot.T @ mu ** 2)


def federated_kmeans(client_mu: Sequence[np.ndarray], k: int, iters: int, start: Prototypes | None = None) -> Prototypes:
    """Prototypes after ``iters`` federated Lloyd steps over the clients' posterior means (module docstring).

    client_mu : per client (n_i, d) float arrays. start : prototypes to refine, or None (principal split).
    """
    if start is None:
        centres = principal_split([moment_stats(m) for m in client_mu], k)
        protos = Prototypes(mu=centres, logvar=np.zeros_like(centres), pi=np.full(k, 1.0 / k))
    else:
        protos = start
    for _ in range(iters):
        protos = aggregate_prototypes([lloyd_stats(m, protos.mu) for m in client_mu], protos)
    return protos
