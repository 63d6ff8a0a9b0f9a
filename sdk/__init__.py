"""fedroute SDK: on-device, cost-aware LLM routing.

``import sdk`` imports only :mod:`sdk.errors`; each public name is imported from its module on first
use (PEP 562 ``__getattr__``): never torch, transformers, ``trainer`` or ``export``.

- :class:`Router` (``Router.load(bundle_dir, public_key).choose(query, lam)`` -> :class:`Choice`),
  :class:`RewardScorer`, :class:`PersonalRewardScorer`, :class:`Selector`: signed bundles, verified when loaded;
- :class:`BudgetController` keeps spend per 1,000 queries on a budget; :class:`Explorer` explores
  by Thompson sampling;
- :class:`EvalLog`, the SQLite log of sparse evaluations, and :class:`SyncClient`, the federated sync;
- the math shared with the trainer: :mod:`sdk.utility` (``U = A - lam * C``, :func:`decide`; ``sdk.utility``
  is the module: ``from sdk.utility import utility`` for the function), :mod:`sdk.voronoi`,
  :mod:`sdk.cell_statistics`, :mod:`sdk.personalisation`.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from sdk.errors import (
    BudgetError,
    BundleError,
    EvalLogError,
    FedrouteError,
    InvalidInputError,
    InvalidLambdaError,
    InvalidQueryError,
    ShapeError,
    SyncError,
    SyncRejectedError,
    UnknownModelError,
)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time `__getattr__` imports these on first use
    from sdk.budget import BudgetController, BudgetEvent
    from sdk.cell_statistics import CellStatistics
    from sdk.eval_log import EvalLog, Evaluations
    from sdk.explorer import Explorer
    from sdk.personal_reward import PersonalLatent, PersonalRewardScorer
    from sdk.personalisation import interpolation_weights, personalise
    from sdk.reward_scorer import ClientChoice, RewardScorer
    from sdk.router import Choice, ModelInfo, ModelScore, Router
    from sdk.selector import Selector
    from sdk.sync import SyncClient, SyncResult
    from sdk.utility import check_lambda, decide
    from sdk.voronoi import nearest_cell

#: Public name -> the module that defines it (imported on first access of the name).
_LAZY = {
    "BudgetController": "sdk.budget",
    "BudgetEvent": "sdk.budget",
    "CellStatistics": "sdk.cell_statistics",
    "EvalLog": "sdk.eval_log",
    "Evaluations": "sdk.eval_log",
    "Explorer": "sdk.explorer",
    "PersonalLatent": "sdk.personal_reward",
    "PersonalRewardScorer": "sdk.personal_reward",
    "interpolation_weights": "sdk.personalisation",
    "personalise": "sdk.personalisation",
    "ClientChoice": "sdk.reward_scorer",
    "RewardScorer": "sdk.reward_scorer",
    "Choice": "sdk.router",
    "ModelInfo": "sdk.router",
    "ModelScore": "sdk.router",
    "Router": "sdk.router",
    "Selector": "sdk.selector",
    "SyncClient": "sdk.sync",  # httpx: only code that syncs imports it
    "SyncResult": "sdk.sync",
    "check_lambda": "sdk.utility",
    "decide": "sdk.utility",
    "nearest_cell": "sdk.voronoi",
}

__all__ = [
    "BudgetController",
    "BudgetError",
    "BudgetEvent",
    "BundleError",
    "CellStatistics",
    "Choice",
    "ClientChoice",
    "EvalLog",
    "EvalLogError",
    "Evaluations",
    "Explorer",
    "FedrouteError",
    "InvalidInputError",
    "InvalidLambdaError",
    "InvalidQueryError",
    "ModelInfo",
    "ModelScore",
    "PersonalLatent",
    "PersonalRewardScorer",
    "RewardScorer",
    "Router",
    "Selector",
    "ShapeError",
    "SyncClient",
    "SyncError",
    "SyncRejectedError",
    "SyncResult",
    "UnknownModelError",
    "check_lambda",
    "decide",
    "interpolation_weights",
    "nearest_cell",
    "personalise",
]


def __getattr__(name: str) -> Any:
    """PEP 562: import a public name's module on first access (and cache the name); a submodule
    (``sdk.kinds``) is imported too."""
    module = _LAZY.get(name)
    if module is None:
        if name.startswith("_") or importlib.util.find_spec(f"sdk.{name}") is None:
            raise AttributeError(f"module 'sdk' has no attribute {name!r}")
        return importlib.import_module(f"sdk.{name}")  # binds sdk.<name> itself
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
