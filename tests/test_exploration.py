"""sdk.exploration: Beta posteriors from the K-means statistics and the logging policies."""

import numpy as np
import pytest

from sdk.exploration import (
    ExplorationPolicy,
    beta_posterior,
    choice_propensities,
    frontier_choice,
    thompson_choice,
    top_two_choice,
    _axis_point,
    uniform_choice,
)


def test_posterior_from_counts_is_the_hand_computed_beta():
    # cell 0: 10 observations summing to 7, prior mean 0.5 with kappa = 4 -> Beta(7 + 2, 3 + 2);
    # cell 1: no observation -> the prior Beta(4 * 0.25, 4 * 0.75).
    count = np.array([[10.0], [0.0]])
    prior = np.array([[0.5], [0.25]])
    raw = np.array([[0.7], [np.nan]])
    alpha, beta = beta_posterior(raw, count, 4.0, prior_mean=prior)
    np.testing.assert_allclose(alpha, [[9.0], [1.0]])
    np.testing.assert_allclose(beta, [[5.0], [3.0]])
    # The bundle's shrunk mean (7 + 4 * 0.5) / (10 + 4) = 9 / 14 gives the same posterior.
    shrunk = np.array([[9 / 14], [0.25]])
    a2, b2 = beta_posterior(shrunk, count, 4.0)
    np.testing.assert_allclose(a2, alpha)
    np.testing.assert_allclose(b2, beta)


def test_posterior_keeps_no_estimate_and_floors_certain_means():
    alpha, beta = beta_posterior(np.array([[np.nan, 1.0]]), np.array([[0.0, 5.0]]), 0.0)
    assert np.isnan(alpha[0, 0]) and np.isnan(beta[0, 0])
    assert alpha[0, 1] == 5.0 and 0 < beta[0, 1] <= 1e-9


# Three models, one cell: costs 1, 2, 4 USD; accuracies 0.3, 0.6, 0.7 known almost exactly.
COST = np.array([[1.0, 2.0, 4.0]])
TIGHT = beta_posterior(np.array([[0.3, 0.6, 0.7]]), np.full((1, 3), 1e7), 0.0)


@pytest.mark.parametrize("lam, greedy", [(0.0, 2), (0.04, 2), (0.1, 1), (1.0, 0)])
def test_thompson_picks_the_greedy_model_when_posteriors_are_tight(lam, greedy):
    # utilities at lam = 0.1: 0.2, 0.4, 0.3 -> model 1; at lam = 1: -0.7, -1.4, -3.3 -> model 0.
    picks = thompson_choice(*TIGHT, COST, lam, np.zeros(50, dtype=int), np.random.default_rng(0))
    assert (picks == greedy).all()


def test_thompson_never_picks_a_model_without_an_estimate():
    alpha, beta = beta_posterior(np.array([[0.3, np.nan, 0.7]]), np.full((1, 3), 2.0), 1.0)
    picks = thompson_choice(alpha, beta, COST, 0.0, np.zeros(200, dtype=int), np.random.default_rng(1))
    assert set(picks.tolist()) <= {0, 2} and {0, 2} <= set(picks.tolist())


def test_frontier_choice_follows_the_cost_axis_when_posteriors_are_tight():
    # Hull vertices (1, .3), (2, .6), (4, .7); u = 0 -> cheapest, u = 1 -> most accurate,
    # u = 1/3 (cost 2) -> model 1 exactly; u = 2/3 (cost 3) -> half model 1, half model 2.
    cells = np.zeros(4000, dtype=int)
    rng = np.random.default_rng(2)
    for u, want in ((0.0, 0), (1.0, 2), (1 / 3, 1)):
        assert (frontier_choice(*TIGHT, COST, np.full(4000, u), cells, rng) == want).all()
    picks = frontier_choice(*TIGHT, COST, np.full(4000, 2 / 3), cells, rng)
    assert set(picks.tolist()) == {1, 2}
    assert abs((picks == 2).mean() - 0.5) < 0.03


