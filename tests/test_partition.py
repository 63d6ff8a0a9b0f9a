"""Simulation protocol (METRICS.md): Dirichlet task split and sparse logging."""

import numpy as np
import pytest

from sdk.errors import InvalidInputError
from trainer.federated.partition import dirichlet_partition, sparse_logging

TASKS = np.array(["a"] * 600 + ["b"] * 300 + ["c"] * 100)


def test_every_query_lands_in_exactly_one_client():
    part = dirichlet_partition(TASKS, 10, 0.6, np.random.default_rng(0))
    assert part.client.shape == TASKS.shape
    assert part.client.min() >= 0 and part.client.max() < 10
    all_idx = np.concatenate([part.indices(i) for i in range(10)])
    assert np.array_equal(np.sort(all_idx), np.arange(TASKS.shape[0]))


@pytest.mark.parametrize("alpha", [0.03, 0.6, 5.0])
def test_client_counts_follow_the_drawn_shares(alpha):
    part = dirichlet_partition(TASKS, 10, alpha, np.random.default_rng(1))
    for task, share in part.shares.items():
        n_task = int((TASKS == task).sum())
        counts = np.bincount(part.client[TASKS == task], minlength=10)
        assert np.all(np.abs(counts - share * n_task) < 1.0 + 1e-9)
        assert share.sum() == pytest.approx(1.0)


def test_shares_concentrate_as_alpha_shrinks():
    def mean_max_share(alpha):
        rng = np.random.default_rng(2)
        return np.mean([max(dirichlet_partition(TASKS, 10, alpha, rng).shares["a"]) for _ in range(200)])

    # E[max share] of Dir(alpha * 1_10): near 1 for alpha -> 0, near 1/10 + small for large alpha.
    assert mean_max_share(0.03) > 0.75
    assert mean_max_share(5.0) < 0.25
    assert mean_max_share(0.03) > mean_max_share(0.6) > mean_max_share(5.0)


def test_partition_is_reproducible_from_the_seed():
    a = dirichlet_partition(TASKS, 5, 0.6, np.random.default_rng(7)).client
    b = dirichlet_partition(TASKS, 5, 0.6, np.random.default_rng(7)).client
    assert np.array_equal(a, b)


def test_sparse_logging_reveals_exactly_one_labelled_model_per_query():
    rng = np.random.default_rng(3)
    n, m = 1000, 5
    acc = rng.integers(0, 2, size=(n, m)).astype(float)
    acc[::7, 2] = np.nan  # unlabelled cells are never drawn
    cost = rng.random((n, m))
    client = rng.integers(0, 4, size=n)
    log = sparse_logging(acc, cost, client, 4, rng)
    assert log.model.shape == (n,)
    rows = np.arange(n)
    assert not np.isnan(acc[rows, log.model]).any()
    assert np.array_equal(log.accuracy, acc[rows, log.model])
    assert np.array_equal(log.cost, cost[rows, log.model])
    assert log.preference.shape == (4, m)
    assert np.allclose(log.preference.sum(axis=1), 1.0)


def test_logged_models_follow_each_clients_preference():
    rng = np.random.default_rng(4)
    n, m = 20000, 4
    acc = np.ones((n, m))
    client = np.repeat([0, 1], n // 2)
    log = sparse_logging(acc, np.ones((n, m)), client, 2, rng)
    for i in (0, 1):
        freq = np.bincount(log.model[client == i], minlength=m) / (n // 2)
        assert np.allclose(freq, log.preference[i], atol=0.02)


def test_a_query_without_labels_cannot_be_logged():
    acc = np.array([[np.nan, np.nan], [1.0, 0.0]])
    with pytest.raises(InvalidInputError, match="query 0"):
        sparse_logging(acc, np.ones((2, 2)), np.zeros(2, dtype=int), 1, np.random.default_rng(0))
