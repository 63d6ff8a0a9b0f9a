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
- ``step_down``: top-two on ``frontier`` whose challenger is drawn among the leader's cheaper models only
  (the pair that decides the next step down the cost axis): a best-arm-identification flavour of TTTS
  (Russo 2020) for the question "is a cheaper model within ``epsilon`` of the leader?".
- ``first_step``: top-two whose challenger labels go to the pair (cell, top model, cheaper model) that is
  the first step down from every cell's most accurate model in a posterior sample of all cells' tables
  (Thompson sampling on which step comes first, the step that decides the saving at the best accuracy).
- ``uniform``: a model uniformly at random among those with an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sdk.utility import _rank_unchecked

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
POLICIES = ("thompson", "frontier", "top_two", "step_down", "first_step", "uniform")
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


def _frontier_end(cost: list[float], theta: list[float], u: float, v: float, axis_power: float, top: bool = False) -> int:
    """The hull end logged at axis position ``u``; ``v ~ U[0, 1]`` picks the end by proximity. With ``top``,
    one end of the hull's top segment (the most accurate sample and its hull neighbour), each with
    probability 1/2, whatever ``u``."""
    h = _upper_hull(cost, theta)
    if top:
        return h[-1] if v < 0.5 or len(h) == 1 else h[-2]
    finite = [c for c, t in zip(cost, theta) if c == c and t == t]
    x = _axis_point(min(finite), max(finite), u, axis_power)
    if x <= cost[h[0]]:
        return h[0]
    if x >= cost[h[-1]]:
        return h[-1]
    i = next(i for i in range(len(h) - 1) if cost[h[i + 1]] > x)
    share = (x - cost[h[i]]) / (cost[h[i + 1]] - cost[h[i]])
    return h[i + 1] if v < share else h[i]


def _frontier_rows(c: Floats, theta: Floats, u: Floats, v: Floats, axis_power: float,
                   top: npt.NDArray[np.bool_] | None = None) -> Ints:
    cl, tl, ul, vl = c.tolist(), theta.tolist(), u.tolist(), v.tolist()
    tops = [False] * len(tl) if top is None else top.tolist()
    return np.array([_frontier_end(cl[i], tl[i], ul[i], vl[i], axis_power, tops[i]) for i in range(len(tl))],
                    dtype=np.int64)


def frontier_choice(alpha: Floats, beta: Floats, cost: Floats, u: npt.ArrayLike, cells: npt.ArrayLike,
                    rng: np.random.Generator, axis_power: float = 1.0, top_share: float = 0.0) -> Ints:
    """Frontier Thompson sampling (METRICS.md "Online protocol"), (n_queries,) int64.

    Arguments as :func:`thompson_choice`; ``u`` (n_queries,) in [0, 1] is each query's position on the
    cost axis from its cheapest to its dearest model with an estimate, on which ``cost ** axis_power``
    is uniform (1: linear, the AUC's axis; 0.5: square root; 0: log), so ``axis_power < 1`` logs cheaper.
    ``top_share`` in [0, 1]: the share of queries that log an end of the sampled hull's top segment
    instead (each end with probability 1/2): labels for the first step down from the most accurate
    model, where the saving at the best model's accuracy is decided. 0 = METRICS.md's policy (and the
    same draws).
    """
    a, b, c, known = _rows(alpha, beta, cost, cells)
    theta = _sample(a, b, known, rng)
    v: Floats = rng.random((theta.shape[0],))
    pos = np.broadcast_to(np.asarray(u, dtype=np.float64), v.shape)
    top = rng.random(v.shape) < top_share if top_share > 0 else None
    return _frontier_rows(np.where(known, c, np.nan), theta, pos, v, axis_power, top)


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
    _resampled_challengers(a, b, c, known, pos, out, pending, rng, max_resamples, axis_power)
    return out


def _resampled_challengers(a: Floats, b: Floats, c: Floats, known: npt.NDArray[np.bool_], pos: Floats, out: Ints,
                           pending: Ints, rng: np.random.Generator, max_resamples: int, axis_power: float) -> None:
    """Top-two's challenger in place: for each row of ``pending``, the first of ``max_resamples`` resampled
    frontier choices that differs from ``out`` (the leader), else the leader."""
    leader = out[pending]
    for _ in range(max_resamples):
        if pending.size == 0:
            break
        p = pending
        other = _frontier_rows(c[p], _sample(a[p], b[p], known[p], rng), pos[p], rng.random((p.shape[0],)), axis_power)
        found = other != leader
        out[p[found]] = other[found]
        pending, leader = p[~found], leader[~found]


