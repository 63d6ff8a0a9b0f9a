"""The exact spend step function of a router's decisions and its randomised inversion (sdk.spend_curve)."""

from fractions import Fraction

import numpy as np
import pytest

from sdk.errors import InvalidInputError, InvalidLambdaError, ShapeError
from sdk.spend_curve import SpendCurve, decision_steps, row_steps
from sdk.utility import decide

pytestmark = pytest.mark.sdk  # runs in the base-install venv of .ci/run too

# Query 0: A = (0.9, 0.7, 0.5), C = (0.010, 0.004, 0.001) USD: model 0 at lam = 0, model 1 from
# (0.9 - 0.7) / 0.006 = 33.33..., model 2 from (0.7 - 0.5) / 0.003 = 66.66...
# Query 1: A = (0.8, 0.8, 0.2), C = (0.002, 0.001, 0.0005): the tie at lam = 0 goes to the cheaper
# model 1; model 2 from (0.8 - 0.2) / 0.0005 = 1200.
A = np.array([[0.9, 0.7, 0.5], [0.8, 0.8, 0.2]])
C = np.array([[0.010, 0.004, 0.001], [0.002, 0.001, 0.0005]])


def test_breakpoints_hand_computed():
    steps = decision_steps(A, C)
    np.testing.assert_allclose(steps.base_cost, [0.010, 0.001])
    order = np.argsort(steps.lam)
    np.testing.assert_array_equal(steps.row[order], [0, 0, 1])
    np.testing.assert_allclose(steps.lam[order], [100 / 3, 200 / 3, 1200])
    np.testing.assert_allclose(steps.delta_cost[order], [-0.006, -0.003, -0.0005])


def test_curve_levels_hand_computed():
    curve = SpendCurve.from_steps(decision_steps(A, C))
    np.testing.assert_allclose(curve.breakpoints, [100 / 3, 200 / 3, 1200])
    # (0.010 + 0.001) / 2, then (0.004 + 0.001) / 2, (0.001 + 0.001) / 2, (0.001 + 0.0005) / 2
    np.testing.assert_allclose(curve.levels, [0.0055, 0.0025, 0.001, 0.00075])
    assert curve.spend_at(50.0) == pytest.approx(0.0025)
    assert curve.spend_at(200 / 3 * 1.001) == pytest.approx(0.001)


def test_mix_between_two_steps_meets_the_target_in_expectation():
    curve = SpendCurve.from_steps(decision_steps(A, C))
    mix = curve.mix_for(0.004)
    # between levels 0.0055 (lam = 0) and 0.0025 (step 1): p_low = (0.004 - 0.0025) / 0.003 = 0.5
    assert mix.lam_low == 0.0
    assert mix.lam_high == pytest.approx(np.sqrt(100 / 3 * 200 / 3))
    assert mix.p_low == pytest.approx(0.5)
    assert mix.reachable


def test_mix_edges():
    curve = SpendCurve.from_steps(decision_steps(A, C))
    assert curve.mix_for(0.01).lam_high == 0.0 and curve.mix_for(0.01).p_low == 0.0  # lam = 0 fits
    floor = curve.mix_for(0.0005)  # below routing everything to the cheapest: 0.00075
    assert not floor.reachable and floor.lam_high == pytest.approx(2400.0) and floor.p_low == 0.0


@pytest.mark.parametrize("duplicated", [False, True])
def test_curve_equals_the_decision_rule_at_every_lam(duplicated):
    rng = np.random.default_rng(0)
    a, c = rng.random((40, 6)), rng.random((40, 6)) * 0.01
    a[:, 2] = np.nan  # a model without estimate is never chosen
    if duplicated:  # K-means-like: 5 distinct rows, shared breakpoints
        a, c = np.repeat(a[:5], 8, axis=0), np.repeat(c[:5], 8, axis=0)
    curve = SpendCurve.from_steps(decision_steps(a, c))
    rows = np.arange(a.shape[0])
    for lam in np.concatenate([[0.0], np.logspace(-2, 6, 200)]):
        assert curve.spend_at(lam) == pytest.approx(c[rows, decide(a, c, lam)].mean(), abs=1e-15)
    for target in np.linspace(curve.levels[-1], curve.levels[0], 9):
        mix = curve.mix_for(target)
        expected = (mix.p_low * c[rows, decide(a, c, mix.lam_low)].mean()
                    + (1 - mix.p_low) * c[rows, decide(a, c, mix.lam_high)].mean())
        assert expected == pytest.approx(target, abs=1e-15)
    if duplicated:
        assert curve.breakpoints.size <= 5 * 4


