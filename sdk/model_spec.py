"""The ``model=`` string of a routed chat call (docs/openai_proxy.md, "model= strings"): ``None`` or
``"fedroute"`` routes with the client's default, ``"fedroute:lam=X"`` (finite, >= 0, USD^-1) or
``"fedroute:budget=Y"`` (finite, > 0, USD per 1,000 queries) with that trade-off or budget, any other
string names a model to call directly. Any other string starting with ``fedroute`` is a
:class:`sdk.errors.ModelSpecError`; numbers are ASCII decimals (no ``_``, spaces, ``inf`` or ``nan``).
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
    """A parsed ``model=`` string: the model id to call directly (None: routed), or the ``lam`` (USD^-1) or
    budget (USD per 1,000 queries) asked for."""

    passthrough: str | None = None
    lam: float | None = None
    budget_usd_per_1k: float | None = None

    @property
    def routed(self) -> bool:
        return self.passthrough is None


def parse_model_spec(model: object) -> ModelSpec:
    """Parse ``model`` (module docstring); :class:`ModelSpecError` for a value that is not a str (nor None),
    an empty one or a malformed ``fedroute...`` string (the message quotes it and the valid forms)."""
    if model is None:
        return ModelSpec()
    if not isinstance(model, str) or not model.strip():
        raise ModelSpecError(f"model must be a non-empty str ('fedroute', 'fedroute:lam=X', 'fedroute:budget=Y' or a "
                             f"model id), got {type(model).__name__} {model!r}")
    if model == ROUTED_MODEL:
        return ModelSpec()
    head, sep, option = model.partition(":")
    if head != ROUTED_MODEL and not model.startswith(ROUTED_MODEL):
        return ModelSpec(passthrough=model)
    key, eq, raw = option.partition("=")
    value = float(raw) if _NUMBER.fullmatch(raw) else math.nan
    lam = key == "lam"
    problem = ("it starts with 'fedroute' but is not 'fedroute' nor 'fedroute:...'" if head != ROUTED_MODEL
               else "expected exactly one option, lam=X or budget=Y" if not eq or key not in _KEYS or "," in raw or ":" in raw
               else f"{raw!r} is not a decimal number in ASCII digits (e.g. 100, 0.5, 1e-3)" if math.isnan(value)
               else f"{key} must be a finite number {'>= 0 (USD^-1)' if lam else '> 0 (USD per 1,000 queries)'}, got {raw}"
               if not math.isfinite(value) or value < 0 or (value == 0 and not lam) else None)
    if problem:
        raise ModelSpecError(_bad(model, problem))
    return ModelSpec(lam=value) if lam else ModelSpec(budget_usd_per_1k=value)


def _bad(model: str, why: str) -> str:
    return (f"model {model!r} is malformed: {why}. Valid: 'fedroute', 'fedroute:lam=100' (USD^-1, >= 0), "
            "'fedroute:budget=0.5' (USD per 1,000 queries, > 0) or a model id to call directly")
