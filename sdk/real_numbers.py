"""Scalar numbers given by callers: the one test of "a finite real number" used at public boundaries.

Real means :class:`numbers.Real` (``int``, ``float``, ``Fraction``, numpy integer and floating scalars)
except ``bool`` / ``numpy.bool_`` (a ``True`` passed as a price is a caller's bug). ``Decimal`` is not
real here (the standard library registers it as ``numbers.Number`` only). Finite means
``math.isfinite(float(value))``; an int beyond the float range (``10**400``) counts as not finite.
"""

from __future__ import annotations

import math
import numbers
from typing import TypeGuard

import numpy as np


def is_real_number(value: object) -> TypeGuard[numbers.Real]:
    """Whether ``value`` is a real number (finite or not); never raises."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def finite_float(value: object) -> float | None:
    """``float(value)`` when ``value`` is a finite real number, else ``None`` (NaN, +-inf, beyond the
    float range, not a real number). Never raises; ``-0.0`` stays ``-0.0``."""
    if not is_real_number(value):
        return None
    try:
        result = float(value)
    except OverflowError:  # an int or Fraction beyond the float range
        return None
    return result if math.isfinite(result) else None


#: Integers of more bits than this are named by their size in error messages (``str()`` of an int of
#: over 4,300 digits raises ValueError).
_SHOWN_BITS = 132


def shown(value: object, limit: int = 40) -> str:
    """``value`` as an error message names it: a number as itself, anything else with its type
    (``str '0.5'``, ``bool True``), a huge int by its number of digits; at most ``limit`` characters.
    Never raises."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        n = int(value)
        if n.bit_length() > _SHOWN_BITS:
            return f"an integer of about {int(math.log10(abs(n))) + 1} digits"  # log10 takes ints of any size
        return str(n)
    if is_real_number(value):  # float, numpy floating, Fraction
        try:
            return str(value)[:limit]
        except ValueError:  # a Fraction of huge integers
            return f"a {type(value).__name__} beyond the float range"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails (an object's own, or a container of huge ints)
        text = "<no repr>"
    return f"{type(value).__name__} {text[:limit]}"
