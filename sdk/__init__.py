"""fedroute SDK: on-device, cost-aware LLM routing.

Imports only numpy and the standard library here (onnxruntime, tokenizers and httpx in the modules
that need them); never torch, transformers, ``trainer`` or ``export``.

On the device:

- :class:`sdk.Router` — ``Router.load(bundle_dir, public_key)`` verifies a signed bundle, then
  ``choose(query, lam)`` returns a :class:`Choice` (embedding in onnxruntime, no network, no torch);
- :class:`sdk.RewardScorer` — ``RewardScorer.load(bundle_dir, public_key)`` verifies a signed MoR
  reward-scorer bundle, then ``score(prompt, response)`` gives this client's reward and ``route(...)``
  the federated router's client choice, locally;
- :class:`sdk.Selector` — ``Selector.load(bundle_dir, public_key)`` verifies a signed selector bundle
  (a FedPrism expert), then ``prefer(x, y_a, y_b)`` returns P(y_a is the better response);
- :class:`sdk.BudgetController` — keeps the realised spend per 1,000 queries on a budget (``choose`` /
  ``record``), adjusting ``lam`` online;
- :class:`sdk.EvalLog` — the SQLite log of sparse evaluations that the federated sync reads;
- :class:`sdk.SyncClient` — the periodic federated sync (upload statistics, install new bundles;
  httpx, imported on first use).

The math shared by the device and the trainer lives here once:

- :mod:`sdk.utility` — utility ``U = A - lam * C`` and the decision rule (METRICS.md tie-break);
- :mod:`sdk.voronoi` — nearest-centroid (Voronoi cell) lookup;
- :mod:`sdk.cell_statistics` — per-(cell, model) count/sum statistics, their merge and shrunk means;
- :mod:`sdk.personalisation` — the error-weighted interpolation of a global and a local estimator.
"""

from sdk.budget import BudgetController, BudgetEvent
from sdk.cell_statistics import CellStatistics
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
from sdk.eval_log import EvalLog, Evaluations
from sdk.personalisation import interpolation_weights, personalise
from sdk.reward_scorer import ClientChoice, RewardScorer
from sdk.router import Choice, ModelInfo, ModelScore, Router
from sdk.selector import Selector
from sdk.utility import check_lambda, decide, utility
from sdk.voronoi import nearest_cell

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
    "utility",
]


def __getattr__(name: str):
    # httpx is imported only by code that syncs.
    if name in ("SyncClient", "SyncResult"):
        from sdk import sync  # httpx: only code that syncs imports it

        return getattr(sync, name)
    raise AttributeError(f"module 'sdk' has no attribute {name!r}")
