"""fedroute SDK: on-device, cost-aware LLM routing.

``import sdk`` imports nothing but :mod:`sdk.errors`: every public name below is imported from its
module on first use (PEP 562 ``__getattr__``), so ``from sdk import Router`` loads the routing path
only (numpy, cryptography for the signature, tokenizers with the bundle; onnxruntime only for a
bundle that runs an ONNX graph, httpx only for the sync). Never torch, transformers, ``trainer`` or
``export``.

On the device:

- :class:`sdk.Router` — ``Router.load(bundle_dir, public_key)`` verifies a signed bundle, then
  ``choose(query, lam)`` returns a :class:`Choice` (the bundle's embedder: a static table in numpy
  or an ONNX encoder in onnxruntime; no network, no torch);
- :class:`sdk.RewardScorer` — ``RewardScorer.load(bundle_dir, public_key)`` verifies a signed MoR
  reward-scorer bundle, then ``score(prompt, response)`` gives this client's reward and ``route(...)``
  the federated router's client choice, locally;
- :class:`sdk.Selector` — ``Selector.load(bundle_dir, public_key)`` verifies a signed selector bundle
  (a FedPrism expert), then ``prefer(x, y_a, y_b)`` returns P(y_a is the better response);
- :class:`sdk.BudgetController` — keeps the realised spend per 1,000 queries on a budget (``choose`` /
  ``record``), adjusting ``lam`` online;
- :class:`sdk.EvalLog` — the SQLite log of sparse evaluations that the federated sync reads;
- :class:`sdk.Explorer` — opt-in Thompson-sampling exploration over a K-means bundle's cell table
  (``Explorer(router, seed=0).choose(query, lam)``), so the logs teach the federated router what it
  does not know yet; each choice carries its policy and propensity;
- :class:`sdk.SyncClient` — the periodic federated sync (upload statistics, install new bundles;
  httpx, imported on first use).

The math shared by the device and the trainer lives here once:

- :mod:`sdk.utility` — utility ``U = A - lam * C`` and the decision rule (METRICS.md tie-break); ``sdk.utility``
  is this module (``from sdk.utility import utility`` for the function: a package attribute cannot be both,
  and the import system rebinds it to the module once anything imports ``sdk.utility``);
- :mod:`sdk.voronoi` — nearest-centroid (Voronoi cell) lookup;
- :mod:`sdk.cell_statistics` — per-(cell, model) count/sum statistics, their merge and shrunk means;
- :mod:`sdk.personalisation` — the error-weighted interpolation of a global and a local estimator.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

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


def __getattr__(name: str):
    """PEP 562: import a public name's module on first access (and cache the name here). A
    submodule not imported yet (``sdk.kinds`` after a bare ``import sdk``) is imported too, as the
    eager ``import sdk`` of earlier versions made it available."""
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
