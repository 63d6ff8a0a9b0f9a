"""Audit of the server-side algorithms against their papers: hand-computed values and numerical hazards.

Each test names the rule it checks (paper 000 FedPrism, 001 MoR, 002 federated routers, METRICS.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdk.errors import InvalidInputError
from sdk.personalisation import interpolation_weights
from trainer.data.client_data import ClientData
from trainer.experts.aggregation import aggregate_components, validate_component_update
from trainer.experts.length_init import client_length_coefs
from trainer.experts.prompt_router import pgpd_pseudo_labels
from trainer.metrics import normalised_auc
from trainer.preference_metrics import expert_utilisation
from trainer.rewards.client_router import ClientRouter, ClientRouterData, RouterConfig, local_router_update
from trainer.rewards.reward_models import ScoreNormaliser, bradley_terry_loss
from trainer.rewards.routing_rule import RoutingRule, softmax
from trainer.routers.fedavg import fedavg
from trainer.routers.mlp_router import MLPRouterConfig, train_mlp_router


# ----------------------------------------------------------------- FedPrism (paper 000)

def _p(v: float) -> dict[str, np.ndarray]:
    return {"w": np.full((2,), v, dtype=np.float32)}


def test_component_aggregation_hand_computed_and_zero_count_update_has_weight_zero():
    # expert 0: clients with 1 and 3 samples -> (1*1 + 3*5) / 4 = 4; a third reply with 0 samples has
    # weight 0 in sum n theta / sum n (paper 000, Step 4) and must neither count nor raise.
    # expert 1: only a zero-count reply -> keeps its parameters (no 0/0). expert 2: nobody -> kept.
    current = [_p(0.0), _p(7.0), _p(9.0)]
    updates = [{0: (_p(1.0), 1.0)}, {0: (_p(5.0), 3.0), 1: (_p(100.0), 0.0)}, {0: (_p(-50.0), 0.0)}]
    out = aggregate_components(current, updates)
    np.testing.assert_allclose(out[0]["w"], [4.0, 4.0])
    np.testing.assert_allclose(out[1]["w"], [7.0, 7.0])
    np.testing.assert_allclose(out[2]["w"], [9.0, 9.0])
    with pytest.raises(InvalidInputError):
        validate_component_update(current, {0: (_p(1.0), -1.0)})
    with pytest.raises(InvalidInputError):
        validate_component_update(current, {0: (_p(1.0), float("nan"))})


def test_pgpd_pseudo_label_is_the_retrieved_expert_with_lowest_ce():
    # retrieved experts 2 and 4; CE per sample -> argmin column -> global index (ties: first column)
    ce = np.array([[0.3, 0.1], [0.2, 0.5], [0.4, 0.4]])
    np.testing.assert_array_equal(pgpd_pseudo_labels(ce, np.array([2, 4])), [4, 2, 2])


def test_length_start_with_swapped_copies_is_the_plain_fit_with_C_doubled():
    # the swapped copy (-f, 1 - y) repeats every loss term of a no-intercept logistic regression, so
    # C * sum over 2n terms = (2C) * sum over n terms (the docstring said "halved" before the audit)
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3))
    y = (x @ np.array([1.0, -0.5, 0.2]) + rng.normal(scale=0.5, size=40) > 0).astype(np.int64)
    got = client_length_coefs(x, y, np.zeros(40, np.int64), 1, C=0.3)[0][0]
    doubled = LogisticRegression(C=0.6, fit_intercept=False, tol=1e-10, max_iter=1000).fit(x, y).coef_[0]
    halved = LogisticRegression(C=0.15, fit_intercept=False, tol=1e-10, max_iter=1000).fit(x, y).coef_[0]
    np.testing.assert_allclose(got, doubled, atol=1e-3)
    assert np.abs(got - halved).max() > 1e-2


def test_expert_utilisation_with_unused_experts_has_finite_entropy():
    share, top, ent = expert_utilisation(np.array([1, 1, 1, 1]), 3)  # 0 log 0 must not give NaN
    np.testing.assert_allclose(share, [0.0, 1.0, 0.0])
    assert top == 1.0 and ent == 0.0
    _, _, ent = expert_utilisation(np.array([0, 1, 2]), 3)
    assert ent == pytest.approx(1.0)


# ----------------------------------------------------------------- FedAvg and the routers (paper 002)

def test_fedavg_with_huge_counts_does_not_overflow_to_zero_weights():
    # 1e308 + 1e308 = inf: normalising by the plain sum gave weights 0 and silently a zero model
    out = fedavg([({"w": np.array([2.0])}, 1e308), ({"w": np.array([4.0])}, 1e308)])
    np.testing.assert_allclose(out["w"], [3.0])


def test_mlp_router_with_a_free_model_trains_finite():
    # a model whose logged costs are all 0 (an on-device model) had cost scale 0 -> 0/0 = NaN targets
    # -> a NaN trunk; now its normalised targets are 0 and the prediction stays below the paid model's
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 8)).astype(np.float32)
    m = np.tile([0, 1], 30).astype(np.int64)
    acc = rng.uniform(size=60)
    cost = np.where(m == 0, 0.0, 2e-3)
    router = train_mlp_router([ClientData(x, m, acc, cost)], ["free", "paid"],
                              MLPRouterConfig(hidden=8, epochs=1, epoch_patience=1), rng, federated=False)
    a, c = router.predict(x[:5])
    assert np.isfinite(a).all() and np.isfinite(c).all()
    assert (np.abs(c[:, 0]) < c[:, 1]).all()


def test_personalisation_weights_hand_computed():
    # w = e_g / (e_g + e_l); both 0 -> 0.5; NaN (no local evidence) -> 0 (paper 002, personalisation)
    w = interpolation_weights(np.array([0.3, 0.0, 0.2]), np.array([0.1, 0.0, np.nan]))
    np.testing.assert_allclose(w, [0.75, 0.5, 0.0])


def test_normalised_auc_of_a_point_dearer_than_every_single_model():
    # c_lo = 0, c_hi = 1: hull (0, 0.2) -> (2, 1.0); H(1) = 0.6; AUC = (0.2 + 0.6) / 2 = 0.4
    assert normalised_auc(np.array([[0.0, 0.2], [2.0, 1.0]]), 0.0, 1.0) == pytest.approx(0.4)
    # every point right of u = 1: H is 0 on [0, 1]
    assert normalised_auc(np.array([[1.5, 0.9]]), 0.0, 1.0) == 0.0


# ----------------------------------------------------------------- MoR (paper 001)

def test_bradley_terry_loss_is_finite_for_huge_margins():
    loss = bradley_terry_loss(torch.tensor([0.0, 1000.0]), torch.tensor([1000.0, 0.0]))
    assert float(loss) == pytest.approx(500.0)  # (1000 + 0) / 2 nats, no log(0)


def test_z_normalisation_of_constant_scores_is_finite():
    norm = ScoreNormaliser.fit(np.array([2.0, 2.0, 2.0]))
    np.testing.assert_allclose(norm(np.array([2.0, 3.0])), [0.0, 1.0 / 1e-6], rtol=1e-6)
    clipped = ScoreNormaliser.fit(np.array([2.0, 2.0]), clip=1.5)
    np.testing.assert_allclose(clipped(np.array([3.0])), [1.5])


def test_routing_weights_do_not_overflow():
    z = np.array([[1000.0, 0.0, -1000.0]])
    np.testing.assert_allclose(softmax(z), [[1.0, 0.0, 0.0]])
    w = RoutingRule("sparse", probabilities="ovr").weights(np.array([[-1000.0, -1000.0]]))
    np.testing.assert_allclose(w, [[0.5, 0.5]])
    # soft: 0.5 * 1 + 0.5 * 3 = 2 (paper 001, R_mix)
    assert RoutingRule("soft").reward(np.zeros((1, 2)), np.array([[1.0, 3.0]]))[0] == pytest.approx(2.0)


def test_router_update_of_an_empty_client_is_a_clear_error():
    router = ClientRouter(4, 2, hidden=4)
    empty = ClientRouterData(np.zeros((0, 4), np.float32), np.zeros((0, 4), np.float32), 0)
    with pytest.raises(InvalidInputError, match="no preference pair"):  # was ZeroDivisionError
        local_router_update(router, empty, RouterConfig(hidden=4), np.random.default_rng(0))


def test_lloyd_step_moves_a_cell_whose_clipped_weight_is_below_one():
    # weighted K-means (paper 002): next centroid = sum w mu / sum w for any w > 0; count clipping
    # (C = 10 of 1000 queries: s = 0.01) scales the weight 50 to 0.5, which used to freeze the cell
    from sdk.cell_statistics import CellStatistics
    from sdk.local_update import KMeansUpdate
    from trainer.federated.kmeans_aggregation import AggregationConfig, aggregate_kmeans

    c = np.array([[1.0, 0.0], [0.0, 1.0]])
    stats = CellStatistics(np.array([[1000.0], [0.0]]), np.array([[500.0], [0.0]]), np.array([[1.0], [0.0]]))
    u = KMeansUpdate(stats, np.array([0, 1]), np.array([[0.6, 0.8], [0.8, 0.6]]), np.array([950.0, 50.0]), 1000)
    agg = aggregate_kmeans(c, {"a": u}, AggregationConfig(clip_count=10), np.random.default_rng(0))
    np.testing.assert_allclose(agg.cell_weights, [9.5, 0.5])
    np.testing.assert_allclose(agg.next_centroids, [[0.6, 0.8], [0.8, 0.6]], rtol=1e-6)
