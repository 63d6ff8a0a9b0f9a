"""Checks of one field of a trainer config dataclass, for its ``__post_init__``.

Each check reads ``getattr(config, name)``, leaves the value as given (constructor arguments are stored
verbatim, as in scikit-learn) and raises ``error`` (default :class:`~sdk.errors.InvalidInputError`, a
``ValueError``) whose message names the class, the field, the allowed range and the value received::

    RewardModelConfig.lr=nan should be a finite number > 0

so a researcher scripting the trainer learns of a bad setting when the config is built, before any
data or model is loaded. What counts as a number is :mod:`sdk.real_numbers` (``bool`` is not one);
an integer is a :class:`numbers.Integral` (``int``, numpy integers), never ``bool`` and never a
float such as ``2.0`` (``range(2.0)`` would fail later, deep inside a training loop).

Pure functions, no I/O.
"""

from __future__ import annotations

import numbers

import numpy as np

from sdk.errors import InvalidInputError
from sdk.real_numbers import finite_float

__all__ = ["check_bool", "check_config", "check_int", "check_real", "check_sequence"]


def _fail(config: object, name: str, rule: str, error: type[InvalidInputError]) -> InvalidInputError:
    return error(f"{type(config).__name__}.{name}={getattr(config, name)!r} should be {rule}")


def check_int(config: object, name: str, low: int, *, optional: bool = False,
              error: type[InvalidInputError] = InvalidInputError) -> None:
    """Raise ``error`` unless ``config.<name>`` is an integer >= ``low`` (or None when ``optional``).

    Raises
    ------
    InvalidInputError (or ``error``)
        A bool, a float (also ``2.0``), a str, None (unless ``optional``) or an integer below ``low``.
    """
    value = getattr(config, name)
    if optional and value is None:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < low:
        raise _fail(config, name, f"an integer >= {low}" + (" or None" if optional else ""), error)


def check_real(config: object, name: str, low: float | None = None, high: float | None = None, *,
               low_open: bool = False, high_open: bool = False, optional: bool = False,
               error: type[InvalidInputError] = InvalidInputError) -> None:
    """Raise ``error`` unless ``config.<name>`` is a finite real number in the interval given.

    low, high : bounds (None: unbounded on that side); low_open, high_open : exclude the bound.
    optional : None is allowed too.

    Raises
    ------
    InvalidInputError (or ``error``)
        NaN, +-inf, a bool, a str, None (unless ``optional``) or a number outside the interval.
    """
    value = getattr(config, name)
    if optional and value is None:
        return
    number = finite_float(value)
    below = low is not None and number is not None and (number <= low if low_open else number < low)
    above = high is not None and number is not None and (number >= high if high_open else number > high)
    if number is None or below or above:
        bounds = [f"{'>' if low_open else '>='} {low}"] if low is not None else []
        bounds += [f"{'<' if high_open else '<='} {high}"] if high is not None else []
        rule = "a finite number" + (" " + " and ".join(bounds) if bounds else "")
        raise _fail(config, name, rule + (" or None" if optional else ""), error)


def check_config(config: object, name: str, kind: type, *,
                 error: type[InvalidInputError] = InvalidInputError) -> None:
    """Raise ``error`` unless ``config.<name>`` is an instance of ``kind`` (a nested config such as
    ``MoRConfig.router``: a dict or None there would fail only when training reaches it)."""
    if not isinstance(getattr(config, name), kind):
        raise error(f"{type(config).__name__}.{name} should be a {kind.__name__} (e.g. {kind.__name__}(**settings)), "
                    f"got {type(getattr(config, name)).__name__}")


def check_bool(config: object, name: str, *, error: type[InvalidInputError] = InvalidInputError) -> None:
    """Raise ``error`` unless ``config.<name>`` is a ``bool`` (or ``numpy.bool_``): a flag given as
    ``0``, ``"False"`` or ``None`` is a bug in the caller (``"False"`` is truthy)."""
    if not isinstance(getattr(config, name), (bool, np.bool_)):
        raise _fail(config, name, "True or False", error)


def check_sequence(config: object, name: str, *, optional: bool = False,
                   error: type[InvalidInputError] = InvalidInputError) -> None:
    """Raise ``error`` unless ``config.<name>`` is a tuple or list (or None when ``optional``): a str
    would be read as its characters (``tuple("query")`` is ``('q', 'u', 'e', 'r', 'y')``)."""
    value = getattr(config, name)
    if (optional and value is None) or isinstance(value, (tuple, list)):
        return
    hint = f"; write ({value!r},)" if isinstance(value, str) else ""
    raise error(f"{type(config).__name__}.{name} must be a tuple, got {type(value).__name__} {value!r:.60}{hint}")
