"""METRICS.md definitions on hand-computed cases."""

import math

import numpy as np
import pytest

from sdk.errors import InvalidInputError, InvalidLambdaError, ShapeError
from sdk.utility import decide, utility
from trainer import metrics

pytestmark = pytest.mark.sdk  # runs in the base-install venv of .ci/run too


def test_lambda_grid_is_zero_plus_100_log_spaced_points():
    grid = metrics.lambda_grid()
    assert grid.shape == (101,)
    assert grid[0] == 0.0
    assert grid[1] == pytest.approx(1e-2) and grid[-1] == pytest.approx(1e7)
    assert np.allclose(np.diff(np.log10(grid[1:])), 9 / 99)


def test_decide_tie_breaks_on_cost_then_index():
    acc = np.array([[0.5, 0.5, 0.5], [0.2, 0.9, 0.9], [0.7, 0.7, 0.1]])
    cost = np.array([[2.0, 1.0, 1.0], [0.0, 3.0, 3.0], [1.0, 1.0, 0.0]])
    # row 0: all tie on utility at lam=0 -> cheaper (1, 2) -> lower index 1
    # row 1: models 1 and 2 tie on utility and cost -> index 1
    # row 2: models 0 and 1 tie -> same cost -> index 0
    assert decide(acc, cost, 0.0).tolist() == [1, 1, 0]
    # lam = 0.1: row 0 -> utilities 0.3, 0.4, 0.4 -> cost tie -> 1; row 2 -> 0.6, 0.6, 0.1 -> 0
    assert decide(acc, cost, 0.1).tolist() == [1, 1, 0]
    # lam = 1: row 1 -> -0.1? no: 0.2 - 0 = 0.2 vs 0.9 - 3 = -2.1 -> model 0
    assert decide(acc, cost, 1.0).tolist()[1] == 0


def test_decide_never_picks_a_model_without_estimate():
    acc = np.array([[np.nan, 0.1]])
    cost = np.array([[0.0, 5.0]])
    assert decide(acc, cost, 0.0).tolist() == [1]


@pytest.mark.parametrize("lam", [-1.0, float("nan"), float("inf"), "0.1", None, True])
def test_bad_lambda_is_rejected(lam):
    with pytest.raises(InvalidLambdaError):
        utility(np.zeros((1, 2)), np.zeros((1, 2)), lam)


def test_frontier_is_upper_concave_hull_made_non_decreasing():
    pts = np.array([[0.0, 0.5], [0.5, 0.6], [0.25, 0.9], [1.0, 0.8], [0.25, 0.1]])
    # (0.5, 0.6) lies under the chord (0, 0.5)-(0.25, 0.9); (1, 0.8) is after the maximum.
    assert metrics.frontier(pts).tolist() == [[0.0, 0.5], [0.25, 0.9]]


def test_normalised_auc_hand_computed():
    # Two points (0, 0.5) and (1, 1.0): trapezoid 0.75.
    assert metrics.normalised_auc(np.array([[10.0, 0.5], [20.0, 1.0]]), 10.0, 20.0) == pytest.approx(0.75)
    # One point at u = 0.5, acc 0.6: H = 0 on [0, 0.5), 0.6 on [0.5, 1] -> 0.3.
    assert metrics.normalised_auc(np.array([[15.0, 0.6]]), 10.0, 20.0) == pytest.approx(0.3)
    # Hull (0, 0.5) -> (0.25, 0.9), then flat: 0.25 * 0.7 + 0.75 * 0.9 = 0.85.
    pts = np.array([[0.0, 0.5], [0.5, 0.6], [0.25, 0.9], [1.0, 0.8]])
    assert metrics.normalised_auc(pts, 0.0, 1.0) == pytest.approx(0.85)
    # Starts at u = 0.2 with 0.4 and rises to 0.8 at u = 0.6: 0.4 * (0.4 + 0.8) / 2 + 0.4 * 0.8 = 0.56.
    assert metrics.normalised_auc(np.array([[0.2, 0.4], [0.6, 0.8]]), 0.0, 1.0) == pytest.approx(0.56)


def test_points_below_the_cheapest_model_are_clipped_to_zero():
    # u = -1 clipped to 0 keeping acc 0.7; the hull to (1, 0.9): (0.7 + 0.9) / 2 = 0.8.
    pts = np.array([[-1.0, 0.7], [1.0, 0.9]])
    assert metrics.normalised_auc(pts, 0.0, 1.0) == pytest.approx(0.8)


def _toy_labels():
    # 4 queries x 3 models. Mean costs: 1, 2, 4. Mean accuracies: 0.25, 0.5, 0.75.
    acc = np.array([[1, 0, 1], [0, 1, 1], [0, 1, 1], [0, 0, 0]], dtype=float)
    cost = np.array([[1, 2, 4]] * 4, dtype=float)
    return acc, cost


