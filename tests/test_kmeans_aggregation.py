"""Server-side K-means aggregation (trainer.federated.kmeans_aggregation): exact merge and Lloyd step,
clipping, trimmed merge, and the Gaussian mechanism against its closed form (Balle & Wang 2018)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from sdk.cell_statistics import CellStatistics
from sdk.errors import InvalidInputError
from sdk.local_update import KMeansUpdate
from trainer.federated.kmeans_aggregation import (
    SENSITIVITY_SQRT,
    AggregationConfig,
    aggregate_kmeans,
    clip_update,
    lloyd_step,
    trimmed_merge,
)
from trainer.federated.gaussian_privacy import gaussian_epsilon


def client_update(rng, centroids, n, n_models=4):
    """A client's update computed like a device does: samples mapped to cells, sums and cell means."""
    from sdk.voronoi import nearest_cell

    x = rng.normal(size=(n, centroids.shape[1]))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    cells = nearest_cell(x, centroids)
    models = rng.integers(0, n_models, n)
    acc = rng.random(n)
    cost = rng.random(n) * 0.01
    stats = CellStatistics.from_samples(cells, models, acc, cost, centroids.shape[0], n_models)
    w = np.bincount(cells, minlength=centroids.shape[0]).astype(float)
    sums = np.zeros_like(centroids, dtype=float)
    np.add.at(sums, cells, x)
    rep = np.flatnonzero(w >= 2)
    return KMeansUpdate(stats, rep, sums[rep] / w[rep, None], w[rep], n), (x, cells, models, acc, cost)


@pytest.fixture
def setting():
    rng = np.random.default_rng(3)
    centroids = rng.normal(size=(5, 8))
    updates, raw = {}, []
    for i, n in enumerate([40, 25, 60]):
        u, r = client_update(rng, centroids, n)
        updates[f"c{i}"] = u
        raw.append(r)
    return centroids, updates, raw


def test_merge_equals_pooled_statistics_and_lloyd_step_equals_centralised(setting):
    centroids, updates, raw = setting
    agg = aggregate_kmeans(centroids, updates, AggregationConfig(), np.random.default_rng(0))
    x = np.concatenate([r[0] for r in raw])
    cells = np.concatenate([r[1] for r in raw])
    pooled = CellStatistics.from_samples(cells, np.concatenate([r[2] for r in raw]), np.concatenate([r[3] for r in raw]),
                                         np.concatenate([r[4] for r in raw]), 5, 4)
    np.testing.assert_allclose(agg.statistics.count, pooled.count)
    np.testing.assert_allclose(agg.statistics.sum_accuracy, pooled.sum_accuracy, rtol=1e-12)
    np.testing.assert_allclose(agg.statistics.sum_cost, pooled.sum_cost, rtol=1e-12)
    assert agg.clients == ("c0", "c1", "c2") and math.isinf(agg.epsilon)
    # Every client has >= 2 samples in each cell it touches here, so the step is the pooled cell mean.
    for k in range(5):
        members = x[cells == k]
        if len(members) and all((r[1] == k).sum() != 1 for r in raw):
            np.testing.assert_allclose(agg.next_centroids[k], members.mean(0), rtol=1e-5, atol=1e-6)


def test_lloyd_step_keeps_a_cell_without_data():
    c = np.array([[1.0, 0.0], [0.0, 1.0]])
    u = KMeansUpdate(CellStatistics.zeros(2, 1), np.array([0]), np.array([[0.6, 0.8]]), np.array([4.0]), 4)
    weights, _, nxt = lloyd_step(c, [u])
    np.testing.assert_allclose(weights, [4, 0])
    np.testing.assert_allclose(nxt, [[0.6, 0.8], [0.0, 1.0]], rtol=1e-6)


def test_clipping_scales_a_heavy_client_to_c_queries_and_keeps_its_means():
    stats = CellStatistics(np.array([[60.0, 40.0]]), np.array([[30.0, 10.0]]), np.array([[0.6, 4.0]]))
    u = KMeansUpdate(stats, np.array([0]), np.array([[1.0, 0.0]]), np.array([100.0]), 100)
    clipped = clip_update(u, clip_count=10, max_cost_usd=None)
    np.testing.assert_allclose(clipped.statistics.count, [[6.0, 4.0]])
    np.testing.assert_allclose(clipped.statistics.sum_accuracy / clipped.statistics.count, [[0.5, 0.25]])
    np.testing.assert_allclose(clipped.local_weights, [10.0])
    # c_max = 0.1 USD: 10 queries may cost 1.0 USD, and the scaled 0.46 USD stays as it is.
    assert clip_update(u, clip_count=10, max_cost_usd=0.1).statistics.sum_cost.sum() == pytest.approx(0.46)
    # c_max = 0.01 USD: the cost bound 0.1 USD binds, s = 0.1 / 4.6, and counts shrink with it.
    both = clip_update(u, clip_count=10, max_cost_usd=0.01)
    assert both.statistics.sum_cost.sum() == pytest.approx(0.1)
    assert both.statistics.count.sum() == pytest.approx(100 * 0.1 / 4.6)
    assert clip_update(u, clip_count=1000, max_cost_usd=None) is u


