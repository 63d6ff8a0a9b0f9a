"""Routers on small problems with known answers; federated K-means == pooled statistics; round trips."""

import numpy as np
import pytest

from sdk import CellStatistics
from sdk.errors import InvalidInputError, ShapeError
from trainer.data.client_data import ClientData
from trainer.routers.kmeans_router import (
    KMeansRouter,
    KMeansRouterConfig,
    client_statistics,
    fit_federated_kmeans_router,
    fit_kmeans_router,
)
from trainer.routers.mlp_router import MLPRouter, MLPRouterConfig, _observed_loss, build_network, train_mlp_router

MODELS = ("cheap", "strong")


def two_topic_clients(rng, n_clients=4, n_per_client=150, d=8):
    """Two well-separated topics; 'cheap' is right on topic 0 only, 'strong' on topic 1 only.
    Costs: cheap 1e-4 USD, strong 1e-3 USD. One random model logged per query."""
    centres = np.zeros((2, d), dtype=np.float32)
    centres[0, 0], centres[1, 1] = 1.0, 1.0
    clients = []
    for _ in range(n_clients):
        topic = rng.integers(0, 2, n_per_client)
        x = centres[topic] + 0.05 * rng.normal(size=(n_per_client, d)).astype(np.float32)
        model = rng.integers(0, 2, n_per_client)
        acc = (model == topic).astype(float)
        cost = np.where(model == 0, 1e-4, 1e-3)
        clients.append(ClientData(x.astype(np.float32), model, acc, cost))
    t_topic = rng.integers(0, 2, 200)
    x_test = (centres[t_topic] + 0.05 * rng.normal(size=(200, d))).astype(np.float32)
    return clients, x_test, t_topic


def test_federated_kmeans_statistics_equal_pooled_statistics_for_the_same_centroids():
    rng = np.random.default_rng(0)
    clients, _, _ = two_topic_clients(rng)
    cfg = KMeansRouterConfig(n_clusters=4, n_local_clusters=3, participation=1.0, statistics_rounds=1)
    fed = fit_federated_kmeans_router(clients, MODELS, cfg, rng)
    pooled = client_statistics(ClientData.pool(clients), fed.centroids_, len(MODELS))
    np.testing.assert_array_equal(fed.statistics_.count, pooled.count)
    np.testing.assert_allclose(fed.statistics_.sum_accuracy, pooled.sum_accuracy)
    np.testing.assert_allclose(fed.statistics_.sum_cost, pooled.sum_cost)
    assert fed.statistics_.count.sum() == sum(c.n_samples for c in clients)


@pytest.mark.parametrize("federated", [True, False])
def test_kmeans_router_learns_the_right_model_per_topic(federated):
    rng = np.random.default_rng(1)
    clients, x_test, topic = two_topic_clients(rng)
    cfg = KMeansRouterConfig(n_clusters=2, n_local_clusters=2, prior_strength=1.0)
    router = (fit_federated_kmeans_router(clients, MODELS, cfg, rng) if federated
              else fit_kmeans_router(ClientData.pool(clients), MODELS, cfg, seed=0))
    # lam = 0: best accuracy -> the right model per topic. lam = 1e4 USD^-1: cost dominates -> cheap.
    assert np.array_equal(router.decide(x_test, 0.0), topic)
    assert (router.decide(x_test, 1e4) == 0).all()


def test_kmeans_router_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    clients, x_test, _ = two_topic_clients(rng)
    router = fit_kmeans_router(ClientData.pool(clients), MODELS, KMeansRouterConfig(n_clusters=3), seed=0)
    router.save(tmp_path / "km")
    again = KMeansRouter.load(tmp_path / "km")
    for a, b in zip(router.predict(x_test), again.predict(x_test)):
        np.testing.assert_array_equal(a, b)
    assert again.models == MODELS


def test_mlp_loss_touches_only_the_observed_heads():
    import torch

    net = build_network(4, 3, hidden=8, dropout=0.0)
    x = torch.randn(5, 4)
    m = torch.tensor([0, 0, 2, 2, 0])
    loss = _observed_loss(net, x, m, torch.ones(5), torch.ones(5))
    loss.backward()
    assert torch.all(net.accuracy_head.weight.grad[1] == 0) and net.accuracy_head.bias.grad[1] == 0
    assert torch.all(net.cost_head.weight.grad[1] == 0)
    assert torch.any(net.accuracy_head.weight.grad[0] != 0) and torch.any(net.accuracy_head.weight.grad[2] != 0)


def test_mlp_router_learns_the_right_model_per_topic_federated(tmp_path):
    rng = np.random.default_rng(3)
    clients, x_test, topic = two_topic_clients(rng)
    cfg = MLPRouterConfig(hidden=32, rounds=150, patience=30, dropout=0.0)
    router = train_mlp_router(clients, MODELS, cfg, rng, federated=True)
    assert (router.decide(x_test, 0.0) == topic).mean() >= 0.98
    assert (router.decide(x_test, 1e4) == 0).all()
    acc, cost = router.predict(x_test)
    np.testing.assert_allclose(cost.mean(axis=0), [1e-4, 1e-3], rtol=0.2)
    router.save(tmp_path / "mlp")
    again = MLPRouter.load(tmp_path / "mlp")
    for a, b in zip(router.predict(x_test), again.predict(x_test)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_local_router_never_chooses_a_model_it_never_saw():
    rng = np.random.default_rng(4)
    clients, x_test, _ = two_topic_clients(rng)
    only_cheap = clients[0].subset(np.flatnonzero(clients[0].model == 0))
    km = fit_kmeans_router(only_cheap, MODELS, KMeansRouterConfig(n_clusters=2), seed=0)
    mlp = train_mlp_router([only_cheap], MODELS, MLPRouterConfig(hidden=16, epochs=5, epoch_patience=5), rng, federated=False)
    for router in (km, mlp):
        acc, _ = router.predict(x_test)
        assert np.isnan(acc[:, 1]).all()
        assert (router.decide(x_test, 0.0) == 0).all()


def test_router_rejects_wrong_embedding_dimension():
    rng = np.random.default_rng(5)
    clients, _, _ = two_topic_clients(rng)
    router = fit_kmeans_router(clients[0], MODELS, KMeansRouterConfig(n_clusters=2), seed=0)
    with pytest.raises(ShapeError, match=r"\(n_queries, 8\)"):
        router.predict(np.zeros((2, 5), dtype=np.float32))


def test_configs_validate_cross_field_values():
    with pytest.raises(InvalidInputError, match="patience=50 must be <= rounds=10"):
        MLPRouterConfig(rounds=10, patience=50)
    with pytest.raises(InvalidInputError, match="participation"):
        KMeansRouterConfig(participation=0.0)
    with pytest.raises(InvalidInputError):
        KMeansRouter(np.zeros((2, 3)), CellStatistics.zeros(3, 2), MODELS, 1.0)


def test_registry_loads_by_kind_and_lists_valid_kinds(tmp_path):
    from trainer.kinds import load_router, router_class

    rng = np.random.default_rng(6)
    clients, x_test, _ = two_topic_clients(rng)
    fit_kmeans_router(clients[0], MODELS, KMeansRouterConfig(n_clusters=2), seed=0).save(tmp_path / "r")
    assert isinstance(load_router(tmp_path / "r"), KMeansRouter)
    with pytest.raises(InvalidInputError, match=r"'forest'.*\['kmeans', 'mlp'\]"):
        router_class("forest")
