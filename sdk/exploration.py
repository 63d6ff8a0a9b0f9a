"""Exploration policies over the K-means bundle's per-(cell, model) statistics (ARCHITECTURE.md §11).

The device decides which model to log, so the federated router learns the part of the
accuracy-cost frontier that matters. Shared by the SDK (``Router.choose(..., explore=...)``) and
the trainer's online simulation (``fedroute simulate --online``); numpy only.

Posterior (:func:`beta_posterior`): the bundle ships per (cell k, model m) the shrunk mean
``A_k^m = (S_k^m + kappa P_k^m) / (n_k^m + kappa)`` and the count ``n_k^m``
(:func:`trainer.routers.shrinkage.shrunk_means`). That is the mean of the Beta posterior of a
Bernoulli accuracy with prior ``Beta(kappa P, kappa (1 - P))`` (``kappa`` pseudo-observations, the
trainer's ``prior_strength``) after ``n`` observations summing to ``S``; fractional scores in
[0, 1] use the same update with the sum. So ``alpha = A (n + kappa)``, ``beta = (1 - A)(n + kappa)``.

Policies (all pick one model per query; NaN in a posterior or a cost = no estimate, never chosen):

- ``thompson`` (:func:`thompson_choice`): Thompson sampling at the caller's ``lam`` (Thompson 1933;
  Russo et al. 2018, "A tutorial on Thompson sampling", Alg. 1): sample each model's accuracy from
  its posterior, utility ``sample - lam * cost``, argmax (ties: the cheaper model, then the lower
  index, as :func:`sdk.utility.decide`).
- ``frontier`` (:func:`frontier_choice`, METRICS.md "Online protocol"): sample each model's
  accuracy, build the upper hull of (cost, sample), draw ``u ~ U[0, 1]`` on the query's normalised
  cost axis and log one end of the hull segment containing ``u``, the end drawn with weights by
  proximity to ``u``. At a fixed ``u`` this is Thompson sampling at the ``lam`` equal to the slope of
  that segment, so ``u ~ U[0, 1]`` makes the logged points cover the cost axis the AUC integrates.
- ``top_two`` (:func:`top_two_choice`): top-two Thompson sampling (Russo 2020, "Simple Bayesian
  algorithms for best-arm identification", TTTS) on the frontier policy: with probability ``beta_tt``
  log the frontier choice (the leader); otherwise resample the accuracies (same ``u``) until another
  model wins (the challenger; at most ``max_resamples`` tries, else the leader). It measures the
  runner-up as well as the leader, which is what a router's table needs to rank models.
- ``uniform``: a model uniformly at random among those with an estimate.

:func:`choice_propensities` gives each model's probability under a policy (exact for ``uniform``,
Monte Carlo otherwise), so an offline evaluation of the logged rows stays possible.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sdk.errors import InvalidInputError
from sdk.utility import _rank_unchecked

POLICIES = ("thompson", "frontier", "top_two", "uniform")

#: Floor of the Beta parameters: a cell mean of exactly 0 or 1 gives a parameter of 0, which
#: numpy's sampler refuses; a floor this small keeps the draws at that end (a point mass, in effect).
_MIN_PARAMETER = 1e-9


@dataclass(frozen=True)
class ExplorationPolicy:
    """An opt-in logging policy, a plain value both the device and the simulation read.

    name : one of ``POLICIES``.
    seed : seed of the policy's own generator (:meth:`generator`); None = fresh OS entropy.
    n_draws : Monte Carlo draws per query for :func:`choice_propensities`, >= 1.
    beta_tt : leader probability of ``top_two``, in [0, 1] (0.5: Russo 2020's default).

    Raises InvalidInputError for an unknown name, ``n_draws < 1`` or ``beta_tt`` outside [0, 1].
    """

    name: str = "thompson"
    seed: int | None = None
    n_draws: int = 1000
    beta_tt: float = 0.5

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise InvalidInputError(f"exploration policy name={self.name!r}; valid: {list(POLICIES)}")
        if int(self.n_draws) != self.n_draws or self.n_draws < 1:
            raise InvalidInputError(f"n_draws={self.n_draws!r} must be an integer >= 1")
        if not 0.0 <= float(self.beta_tt) <= 1.0:
            raise InvalidInputError(f"beta_tt={self.beta_tt!r} must lie in [0, 1]")

    def generator(self) -> np.random.Generator:
        """A numpy Generator seeded with ``seed`` (the same seed gives the same choices)."""
        return np.random.default_rng(self.seed)


def beta_posterior(
    accuracy_mean: np.ndarray, count: np.ndarray, prior_strength: float, prior_mean: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Beta posterior of each (cell, model) accuracy from the K-means statistics.

    Parameters
    ----------
    accuracy_mean : ndarray of shape (n_cells, n_models), in [0, 1]; NaN = no estimate. With
        ``prior_mean=None`` it is the bundle's shrunk mean ``(S + kappa P) / (n + kappa)``; with a
        ``prior_mean`` it is the raw cell mean ``S / n`` (any value where ``n == 0``).
    count : ndarray of shape (n_cells, n_models), >= 0, observations per cell (``n``).
    prior_strength : kappa >= 0, the trainer's ``prior_strength`` (pseudo-observations).
    prior_mean : ndarray broadcastable to (n_cells, n_models), the prior mean ``P`` in [0, 1], or None.

    Returns
    -------
    (alpha, beta) : ndarrays of shape (n_cells, n_models), float64, ``alpha = S + kappa P`` and
    ``beta = (n - S) + kappa (1 - P)`` (floored at 1e-9, so a mean of 0 or 1 stays samplable);
    NaN where the mean is NaN.

    Raises
    ------
    InvalidInputError
        ``prior_strength`` negative or not finite, or shapes that do not broadcast.
    """
    kappa = float(prior_strength)
    if not np.isfinite(kappa) or kappa < 0:
        raise InvalidInputError(f"prior_strength={prior_strength!r} must be finite and >= 0")
    mean = np.asarray(accuracy_mean, dtype=np.float64)
    n = np.asarray(count, dtype=np.float64)
    if mean.shape != n.shape:
        raise InvalidInputError(f"accuracy_mean {mean.shape} and count {n.shape} must have one shape")
    if prior_mean is None:
        alpha, beta = mean * (n + kappa), (1.0 - mean) * (n + kappa)
    else:
        prior = np.broadcast_to(np.asarray(prior_mean, dtype=np.float64), mean.shape)
        raw = np.where(n > 0, mean, 0.0)
        alpha, beta = raw * n + kappa * prior, (1.0 - raw) * n + kappa * (1.0 - prior)
        alpha = np.where(np.isnan(mean) & (n > 0), np.nan, alpha)
        beta = np.where(np.isnan(alpha), np.nan, beta)
    with np.errstate(invalid="ignore"):
        return np.maximum(alpha, _MIN_PARAMETER), np.maximum(beta, _MIN_PARAMETER)


def _rows(alpha, beta, cost, cells):
    """Per-query (n, M) posterior parameters and costs; NaN marks a model without an estimate."""
    cells = np.asarray(cells, dtype=np.int64)
    a, b = np.asarray(alpha, dtype=np.float64)[cells], np.asarray(beta, dtype=np.float64)[cells]
    c = np.asarray(cost, dtype=np.float64)
    c = c[cells] if c.ndim == 2 else np.broadcast_to(c, a.shape)
    known = np.isfinite(a) & np.isfinite(b) & np.isfinite(c)
    if not known.any(axis=1).all():
        row = int(np.flatnonzero(~known.any(axis=1))[0])
        raise InvalidInputError(f"query {row} (cell {int(cells[row])}) has no model with a posterior and a cost")
    return a, b, c, known


def _sample(a: np.ndarray, b: np.ndarray, known: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One accuracy draw per (query, model) from Beta(a, b); NaN where not ``known``."""
    out = np.full(a.shape, np.nan)
    out[known] = rng.beta(a[known], b[known])
    return out


def thompson_choice(alpha, beta, cost, lam, cells, rng: np.random.Generator) -> np.ndarray:
    """Thompson sampling at ``lam``: per query, ``argmax_m theta_m - lam * cost_m`` with
    ``theta_m ~ Beta(alpha[k, m], beta[k, m])`` for the query's cell k (module docstring).

    Parameters
    ----------
    alpha, beta : ndarray of shape (n_cells, n_models), float64 (:func:`beta_posterior`; NaN = no estimate).
    cost : ndarray of shape (n_cells, n_models) or (n_models,), USD per query (NaN = no estimate).
    lam : float or ndarray of shape (n_queries,), USD^-1, >= 0 (not validated here: the caller's ``lam``
        went through :func:`sdk.utility.check_lambda`).
    cells : ndarray of shape (n_queries,), int, each query's cell.
    rng : numpy Generator (all randomness comes from it).

    Returns
    -------
    ndarray of shape (n_queries,), int64, the chosen model per query.

    Raises
    ------
    InvalidInputError
        A query whose cell has no model with both a posterior and a cost.
    """
    a, b, c, known = _rows(alpha, beta, cost, cells)
    theta = _sample(a, b, known, rng)
    lam = np.asarray(lam, dtype=np.float64).reshape(-1, 1) if np.ndim(lam) else float(lam)
    return _rank_unchecked(theta - lam * c, np.where(known, c, np.nan))[:, 0]


def _upper_hull(cost: list[float], acc: list[float]) -> list[int]:
    """Model indices of the upper concave hull of (cost, acc), made non-decreasing (METRICS.md
    step 3), by increasing cost; entries that are NaN do not count. Prior validation is assumed
    (plain Python floats: this runs once per query)."""
    idx = sorted((j for j in range(len(acc)) if acc[j] == acc[j] and cost[j] == cost[j]),
                 key=lambda j: (cost[j], -acc[j], j))
    hull: list[int] = []
    for j in idx:
        if hull and cost[j] == cost[hull[-1]]:
            continue
        while len(hull) >= 2:
            o, m = hull[-2], hull[-1]
            if (cost[m] - cost[o]) * (acc[j] - acc[o]) - (acc[m] - acc[o]) * (cost[j] - cost[o]) >= 0:
                hull.pop()
            else:
                break
        hull.append(j)
    best = max(range(len(hull)), key=lambda i: (acc[hull[i]], -i))
    return hull[: best + 1]


def _axis_point(lo: float, hi: float, u: float, power: float) -> float:
    """The cost at position ``u`` in [0, 1] of the axis from ``lo`` to ``hi`` on which ``cost ** power``
    is uniform (1: linear; 0: log, for ``lo > 0``)."""
    if power == 1.0 or hi <= lo or (power == 0.0 and lo <= 0.0):
        return lo + u * (hi - lo)
    if power == 0.0:
        return lo * (hi / lo) ** u
    return (lo**power + u * (hi**power - lo**power)) ** (1.0 / power)


def _frontier_end(cost: list[float], theta: list[float], u: float, v: float, axis_power: float = 1.0) -> int:
    """The hull end logged for position ``u`` in [0, 1] of the cost axis (:func:`_axis_point`), with
    ``v`` a U[0, 1] draw choosing between the segment's two ends (weights by proximity to ``u``)."""
    h = _upper_hull(cost, theta)
    finite = [c for c, t in zip(cost, theta) if c == c and t == t]
    x = _axis_point(min(finite), max(finite), u, axis_power)
    if x <= cost[h[0]]:
        return h[0]
    if x >= cost[h[-1]]:
        return h[-1]
    i = next(i for i in range(len(h) - 1) if cost[h[i + 1]] > x)
    share = (x - cost[h[i]]) / (cost[h[i + 1]] - cost[h[i]])
    return h[i + 1] if v < share else h[i]


def _frontier_rows(c: np.ndarray, theta: np.ndarray, u: np.ndarray, v: np.ndarray,
                   axis_power: float = 1.0) -> np.ndarray:
    cl, tl, ul, vl = c.tolist(), theta.tolist(), u.tolist(), v.tolist()
    return np.array([_frontier_end(cl[i], tl[i], ul[i], vl[i], axis_power) for i in range(len(tl))], dtype=np.int64)


def frontier_choice(alpha, beta, cost, u, cells, rng: np.random.Generator, axis_power: float = 1.0) -> np.ndarray:
    """Frontier Thompson sampling (METRICS.md "Online protocol"; module docstring).

    Parameters
    ----------
    alpha, beta, cost, cells, rng : as :func:`thompson_choice`.
    u : ndarray of shape (n_queries,), in [0, 1], each query's position on its normalised cost axis
        (``(c - min_m cost_m) / (max_m cost_m - min_m cost_m)`` over the models with an estimate).
    axis_power : g >= 0, the axis on which ``u`` is uniform: ``c ** g`` normalised as above (1: the
        linear axis above, the AUC's; 0.5: square-root cost; 0: log cost), so g < 1 draws cheaper points.

    Returns
    -------
    ndarray of shape (n_queries,), int64, the logged model per query.
    """
    a, b, c, known = _rows(alpha, beta, cost, cells)
    theta = _sample(a, b, known, rng)
    v = rng.random(theta.shape[0])
    u = np.broadcast_to(np.asarray(u, dtype=np.float64), v.shape)
    return _frontier_rows(np.where(known, c, np.nan), theta, u, v, axis_power)


def top_two_choice(alpha, beta, cost, u, cells, rng: np.random.Generator, beta_tt: float = 0.5,
                   max_resamples: int = 20, axis_power: float = 1.0) -> np.ndarray:
    """Top-two Thompson sampling on the frontier policy (Russo 2020, TTTS; module docstring).

    Parameters as :func:`frontier_choice`; ``beta_tt`` in [0, 1] is the leader probability and
    ``max_resamples`` the draws spent looking for a challenger before the leader is kept.

    Returns
    -------
    ndarray of shape (n_queries,), int64.
    """
    a, b, c, known = _rows(alpha, beta, cost, cells)
    c = np.where(known, c, np.nan)
    u = np.broadcast_to(np.asarray(u, dtype=np.float64), (a.shape[0],))
    leader = _frontier_rows(c, _sample(a, b, known, rng), u, rng.random(a.shape[0]), axis_power)
    out = leader.copy()
    pending = np.flatnonzero(rng.random(a.shape[0]) >= beta_tt)  # these log a challenger
    for _ in range(max_resamples):
        if pending.size == 0:
            break
        p = pending
        other = _frontier_rows(c[p], _sample(a[p], b[p], known[p], rng), u[p], rng.random(p.shape[0]), axis_power)
        found = other != leader[p]
        out[p[found]] = other[found]
        pending = p[~found]
    return out


def uniform_choice(alpha, beta, cost, cells, rng: np.random.Generator) -> np.ndarray:
    """A model uniformly at random among those with a posterior and a cost, per query (n_queries,) int64."""
    _, _, _, known = _rows(alpha, beta, cost, cells)
    r = rng.random(known.shape)
    return np.argmax(np.where(known, r, -1.0), axis=1).astype(np.int64)


def choice_propensities(alpha, beta, cost, lam, cells, rng: np.random.Generator, n_draws: int = 1000,
                        chosen: np.ndarray | None = None, policy: str = "thompson", u=None,
                        beta_tt: float = 0.5) -> np.ndarray:
    """Probability of each model under ``policy`` for each query.

    ``uniform`` is exact (1 / number of models with an estimate). The others are Monte Carlo over
    ``n_draws`` runs of the policy; with ``chosen`` (the logged model per query) that decision
    counts as one more draw, so the logged model's propensity is > 0 (an unbiased frequency
    estimate once the decision itself is one of the draws).

    Parameters
    ----------
    alpha, beta, cost, cells, rng : as :func:`thompson_choice`.
    lam : float or ndarray (n_queries,), USD^-1 (``thompson``); ignored by the others.
    u : ndarray (n_queries,) in [0, 1] (``frontier``, ``top_two``); None draws ``u ~ U[0, 1]`` each draw.
    chosen : ndarray (n_queries,), int, or None.

    Returns
    -------
    ndarray of shape (n_queries, n_models), float64, rows summing to 1; 0 for a model without an estimate.
    """
    if policy not in POLICIES:
        raise InvalidInputError(f"policy={policy!r}; valid: {list(POLICIES)}")
    _, _, _, known = _rows(alpha, beta, cost, cells)
    n, m = known.shape
    if policy == "uniform":
        return known / known.sum(axis=1, keepdims=True)
    counts = np.zeros((n, m))
    rows = np.arange(n)
    draws = int(n_draws)
    repeated = np.tile(np.asarray(cells, dtype=np.int64), draws)  # draw-major: query i of draw d at d * n + i
    if policy == "thompson":
        lam_rep = np.tile(np.asarray(lam, dtype=np.float64), draws) if np.ndim(lam) else lam
        picks = thompson_choice(alpha, beta, cost, lam_rep, repeated, rng)
    else:
        pos = rng.random(n * draws) if u is None else np.tile(np.broadcast_to(np.asarray(u, dtype=np.float64), (n,)), draws)
        picks = (frontier_choice(alpha, beta, cost, pos, repeated, rng) if policy == "frontier"
                 else top_two_choice(alpha, beta, cost, pos, repeated, rng, beta_tt))
    np.add.at(counts, (np.tile(rows, draws), picks), 1.0)
    if chosen is not None:
        counts[rows, np.asarray(chosen, dtype=np.int64)] += 1
    return counts / counts.sum(axis=1, keepdims=True)


__all__ = [
    "POLICIES",
    "ExplorationPolicy",
    "beta_posterior",
    "choice_propensities",
    "frontier_choice",
    "thompson_choice",
    "top_two_choice",
    "uniform_choice",
]
