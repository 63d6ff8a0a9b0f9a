"""``Explorer``: opt-in Thompson-sampling exploration on the device over a K-means bundle's cell table
(docs/device-and-bundles.md "Exploration"; Russo et al. 2018, "A tutorial on Thompson sampling", Alg. 1).

For a query in cell ``k`` it draws ``theta_m ~ Beta(alpha_k^m, beta_k^m)``, the posterior of the bundle's
shrunk means (:func:`sdk.exploration.beta_posterior`), and picks ``argmax_m theta_m - lam * C_k^m`` (ties:
the cheaper model, then the lower index). Each :class:`~sdk.router.Choice` carries ``policy`` and
``propensity``: for Thompson sampling the share of ``n_draws`` pooled posterior draws of the cell that the
model wins at ``lam``, the query's own draw counted as one more, ``(count + 1) / (n_draws + 1)``.
"""

from __future__ import annotations

import bisect
import numbers
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sdk.errors import InvalidInputError
from sdk.exploration import ExplorationPolicy, beta_posterior
from sdk.real_numbers import finite_float, is_real_number, shown
from sdk.router import Choice, Router, _check_queries, check_query
from sdk.scorers import KMeansScorer
from sdk.utility import check_lambda

__all__ = ["DEVICE_POLICIES", "Explorer"]

#: Policies an :class:`Explorer` runs (both at the caller's ``lam``; ``frontier`` and ``top_two``: simulation only).
DEVICE_POLICIES = ("thompson", "uniform")
#: (cell, lam) entries of the counted-propensity cache before it is emptied.
_CACHE_SIZE = 4096
#: Largest ``n_draws`` whose propensities are tabulated over ``lam`` (<= n_draws * (n_models - 1) rows per cell).
_TABLE_MAX_DRAWS = 10_000


