"""The ``model=`` string of a routed chat call: route, or pass straight through.

==============================  ============================================================
``model=``                      meaning
==============================  ============================================================
``None`` or ``"fedroute"``      route with the client's default (its ``lam`` or budget)
``"fedroute:lam=100"``          route with ``lam = 100`` USD^-1 (finite, >= 0)
``"fedroute:budget=0.5"``       route keeping the realised spend at 0.5 USD per 1,000 queries
                                (finite, > 0; :class:`sdk.budget.BudgetController`)
any other string                that model, straight through (no routing, no fallback)
==============================  ============================================================

Anything else that starts with ``fedroute`` (``"fedroute:"``, ``"fedroute:lam=abc"``,
``"fedroute:lam=1,budget=2"``, ``"fedroute:speed=9"``, ``"fedroute:lam=-1"``,
``"fedroute:budget=0"``, ``"fedroute:budget=nan"``) is a :class:`sdk.errors.ModelSpecError`. Numbers are
written in ASCII digits with an optional sign, decimal point and exponent (``100``, ``0.5``, ``1e-3``):
no other script's digits, ``_`` separators, spaces, ``inf`` or ``nan``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from sdk.errors import ModelSpecError

#: The model id that asks for routing.
ROUTED_MODEL = "fedroute"
_KEYS = ("lam", "budget")
#: The number syntax of an option: ASCII digits, an optional sign, point and exponent (no '_', spaces, inf or nan).
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


@dataclass(frozen=True)
class ModelSpec:
    """A parsed ``model=`` string.

    Attributes
    ----------
    passthrough : the model id to call directly, or None when the call is routed.
    lam : USD^-1 asked for by ``fedroute:lam=X``, else None.
    budget_usd_per_1k : USD per 1,000 queries asked for by ``fedroute:budget=Y``, else None.
    """

    passthrough: str | None = None
    lam: float | None = None
    budget_usd_per_1k: float | None = None

    @property
    def routed(self) -> bool:
        return self.passthrough is None


def parse_model_spec(model: object) -> ModelSpec:
    """Parse ``model`` (table in the module docstring).

    Raises
    ------
    ModelSpecError
        Not a str (nor None), empty, or a malformed ``fedroute...`` string; the message quotes it and
        the valid forms.
    """
    if model is None:
        return ModelSpec()
    if not isinstance(model, str):
        raise ModelSpecError(f"model must be a str, got {type(model).__name__} {model!r}")
    if not model.strip():
        raise ModelSpecError("model is empty; use 'fedroute', 'fedroute:lam=X', 'fedroute:budget=Y' or a model id")
    if model == ROUTED_MODEL:
        return ModelSpec()
    head, sep, option = model.partition(":")
    if head != ROUTED_MODEL:
        if model.startswith(ROUTED_MODEL):
            raise ModelSpecError(_bad(model, "it starts with 'fedroute' but is not 'fedroute' nor 'fedroute:...'"))
        return ModelSpec(passthrough=model)
    key, eq, raw = option.partition("=")
    if not eq or key not in _KEYS or "," in raw or ":" in raw:
        raise ModelSpecError(_bad(model, "expected exactly one option, lam=X or budget=Y"))
    if _NUMBER.fullmatch(raw) is None:  # float() alone also took '٣', '1_0', ' 3 ' and 'inf'
        raise ModelSpecError(_bad(model, f"{raw!r} is not a decimal number in ASCII digits (e.g. 100, 0.5, 1e-3)"))
    value = float(raw)
    if key == "lam":
        if not math.isfinite(value) or value < 0:
            raise ModelSpecError(_bad(model, f"lam must be a finite number >= 0 (USD^-1), got {raw}"))
        return ModelSpec(lam=value)
    if not math.isfinite(value) or value <= 0:
        raise ModelSpecError(_bad(model, f"budget must be a finite number > 0 (USD per 1,000 queries), got {raw}"))
    return ModelSpec(budget_usd_per_1k=value)


def _bad(model: str, why: str) -> str:
    return (f"model {model!r} is malformed: {why}. Valid: 'fedroute', 'fedroute:lam=100' (USD^-1, >= 0), "
            "'fedroute:budget=0.5' (USD per 1,000 queries, > 0) or a model id to call directly")
