"""Exploration policies over the K-means bundle's per-(cell, model) statistics (ARCHITECTURE.md §11;
docs/routers-and-results.md "Online"): the Beta posterior of each cell's accuracies and the logging
policies the device (:class:`sdk.Explorer`) and the online replay (``fedroute simulate --online``)
draw from. Internal: inputs validated by the caller. NaN in a posterior or a cost = no estimate,
never chosen; ties go to the cheaper model, then the lower index (:func:`sdk.utility.decide`).

- ``thompson``: Thompson sampling at ``lam`` (Russo et al. 2018, "A tutorial on Thompson sampling", Alg. 1).
- ``frontier`` (METRICS.md "Online protocol"): sample the accuracies, take the upper hull of (cost,
  sample), log one end of the hull segment containing a point ``u`` of the cost axis (the end drawn by
  proximity): Thompson sampling at the ``lam`` of that segment's slope.
- ``top_two``: top-two Thompson sampling (Russo 2020, TTTS) on ``frontier``: the leader with probability
  ``beta_tt``, else a resampled challenger.
- ``uniform``: a model uniformly at random among those with an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sdk.utility import _rank_unchecked

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
POLICIES = ("thompson", "frontier", "top_two", "uniform")
#: Floor of the Beta parameters: a mean of exactly 0 or 1 stays samplable (a point mass, in effect).
_MIN_PARAMETER = 1e-9


@dataclass(frozen=True)
class ExplorationPolicy:
    """A logging policy's name (``POLICIES``), seed (None: OS entropy) and Monte Carlo draws per propensity."""

    name: str = "thompson"
    seed: int | None = None
    n_draws: int = 1000

    def generator(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def beta_posterior(accuracy_mean: npt.ArrayLike, count: npt.ArrayLike, prior_strength: float,
                   prior_mean: npt.ArrayLike | None = None) -> tuple[Floats, Floats]:
    """Beta posterior (alpha, beta), each (n_cells, n_models) float64, of every (cell, model) accuracy.

    With ``prior_mean=None``, ``accuracy_mean`` is the bundle's shrunk mean
    ``A = (S + kappa P) / (n + kappa)`` (:func:`trainer.routers.shrinkage.shrunk_means`), the mean of
    the posterior of prior ``Beta(kappa P, kappa (1 - P))`` after ``n = count`` observations summing
    to ``S``, so ``alpha = A (n + kappa)``, ``beta = (1 - A)(n + kappa)``; with a ``prior_mean`` P it
    is the raw mean ``S / n`` and ``alpha = S + kappa P``, ``beta = n - S + kappa (1 - P)``.
    ``kappa = prior_strength`` >= 0. Floored at 1e-9; NaN where the mean is NaN (and ``n > 0``).
    """
    mean, n, kappa = np.asarray(accuracy_mean, dtype=np.float64), np.asarray(count, dtype=np.float64), prior_strength
    if prior_mean is None:
        alpha, beta = mean * (n + kappa), (1.0 - mean) * (n + kappa)
    else:
        prior = np.broadcast_to(np.asarray(prior_mean, dtype=np.float64), mean.shape)
        raw = np.where(n > 0, mean, 0.0)
        alpha = np.where(np.isnan(mean) & (n > 0), np.nan, raw * n + kappa * prior)
        beta = np.where(np.isnan(alpha), np.nan, (1.0 - raw) * n + kappa * (1.0 - prior))
    with np.errstate(invalid="ignore"):
        return np.maximum(alpha, _MIN_PARAMETER), np.maximum(beta, _MIN_PARAMETER)


def _rows(alpha: Floats, beta: Floats, cost: Floats, cells: npt.ArrayLike) -> tuple[Floats, Floats, Floats, npt.NDArray[np.bool_]]:
    """Per-query (n, M) posterior parameters, costs and which models have an estimate."""
    idx = np.asarray(cells, dtype=np.int64)
    a, b, c = alpha[idx], beta[idx], np.asarray(cost, dtype=np.float64)
    c = c[idx] if c.ndim == 2 else np.broadcast_to(c, a.shape)
    return a, b, c, np.isfinite(a) & np.isfinite(b) & np.isfinite(c)


def _sample(a: Floats, b: Floats, known: npt.NDArray[np.bool_], rng: np.random.Generator) -> Floats:
    out = np.full(a.shape, np.nan)
    out[known] = rng.beta(a[known], b[known])
    return out


def thompson_choice(alpha: Floats, beta: Floats, cost: Floats, lam: float | Floats, cells: npt.ArrayLike,
                    rng: np.random.Generator) -> Ints:
    """Thompson sampling at ``lam``: per query ``argmax_m theta_m - lam * cost_m``, ``theta ~ Beta(alpha_k, beta_k)``.

    alpha, beta : (n_cells, n_models) float64 (:func:`beta_posterior`). cost : (n_cells, n_models) or
    (n_models,), USD per query. lam : float or (n_queries,), USD^-1. cells : (n_queries,) int, each
    query's cell. Returns the chosen model per query, (n_queries,) int64.
    """
    a, b, c, known = _rows(alpha, beta, cost, cells)
    theta = _sample(a, b, known, rng)
    lam_col = np.asarray(lam, dtype=np.float64).reshape(-1, 1) if np.ndim(lam) else float(lam)
    return _rank_unchecked(theta - lam_col * c, np.where(known, c, np.nan))[:, 0].astype(np.int64)


def _upper_hull(cost: list[float], acc: list[float]) -> list[int]:
    """Model indices of the non-decreasing upper hull of (cost, acc) by increasing cost (METRICS.md step 3); NaN skipped."""
    idx = sorted((j for j in range(len(acc)) if acc[j] == acc[j] and cost[j] == cost[j]),
                 key=lambda j: (cost[j], -acc[j], j))
    hull: list[int] = []
    for j in idx:
        if hull and cost[j] == cost[hull[-1]]:
            continue
        while len(hull) >= 2:
            o, m = hull[-2], hull[-1]
            if (cost[m] - cost[o]) * (acc[j] - acc[o]) - (acc[m] - acc[o]) * (cost[j] - cost[o]) < 0:
                break
            hull.pop()
        hull.append(j)
    best = max(range(len(hull)), key=lambda i: (acc[hull[i]], -i))
    return hull[: best + 1]


def _axis_point(lo: float, hi: float, u: float, power: float) -> float:
    """The cost at position ``u`` in [0, 1] of the axis from ``lo`` to ``hi`` on which ``cost ** power``
    is uniform (1: linear; 0: log, for ``lo > 0``)."""
    if power == 1.0 or hi <= lo or (power == 0.0 and lo <= 0.0):
        return lo + u * (hi - lo)
    if power == 0.0:
        return float(lo * (hi / lo) ** u)
    return float((lo**power + u * (hi**power - lo**power)) ** (1.0 / power))


def _frontier_end(cost: list[float], theta: list[float], u: float, v: float, axis_power: float) -> int:
    """The hull end logged at axis position ``u``; ``v ~ U[0, 1]`` picks the end by proximity."""
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


def _frontier_rows(c: Floats, theta: Floats, u: Floats, v: Floats, axis_power: float) -> Ints:
    cl, tl, ul, vl = c.tolist(), theta.tolist(), u.tolist(), v.tolist()
    return np.array([_frontier_end(cl[i], tl[i], ul[i], vl[i], axis_power) for i in range(len(tl))], dtype=np.int64)


def frontier_choice(alpha: Floats, beta: Floats, cost: Floats, u: npt.ArrayLike, cells: npt.ArrayLike,
                    rng: np.random.Generator, axis_power: float = 1.0) -> Ints:
    """Frontier Thompson sampling (METRICS.md "Online protocol"), (n_queries,) int64.

    Arguments as :func:`thompson_choice`; ``u`` (n_queries,) in [0, 1] is each query's position on the
    cost axis from its cheapest to its dearest model with an estimate, on which ``cost ** axis_power``
    is uniform (1: linear, the AUC's axis; 0.5: square root; 0: log), so ``axis_power < 1`` logs cheaper.
    """
    a, b, c, known = _rows(alpha, beta, cost, cells)
    theta = _sample(a, b, known, rng)
    v: Floats = rng.random((theta.shape[0],))
    pos = np.broadcast_to(np.asarray(u, dtype=np.float64), v.shape)
    return _frontier_rows(np.where(known, c, np.nan), theta, pos, v, axis_power)


def top_two_choice(alpha: Floats, beta: Floats, cost: Floats, u: npt.ArrayLike, cells: npt.ArrayLike,
                   rng: np.random.Generator, beta_tt: float = 0.5, max_resamples: int = 20,
                   axis_power: float = 1.0) -> Ints:
    """Top-two Thompson sampling on :func:`frontier_choice` (Russo 2020): with probability ``beta_tt`` the
    leader, else the first of ``max_resamples`` resampled frontier choices that differs from it (else the
    leader). (n_queries,) int64."""
    a, b, c, known = _rows(alpha, beta, cost, cells)
    c = np.where(known, c, np.nan)
    pos = np.broadcast_to(np.asarray(u, dtype=np.float64), (a.shape[0],))
    leader = _frontier_rows(c, _sample(a, b, known, rng), pos, rng.random((a.shape[0],)), axis_power)
    out = leader.copy()
    pending = np.flatnonzero(rng.random(a.shape[0]) >= beta_tt)  # these log a challenger
    leader = leader[pending]
    for _ in range(max_resamples):
        if pending.size == 0:
            break
        p = pending
        other = _frontier_rows(c[p], _sample(a[p], b[p], known[p], rng), pos[p], rng.random((p.shape[0],)), axis_power)
        found = other != leader
        out[p[found]] = other[found]
        pending, leader = p[~found], leader[~found]
    return out


def uniform_choice(alpha: Floats, beta: Floats, cost: Floats, cells: npt.ArrayLike, rng: np.random.Generator) -> Ints:
    """A model uniformly at random among those with a posterior and a cost, (n_queries,) int64."""
    known = _rows(alpha, beta, cost, cells)[3]
    picks: Ints = np.argmax(np.where(known, rng.random(known.shape), -1.0), axis=1).astype(np.int64)
    return picks


def choice_propensities(alpha: Floats, beta: Floats, cost: Floats, lam: float | Floats, cells: npt.ArrayLike,
                        rng: np.random.Generator, n_draws: int = 1000, chosen: npt.ArrayLike | None = None,
                        policy: str = "thompson", u: npt.ArrayLike | None = None, beta_tt: float = 0.5) -> Floats:
    """Each model's probability under ``policy`` per query, (n_queries, n_models) float64, rows summing to 1.

    Exact for ``uniform``; else the share of ``n_draws`` runs of the policy (``lam`` for ``thompson``;
    ``u`` for the frontier ones, None = ``u ~ U[0, 1]`` per run; ``beta_tt`` for ``top_two``), with the
    logged ``chosen`` model per query counted as one more run, so its propensity is > 0.
    """
    known = _rows(alpha, beta, cost, cells)[3]
    n, m = known.shape
    if policy == "uniform":
        return np.asarray(known / known.sum(axis=1, keepdims=True), dtype=np.float64)
    repeated = np.tile(np.asarray(cells, dtype=np.int64), n_draws)  # draw-major: query i of draw d at d * n + i
    if policy == "thompson":
        lam_rep = np.tile(np.asarray(lam, dtype=np.float64), n_draws) if np.ndim(lam) else lam
        picks = thompson_choice(alpha, beta, cost, lam_rep, repeated, rng)
    else:
        pos = rng.random(n * n_draws) if u is None else np.tile(np.broadcast_to(np.asarray(u, dtype=np.float64), (n,)), n_draws)
        if policy == "frontier":
            picks = frontier_choice(alpha, beta, cost, pos, repeated, rng)
        else:
            picks = top_two_choice(alpha, beta, cost, pos, repeated, rng, beta_tt)
    counts = np.zeros((n, m))
    np.add.at(counts, (np.tile(np.arange(n), n_draws), picks), 1.0)
    if chosen is not None:
        counts[np.arange(n), np.asarray(chosen, dtype=np.int64)] += 1
    out: Floats = counts / counts.sum(axis=1, keepdims=True)
    return out


__all__ = ["POLICIES", "ExplorationPolicy", "beta_posterior", "choice_propensities", "frontier_choice",
           "thompson_choice", "top_two_choice", "uniform_choice"]
