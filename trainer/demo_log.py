"""``fedroute demo-log``: a device's evaluation log made from RouterBench rows, without calling any LLM.

A real device routes each query with its bundle (:meth:`sdk.Router.choose`), sends it to the chosen
model and records the outcome in its :class:`sdk.EvalLog`; the sync job then reads the log's query
embeddings and outcomes (:func:`sdk.local_update.kmeans_update` skips rows without an embedding).
This module plays that device on rows of a RouterBench-schema table (``../shared/data/README.md``,
section A), whose labels already hold every model's outcome: each sampled prompt is routed by the
bundle's own :class:`sdk.Router` (so the logged embeddings are the ones the device's encoder gives),
and the *chosen* model's correctness and cost are recorded as its score and cost, exactly what
:meth:`sdk.EvalLog.record_choice` stores on a device (embedding, Voronoi cell, bundle version; no
query text).

With ``explore > 0`` a share of the queries is sent to a model drawn uniformly among those labelled
for the row instead (an exploring device: without it the log only ever holds the models the router
already prefers). A row whose picked model has no label is skipped (counted in
:attr:`DemoLogResult.skipped`), as a device never learns the outcome of an unanswered query.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import numpy as np
import typer

from sdk.errors import InvalidInputError
from sdk.eval_log import EvalLog
from sdk.finite_option import COUNT_MAX, SEED_MAX, finite_option
from sdk.router import Router
from sdk.utility import check_lambda

if TYPE_CHECKING:  # the loader imports pandas; the command imports it when it runs
    from trainer.data.routerbench import EvalTable

__all__ = ["DemoLogResult", "demo_log", "write_demo_log"]


@dataclass(frozen=True)
class DemoLogResult:
    """What :func:`write_demo_log` recorded.

    Attributes
    ----------
    n_recorded : int, rows appended to the log.
    skipped : int, sampled rows not recorded (the picked model has no label in the table).
    explored : int, recorded rows sent to a randomly drawn model other than the router's choice.
    per_model : dict of model id -> rows recorded for it.
    mean_score : float or None, mean recorded score in [0, 1] (None when nothing was recorded: the
        command's JSON line then holds null, not a bare NaN).
    total_cost_usd : float, sum of the recorded costs, USD.
    """

    n_recorded: int
    skipped: int
    explored: int
    per_model: dict[str, int]
    mean_score: float | None
    total_cost_usd: float


def write_demo_log(router: Router, table: EvalTable, log: EvalLog, *, n_rows: int, lam: float,
                   explore: float = 0.0, seed: int = 0) -> DemoLogResult:
    """Route ``n_rows`` prompts of ``table`` with ``router`` and append the outcomes to ``log``.

    Parameters
    ----------
    router : the device's bundle, loaded (and verified) with :meth:`sdk.Router.load`.
    table : RouterBench-schema rows; its ``accuracy`` (n_queries, n_models) float64 and ``cost``
        (n_queries, n_models) float64, USD per query, give the outcome of each (row, model).
    log : the device's :class:`sdk.EvalLog`, opened with the bundle's model ids; rows are appended.
    n_rows : int >= 1, rows drawn without replacement (all rows when the table has fewer).
    lam : float, USD^-1, >= 0, the accuracy-cost trade-off of :meth:`sdk.Router.choose`.
    explore : float in [0, 1], share of queries sent to a uniformly drawn labelled model instead.
    seed : int, seeds the row sample and the exploration draws (same seed, same log content).

    Returns
    -------
    DemoLogResult

    Raises
    ------
    InvalidInputError
        ``n_rows`` < 1, ``explore`` outside [0, 1], or the table has no model of the bundle.
    InvalidLambdaError
        ``lam`` negative, NaN or infinite.
    """
    if isinstance(n_rows, bool) or not isinstance(n_rows, int) or n_rows < 1:
        raise InvalidInputError(f"n_rows must be an int >= 1, got {n_rows!r}")
    if not isinstance(explore, (int, float)) or not 0.0 <= explore <= 1.0:
        raise InvalidInputError(f"explore must lie in [0, 1], got {explore!r}")
    lam = check_lambda(lam)
    column = {m: table.models.index(m) for m in router.model_ids if m in table.models}
    if not column:
        raise InvalidInputError(f"the table {table.source} has none of the bundle's models {list(router.model_ids)}; "
                                f"it has {list(table.models)}")
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(table.n_queries, size=min(n_rows, table.n_queries), replace=False))
    choices = router.choose_batch([table.prompts[i] for i in rows], lam)
    explore_draws = rng.random(len(rows))
    per_model: Counter[str] = Counter()
    scores, cost_total, skipped, explored = [], 0.0, 0, 0
    for row, choice, draw in zip(rows, choices, explore_draws):
        model = choice.model
        if draw < explore:
            labelled = [m for m, j in column.items() if not math.isnan(table.accuracy[row, j])]
            if labelled:
                model = labelled[int(rng.integers(len(labelled)))]
        j = column.get(model)
        if j is None or math.isnan(table.accuracy[row, j]):
            skipped += 1
            continue
        score, cost = float(table.accuracy[row, j]), float(table.cost[row, j])
        log.record_choice(choice, score=score, cost_usd=cost, model=model)
        explored += model != choice.model
        per_model[model] += 1
        scores.append(score)
        cost_total += cost
    return DemoLogResult(n_recorded=len(scores), skipped=skipped, explored=explored, per_model=dict(per_model),
                         mean_score=float(np.mean(scores)) if scores else None, total_cost_usd=cost_total)


def demo_log(
    bundle: Annotated[Path, typer.Option(help="the device's bundle (e.g. device/bundle)")],
    public_key: Annotated[Path, typer.Option(help="signing.pub that signed the bundle")],
    data: Annotated[Path, typer.Option(help="RouterBench folder (its train.parquet is used) or a .parquet/.csv file")],
    out: Annotated[Path, typer.Option(help="the EvalLog SQLite file to append to (created with its folder)")],
    rows: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="prompts to route and log")] = 200,
    lam: Annotated[float, typer.Option(callback=finite_option, min=0.0, help="accuracy-cost trade-off, 1/USD")] = 100.0,
    explore: Annotated[float, typer.Option(callback=finite_option, min=0.0, max=1.0, help="share of queries sent to a random labelled model")] = 0.2,
    seed: Annotated[int, typer.Option(min=0, max=SEED_MAX, help="seeds the row sample and exploration")] = 0,
) -> None:
    """Make a device's evaluation log from RouterBench rows: route each prompt with the bundle and
    record the chosen model's labelled outcome (no LLM is called, no text is stored)."""
    from trainer.data.routerbench import load_eval_file, load_routerbench_dir  # trainer.data.routerbench imports huggingface_hub, pandas: on use only

    if not data.exists():
        raise typer.BadParameter(f"--data {data} does not exist (a RouterBench folder or a .parquet/.csv file)")
    table = load_routerbench_dir(data)[0] if data.is_dir() else load_eval_file(data)
    router = Router.load(bundle, public_key)
    with EvalLog(out, router.model_ids) as log:
        result = write_demo_log(router, table, log, n_rows=rows, lam=lam, explore=explore, seed=seed)
        total = len(log)
    typer.echo(json.dumps({"log": str(out), "rows_in_log": total, "bundle_version": router.bundle_version,
                           **asdict(result)}))
