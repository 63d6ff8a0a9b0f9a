"""Scalar numbers given by callers: the one test of "a finite real number" used at public boundaries.

What counts as a real number is Python's numeric tower, :class:`numbers.Real`: ``int``, ``float``,
:class:`fractions.Fraction` and numpy's integer and floating scalars (``np.int64``, ``np.float32``...;
numpy registers them). Not real here:

- ``bool`` and ``numpy.bool_``. ``bool`` subclasses ``int`` (so it is a ``numbers.Real``), but a
  ``True`` passed as a price, a budget or a trade-off is a bug in the caller, never the number 1.
- :class:`decimal.Decimal`. The standard library registers it as :class:`numbers.Number` only, not
  ``numbers.Real``, because Decimal does not mix with float in arithmetic (``Decimal(1) + 0.5``
  raises TypeError). A caller holding a Decimal converts it with ``float(d)`` first, deciding the
  rounding; we do not decide it silently.
- ``complex``, ``str``, ``None`` and everything else.

Finite means ``math.isfinite`` of the value as a float: NaN and +-inf are not. An int (or a Fraction)
beyond the float range, about +-1.8e308 (e.g. ``10**400``), has no float: ``float()`` and
``math.isfinite`` raise OverflowError on it. It counts as not finite, so no caller meets that
OverflowError.

Pure functions, no I/O.
"""

from __future__ import annotations

import math
import numbers

import numpy as np


def is_real_number(value: object) -> bool:
    """Whether ``value`` is a real number in the sense of this module (finite or not).

    True for ``int``, ``float``, ``Fraction`` and numpy integer/floating scalars, including NaN, +-inf
    and ints beyond the float range; False for ``bool``, ``numpy.bool_``, ``Decimal``, ``complex``,
    ``str``, ``None`` and other objects. Never raises.
    """
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def finite_float(value: object) -> float | None:
    """``value`` as a Python ``float`` when it is a finite real number, else ``None``.

    Parameters
    ----------
    value : any object; typically a number a caller passed in (a price in USD, a budget in USD per
        1,000 queries, a trade-off in USD^-1...: the unit is the caller's).

    Returns
    -------
    float or None
        ``float(value)`` when :func:`is_real_number` holds and that float is finite; ``None`` for NaN,
        +-inf, an int or Fraction beyond the float range (``10**400``: ``float()`` would raise
        OverflowError), and for anything that is not a real number (``bool``, ``numpy.bool_``,
        ``Decimal``, ``str``, ``None``...). Never raises. ``-0.0`` stays ``-0.0``.

    A ``None`` result for a value that :func:`is_real_number` accepts and that is a
    :class:`numbers.Rational` (an int, a Fraction, a numpy integer) always means "beyond the float
    range": rationals are never NaN or inf.
    """
    if not is_real_number(value):
        return None
    try:
        result = float(value)
    except OverflowError:  # an int or Fraction beyond the float range
        return None
    return result if math.isfinite(result) else None


#: Integers of more bits than this are named by their size in error messages (|n| >= ~5.4e39; Python's
#: ``str()`` of an int of over 4,300 digits raises ValueError, so the message itself would fail).
_SHOWN_BITS = 132


def shown(value: object, limit: int = 40) -> str:
    """``value`` as an error message names it: a number as itself, anything else with its type.

    A str ``"0.5"`` is shown as ``str '0.5'``, never as ``0.5`` (which reads as a valid number); a bool
    as ``bool True``; an int beyond about 5.4e39 by its size (``an integer of about 5001 digits``: ``str``
    of an int of over 4,300 digits raises ValueError, so a message built with it failed with a
    traceback instead of naming the value). At most ``limit`` characters of the value. Never raises.
    """
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
