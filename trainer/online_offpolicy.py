"""Off-policy evaluation of a router on an explored device log: ``fedroute offpolicy``.

A device that explores (:class:`sdk.Explorer`, the proxy's ``explore`` key) logs with each row the policy that
chose the model and its propensity ``p_i = pi_0(a_i | x_i)``. For a candidate router ``pi`` (a bundle, greedy at
``lam``) and the logged rows ``i`` that carry a propensity and an embedding ``x_i``, with logged model ``a_i``
and reward ``r_i`` (the row's score, or its cost in USD), the self-normalised inverse-propensity estimate
(Swaminathan & Joachims 2015, "The self-normalized estimator for counterfactual learning", eq. 3) is

    w_i = 1[pi(x_i) = a_i] / p_i,    V = sum_i w_i r_i / sum_i w_i,

with the delta-method standard error ``SE = sqrt(sum_i w_i^2 (r_i - V)^2) / sum_i w_i`` and the effective
sample size ``(sum_i w_i)^2 / sum_i w_i^2`` (Kong 1992). Rows without a propensity (greedy fallbacks, calls
answered by another model) or without an embedding are left out and counted. Only models the logging policy
could choose are covered: a model logged with probability 0 gets no weight (docs/routers-and-results.md
"Your own logs").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from sdk.eval_log import EvalLog, Evaluations
from sdk.finite_option import finite_option
from sdk.router import Router
from sdk.utility import decide

__all__ = ["OffPolicyEstimate", "offpolicy", "offpolicy_estimates", "snips"]


@dataclass(frozen=True)
class OffPolicyEstimate:
    """The candidate's SNIPS estimates at one ``lam`` (USD^-1): ``accuracy`` and ``cost_usd`` (USD per query)
    with standard errors (None when no usable row matches the candidate's choice); ``n_rows`` usable rows,
    ``n_matched`` of them logged with the candidate's model, ``effective_sample_size``; rows left out for
    having no propensity or no embedding."""

    lam: float
    accuracy: float | None
    accuracy_se: float | None
    cost_usd: float | None
    cost_usd_se: float | None
    n_rows: int
    n_matched: int
    effective_sample_size: float
    left_out_no_propensity: int
    left_out_no_embedding: int


def snips(weights: np.ndarray, rewards: np.ndarray) -> tuple[float, float]:
    """(V, SE) of the module docstring for weights (n,) >= 0 with a positive sum and rewards (n,), float64."""
    total = weights.sum()
    value = float(weights @ rewards / total)
    return value, float(np.sqrt(np.sum(weights**2 * (rewards - value) ** 2)) / total)


def offpolicy_estimates(router: Router, rows: Evaluations, lams: list[float]) -> list[OffPolicyEstimate]:
    """One :class:`OffPolicyEstimate` per ``lam`` of the greedy ``router`` on the logged ``rows``."""
    has_p = np.isfinite(rows.propensity)
    has_x = np.isfinite(rows.embedding).all(axis=1) & (rows.embedding.shape[1] == router.d_emb)
    use = np.flatnonzero(has_p & has_x)
    logged = np.array([router.model_ids.index(m) if m in router.model_ids else -1 for m in rows.model])[use]
    acc, cost = router.predict_from_embeddings(rows.embedding[use]) if use.size else (None, None)
    out = []
    for lam in lams:
        weights = (decide(acc, cost, lam) == logged) / rows.propensity[use] if use.size else np.zeros(0)
        matched = int(np.count_nonzero(weights))
        ests = [snips(weights, r[use]) for r in (rows.score, rows.cost_usd)] if matched else [(None, None)] * 2
        ess = float(weights.sum() ** 2 / np.sum(weights**2)) if matched else 0.0
        out.append(OffPolicyEstimate(lam, *ests[0], *ests[1], int(use.size), matched, ess,
                                     int(np.count_nonzero(~has_p)), int(np.count_nonzero(has_p & ~has_x))))
    return out


def offpolicy(
    log: Annotated[Path, typer.Option(help="the device's EvalLog SQLite file, rows logged by an exploring policy")],
    bundle: Annotated[Path, typer.Option(help="the candidate router's bundle (any router kind)")],
    public_key: Annotated[Path, typer.Option(help="signing.pub that signed the bundle")],
    lam: Annotated[list[float], typer.Option(callback=lambda v: [finite_option(x) for x in v], min=0.0,
                                             help="accuracy-cost trade-off, 1/USD (repeat for several)")],
) -> None:
    """Estimate a router's accuracy and cost on an explored device log (self-normalised inverse propensity
    weighting, with standard errors): one JSON line per --lam."""
    if not log.is_file():
        raise typer.BadParameter(f"--log {log} is not a file (an EvalLog SQLite file)")
    router = Router.load(bundle, public_key)
    with EvalLog(log, router.model_ids) as ev:
        rows = ev.rows()
    if rows.embedding.shape[1] not in (0, router.d_emb):
        raise typer.BadParameter(f"--log {log} holds {rows.embedding.shape[1]}-d embeddings, the bundle's embedder "
                                 f"gives {router.d_emb}-d: the candidate must embed queries as the logging device did")
    for est in offpolicy_estimates(router, rows, lam):
        typer.echo(json.dumps(asdict(est)))
