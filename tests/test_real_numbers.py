"""sdk.real_numbers: which values are finite real numbers, and the float each one gives (hand-computed)."""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

from sdk.real_numbers import finite_float, is_real_number


@pytest.mark.parametrize("value, expected", [
    (3, 3.0),
    (-7, -7.0),
    (0, 0.0),
    (0.1, 0.1),
    (-2.5, -2.5),
    (2**53 + 1, 9007199254740992.0),  # rounds to the nearest float (ties to even)
    (2**1023, 8.98846567431158e307),  # the largest power of two a float holds
    (np.float32(0.5), 0.5),
    (np.float32(0.1), 0.10000000149011612),  # float32's nearest value to 0.1, widened exactly
    (np.float64(1e-300), 1e-300),
    (np.int64(-4), -4.0),
    (np.uint8(255), 255.0),
    (Fraction(1, 4), 0.25),
    (Fraction(1, 3), 0.3333333333333333),
    (Fraction(-3, 2), -1.5),
])
def test_a_finite_real_number_gives_its_float(value, expected):
    result = finite_float(value)
    assert type(result) is float and result == expected
    assert is_real_number(value)


def test_negative_zero_keeps_its_sign():
    assert math.copysign(1.0, finite_float(-0.0)) == -1.0 and finite_float(0) == 0.0


@pytest.mark.parametrize("value", [
    10**400, -10**400, 2**1024,  # ints beyond the float range: float() raises OverflowError
    Fraction(10**400, 3),  # a rational beyond the float range
    math.nan, math.inf, -math.inf,
    np.float64("nan"), np.float32("inf"), np.float32("-inf"),
])
def test_a_real_number_that_is_not_finite_gives_none(value):
    assert is_real_number(value)
    assert finite_float(value) is None


@pytest.mark.parametrize("value", [
    True, False, np.True_, np.False_,  # a bool is never the number 0 or 1 here
    Decimal("1.5"), Decimal("NaN"),  # Decimal is numbers.Number, not numbers.Real: the caller converts it
    "1.0", b"1", None, 1 + 0j, complex(2, 0), [1.0], (1.0,), np.array(1.0), np.array([1.0]),
])
def test_what_is_not_a_real_number_gives_none(value):
    assert not is_real_number(value)
    assert finite_float(value) is None
