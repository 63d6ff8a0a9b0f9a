"""FedAvg on deltas for the MLP router (trainer.federated.mlp_aggregation), against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdk.errors import InvalidInputError
from trainer.federated.gaussian_privacy import gaussian_epsilon
from trainer.federated.mlp_aggregation import (
    MLPAggregationConfig,
    MLPUpdate,
    aggregate_mlp,
)

G = {"w": np.array([[1.0, 2.0]], dtype=np.float32), "b": np.array([0.5], dtype=np.float32)}


def upd(w, b, n, base=G):
    return MLPUpdate({"w": np.array([w], dtype=np.float32), "b": np.array([b], dtype=np.float32)}, n, base)


def test_fedavg_is_the_sample_weighted_mean_of_the_uploads():
    agg = aggregate_mlp(G, {"a": upd([2, 2], 1.0, 10), "b": upd([1, 5], 0.0, 30)}, MLPAggregationConfig(),
                        np.random.default_rng(0))
    np.testing.assert_allclose(agg.parameters["w"], [[(2 * 10 + 1 * 30) / 40, (2 * 10 + 5 * 30) / 40]])
    np.testing.assert_allclose(agg.parameters["b"], [(1.0 * 10 + 0.0 * 30) / 40])
    assert agg.clients == ("a", "b") and agg.n_samples == 40 and math.isinf(agg.epsilon)


def test_a_stragglers_delta_is_applied_to_the_new_parameters():
    old = {"w": np.array([[0.0, 0.0]], dtype=np.float32), "b": np.array([0.0], dtype=np.float32)}
    late = upd([0.5, -0.5], 0.25, 10, base=old)  # trained from the previous round's parameters
    agg = aggregate_mlp(G, {"late": late}, MLPAggregationConfig(), np.random.default_rng(0))
    np.testing.assert_allclose(agg.parameters["w"], [[1.5, 1.5]])
    np.testing.assert_allclose(agg.parameters["b"], [0.75])


def test_weight_clipping_and_trimmed_mean():
    ups = {"a": upd([2, 2], 1.0, 10), "b": upd([1, 5], 0.0, 1000)}
    clipped = aggregate_mlp(G, ups, MLPAggregationConfig(clip_count=10), np.random.default_rng(0))
    np.testing.assert_allclose(clipped.parameters["w"], [[1.5, 3.5]])  # equal weights after clipping
    ups = {"a": upd([1, 2], 0.5, 1), "b": upd([1.2, 2], 0.5, 1), "c": upd([1.1, 2], 0.5, 1), "evil": upd([100, 2], 0.5, 1)}
    robust = aggregate_mlp(G, ups, MLPAggregationConfig(trim_fraction=0.25), np.random.default_rng(0))
    np.testing.assert_allclose(robust.parameters["w"], [[(1.1 + 1.2) / 2, 2.0]], rtol=1e-6)


def test_dp_fedavg_clips_each_delta_and_adds_noise_of_z_s_over_the_expected_clients():
    big = upd([1 + 30, 2 + 40], 0.5, 5)  # delta (30, 40, 0): norm 50 -> clipped to S = 5: (3, 4, 0)
    config = MLPAggregationConfig(clip_norm=5.0, noise_multiplier=1e-9, expected_clients=1)
    agg = aggregate_mlp(G, {"a": big}, config, np.random.default_rng(0))
    np.testing.assert_allclose(agg.parameters["w"], [[4.0, 6.0]], atol=1e-6)
    assert agg.epsilon == pytest.approx(gaussian_epsilon(1e-9, 1e-5))
    wide = {"w": np.zeros((200, 50), dtype=np.float32), "b": np.zeros(1, dtype=np.float32)}
    noisy = aggregate_mlp(wide, {"a": MLPUpdate(wide, 5, wide), "b": MLPUpdate(wide, 5, wide)},
                          MLPAggregationConfig(clip_norm=2.0, noise_multiplier=1.5, expected_clients=4),
                          np.random.default_rng(1))
    assert np.std(noisy.parameters["w"]) == pytest.approx(1.5 * 2.0 / 4, rel=0.05)  # sigma = z S / W
    half = aggregate_mlp(G, {"a": big}, MLPAggregationConfig(clip_norm=5.0, noise_multiplier=1e-9, expected_clients=2),
                         np.random.default_rng(0))
    np.testing.assert_allclose(half.parameters["w"], [[2.5, 4.0]], atol=1e-6)  # (3, 4) / W = 2


@pytest.mark.parametrize("kwargs, field", [({"noise_multiplier": 1.0}, "clip_norm"),
                                           ({"noise_multiplier": 1.0, "clip_norm": 1.0}, "expected_clients")])
def test_noise_without_its_bounds_is_refused(kwargs, field):
    with pytest.raises(InvalidInputError) as info:
        MLPAggregationConfig(**kwargs)
    assert field in str(info.value)