def test_reference_curves_on_a_toy_table():
    acc, cost = _toy_labels()
    zero = metrics.zero_router_report(acc, cost)
    # Single models at u = 0, 1/3, 1 with acc 0.25, 0.5, 0.75 (concave: all three on the hull):
    # 1/3 * (0.25 + 0.5) / 2 + 2/3 * (0.5 + 0.75) / 2.
    assert zero.auc == pytest.approx(0.125 + 5 / 12)
    oracle = metrics.oracle_report(acc, cost)
    # lam = 0: acc per query max -> 0.75 at cost (1+2+2+1)/4 = 1.5 (ties -> cheaper; row 3 all 0 -> model 0).
    # lam large: cheapest model everywhere -> (1, 0.25)... but the oracle at small lam prefers
    # model 0 on row 0 (acc 1, cost 1): point (1.5, 0.75).  u = 0.5/3 = 1/6.
    # Hull: (0, 0.25) [cheapest] ... the oracle reaches 0.75 at u = 1/6.
    assert oracle.auc == pytest.approx(0.5 * (1 / 6) * (0.25 + 0.75) + (5 / 6) * 0.75)
    rand = metrics.random_router_report(acc, cost)
    # Random: expected point (7/3, 0.5) -> u = (7/3 - 1) / 3 = 4/9; AUC = 0.5 * 5/9.
    assert rand.auc == pytest.approx(0.5 * 5 / 9)
    assert metrics.gain(zero.auc, zero.auc, oracle.auc) == 0.0
    assert metrics.gain(oracle.auc, zero.auc, oracle.auc) == 1.0


def test_acc_at_best_cost_and_cost_at_best_acc():
    acc, cost = _toy_labels()
    # Router frontier: (1, 0.25) -> (1.5, 0.75) (the oracle's points).
    pts = np.array([[1.0, 0.25], [1.5, 0.75]])
    # Best single model: acc 0.75 at cost 4: the frontier is flat at 0.75 there.
    assert metrics.accuracy_at_best_cost(pts, acc, cost) == pytest.approx(0.75)
    # It reaches 0.75 at cost 1.5 -> 1.5 / 4.
    assert metrics.cost_at_best_accuracy(pts, acc, cost) == pytest.approx(0.375)
    # Reaching only 0.5 at cost 2 (interpolated halfway: 0.5 at 1.5): never 0.75 -> inf.
    low = np.array([[1.0, 0.25], [2.0, 0.5]])
    assert math.isinf(metrics.cost_at_best_accuracy(low, acc, cost))
    # Linear interpolation: (1, 0.25) -> (3, 1.0) reaches 0.75 at cost 1 + 2 * (0.5 / 0.75) = 7/3.
    assert metrics.cost_at_best_accuracy(np.array([[1.0, 0.25], [3.0, 1.0]]), acc, cost) == pytest.approx((7 / 3) / 4)


def test_curve_points_of_a_perfect_router_equal_the_oracle():
    acc, cost = _toy_labels()
    pts = metrics.curve_points(acc, cost, acc, cost)
    assert pts[0].tolist() == [1.5, 0.75]
    assert pts[-1].tolist() == [1.0, 0.25]


def test_labels_with_nan_are_refused():
    acc, cost = _toy_labels()
    acc[0, 0] = np.nan
    with pytest.raises(ShapeError):
        metrics.oracle_report(acc, cost)


# RouteLLM APGR / CPT on a hand-computed frontier: weak (1 USD, 0.5), strong (3 USD, 0.9); the router's
# points (1, .5), (2, .8), (3, .9) are at normalised cost 0, 0.5, 1, so PGR = 0, 0.75, 1 there.
WEAK, STRONG = np.array([1.0, 0.5]), np.array([3.0, 0.9])
ROUTER = np.array([[1.0, 0.5], [2.0, 0.8], [3.0, 0.9], [0.5, 0.2]])


def test_apgr_hand_computed():
    # integral of PGR: 0.5 * (0 + 0.75) * 0.5 + 0.5 * (0.75 + 1) * 0.5 = 0.625 (the point cheaper than
    # the weak model is clipped to c = 0 and lies below it).
    assert metrics.apgr(ROUTER, WEAK, STRONG) == pytest.approx(0.625)


@pytest.mark.parametrize("share, c", [(0.5, 1 / 3), (0.8, 0.6), (1.0, 1.0), (0.0, 0.0), (1.01, math.inf)])
def test_cpt_hand_computed(share, c):
    # CPT(50%): accuracy 0.7 on the segment (0, .5)-(.5, .8) at c = 0.5 * 0.2 / 0.3 = 1/3;
    # CPT(80%): accuracy 0.82 on (.5, .8)-(1, .9) at c = 0.5 + 0.5 * 0.02 / 0.1 = 0.6.
    assert metrics.cpt(ROUTER, WEAK, STRONG, share) == pytest.approx(c)


def test_weak_strong_pair_follows_routellm():
    single = np.array([[0.1, 0.6], [0.5, 0.7], [2.0, 0.8], [1.0, 0.8], [0.05, 0.55]])
    # strong: the most accurate, the cheaper of the two 0.8 models (index 3, 1 USD); weak: the most
    # accurate of the models costing <= 0.1 USD (indices 0 and 4) -> index 0.
    assert metrics.weak_strong_pair(single) == (0, 3)
    with pytest.raises(InvalidInputError, match="at most"):
        metrics.weak_strong_pair(single, weak_cost_share=0.01)


def test_cost_saved_at_best_acc_median_and_never_share():
    saved, never = metrics.cost_saved_at_best_acc(np.array([0.7, 0.8, math.inf, 0.6, 0.9]))
    # savings 0.3, 0.2, -inf, 0.4, 0.1 -> median 0.2; one of five seeds never reaches it.
    assert saved == pytest.approx(0.2) and never == pytest.approx(0.2)
