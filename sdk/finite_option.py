"""Checks every float and count option of the ``fedroute`` and ``fedroute-sync`` commands carries.

click's ``min=``/``max=`` lets NaN through (it compares False with every bound), so each float option
is declared ``typer.Option(callback=finite_option, ...)``: ``--alpha nan`` exits 2 with ``Invalid value
for '--alpha': must be a finite number, got nan`` (``tests/test_cli_hostile.py`` checks every option).
Integer options get ``max=COUNT_MAX`` or ``max=SEED_MAX``.
"""

from __future__ import annotations

import typer

from sdk.real_numbers import finite_float

#: Upper bound of a count option: the largest C ``int`` (torch and the data loaders overflow beyond).
COUNT_MAX = 2**31 - 1

#: Upper bound of a random-seed option: ``np.random.seed`` takes 0 .. 2**32 - 1.
SEED_MAX = 2**32 - 1


def finite_option(value: float | None) -> float | None:
    """typer ``callback=`` of a float option: ``value`` unchanged, or typer.BadParameter for NaN / +-inf."""
    if value is not None and finite_float(value) is None:
        raise typer.BadParameter(f"must be a finite number, got {value}")
    return value
