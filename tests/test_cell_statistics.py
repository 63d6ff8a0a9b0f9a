"""Per-(cell, model) statistics: pooled == merged, shrinkage by hand, Voronoi lookup by hand."""

import numpy as np
import pytest

from sdk import CellStatistics, nearest_cell
from sdk.errors import ShapeError
from sdk.voronoi import CentroidTable
from trainer.routers.shrinkage import additive_effects, model_means, shrunk_means

pytestmark = pytest.mark.sdk  # runs in the base-install venv of .ci/run too


def _random_log(rng, n, n_cells, n_models):
    return (
        rng.integers(0, n_cells, n),
        rng.integers(0, n_models, n),
        rng.integers(0, 2, n).astype(float),
        rng.random(n) * 1e-3,
    )


def test_merge_equals_the_statistics_of_the_pooled_data():
    rng = np.random.default_rng(0)
    parts = [_random_log(rng, n, 4, 3) for n in (50, 7, 120)]
    merged = CellStatistics.merge([CellStatistics.from_samples(*p, 4, 3) for p in parts])
    pooled = CellStatistics.from_samples(*[np.concatenate(x) for x in zip(*parts)], 4, 3)
    np.testing.assert_array_equal(merged.count, pooled.count)
    np.testing.assert_allclose(merged.sum_accuracy, pooled.sum_accuracy, rtol=1e-12)
    np.testing.assert_allclose(merged.sum_cost, pooled.sum_cost, rtol=1e-12)
    for a, b in zip(shrunk_means(merged, 3.0), shrunk_means(pooled, 3.0)):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_from_samples_hand_computed():
    stats = CellStatistics.from_samples(
        cells=[0, 0, 1, 1, 1], models=[0, 1, 1, 1, 0], accuracy=[1, 0, 1, 0, 1], cost=[1, 2, 3, 5, 7],
        n_cells=2, n_models=2,
    )
    assert stats.count.tolist() == [[1, 1], [1, 2]]
    assert stats.sum_accuracy.tolist() == [[1, 0], [1, 1]]
    assert stats.sum_cost.tolist() == [[1, 2], [7, 8]]
    acc, cost = shrunk_means(stats, 0.0)
    assert acc.tolist() == [[1.0, 0.0], [1.0, 0.5]]
    assert cost.tolist() == [[1.0, 2.0], [7.0, 4.0]]


def test_shrinkage_toward_the_model_mean_hand_computed():
    # Model 0: cell 0 has 1/1 correct, cell 1 has 0/3 -> model mean 1/4. kappa = 2:
    # cell 0: (1 + 2 * 0.25) / (1 + 2) = 0.5 ; cell 1: (0 + 0.5) / (3 + 2) = 0.1 ; empty cell 2: 0.25.
    stats = CellStatistics(
        count=np.array([[1.0], [3.0], [0.0]]),
        sum_accuracy=np.array([[1.0], [0.0], [0.0]]),
        sum_cost=np.array([[4.0], [0.0], [0.0]]),
    )
    acc, cost = shrunk_means(stats, 2.0, prior="model")
    np.testing.assert_allclose(acc[:, 0], [0.5, 0.1, 0.25])
    np.testing.assert_allclose(cost[:, 0], [(4 + 2) / 3, 2 / 5, 1.0])
    raw_acc, _ = shrunk_means(stats, 0.0)
    assert np.isnan(raw_acc[2, 0])


def test_a_model_never_observed_has_no_estimate():
    stats = CellStatistics.from_samples([0], [0], [1.0], [1.0], n_cells=1, n_models=2)
    acc, cost = shrunk_means(stats, 5.0)
    assert acc[0, 0] == pytest.approx(1.0) and np.isnan(acc[0, 1]) and np.isnan(cost[0, 1])


def test_min_count_suppresses_small_cells():
    stats = CellStatistics.from_samples([0, 0, 1], [0, 0, 0], [1, 1, 1], [1, 1, 1], 2, 1)
    kept = stats.suppress_below(2)
    assert kept.count.tolist() == [[2], [0]]
    assert kept.sum_accuracy.tolist() == [[2], [0]]