class Explorer:
    """A K-means :class:`~sdk.Router` that explores: :meth:`choose` samples the model to log. Thread-safe.

    router : a loaded K-means :class:`sdk.Router`. policy : ``"thompson"`` or ``"uniform"`` (every model
    with an estimate alike). seed : int >= 0 or None (OS entropy); a seed reproduces choices and
    propensities bit for bit. n_draws : int in [1, 10**7], posterior draws per cell for the propensity.
    max_regret : float >= 0 or None: the most posterior-mean utility (accuracy points at ``lam``) a query
    may give up against the greedy choice. Attributes ``policy`` (:class:`~sdk.exploration.ExplorationPolicy`),
    ``alpha_``, ``beta_`` ((n_cells, n_models) float64 Beta posterior, NaN: no estimate).
    Raises InvalidInputError for a router that is not a K-means Router or an argument out of range.
    """

    def __init__(self, router: Router, *, policy: str = "thompson", seed: int | None = None, n_draws: int = 1000,
                 max_regret: float | None = None) -> None:
        if not isinstance(router, Router):
            raise InvalidInputError(f"router must be an sdk.Router, got {type(router).__name__}")
        scorer = router._scorer  # the K-means table this module samples from (sdk-internal)
        if not isinstance(scorer, KMeansScorer):
            raise InvalidInputError(f"exploration needs a K-means bundle (per-cell counts and means to sample from); "
                                    f"this bundle's router is {router.router_kind!r}")
        if policy not in DEVICE_POLICIES:
            raise InvalidInputError(f"policy must be one of {list(DEVICE_POLICIES)}, got {shown(policy)}")
        if seed is not None and not (_is_int(seed) and seed >= 0):
            raise InvalidInputError(f"seed must be an int >= 0 or None, got {shown(seed)}")
        if not (_is_int(n_draws) and 1 <= n_draws <= 10**7):
            raise InvalidInputError(f"n_draws must be an int in [1, 10**7], got {shown(n_draws)}")
        if max_regret is not None:
            bound = finite_float(max_regret) if is_real_number(max_regret) else None
            if bound is None or bound < 0:
                raise InvalidInputError(f"max_regret must be a finite real number >= 0 or None, got {shown(max_regret)}")
            max_regret = bound
        self.router = router
        self.policy = ExplorationPolicy(policy, None if seed is None else int(seed), int(n_draws))
        self.max_regret = max_regret
        self.alpha_, self.beta_ = beta_posterior(scorer.accuracy, scorer.count, scorer.prior_strength)
        self._accuracy, self._cost = scorer.accuracy, scorer.cost
        self._seeds = np.random.SeedSequence(self.policy.seed)
        self._rng = np.random.default_rng(self._seeds)
        self._lock = threading.Lock()
        self._plans: dict[tuple[int, float], tuple[_CellPlan, np.ndarray]] = {}
        self._cell_plans: dict[int, _CellPlan] = {}
        self._pools: dict[int, np.ndarray] = {}
        self._tables: dict[int, tuple[list[float], np.ndarray]] = {}

    # -- decisions ----------------------------------------------------------------------------

    def choose(self, query: str, lam: float) -> Choice:
        """The :class:`~sdk.router.Choice` for ``query`` (non-blank str) drawn at ``lam`` (USD^-1, >= 0), with
        ``policy`` and ``propensity`` in (0, 1]; ``scores`` are the posterior means, as greedy's.
        Raises InvalidQueryError, InvalidLambdaError."""
        lam = check_lambda(lam)
        return self._choices([check_query(query)], lam)[0]

    def choose_batch(self, queries: Sequence[str], lam: float) -> list[Choice]:
        """:meth:`choose` for each query (one embedding call). Raises InvalidQueryError, InvalidLambdaError."""
        lam = check_lambda(lam)
        return self._choices(_check_queries(queries), lam)

    def _choices(self, queries: list[str], lam: float) -> list[Choice]:
        acc, cost, cells, emb = self.router._predict(queries)
        assert cells is not None  # K-means bundles only: __init__ refuses the others
        picked, p = np.empty(len(queries), dtype=np.int64), np.empty(len(queries))
        with self._lock:
            for i, k in enumerate(cells):
                plan, probs = self._plan(int(k), lam)
                if plan.models_ranked.size == 0:  # as greedy (sdk.utility.decide): nothing to choose from
                    raise InvalidInputError(f"query {i} (cell {int(k)}) has no model with an estimate")
                picked[i] = plan.draw(self._rng, lam, self.policy.name)
                p[i] = probs[picked[i]]
        if self.policy.name == "thompson":  # the query's own draw is one more run (module docstring)
            n = self.policy.n_draws
            p = (np.rint(p * n) + 1.0) / (n + 1.0)
        return self.router._choices_of(acc, cost, cells, emb, lam, picked, self.policy.name, p)

    # -- what exploring costs -----------------------------------------------------------------

    def probabilities(self, lam: float) -> np.ndarray:
        """Each model's probability of being chosen per cell at ``lam``, (n_cells, n_models) float64, rows
        summing to 1 (NaN rows: no model to choose). Raises InvalidLambdaError."""
        return self._all_probabilities(check_lambda(lam))

    def expected_regret(self, lam: float) -> np.ndarray:
        """Expected utility lost against greedy per query of each cell, ``R_k = sum_m p_k^m (U_k^* - U_k^m)``
        with ``U = A - lam * C``: (n_cells,) float64 accuracy points, NaN: no model. Raises InvalidLambdaError."""
        lam = check_lambda(lam)
        p = self._all_probabilities(lam)
        u = self._accuracy - lam * self._cost
        gap = np.fmax.reduce(u, axis=1, keepdims=True) - u  # fmax skips NaN (no estimate)
        regret: np.ndarray = np.nansum(p * gap, axis=1)  # p is 0 exactly where gap is NaN
        regret[np.isnan(p).all(axis=1)] = np.nan
        return regret

    # -- internals ----------------------------------------------------------------------------

    def _all_probabilities(self, lam: float) -> np.ndarray:
        out = np.full(self._cost.shape, np.nan)
        with self._lock:
            for k in range(out.shape[0]):
                plan, probs = self._plan(k, lam)
                if plan.models_ranked.size:
                    out[k] = probs
        return out

    def _plan(self, cell: int, lam: float) -> tuple[_CellPlan, np.ndarray]:
        """The models ``cell`` offers at ``lam`` and each model's probability (n_models,): Thompson's the share
        of the cell's pooled draws each wins (from the cell's table over ``lam`` without ``max_regret``),
        uniform's exact. Caller holds the lock."""
        plan = self._cell_plans.get(cell)
        if plan is not None and self.policy.name == "thompson" and plan.models_ranked.size \
                and self.policy.n_draws <= _TABLE_MAX_DRAWS:
            table = self._tables.get(cell)
            if table is None:
                ranked = plan.known_ranked
                table = self._tables[cell] = _switch_table(self._pool(cell, ranked), self._cost[cell, ranked], ranked,
                                                           self._cost.shape[1])
            return plan, table[1][bisect.bisect_right(table[0], lam)]
        key = (cell, lam)
        found = self._plans.get(key)
        if found is not None:
            return found
        if len(self._plans) >= _CACHE_SIZE:
            self._plans.clear()
        if plan is None:  # cached without max_regret: then the models do not depend on lam
            plan = self._cell_plan(cell, lam)
            if self.max_regret is None:
                self._cell_plans[cell] = plan
        probs = np.zeros(self._cost.shape[1])
        if self.policy.name == "uniform" and plan.models_ranked.size:
            probs[plan.models_ranked] = 1.0 / plan.models_ranked.size
        elif plan.models_ranked.size:
            u = self._pool(cell, plan.known_ranked) - lam * self._cost[cell, plan.known_ranked]
            if not plan.keep.all():
                u[:, ~plan.keep] = -np.inf
            probs[plan.known_ranked] = np.bincount(np.argmax(u, axis=1), minlength=plan.keep.size) / u.shape[0]
        self._plans[key] = plan, probs
        return plan, probs

    def _cell_plan(self, cell: int, lam: float) -> _CellPlan:
        """The models of ``cell`` with a posterior and a cost, within ``max_regret`` of the greedy utility at ``lam``."""
        a, b, cost = self.alpha_[cell], self.beta_[cell], self._cost[cell]
        known = np.flatnonzero(np.isfinite(a) & np.isfinite(b) & np.isfinite(cost))
        ranked = known[np.lexsort((known, cost[known]))]  # by cost, then index: an argmax keeps the first of a tie
        keep = np.ones(ranked.size, dtype=bool)
        if self.max_regret is not None and ranked.size:
            u = self._accuracy[cell, ranked] - lam * cost[ranked]
            keep = u.max() - u <= self.max_regret
        models = np.sort(ranked[keep])  # column order: the order thompson_choice draws them in
        mask = np.zeros(cost.size, dtype=bool)
        mask[models] = True
        return _CellPlan(mask, a[models], b[models], np.searchsorted(models, ranked[keep]), cost[ranked[keep]],
                         ranked[keep], ranked, keep)

    def _pool(self, cell: int, ranked: np.ndarray) -> np.ndarray:
        """(n_draws, len(ranked)) posterior draws of ``cell``'s models ``ranked``, by a generator of the seed and cell."""
        theta = self._pools.get(cell)
        if theta is None:
            rng = np.random.default_rng(np.random.SeedSequence(self._seeds.entropy, spawn_key=(cell,)))
            theta = rng.beta(self.alpha_[cell, ranked], self.beta_[cell, ranked], size=(self.policy.n_draws, ranked.size))
            self._pools[cell] = theta
        return theta

    def __repr__(self) -> str:
        return (f"Explorer(policy={self.policy.name!r}, seed={self.policy.seed}, n_draws={self.policy.n_draws}, "
                f"max_regret={self.max_regret}, router={self.router!r})")


