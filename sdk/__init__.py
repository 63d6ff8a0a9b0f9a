"""fedroute SDK: on-device, cost-aware LLM routing.

Imports only numpy and the standard library here (onnxruntime, tokenizers and httpx in the modules
that need them); never torch, transformers, ``trainer`` or ``export``.

The math shared by the device and the trainer lives here once:

- :mod:`sdk.utility` — utility ``U = A - lam * C`` and the decision rule (METRICS.md tie-break);
- :mod:`sdk.voronoi` — nearest-centroid (Voronoi cell) lookup;
- :mod:`sdk.cell_statistics` — per-(cell, model) count/sum statistics, their merge and shrunk means;
- :mod:`sdk.personalisation` — the error-weighted interpolation of a global and a local estimator.
"""

from sdk.cell_statistics import CellStatistics
from sdk.errors import (
    FedrouteError,
    InvalidInputError,
    InvalidLambdaError,
    ShapeError,
    UnknownModelError,
)
from sdk.personalisation import interpolation_weights, personalise
from sdk.utility import check_lambda, decide, utility
from sdk.voronoi import nearest_cell

__all__ = [
    "CellStatistics",
    "FedrouteError",
    "InvalidInputError",
    "InvalidLambdaError",
    "ShapeError",
    "UnknownModelError",
    "check_lambda",
    "decide",
    "interpolation_weights",
    "nearest_cell",
    "personalise",
    "utility",
]