@pytest.mark.parametrize("a, c, error, field", [
    (np.zeros((2, 3)), np.zeros((2, 2)), ShapeError, "cost"),
    (np.zeros(3), np.zeros(3), ShapeError, "cost"),
    (np.array([[0.5, np.inf]]), np.array([[0.1, 0.2]]), ShapeError, "accuracy"),
    (np.array([[0.5, 0.4]]), np.array([[0.1, -0.2]]), ShapeError, "cost"),
    (np.array([[np.nan, 0.4]]), np.array([[0.1, np.nan]]), InvalidInputError, "query 0"),
])
def test_bad_predictions_are_refused(a, c, error, field):
    with pytest.raises(error, match=field):
        decision_steps(a, c)


def test_row_steps_equals_decision_steps():
    rng = np.random.default_rng(1)
    a, c = rng.random((200, 7)), rng.random((200, 7)) * 0.01
    a[:, 4] = np.nan
    a[::7, 1] = a[::7, 0]  # ties in accuracy at lam = 0
    for i in range(a.shape[0]):
        base, lams, deltas = row_steps(a[i], c[i])
        steps = decision_steps(a[i:i + 1], c[i:i + 1])
        assert base == steps.base_cost[0]
        np.testing.assert_array_equal(lams, steps.lam)
        np.testing.assert_array_equal(deltas, steps.delta_cost)
    base, lams, deltas = row_steps(A[0], C[0])
    assert base == 0.010 and lams == pytest.approx([100 / 3, 200 / 3]) and deltas == pytest.approx([-0.006, -0.003])


@pytest.mark.parametrize("lam", ["1", True, np.bool_(True), None, float("nan"), float("inf"), -1.0, -1e-300,
                                 pytest.param(10**400, id="10**400"), 1 + 0j])
def test_spend_at_refuses_what_check_lambda_refuses(lam):
    """spend_at("1") and spend_at(-5.0) answered S(0), spend_at(nan) the last level, spend_at(True) S(1):
    a caller's bug became a spend figure. The trade-off is checked as everywhere in the SDK
    (sdk.utility.check_lambda): InvalidLambdaError naming lam."""
    curve = SpendCurve.from_steps(decision_steps(A, C))
    with pytest.raises(InvalidLambdaError, match=r"^lam must be"):
        curve.spend_at(lam)


def test_spend_at_takes_every_real_lam():
    curve = SpendCurve.from_steps(decision_steps(A, C))
    assert curve.spend_at(50) == curve.spend_at(np.float32(50.0)) == curve.spend_at(Fraction(50)) == pytest.approx(0.0025)
    assert curve.spend_at(np.int64(0)) == curve.spend_at(-0.0) == pytest.approx(0.0055)


def test_step_lam_of_each_step():
    curve = SpendCurve.from_steps(decision_steps(A, C))
    assert [curve.step_lam(i) for i in range(4)] == pytest.approx(
        [0.0, np.sqrt(100 / 3 * 200 / 3), np.sqrt(200 / 3 * 1200), 2400.0])
    assert curve.step_lam(np.int64(3)) == pytest.approx(2400.0)


def test_mix_for_takes_numpy_and_fraction_targets():
    curve = SpendCurve.from_steps(decision_steps(A, C))
    assert curve.mix_for(np.float32(0.004)).p_low == pytest.approx(0.5, rel=1e-6)
    assert curve.mix_for(Fraction(1, 250)).p_low == pytest.approx(0.5)


def test_from_arrays_of_a_padded_table():
    inf = float("inf")
    curve = SpendCurve.from_arrays(np.array([0.5, 0.7]), np.array([[2.0, inf], [4.0, inf]]),
                                   np.array([[-0.2, 0.0], [-0.6, 0.0]]))
    # S(lam) = mean base 0.6, - 0.2 / 2 from lam 2, - 0.6 / 2 from lam 4
    np.testing.assert_allclose(curve.levels, [0.6, 0.5, 0.2])
    np.testing.assert_array_equal(curve.breakpoints, [2.0, 4.0])
