"""Neural Thompson sampling on the router's last layer (MoR, paper 001, "Online Router Updating")."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

from sdk.errors import InvalidInputError, ShapeError
from trainer.alignment.errors import AlignmentConfigError
from trainer.alignment.thompson_routing import (
    NeuralThompsonRouting,
    ThompsonConfig,
    bandit_feedback,
    last_linear,
)

torch.set_num_threads(1)


def identity_router(n_arms: int = 2) -> nn.Module:
    """Features a(c) = c (1-d), last layer W = 0, b = 0: every score is sigmoid(0) = 0.5."""
    first = nn.Linear(1, 1)
    last = nn.Linear(1, n_arms)
    with torch.no_grad():
        first.weight.fill_(1.0)
        first.bias.zero_()
        last.weight.zero_()
        last.bias.zero_()
    return nn.Sequential(first, last)


def test_gradient_of_score_on_hand_made_case():
    ts = NeuralThompsonRouting(identity_router(), ThompsonConfig(lam=2.0, width=1))
    a = ts.features(np.array([[2.0]], dtype=np.float32))
    # phi = [W00, W10, b0, b1]; d sigmoid(z)/dz at z = 0 is 0.25; dz_0/dW00 = a = 2, dz_0/db0 = 1
    g = ts.gradients(a)
    assert g.shape == (1, 2, 4)
    np.testing.assert_array_equal(g[0, 0].numpy(), [0.5, 0.0, 0.25, 0.0])
    np.testing.assert_array_equal(g[0, 1].numpy(), [0.0, 0.5, 0.0, 0.25])


def test_gradients_equal_autograd_on_a_random_router():
    torch.manual_seed(0)
    router = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ts = NeuralThompsonRouting(router, ThompsonConfig())
    c = torch.randn(4, 5)
    a = ts.features(c)
    ours = ts.gradients(a)
    layer = last_linear(router)
    for i in range(4):
        for k in range(3):
            layer.zero_grad()
            torch.sigmoid(router(c[i:i + 1])[0, k]).backward()
            expected = torch.cat([layer.weight.grad.reshape(-1), layer.bias.grad.reshape(-1)]).double()
            torch.testing.assert_close(ours[i, k], expected, rtol=1e-5, atol=1e-7)


def test_covariance_update_exact_values():
    ts = NeuralThompsonRouting(identity_router(), ThompsonConfig(lam=2.0, width=4))
    g = torch.tensor([[1.0, 2.0, 0.0, -1.0]], dtype=torch.float64)
    ts.update_covariance(g)
    expected = 2.0 * np.eye(4) + np.outer([1, 2, 0, -1], [1, 2, 0, -1]) / 4.0
    np.testing.assert_array_equal(ts.U_.numpy(), expected)
    ts.update_covariance(torch.tensor([[0.0, 0.0, 4.0, 0.0]], dtype=torch.float64))
    expected[2, 2] += 16.0 / 4.0
    np.testing.assert_array_equal(ts.U_.numpy(), expected)


def test_posterior_variance_uses_inverse_covariance():
    # sigma^2 = lam g^T U^{-1} g / m. Before any update U = lam I: 2 * (0.5^2 + 0.25^2) / 2 = 0.3125.
    ts = NeuralThompsonRouting(identity_router(), ThompsonConfig(lam=2.0, width=1))
    c = np.array([[2.0]], dtype=np.float32)
    mean, var = ts.posterior(c)
    np.testing.assert_allclose(mean, [[0.5, 0.5]])
    np.testing.assert_allclose(var, [[0.3125, 0.3125]], rtol=1e-12)
    # after U += g0 g0^T (arm 0 only), Sherman-Morrison: g0^T U^{-1} g0 = q / (1 + q), q = 0.3125 / 2
    ts.update_covariance(ts.gradients(ts.features(c), np.array([0])))
    q = 0.3125 / 2
    _, var = ts.posterior(c)
    np.testing.assert_allclose(var, [[2.0 * q / (1 + q), 0.3125]], rtol=1e-12)


def test_sample_is_mean_plus_nu_sigma_z_from_its_own_generator():
    cfg = ThompsonConfig(lam=2.0, nu=3.0, width=1, seed=7)
    ts = NeuralThompsonRouting(identity_router(), cfg)
    c = np.array([[2.0], [-1.0], [0.5]], dtype=np.float32)
    mean, var = ts.posterior(c)
    decision = ts.select(c)
    z = torch.randn(mean.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).numpy()
    np.testing.assert_allclose(decision.std, 3.0 * np.sqrt(var))
    np.testing.assert_allclose(decision.sampled, mean + 3.0 * np.sqrt(var) * z)
    np.testing.assert_array_equal(decision.arms, decision.sampled.argmax(1))
    # the decision on the logit scale (what the routing rule reads): logit of the clipped sample
    clipped = np.clip(decision.sampled, 1e-9, 1 - 1e-9)
    np.testing.assert_allclose(decision.logits, np.log(clipped / (1 - clipped)))
    np.testing.assert_allclose(decision.offline_logits, ts.logits(c))  # phi = phi_0 before any update


def test_update_moves_the_chosen_arm_towards_the_feedback_and_grows_U():
    torch.manual_seed(1)
    router = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    first_before = router[0].weight.detach().clone()
    ts = NeuralThompsonRouting(router, ThompsonConfig(lam=1e-3, lr=1.0, n_update_steps=20))
    c = torch.randn(6, 4).numpy()
    arms = np.array([0, 0, 1, 1, 2, 0])
    before, _ = ts.posterior(c)
    out = ts.update(c, arms, 0.0)
    after, _ = ts.posterior(c)
    rows = np.arange(6)
    assert out["loss_after"] < out["loss_before"]
    assert np.all(after[rows, arms] < before[rows, arms])
    assert torch.equal(router[0].weight, first_before)  # only the last layer is the bandit's
    assert ts.drift() > 0
    g = ts.gradients(ts.features(c), arms)
    # U was updated with the gradients at the *updated* phi (MoR's U_t uses phi_t)
    expected = 1e-3 * torch.eye(ts.n_params_, dtype=torch.float64) + g.T @ g / 8
    torch.testing.assert_close(ts.U_, expected)


def test_pull_back_to_offline_router_limits_drift():
    torch.manual_seed(2)
    c = torch.randn(5, 4).numpy()
    arms = np.array([0, 1, 2, 0, 1])
    drifts = []
    for lam in (1e-3, 10.0):
        torch.manual_seed(3)
        router = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        ts = NeuralThompsonRouting(router, ThompsonConfig(lam=lam, lr=0.05, n_update_steps=30))
        ts.update(c, arms, 1.0)
        drifts.append(ts.drift())
    assert drifts[1] < 0.5 * drifts[0]


def test_disabled_is_the_offline_argmax_and_never_updates():
    torch.manual_seed(4)
    router = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    ts = NeuralThompsonRouting(router, ThompsonConfig(enabled=False))
    c = torch.randn(10, 4)
    decision = ts.select(c.numpy())
    np.testing.assert_array_equal(decision.arms, router(c).argmax(1).numpy())
    np.testing.assert_array_equal(decision.arms, decision.offline_arms)
    with torch.no_grad():
        np.testing.assert_allclose(decision.logits, router(c).double().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(decision.logits, decision.offline_logits)
    assert ts.update(c.numpy(), decision.arms, 0.0) == {}
    assert ts.drift() == 0.0
    assert torch.equal(ts.U_, torch.eye(ts.n_params_, dtype=torch.float64))


def test_bandit_feedback_is_one_when_the_grpo_loss_does_not_increase():
    assert bandit_feedback(0.5, 0.4) == 1.0
    assert bandit_feedback(0.5, 0.5) == 1.0
    assert bandit_feedback(0.4, 0.5) == 0.0
    with pytest.raises(InvalidInputError):
        bandit_feedback(float("nan"), 0.1)


@pytest.mark.parametrize("kwargs", [{"lam": 0.0}, {"lam": float("inf")}, {"nu": -1.0}, {"width": 0},
                                    {"lr": 0.0}, {"n_update_steps": 0},
                                    {"lam": 10**400}, {"nu": True}, {"lr": float("nan")}, {"nu": "1"}])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(InvalidInputError):
        ThompsonConfig(**kwargs)


@pytest.mark.parametrize("lam, lr", [(4.0, 0.5), (10.0, 0.5), (1e308, 0.5), (20.0, 0.1)])
def test_config_refuses_a_lambda_whose_pull_back_step_diverges(lam, lr):
    """--ts-lambda 10 (lr 0.5) turned the last layer, then every posterior sample, NaN within a few
    feedbacks: the SGD step on lam/2 ||phi - phi_0||^2 scales phi - phi_0 by 1 - lr lam, which grows
    once lr lam >= 2. (10.0 with lr 0.05, used above, stays accepted.)"""
    message = f"lam must be below 2 / lr = {2 / lr:g} (lr {lr:g}, the online SGD step), got {lam:g}"
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        ThompsonConfig(lam=lam, lr=lr)


def test_the_largest_accepted_lambda_keeps_the_router_finite():
    torch.manual_seed(0)
    router = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ts = NeuralThompsonRouting(router, ThompsonConfig(lam=3.5, seed=0))  # lr 0.5: lr lam = 1.75
    rng = np.random.default_rng(0)
    for t in range(20):
        contexts = rng.normal(size=(4, 8)).astype(np.float32)
        decision = ts.select(contexts)
        assert np.isfinite(decision.sampled).all()
        ts.update(contexts, decision.arms, float(t % 2))
    assert np.isfinite(ts.drift()) and ts.drift() < 1.0


def test_bad_inputs_raise_sdk_errors():
    ts = NeuralThompsonRouting(identity_router(), ThompsonConfig())
    with pytest.raises(ShapeError):
        ts.select(np.zeros(3, dtype=np.float32))
    with pytest.raises(ShapeError):
        ts.select(np.array([[np.nan]], dtype=np.float32))
    with pytest.raises(InvalidInputError):
        ts.update(np.ones((1, 1), np.float32), np.array([2]), 1.0)
    with pytest.raises(InvalidInputError):
        ts.update(np.ones((1, 1), np.float32), np.array([0]), 0.5)
    with pytest.raises(InvalidInputError):
        NeuralThompsonRouting(nn.Sequential(nn.Tanh()))


@pytest.mark.parametrize("kwargs, message", [
    ({"nu": 1e300}, "nu must be at most 1e+100, got 1e+300: a larger nu can overflow the posterior sample"),
    ({"nu": 1.0000001e100}, "nu must be at most 1e+100"),
    ({"lam": 1e-320}, "lam must be at least 1e-100, got 9.99989e-321: a smaller lam overflows the posterior variance"),
])
def test_config_refuses_a_nu_or_lambda_that_overflows_the_sample(kwargs, message):
    """--ts-nu 1e308 gave +-inf samples (1e300 too, with features of ~1e9), lam 1e-320 NaN ones (U^-1 g ~ g / lam
    overflowed); np.argmax then picked the lowest arm of the ties, silently."""
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        ThompsonConfig(**kwargs)


def test_the_extreme_accepted_nu_and_lambda_keep_samples_finite_for_the_largest_float32_features():
    from trainer.alignment.thompson_routing import LAM_MIN, NU_MAX

    ts = NeuralThompsonRouting(identity_router(3), ThompsonConfig(nu=NU_MAX, lam=LAM_MIN, seed=1))
    contexts = np.array([[3.4e38], [-3.4e38], [1.0], [0.0]], dtype=np.float32)  # a(c) = c
    for _ in range(3):
        decision = ts.select(contexts)
        assert np.isfinite(decision.sampled).all() and np.isfinite(decision.std).all()
        assert decision.std[0, 0] > 1e130  # nu sigma = 1e100 * 0.25 * |[a, 1]|, not clipped
    ts.update(contexts[2:], decision.arms[2:], 1.0)
    assert np.isfinite(ts.select(contexts).sampled).all()


def test_a_nan_last_layer_is_an_error_not_arm_zero():
    """A router whose last layer turned NaN gave NaN for every sample, and argmax chose arm 0 for every pair."""
    router = identity_router(3)
    with torch.no_grad():
        last_linear(router).bias.fill_(float("nan"))
    ts = NeuralThompsonRouting(router, ThompsonConfig())
    with pytest.raises(AlignmentConfigError, match=r"ThompsonConfig\.lr"):
        ts.select(np.ones((2, 1), np.float32))


def test_a_sample_overflowing_at_run_time_names_nu():
    """A config changed after its checks (nu 1e308): the samples were +-inf and argmax went to the lowest tied arm."""
    ts = NeuralThompsonRouting(identity_router(3), ThompsonConfig(seed=0))
    ts.config.nu = 1e308
    with pytest.raises(AlignmentConfigError, match=r"ThompsonConfig\.nu"):
        ts.select(np.full((4, 1), 1e3, np.float32))


def test_an_sgd_step_that_overflows_the_router_is_an_error_and_is_undone():
    """lr 1e30 (lam 1e-31, lr lam < 2) with features of 1e10 turned the last layer NaN; every later pick was arm 0."""
    ts = NeuralThompsonRouting(identity_router(3), ThompsonConfig(lr=1e30, lam=1e-31))
    contexts = np.full((4, 1), 1e10, np.float32)
    before = [p.detach().clone() for p in last_linear(ts.router).parameters()]
    U_before = ts.U_.clone()
    with pytest.raises(AlignmentConfigError, match=r"ThompsonConfig\.lr"):
        ts.update(contexts, ts.select(contexts).arms, 1.0)
    for param, old in zip(last_linear(ts.router).parameters(), before):
        torch.testing.assert_close(param.detach(), old, rtol=0, atol=0)
    assert torch.equal(ts.U_, U_before) and ts.n_updates_ == 0
    assert np.isfinite(ts.select(contexts).sampled).all()


def test_a_covariance_that_would_overflow_is_an_error_and_left_unchanged():
    ts = NeuralThompsonRouting(identity_router(), ThompsonConfig(lam=2.0, width=1))
    with pytest.raises(AlignmentConfigError, match="covariance U"):
        ts.update_covariance(torch.full((1, 4), 1e200, dtype=torch.float64))
    np.testing.assert_array_equal(ts.U_.numpy(), 2.0 * np.eye(4))