@pytest.mark.parametrize(
    "count, sum_acc, sum_cost, field",
    [
        ([[-1.0]], [[0.0]], [[0.0]], "count"),
        ([[1.0]], [[2.0]], [[0.0]], "sum_accuracy"),
        ([[1.0]], [[1.0]], [[-0.5]], "sum_cost"),
        ([[np.nan]], [[0.0]], [[0.0]], "count"),
        ([[1.0]], [[1.0]], [[np.inf]], "sum_cost"),
        ([[1.0, 1.0]], [[1.0]], [[1.0]], "sum_accuracy"),  # another shape than count's
        ([1.0], [1.0], [1.0], "count"),  # not 2-D
    ],
)
def test_invalid_statistics_are_refused_naming_the_field(count, sum_acc, sum_cost, field):
    with pytest.raises(ShapeError) as info:
        CellStatistics(np.array(count), np.array(sum_acc), np.array(sum_cost))
    assert str(info.value).split(":")[0] == field


def test_nearest_cell_hand_computed():
    centroids = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    x = np.array([[0.1, 0.1], [0.9, -0.5], [0.0, 1.5], [0.5, 0.0]])
    # The last point is equidistant from cells 0 and 1 -> the lower index.
    assert nearest_cell(x, centroids).tolist() == [0, 1, 2, 0]


@pytest.mark.parametrize("x, c", [
    pytest.param(np.zeros((1, 3)), np.zeros((2, 2)), id="dimensions-differ"),
    pytest.param(np.zeros(3), np.zeros((2, 3)), id="embeddings-1d"),
    pytest.param(np.zeros((1, 2)), np.zeros((0, 2)), id="no-centroids"),
    pytest.param(np.full((1, 2), np.nan), np.zeros((2, 2)), id="embeddings-nan"),
    pytest.param(np.zeros((1, 2)), np.full((2, 2), np.inf), id="centroids-inf"),
])
def test_nearest_cell_refuses_bad_arrays(x, c):
    with pytest.raises(ShapeError, match="centroids"):
        nearest_cell(x, c)


def test_additive_effects_undo_the_confounding_of_plain_model_means():
    # Cell 1 is 0.3 easier than cell 0 for every model; model B is truly 0.1 better than model A,
    # but A was logged mostly in the hard cell and B mostly in the easy one.
    a_true, b_true = np.array([0.4, 0.5]), np.array([0.0, 0.3])
    count = np.array([[9.0, 1.0], [1.0, 9.0]])
    stats = CellStatistics(count, count * (a_true[None, :] + b_true[:, None]), count * 1e-3)
    plain, _ = model_means(stats)
    np.testing.assert_allclose(plain, [0.43, 0.77])  # plain means: B looks 0.34 better
    a, b = additive_effects(stats)
    np.testing.assert_allclose(a[1] - a[0], 0.1, atol=1e-9)
    np.testing.assert_allclose(b[1] - b[0], 0.3, atol=1e-9)
    np.testing.assert_allclose(a[None, :] + b[:, None], a_true[None, :] + b_true[:, None], atol=1e-9)
    # With the additive prior, even a heavily shrunk table keeps the true per-cell values here.
    acc, _ = shrunk_means(stats, prior_strength=1e6)
    np.testing.assert_allclose(acc, a_true[None, :] + b_true[:, None], atol=1e-6)


def test_centroid_table_gives_nearest_cells_answers():
    """The device's cached lookup: the hand-computed cells, ties to the lower index, and the same
    answers as nearest_cell on random float32 queries."""
    centroids = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    x = np.array([[0.1, 0.1], [0.9, 0.0], [0.0, 0.8], [0.5, 0.0]])  # the last is a tie: cell 0
    assert CentroidTable(centroids).nearest(x).tolist() == [0, 1, 2, 0]
    rng = np.random.default_rng(3)
    c = rng.normal(size=(64, 384)).astype(np.float32)
    q = rng.normal(size=(200, 384)).astype(np.float32)
    np.testing.assert_array_equal(CentroidTable(c).nearest(q), nearest_cell(q, c))