@dataclass(frozen=True)
class _CellPlan:
    """The models one cell offers at one ``lam`` (``mask``, their posteriors, ranks by (cost, index),
    costs and indices in that order; ``known_ranked``: all with an estimate, ``keep``: within ``max_regret``)."""

    mask: np.ndarray
    alpha: np.ndarray
    beta: np.ndarray
    rank: np.ndarray
    cost_ranked: np.ndarray
    models_ranked: np.ndarray
    known_ranked: np.ndarray
    keep: np.ndarray

    def draw(self, rng: np.random.Generator, lam: float, policy: str) -> int:
        """One query's choice, drawn from ``rng`` as :func:`sdk.exploration.thompson_choice` / ``uniform_choice`` do."""
        if policy == "uniform":
            return int(np.argmax(np.where(self.mask, rng.random(self.mask.size), -1.0)))
        u = rng.beta(self.alpha, self.beta)[self.rank] - lam * self.cost_ranked
        return int(self.models_ranked[np.argmax(u)])


def _switch_table(theta: np.ndarray, cost: np.ndarray, ranked: np.ndarray,
                  n_models: int) -> tuple[list[float], np.ndarray]:
    """Thompson propensities of a cell as a step function of ``lam``: (breakpoints ``b``, table (len(b) + 1,
    n_models)), row ``bisect_right(b, lam)`` = share of draws ``theta`` (n_draws, n_ranked; columns by cost,
    then index) whose ``argmax theta - lam * cost`` is each model. Each draw's winner walks down its upper
    envelope to cheaper models, from ``w`` to ``m`` at ``lam = (theta_w - theta_m) / (c_w - c_m)``."""
    d, r = theta.shape
    rows = np.arange(d)
    winner = np.argmax(theta, axis=1)
    start = np.bincount(winner, minlength=r).astype(np.float64)
    at, old, new = [], [], []
    while rows.size:
        w = winner[rows]
        cw = cost[w][:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            cross = np.where(cost[None, :] < cw, (theta[rows, w][:, None] - theta[rows]) / (cw - cost[None, :]), np.inf)
        nxt = np.argmin(cross, axis=1)  # a tie of crossings: the first column, the cheapest model
        lam = cross[np.arange(rows.size), nxt]
        go = np.isfinite(lam)
        at.append(lam[go])
        old.append(w[go])
        new.append(nxt[go])
        rows = rows[go]
        winner[rows] = nxt[go]
    lams, old_c, new_c = np.concatenate(at), np.concatenate(old), np.concatenate(new)
    order = np.argsort(lams, kind="stable")
    steps = np.zeros((order.size + 1, r))
    steps[0] = start
    steps[1 + np.arange(order.size), old_c[order]] -= 1.0
    steps[1 + np.arange(order.size), new_c[order]] += 1.0
    table = np.zeros((order.size + 1, n_models))
    table[:, ranked] = np.cumsum(steps, axis=0) / d
    return lams[order].tolist(), table


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