def test_top_two_logs_the_challenger_about_half_the_time():
    # Two equal models in one cell: the leader is either, and the challenger is the other one.
    alpha, beta = beta_posterior(np.array([[0.5, 0.5]]), np.full((1, 2), 20.0), 0.0)
    cost = np.array([1.0, 1.0])
    rng = np.random.default_rng(3)
    picks = top_two_choice(alpha, beta, cost, np.full(2000, 1.0), np.zeros(2000, dtype=int), rng)
    assert abs(picks.mean() - 0.5) < 0.05
    # beta_tt = 1: always the leader, i.e. the frontier policy itself.
    tight = top_two_choice(*TIGHT, COST, np.zeros(100), np.zeros(100, dtype=int), rng, beta_tt=1.0)
    assert (tight == 0).all()


@pytest.mark.parametrize("policy", ["thompson", "frontier", "top_two", "uniform"])
def test_propensities_lie_in_0_1_and_sum_to_one(policy):
    alpha, beta = beta_posterior(np.array([[0.3, 0.6, 0.7], [0.9, 0.5, np.nan]]), np.full((2, 3), 3.0), 2.0)
    cells = np.array([0, 1, 0])
    rng = np.random.default_rng(4)
    chosen = np.array([2, 0, 1])
    p = choice_propensities(alpha, beta, COST[0], 0.05, cells, rng, n_draws=300, chosen=chosen, policy=policy)
    assert p.shape == (3, 3)
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    assert ((p >= 0) & (p <= 1)).all()
    assert (p[np.arange(3), chosen] > 0).all()
    assert p[1, 2] == 0.0  # no estimate: never chosen


def test_thompson_propensities_match_the_two_model_beta_probability():
    # Equal costs, lam = 0: P(theta_0 > theta_1) for Beta(2, 1) vs Beta(1, 1) = 2/3 (hand-computed:
    # integral_0^1 2x * x dx).
    alpha, beta = np.array([[2.0, 1.0]]), np.array([[1.0, 1.0]])
    p = choice_propensities(alpha, beta, np.array([1.0, 1.0]), 0.0, np.zeros(1, dtype=int),
                            np.random.default_rng(5), n_draws=40000)
    assert abs(p[0, 0] - 2 / 3) < 0.01


def test_uniform_choice_covers_the_models_with_an_estimate():
    alpha, beta = beta_posterior(np.array([[0.3, np.nan, 0.7]]), np.full((1, 3), 2.0), 1.0)
    picks = uniform_choice(alpha, beta, COST, np.zeros(3000, dtype=int), np.random.default_rng(6))
    assert set(picks.tolist()) == {0, 2} and abs(picks.mean() / 2 - 0.5) < 0.03


def test_policy_seeds_reproduce():
    policy = ExplorationPolicy(name="thompson", seed=7)
    cells = np.zeros(100, dtype=int)
    a = thompson_choice(*beta_posterior(np.array([[0.5, 0.5]]), np.ones((1, 2)), 1.0), np.ones(2), 0.0, cells,
                        policy.generator())
    b = thompson_choice(*beta_posterior(np.array([[0.5, 0.5]]), np.ones((1, 2)), 1.0), np.ones(2), 0.0, cells,
                        policy.generator())
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("power, u, want", [(1.0, 0.5, 5.5), (0.0, 0.5, 10 ** 0.5), (0.5, 0.5, ((1 + 10 ** 0.5) / 2) ** 2),
                                            (0.0, 0.0, 1.0), (0.5, 1.0, 10.0)])
def test_axis_point_is_uniform_on_cost_to_the_power(power, u, want):
    # lo = 1, hi = 10 USD: linear midpoint 5.5; log midpoint sqrt(10); sqrt midpoint ((1 + sqrt(10)) / 2) ** 2.
    assert _axis_point(1.0, 10.0, u, power) == pytest.approx(want)


def test_a_log_cost_axis_logs_the_cheap_end_more():
    # Tight posteriors, costs 1, 2, 4: on the linear axis u = 0.5 is cost 2.5 (segment 2-4); on the log
    # axis it is cost 2 (model 1 exactly).
    cells, rng = np.zeros(2000, dtype=int), np.random.default_rng(3)
    linear = frontier_choice(*TIGHT, COST, np.full(2000, 0.5), cells, rng)
    log = frontier_choice(*TIGHT, COST, np.full(2000, 0.5), cells, rng, axis_power=0.0)
    assert (log == 1).all() and abs((linear == 2).mean() - 0.25) < 0.04