def step_down_choice(alpha: Floats, beta: Floats, cost: Floats, u: npt.ArrayLike, cells: npt.ArrayLike,
                     rng: np.random.Generator, beta_tt: float = 0.5, epsilon: float = 0.02,
                     axis_power: float = 1.0, cheapest: bool = False, fallback: bool = False,
                     max_resamples: int = 20) -> Ints:
    """Top-two sampling with a cheaper challenger, (n_queries,) int64.

    The leader ``L`` is :func:`frontier_choice`'s at ``u``. With probability ``1 - beta_tt`` one more
    posterior sample ``theta`` is drawn; among the models cheaper than ``L`` the challenger is
    ``C = argmax theta_j`` (ties: the cheaper), logged if ``theta_C >= theta_L - epsilon``, else ``L``.
    So ``C`` is logged with probability ``(1 - beta_tt) P(C is the best cheaper model and within epsilon
    of L)``: labels go to the pair that decides whether the cell steps down from ``L`` (epsilon-best-arm
    identification between ``L`` and its cheaper rivals, after top-two Thompson sampling, Russo 2020),
    and to none once the posteriors settle the question (then the policy is greedy at ``u``). Arguments
    as :func:`top_two_choice`; ``epsilon`` >= 0 in accuracy units. ``cheapest``: the challenger is instead
    the cheapest model within ``epsilon`` of ``L`` in the sample (the deepest step down that keeps ``L``'s
    accuracy). ``fallback``: where no cheaper model is within ``epsilon``, :func:`top_two_choice`'s
    resampled challenger instead of ``L`` (top-two's exploration kept, the step-down pair preferred).
    """
    a, b, c, known = _rows(alpha, beta, cost, cells)
    c = np.where(known, c, np.nan)
    pos = np.broadcast_to(np.asarray(u, dtype=np.float64), (a.shape[0],))
    out = _frontier_rows(c, _sample(a, b, known, rng), pos, rng.random((a.shape[0],)), axis_power)
    p = np.flatnonzero(rng.random(a.shape[0]) >= beta_tt)  # these may log a challenger
    rows = np.arange(p.shape[0])
    theta = _sample(a[p], b[p], known[p], rng)
    lead = out[p]
    with np.errstate(invalid="ignore"):
        cheaper = c[p] < c[p, lead][:, None]
    if cheapest:
        cheaper &= theta >= theta[rows, lead][:, None] - epsilon
        rival = _rank_unchecked(np.where(cheaper, -c[p], np.nan), np.where(cheaper, c[p], np.nan))[:, 0]
    else:
        rival = _rank_unchecked(np.where(cheaper, theta, np.nan), np.where(cheaper, c[p], np.nan))[:, 0]
    ok = cheaper.any(axis=1)
    rival = np.where(ok, rival, lead).astype(np.int64)
    take = ok & (theta[rows, rival] >= theta[rows, lead] - epsilon)
    out[p[take]] = rival[take]
    if fallback:
        _resampled_challengers(a, b, c, known, pos, out, p[~take], rng, max_resamples, axis_power)
    return out


