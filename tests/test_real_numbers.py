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


@pytest.mark.parametrize("value, expected", [
    ("0.5", "str '0.5'"),  # was shown as 0.5, which reads as a valid number
    (True, "bool True"),
    (None, "NoneType None"),
    (10**400, "an integer of about 401 digits"),  # was its first 40 digits, which read as a finite number
    (10**5000, "an integer of about 5001 digits"),  # str() of it raises ValueError
    (-(10**39), "-1000000000000000000000000000000000000000"),
    (2.5, "2.5"),
    (float("nan"), "nan"),
    (np.float32(0.25), "0.25"),
    ([10**5000], "list <no repr>"),
], ids=["str", "bool", "None", "int-401-digits", "int-5001-digits", "int-40-digits", "float", "nan", "float32",
        "list-of-huge-int"])
def test_shown_names_a_value_as_an_error_message_should(value, expected):
    from sdk.real_numbers import shown

    assert shown(value) == expected


def test_an_int_of_thousands_of_digits_is_a_clear_error_at_every_numeric_boundary(tmp_path):
    """Python cannot str() an int of over 4,300 digits (ValueError): messages that quoted the bad value
    turned a clear refusal into a traceback. A str number is shown as a str, not as the number."""
    from sdk import EvalLog
    from sdk.embedder import SessionThreads
    from sdk.errors import InvalidInputError
    from sdk.routed_chat import check_budget
    from sdk.token_prices import TokenPrice

    huge = 10**5000
    log = EvalLog(tmp_path / "log.sqlite", ["m"])
    calls = {
        "record cost_usd": lambda v: log.record("m", 1.0, v, cell=0),
        "record score": lambda v: log.record("m", v, 0.0, cell=0),
        "record timestamp": lambda v: log.record("m", 1.0, 0.0, cell=0, timestamp=v),
        "record cell": lambda v: log.record("m", 1.0, 0.0, cell=v),
        "EvalLog max_age_days": lambda v: EvalLog(tmp_path / "b.sqlite", ["m"], max_age_days=v),
        "EvalLog max_rows": lambda v: EvalLog(tmp_path / "c.sqlite", ["m"], max_rows=v),  # was OverflowError at record
        "TokenPrice": lambda v: TokenPrice(v, 1.0),
        "TokenPrice.cost_usd": lambda v: TokenPrice(1.0, 1.0).cost_usd(v, 1),
        "check_budget": check_budget,
        "SessionThreads": SessionThreads,
    }
    for name, call in calls.items():
        with pytest.raises(InvalidInputError, match="an integer of about 5001 digits"):
            call(huge)
        print(name, "refused")
    with pytest.raises(InvalidInputError, match=r"input_usd_per_1m.*got str '10\.0'"):
        TokenPrice("10.0", 1.0)  # a price quoted in a JSON config: the message said "got 10.0"
    log.close()
