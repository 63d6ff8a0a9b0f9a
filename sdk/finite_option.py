"""The check every float option of the ``fedroute`` and ``fedroute-sync`` commands carries: finite.

typer (click) parses ``--alpha nan`` and ``--tick-s inf`` into floats, and its ``min=``/``max=``
range check lets NaN through: NaN compares False with every bound, so it is never "below the
minimum". An option declared ``typer.Option(callback=finite_option, ...)`` refuses NaN and +-inf
while the command line is parsed, before the command's body reads a file or writes anything::

    alpha: Annotated[float, typer.Option(min=1e-6, callback=finite_option, help="...")] = 0.6

``fedroute simulate --alpha nan`` then exits with status 2 and one line,
``Invalid value for '--alpha': must be a finite number, got nan`` (click names the option).
``tests/test_cli_hostile.py`` walks every command and checks that each float option has it.

Integer options get an upper bound, :data:`COUNT_MAX` (counts: seeds, steps, threads, pairs) or
:data:`SEED_MAX` (random seeds), through typer's ``max=``: without one, ``--seeds 99999999999999999999``
or ``--threads 2**31`` passed the parse and ended in an OverflowError traceback inside torch or numpy,
some only after minutes of data preparation. ``--bundle-version`` is bounded by
:data:`sdk.bundle_manifest.MAX_BUNDLE_VERSION` (2**63 - 1, what the SDK loads) the same way.
"""

from __future__ import annotations

import typer

from sdk.real_numbers import finite_float

#: Upper bound of a count option (seeds, steps, threads, pairs, tokens): the largest C ``int``, what
#: torch (``set_num_threads``) and the data loaders take without overflow.
COUNT_MAX = 2**31 - 1

#: Upper bound of a random-seed option: numpy's legacy seed (``np.random.seed``, which TRL's
#: ``set_seed`` calls) takes 0 .. 2**32 - 1.
SEED_MAX = 2**32 - 1


def finite_option(value: float | None) -> float | None:
    """typer ``callback=`` of a float option: ``value`` unchanged when it is finite (or None: not given).

    Raises
    ------
    typer.BadParameter
        ``value`` is NaN, inf or -inf; click prefixes the option's name and exits with status 2.
    """
    if value is not None and finite_float(value) is None:
        raise typer.BadParameter(f"must be a finite number, got {value}")
    return value
