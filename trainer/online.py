"""Online replay of a train split through a logging policy (METRICS.md "Online protocol";
ARCHITECTURE.md §11): ``fedroute simulate --online``.

One seed: the train queries are split over N clients with the Dirichlet(alpha) task split of the
offline protocol, the federated K-means centroids are fitted from the clients' embeddings (no
labels needed), then each client's queries stream in a random order (``passes`` > 1 draws the
queries again with replacement). For each query the client's policy picks one model and only that
model's outcome (accuracy and cost) is revealed. Every ``round_labels`` labels (summed over
clients) a random ``participation`` share of the clients upload their per-(cell, model) counts and
sums; the merged table is every client's next posterior (:mod:`sdk.exploration`) and the router
scored on the test split (a curve: labels -> gain). After the stream ends every client uploads
once more (the stream is over; a final statistics round), and that router gives the seed's figures.

Policies: ``fixed`` (the paper's logging: client i logs ``m ~ pi_i``, ``pi_i ~ Dir(0.5)``),
``uniform``, ``thompson`` (frontier Thompson sampling of METRICS.md), ``top_two`` (top-two
Thompson sampling on the frontier, :func:`sdk.exploration.top_two_choice`). Before the first merge,
and for a model with no estimate yet, an exploring policy logs uniformly among the models without
an estimate (each model tried before its posterior is used).

Cost trade-off in simulation: each label gets its own position ``u ~ U[0, 1]`` on the normalised
cost axis (the measure the AUC integrates). The frontier policy logs one end of the sampled hull
segment containing ``u``; that is Thompson sampling at the ``lam`` equal to the slope of that
segment, so the logged points cover the cost axis uniformly, as if each query's app asked for a
``lam`` drawn to that end.

The loop reads a query's outcome only for the model it chose (a test poisons the others with NaN).
All randomness of a seed comes from ``numpy.random.default_rng(seed)`` (shared draws: partition,
centroids, stream order, ``u``, participation) and one generator per policy, so policies are
compared on the same streams and a seeded run reproduces bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sdk.cell_statistics import CellStatistics
from sdk.errors import InvalidInputError
from sdk.exploration import beta_posterior, frontier_choice, top_two_choice
from sdk.utility import _decide_unchecked
from sdk.voronoi import nearest_cell
from trainer import metrics
from trainer.config_fields import check_config, check_int, check_real, check_sequence
from trainer.federated.partition import dirichlet_partition
from trainer.routers.kmeans_router import KMeansRouterConfig, federated_centroids
from trainer.routers.shrinkage import shrunk_means

POLICIES = ("fixed", "uniform", "thompson", "top_two")
#: Stable key of each policy's own generator (``default_rng([seed, key])``).
_POLICY_KEY = {"fixed": 1, "uniform": 2, "thompson": 3, "top_two": 4}


def _default_kmeans() -> KMeansRouterConfig:
    # Chosen on a validation split carved from train (benchmarks/online_settings.py, docs/routers-and-results.md).
    return KMeansRouterConfig(n_clusters=3, prior_strength=32.0)


@dataclass
class OnlineConfig:
    """Settings of the online replay.

    policies : logging policies to compare (``POLICIES``).
    round_labels : R, labels (summed over clients) between federated statistics rounds.
    passes : P >= 1, length of the stream in units of the train split (extra queries drawn with replacement).
    n_clients, alpha, preference_concentration, participation : as :class:`trainer.simulation.SimulationConfig`.
    kmeans : the K-means router (K, shrinkage) scored and used as the posterior.
    beta_tt : leader probability of ``top_two``.
    thompson_u_power, top_two_u_power : each exploring policy draws its cost-axis position as
        ``u = v ** power``, ``v ~ U[0, 1]`` (1: uniform, the AUC's measure and METRICS.md's ``thompson``;
        > 1 favours cheap models, < 1 expensive ones).
    thompson_axis_power, top_two_axis_power : the cost axis ``u`` is uniform on: ``cost ** g`` (1: linear,
        the AUC's; 0.5: square root; 0: log cost; :func:`sdk.exploration.frontier_choice`).
    explore_prior_strength : prior strength of the exploring policies' posterior; None = ``kmeans.prior_strength``.
    Raises InvalidInputError for an unknown policy or a value out of range.
    """

    policies: tuple[str, ...] = POLICIES
    round_labels: int = 250
    passes: float = 1.0
    n_clients: int = 10
    alpha: float = 0.6
    preference_concentration: float = 0.5
    participation: float = 0.6
    kmeans: KMeansRouterConfig = field(default_factory=_default_kmeans)
    beta_tt: float = 0.5
    thompson_u_power: float = 1.0
    top_two_u_power: float = 1.0
    thompson_axis_power: float = 1.0
    top_two_axis_power: float = 0.5  # top_two's settings: chosen on validation (benchmarks/online_settings.py --stage targets)
    explore_prior_strength: float | None = None

    def __post_init__(self) -> None:
        check_sequence(self, "policies")
        unknown = sorted(set(self.policies) - set(POLICIES))
        if unknown or not self.policies or len(set(self.policies)) != len(self.policies):
            raise InvalidInputError(f"policies={tuple(self.policies)}: give each once, from {list(POLICIES)}")
        check_int(self, "round_labels", 1)
        check_int(self, "n_clients", 1)
        check_real(self, "passes", 1)
        check_real(self, "alpha", 0, low_open=True)
        check_real(self, "preference_concentration", 0, low_open=True)
        check_real(self, "participation", 0, 1, low_open=True)
        check_real(self, "beta_tt", 0, 1)
        check_real(self, "thompson_u_power", 0, low_open=True)
        check_real(self, "top_two_u_power", 0, low_open=True)
        check_real(self, "thompson_axis_power", 0, 1)
        check_real(self, "top_two_axis_power", 0, 1)
        if self.explore_prior_strength is not None:
            check_real(self, "explore_prior_strength", 0)
        check_config(self, "kmeans", KMeansRouterConfig)
        self.kmeans.participation = self.participation


@dataclass(frozen=True)
class Stream:
    """What the replay reads: train embeddings, tasks (for the client split only), the outcome table
    (read only at the chosen model) and which models are labelled for each query.

    embeddings : (n, d_emb) float32. tasks : (n,). accuracy, cost : (n, n_models) float64 (USD).
    available : (n, n_models) bool, the models a query may be logged with (labelled upstream).
    """

    embeddings: np.ndarray
    tasks: np.ndarray
    accuracy: np.ndarray
    cost: np.ndarray
    available: np.ndarray


@dataclass(frozen=True)
class ScoringSet:
    """The fully labelled split the merged router is scored on: embeddings (n, d_emb), accuracy and cost (n, n_models)."""

    embeddings: np.ndarray
    accuracy: np.ndarray
    cost: np.ndarray


@dataclass
class PolicyRun:
    """One policy on one seed: the curve, the final router's curve report and the served queries."""

    labels: list[int]
    gains: list[float]
    final: metrics.CurveReport | None  # None for a quality-only pool (equal costs)
    served_accuracy: float
    served_cost: float
    chosen: np.ndarray  # (n_labels, 2) int: (query, model) of each label, in stream order
    tables: tuple[np.ndarray, np.ndarray]  # the final router's (n_cells, n_models) accuracy and cost (USD) tables


class _Scorer:
    """Test-split curve of a cell-table router, computed per cell: every test query of a cell gets
    the same decision, so a point is ``sum_k S_k[d_k] / n`` with ``S_k`` the per-cell sums of the true
    accuracy and cost (equal to :func:`trainer.metrics.curve_points` on the per-query predictions)."""

    def __init__(self, test: ScoringSet, centroids: np.ndarray) -> None:
        cells = nearest_cell(test.embeddings, centroids)
        k = centroids.shape[0]
        self.n = test.accuracy.shape[0]
        self.acc_sum = np.zeros((k, test.accuracy.shape[1]))
        self.cost_sum = np.zeros_like(self.acc_sum)
        np.add.at(self.acc_sum, cells, test.accuracy)
        np.add.at(self.cost_sum, cells, test.cost)
        self.occupied = np.flatnonzero(np.bincount(cells, minlength=k) > 0)
        self.true_acc, self.true_cost = test.accuracy, test.cost
        self.lambdas = metrics.lambda_grid()
        mean_cost = test.cost.mean(axis=0)
        self.quality_only = not mean_cost.max() > mean_cost.min()

    def points(self, acc_table: np.ndarray, cost_table: np.ndarray) -> np.ndarray:
        a, c = acc_table[self.occupied], cost_table[self.occupied]
        n_lam, (k, m) = self.lambdas.shape[0], a.shape
        u = (a[None] - self.lambdas[:, None, None] * c[None]).reshape(n_lam * k, m)
        d = _decide_unchecked(u, np.broadcast_to(c[None], (n_lam, k, m)).reshape(n_lam * k, m)).reshape(n_lam, k)
        cells = self.occupied[None, :]
        return np.stack([self.cost_sum[cells, d].sum(axis=1), self.acc_sum[cells, d].sum(axis=1)], axis=1) / self.n

    def score(self, acc_table: np.ndarray, cost_table: np.ndarray,
              references: tuple[float, float]) -> tuple[float, metrics.CurveReport | None]:
        """(gain, curve report) of a cell table. With equal costs (a quality-only pool) there is no
        cost axis: the gain is that of the accuracy of the ``lam = 0`` decisions against the
        references (best single model, oracle) and there is no curve report."""
        points = self.points(acc_table, cost_table)
        if self.quality_only:
            return metrics.gain(float(points[0, 1]), *references), None
        report = metrics.report_points(points, self.true_acc, self.true_cost)
        return metrics.gain(report.auc, *references), report


#: Last seeds' partitions and centroids (the costly part of a seed), keyed by what they depend on, with the
#: generator's state after them: runs that differ only in policy or shrinkage reuse them bit for bit.
_CELLS_CACHE: dict[tuple, tuple] = {}


def _seed_cells(stream: Stream, config: OnlineConfig, rng: np.random.Generator):
    """The seed's client of each query (n,), federated centroids (K, d_emb) and cell of each query (n,)."""
    km = config.kmeans
    digest = hashlib.blake2b(stream.embeddings.tobytes(), digest_size=16)
    digest.update(np.asarray(stream.tasks).astype(str).tobytes())
    key = (digest.hexdigest(), stream.embeddings.shape, str(rng.bit_generator.state), config.n_clients,
           config.alpha, km.n_clusters, km.n_local_clusters, km.centroid_rounds, km.participation)
    if key not in _CELLS_CACHE:
        part = dirichlet_partition(stream.tasks, config.n_clients, config.alpha, rng)
        embs = [stream.embeddings[part.indices(i)] for i in range(config.n_clients)]
        centroids = federated_centroids(embs, km, rng)
        if len(_CELLS_CACHE) >= 256:
            _CELLS_CACHE.clear()
        _CELLS_CACHE[key] = (part.client, centroids, nearest_cell(stream.embeddings, centroids), rng.bit_generator.state)
    client, centroids, cells, state = _CELLS_CACHE[key]
    rng.bit_generator.state = state
    return client, centroids, cells


def _stream_order(client: np.ndarray, passes: float, rng: np.random.Generator) -> np.ndarray:
    """Query indices in stream order: every query once in a random order, then ``(passes - 1) * n``
    more drawn uniformly with replacement (each client's queries in proportion to its share)."""
    n = client.shape[0]
    extra = int(round((passes - 1.0) * n))
    return np.concatenate([rng.permutation(n), rng.integers(0, n, size=extra)]).astype(np.int64)


def _tables(stats: CellStatistics, config: KMeansRouterConfig) -> tuple[np.ndarray, np.ndarray]:
    return shrunk_means(stats, config.prior_strength, config.model_prior_strength, config.prior)


def _choose(policy: str, queries: np.ndarray, client: np.ndarray, cells: np.ndarray, stream: Stream,
            merged: CellStatistics | None, u: np.ndarray, preference: np.ndarray, config: OnlineConfig,
            rng: np.random.Generator) -> np.ndarray:
    """One model per query of the batch (n_batch,) int64; reads no outcome."""
    avail = stream.available[queries]
    if policy == "fixed":
        p = preference[client[queries]] * avail
        zero = p.sum(axis=1) == 0
        p[zero] = avail[zero]
        p /= p.sum(axis=1, keepdims=True)
        pick = (np.cumsum(p, axis=1) < rng.random(queries.shape[0])[:, None]).sum(axis=1)
        return np.minimum(pick, avail.shape[1] - 1)
    uniform = np.argmax(np.where(avail, rng.random(avail.shape), -1.0), axis=1)
    if policy == "uniform" or merged is None:
        return uniform
    kappa = config.kmeans.prior_strength if config.explore_prior_strength is None else config.explore_prior_strength
    acc, cost = _tables(merged, dataclasses.replace(config.kmeans, prior_strength=kappa))
    alpha, beta = beta_posterior(acc, merged.count, kappa)
    k = cells[queries]
    a, b, c = alpha[k], beta[k], cost[k]
    unknown = avail & ~(np.isfinite(a) & np.isfinite(c))
    a, b, c = (np.where(avail, x, np.nan) for x in (a, b, c))
    rows = np.arange(queries.shape[0])
    # A model without an estimate yet is tried first (uniformly among such models).
    untried = np.argmax(np.where(unknown, rng.random(avail.shape), -1.0), axis=1)
    explore = ~unknown.any(axis=1)
    out = untried.copy()
    if explore.any():
        q = rows[explore]
        if policy == "thompson":
            out[q] = frontier_choice(a[q], b[q], c[q], u[q] ** config.thompson_u_power, np.arange(q.shape[0]), rng,
                                     axis_power=config.thompson_axis_power)
        else:
            out[q] = top_two_choice(a[q], b[q], c[q], u[q] ** config.top_two_u_power, np.arange(q.shape[0]), rng,
                                    beta_tt=config.beta_tt, axis_power=config.top_two_axis_power)
    return out.astype(np.int64)


def run_online_seed(stream: Stream, test: ScoringSet, config: OnlineConfig, seed: int,
                    references: tuple[float, float]) -> dict[str, PolicyRun]:
    """One seed of the online protocol for every policy of ``config`` (module docstring).

    ``references`` : (AUC of the zero router, AUC of the oracle) on ``test``, for the gain; for a
    quality-only pool (equal costs), (accuracy of the best single model, accuracy of the oracle).
    Returns {policy: PolicyRun}.
    """
    rng = np.random.default_rng(seed)
    n_models = stream.accuracy.shape[1]
    client, centroids, cells = _seed_cells(stream, config, rng)
    n_cells = centroids.shape[0]
    order = _stream_order(client, config.passes, rng)
    u = rng.random(order.shape[0])
    preference = rng.dirichlet(np.full(n_models, config.preference_concentration), size=config.n_clients)
    bounds = list(range(0, order.shape[0], config.round_labels)) + [order.shape[0]]
    n_part = max(1, int(round(config.participation * config.n_clients)))
    participants = [rng.choice(config.n_clients, size=n_part, replace=False) for _ in bounds[1:]]
    participants[-1] = np.arange(config.n_clients)  # the final round after the stream: every client
    scorer = _Scorer(test, centroids)

    runs: dict[str, PolicyRun] = {}
    for policy in config.policies:
        prng = np.random.default_rng([seed, _POLICY_KEY[policy]])
        own = np.zeros((3, config.n_clients, n_cells, n_models))  # count, sum acc, sum cost per client
        uploaded = np.zeros_like(own)
        merged: CellStatistics | None = None
        labels, gains, chosen = [], [], []
        served_acc = served_cost = 0.0
        for r, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
            q = order[start:stop]
            m = _choose(policy, q, client, cells, stream, merged, u[start:stop], preference, config, prng)
            acc, cost = stream.accuracy[q, m], stream.cost[q, m]  # the only outcome read: the chosen model's
            served_acc += acc.sum()
            served_cost += cost.sum()
            chosen.append(np.stack([q, m], axis=1))
            for arr, val in ((own[0], 1.0), (own[1], acc), (own[2], cost)):
                np.add.at(arr, (client[q], cells[q], m), val)
            uploaded[:, participants[r]] = own[:, participants[r]]
            total = uploaded.sum(axis=1)
            if total[0].sum() == 0:
                continue
            merged = CellStatistics(total[0], np.minimum(total[1], total[0]), total[2])
            tables = _tables(merged, config.kmeans)
            gain, report = scorer.score(*tables, references)
            labels.append(stop)
            gains.append(gain)
        runs[policy] = PolicyRun(labels, gains, report, served_acc / order.shape[0], served_cost / order.shape[0],
                                 np.concatenate(chosen), tables)
    return runs


def dense_tables(stream: Stream, config: OnlineConfig, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(centroids (K, d_emb), accuracy and cost tables (K, n_models)) of the same K-means router (same seed's
    centroids) with every train query labelled by every available model."""
    _, centroids, cells = _seed_cells(stream, config, np.random.default_rng(seed))
    k, m = centroids.shape[0], stream.accuracy.shape[1]
    stats = np.zeros((3, k, m))
    avail = stream.available
    for j in range(m):
        rows = np.flatnonzero(avail[:, j])
        for arr, val in ((stats[0], 1.0), (stats[1], stream.accuracy[rows, j]), (stats[2], stream.cost[rows, j])):
            np.add.at(arr[:, j], cells[rows], val)
    return centroids, *_tables(CellStatistics(*stats), config.kmeans)


def dense_ceiling(stream: Stream, test: ScoringSet, config: OnlineConfig, seed: int,
                  references: tuple[float, float]) -> float:
    """Gain of :func:`dense_tables`' router: the ceiling a logging policy approaches."""
    centroids, acc, cost = dense_tables(stream, config, seed)
    return _Scorer(test, centroids).score(acc, cost, references)[0]


def _se(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1) / np.sqrt(x.shape[0])) if x.shape[0] > 1 else float("nan")


def _finite_or_none(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _saved(cost_at_best: np.ndarray) -> dict:
    """Median of ``1 - cost@best_acc`` over seeds (None when most seeds never reach it), its bootstrap SE
    over seeds (None when a resample's median is such a seed), the per-seed savings (None = never) and the
    never-reaches share (strict JSON: no infinities)."""
    saved, never = metrics.cost_saved_at_best_acc(cost_at_best)
    boot = np.random.default_rng(0).integers(0, cost_at_best.shape[0], size=(2000, cost_at_best.shape[0]))
    saved_boot = np.array([metrics.cost_saved_at_best_acc(cost_at_best[b])[0] for b in boot])
    return {
        "cost_saved_at_best_acc_median": _finite_or_none(saved),
        "cost_saved_at_best_acc_median_se": float(saved_boot.std(ddof=1)) if np.isfinite(saved_boot).all() else None,
        "cost_saved_at_best_acc_per_seed": [_finite_or_none(1.0 - c) for c in cost_at_best],
        "never_reaches_best_share": never,
    }


def _savings(finals: Sequence[metrics.CurveReport], weak: np.ndarray | None, strong: np.ndarray | None) -> dict:
    """APGR and CPT (None without a RouteLLM weak/strong pair) and the cost saved at the best single model's accuracy."""
    pts = [r.points for r in finals]
    return {
        "apgr_mean": None if weak is None else float(np.mean([metrics.apgr(p, weak, strong) for p in pts])),
        # None: no weak/strong pair, or most seeds never reach that share of the gap (strict JSON)
        "cpt50_median": None if weak is None else _finite_or_none(np.median([metrics.cpt(p, weak, strong, 0.5) for p in pts])),
        "cpt80_median": None if weak is None else _finite_or_none(np.median([metrics.cpt(p, weak, strong, 0.8) for p in pts])),
        **_saved(np.array([r.cost_at_best_acc for r in finals])),
    }


def summarise_online(per_seed: Sequence[dict[str, PolicyRun]], weak_strong: tuple[np.ndarray, np.ndarray] | None,
                     ceilings: Sequence[float]) -> dict:
    """Per policy: gain mean, SE, median and per seed; APGR; CPT(50%) and CPT(80%) medians;
    cost saved at the best single model's accuracy (median, its bootstrap SE over seeds, per seed:
    None = never) and the never-reaches share; served
    accuracy and USD cost; the curve (labels -> gain mean and SE over seeds); and the paired
    difference against ``fixed`` (mean and SE over seeds) where it ran."""
    weak, strong = weak_strong if weak_strong is not None else (None, None)
    out: dict = {}
    policies = list(per_seed[0])
    for policy in policies:
        runs = [s[policy] for s in per_seed]
        g = np.array([r.gains[-1] for r in runs])
        curve = np.array([r.gains for r in runs])
        entry = {
            "gain_mean": float(g.mean()), "gain_se": _se(g), "gain_median": float(np.median(g)),
            "gain_per_seed": g.tolist(),
            "served_acc": float(np.mean([r.served_accuracy for r in runs])),
            "served_cost_usd": float(np.mean([r.served_cost for r in runs])),
            "curve": {str(lab): float(v) for lab, v in zip(runs[0].labels, curve.mean(axis=0))},
            "curve_se": {str(lab): _se(col) for lab, col in zip(runs[0].labels, curve.T)},
        }
        if runs[0].final is not None:  # a cost axis: the savings an app developer reads
            entry.update(_savings([r.final for r in runs], weak, strong))
        if "fixed" in policies and policy != "fixed":
            d = g - np.array([s["fixed"].gains[-1] for s in per_seed])
            entry["gain_minus_fixed_mean"], entry["gain_minus_fixed_se"] = float(d.mean()), _se(d)
        out[policy] = entry
    c = np.asarray(ceilings, dtype=np.float64)
    out["dense_ceiling"] = {"gain_mean": float(c.mean()), "gain_se": _se(c)}
    return out


def run_online(stream: Stream, test: ScoringSet, config: OnlineConfig, seeds: Sequence[int],
               weak_strong: tuple[np.ndarray, np.ndarray] | None,
               progress: Callable[[Sequence[int]], Sequence[int]] = lambda s: s) -> dict:
    """All seeds; returns :func:`summarise_online`'s summary. ``progress`` wraps the seed list (tqdm).
    ``weak_strong`` : RouteLLM's pair as (cost, accuracy) points on ``test``; None for a quality-only
    pool (equal costs: gain against the best single model and the oracle, no savings)."""
    mean_cost = test.cost.mean(axis=0)
    if mean_cost.max() > mean_cost.min():
        references = (metrics.zero_router_report(test.accuracy, test.cost).auc,
                      metrics.oracle_report(test.accuracy, test.cost).auc)
    else:  # quality only (equal costs): best single model and per-query oracle accuracy
        references = (float(test.accuracy.mean(axis=0).max()), float(test.accuracy.max(axis=1).mean()))
    per_seed, ceilings = [], []
    for seed in progress(list(seeds)):
        per_seed.append(run_online_seed(stream, test, config, seed, references))
        ceilings.append(dense_ceiling(stream, test, config, seed, references))
    return summarise_online(per_seed, weak_strong, ceilings)