def test_trimmed_merge_drops_the_extreme_clients_per_entry():
    cnt, acc = [2, 4, 0, 5, 10, 1], [0.2, 2.0, 0, 4.5, 1.0, 1.0]  # means .1 .5 - .9 .1 1.0
    parts = [CellStatistics(np.array([[c]], float), np.array([[a]], float), np.array([[c * 0.01]], float))
             for c, a in zip(cnt, acc)]
    # 5 clients present, beta=0.2 -> one dropped at each end: the first of the tied lowest (client 0,
    # stable order) and the highest (client 5). Kept: clients 4, 1, 3.
    m = trimmed_merge(parts, 0.2)
    assert m.count[0, 0] == 19 and m.sum_accuracy[0, 0] == pytest.approx(7.5)
    assert trimmed_merge(parts, 0.0).count[0, 0] == sum(cnt)


def test_trimmed_merge_resists_a_poisoning_client():
    honest = [CellStatistics(np.array([[10.0]]), np.array([[7.0 + i * 0.1]]), np.array([[0.1]])) for i in range(5)]
    poison = CellStatistics(np.array([[1000.0]]), np.array([[0.0]]), np.array([[0.0]]))
    plain = trimmed_merge([*honest, poison], 0.0)
    robust = trimmed_merge([*honest, poison], 0.2)
    assert plain.sum_accuracy[0, 0] / plain.count[0, 0] < 0.1
    assert 0.7 <= robust.sum_accuracy[0, 0] / robust.count[0, 0] <= 0.74


def _gaussian_delta(eps: float, z: float) -> float:
    """Exact delta(eps) of the Gaussian mechanism with std/sensitivity z (Balle & Wang 2018, Thm. 8)."""
    a = 1.0 / z
    return norm.cdf(a / 2 - eps / a) - math.exp(eps) * norm.cdf(-a / 2 - eps / a)


@pytest.mark.parametrize("z", [0.8, 1.0, 2.0, 5.0])
def test_gaussian_epsilon_matches_the_closed_form(z):
    eps = gaussian_epsilon(z, 1e-5)
    assert _gaussian_delta(eps, z) == pytest.approx(1e-5, rel=1e-3)
    assert _gaussian_delta(eps * 0.99, z) > 1e-5
    # Four releases compose into one with half the noise multiplier.
    assert gaussian_epsilon(z, 1e-5, releases=4) == pytest.approx(gaussian_epsilon(z / 2, 1e-5))
    assert math.isinf(gaussian_epsilon(0.0, 1e-5))


def test_noise_has_the_documented_scale_and_keeps_statistics_valid():
    n_cells, n_models = 40, 25
    centroids = np.eye(n_cells, 8 * 5)[:, :40]
    count = np.full((n_cells, n_models), 1000.0)  # 1e6 queries in all, the clip bound: no scaling
    stats = CellStatistics(count, count * 0.5, count * 0.001)
    u = KMeansUpdate(stats, np.arange(n_cells), centroids, np.full(n_cells, 2.0), int(count.sum()))
    config = AggregationConfig(clip_count=1e6, max_cost_usd=0.01, noise_multiplier=1e-4)
    agg = aggregate_kmeans(centroids, {"a": u}, config, np.random.default_rng(1))
    sigma = 1e-4 * SENSITIVITY_SQRT * 1e6  # 223.6 queries
    assert np.std(agg.statistics.count - count) == pytest.approx(sigma, rel=0.1)
    assert agg.epsilon == pytest.approx(gaussian_epsilon(1e-4, 1e-5))
    assert (agg.statistics.count >= 0).all() and (agg.statistics.sum_accuracy <= agg.statistics.count + 1e-9).all()


@pytest.mark.parametrize("kwargs, field", [
    ({"noise_multiplier": 1.0}, "clip_count"),
    ({"trim_fraction": 0.5}, "trim_fraction"),
    ({"clip_count": 10, "max_cost_usd": 1.0, "noise_multiplier": 1.0, "trim_fraction": 0.1}, "trim_fraction"),
])
def test_configuration_errors(kwargs, field):
    with pytest.raises(InvalidInputError) as info:
        AggregationConfig(**kwargs)
    assert field in str(info.value)