def first_step_choice(alpha: Floats, beta: Floats, cost: Floats, u: npt.ArrayLike, cells: npt.ArrayLike,
                      rng: np.random.Generator, beta_tt: float = 0.5, axis_power: float = 1.0,
                      available: npt.NDArray[np.bool_] | None = None, max_resamples: int = 20) -> Ints:
    """Top-two sampling whose challenger is the first step down of a sampled table, (n_queries,) int64.

    alpha, beta, cost : (n_cells, n_models) tables (cost (n_models,) broadcasts). The leader is
    :func:`frontier_choice`'s at ``u``. With probability ``1 - beta_tt`` every cell's table is sampled,
    ``theta ~ Beta(alpha, beta)``; in it each cell k's most accurate model ``t_k`` and the step
    ``(k*, j*) = argmin_{k, j: c_kj < c_kt_k} (theta_kt_k - theta_kj) / (c_kt_k - c_kj)``, the cell and
    model a cell-table router switches to first as ``lam`` grows from 0 (the step that decides the saving at
    the best model's accuracy). A query of cell ``k*`` logs ``t_k*`` or ``j*`` (1/2 each); any other query
    (or one whose pick is not ``available``, (n_queries, n_models) bool) logs :func:`top_two_choice`'s
    resampled challenger. Arguments otherwise as :func:`top_two_choice`.
    """
    a, b, c, known = _rows(alpha, beta, cost, cells)
    if available is not None:
        known = known & available
    c = np.where(known, c, np.nan)
    pos = np.broadcast_to(np.asarray(u, dtype=np.float64), (a.shape[0],))
    out = _frontier_rows(c, _sample(a, b, known, rng), pos, rng.random((a.shape[0],)), axis_power)
    p = np.flatnonzero(rng.random(a.shape[0]) >= beta_tt)
    tab_c = np.broadcast_to(np.asarray(cost, dtype=np.float64), alpha.shape)
    tab_known = np.isfinite(alpha) & np.isfinite(beta) & np.isfinite(tab_c)
    shape = (p.shape[0], *alpha.shape)
    theta = _sample(np.broadcast_to(alpha, shape), np.broadcast_to(beta, shape),
                    np.broadcast_to(tab_known, shape), rng)
    top = np.argmax(np.where(tab_known, theta, -np.inf), axis=2)  # (n_p, n_cells)
    th_top = np.take_along_axis(theta, top[..., None], axis=2)
    c_top = tab_c[np.arange(alpha.shape[0])[None, :], top][..., None]
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = np.where(tab_known & (tab_c < c_top), (th_top - theta) / (c_top - tab_c), np.inf)
    flat = np.argmin(slope.reshape(p.shape[0], -1), axis=1)
    k_star, j_star = np.divmod(flat, alpha.shape[1])
    step = np.isfinite(slope.reshape(p.shape[0], -1)[np.arange(p.shape[0]), flat])
    pick = np.where(rng.random(p.shape[0]) < 0.5, top[np.arange(p.shape[0]), k_star], j_star)
    take = step & (np.asarray(cells, dtype=np.int64)[p] == k_star) & known[p, pick]
    out[p[take]] = pick[take]
    _resampled_challengers(a, b, c, known, pos, out, p[~take], rng, max_resamples, axis_power)
    return out


def uniform_choice(alpha: Floats, beta: Floats, cost: Floats, cells: npt.ArrayLike, rng: np.random.Generator) -> Ints:
    """A model uniformly at random among those with a posterior and a cost, (n_queries,) int64."""
    known = _rows(alpha, beta, cost, cells)[3]
    picks: Ints = np.argmax(np.where(known, rng.random(known.shape), -1.0), axis=1).astype(np.int64)
    return picks


def choice_propensities(alpha: Floats, beta: Floats, cost: Floats, lam: float | Floats, cells: npt.ArrayLike,
                        rng: np.random.Generator, n_draws: int = 1000, chosen: npt.ArrayLike | None = None,
                        policy: str = "thompson", u: npt.ArrayLike | None = None, beta_tt: float = 0.5,
                        epsilon: float = 0.02) -> Floats:
    """Each model's probability under ``policy`` per query, (n_queries, n_models) float64, rows summing to 1.

    Exact for ``uniform``; else the share of ``n_draws`` runs of the policy (``lam`` for ``thompson``;
    ``u`` for the frontier ones, None = ``u ~ U[0, 1]`` per run; ``beta_tt`` for the top-two ones,
    ``epsilon`` for ``step_down``), with the logged ``chosen`` model per
    query counted as one more run, so its propensity is > 0.
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
        elif policy == "top_two":
            picks = top_two_choice(alpha, beta, cost, pos, repeated, rng, beta_tt)
        elif policy == "step_down":
            picks = step_down_choice(alpha, beta, cost, pos, repeated, rng, beta_tt, epsilon)
        else:
            picks = first_step_choice(alpha, beta, cost, pos, repeated, rng, beta_tt)
    counts = np.zeros((n, m))
    np.add.at(counts, (np.tile(np.arange(n), n_draws), picks), 1.0)
    if chosen is not None:
        counts[np.arange(n), np.asarray(chosen, dtype=np.int64)] += 1
    out: Floats = counts / counts.sum(axis=1, keepdims=True)
    return out


__all__ = ["POLICIES", "ExplorationPolicy", "beta_posterior", "choice_propensities", "first_step_choice", "frontier_choice",
           "step_down_choice", "thompson_choice", "top_two_choice", "uniform_choice"]
