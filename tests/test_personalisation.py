"""Paper 002 personalisation: w = e_global / (e_global + e_local), prediction w*local + (1-w)*global."""

import numpy as np
import pytest

from sdk import interpolation_weights, personalise
from sdk.errors import ShapeError


def test_weights_hand_computed():
    w = interpolation_weights(np.array([0.3, 0.1, 0.2, 0.0, 0.4]), np.array([0.1, 0.3, 0.2, 0.0, np.nan]))
    # 0.3/0.4, 0.1/0.4, 0.5, both zero -> 0.5, no local error -> 0 (use the global estimator)
    np.testing.assert_allclose(w, [0.75, 0.25, 0.5, 0.5, 0.0])


def test_weights_of_errors_whose_sum_overflows():
    # 1e308 + 1e308 is inf in float64: the weight was 1e308 / inf = 0 instead of 0.5
    w = interpolation_weights(np.array([1e308, 1.5e308, 5e-324]), np.array([1e308, 0.5e308, 5e-324]))
    np.testing.assert_allclose(w, [0.5, 0.75, 0.5])


def test_personalised_prediction_hand_computed():
    g = np.array([[0.8, 0.2, 0.5]])
    loc = np.array([[0.4, 0.6, np.nan]])
    out = personalise(g, loc, np.array([0.75, 0.25, 0.9]))
    # 0.75*0.4 + 0.25*0.8 = 0.5 ; 0.25*0.6 + 0.75*0.2 = 0.3 ; local NaN -> global 0.5
    np.testing.assert_allclose(out, [[0.5, 0.3, 0.5]])


def test_the_more_accurate_estimator_gets_more_weight():
    w = interpolation_weights(np.array([0.2]), np.array([0.05]))
    assert w[0] > 0.5


@pytest.mark.parametrize("eg, el", [([-0.1], [0.1]), ([np.inf], [0.1]), ([0.1, 0.2], [0.1])])
def test_bad_errors_are_refused(eg, el):
    with pytest.raises(ShapeError):
        interpolation_weights(np.array(eg), np.array(el))
