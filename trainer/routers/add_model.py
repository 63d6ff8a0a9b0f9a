"""A new model in the pool without retraining (paper 002; ARCHITECTURE.md §4 "Model pool changes").

``fedroute add-model`` widens a trained router by one model fitted on a small calibration set, leaving
what the router knew untouched: the MLP router (:func:`add_model_mlp`) gets new accuracy and cost heads on
its frozen trunk features; the K-means router (:func:`add_model_kmeans`) a new column of per-cell
statistics. Both start the model from the pool's mean accuracy and its price (USD per query) and move to
the data with ``kappa0 = model_prior_strength`` pseudo-observations
(:func:`trainer.routers.shrinkage.shrink_toward`). The calibration file, the price rule and the prior
are in docs/add_model.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sdk.cell_statistics import CellStatistics
from sdk.errors import InvalidInputError, ShapeError, UnknownModelError
from sdk.eval_log import MAX_COST_PER_QUERY_USD
from sdk.real_numbers import finite_float
from sdk.voronoi import nearest_cell
from trainer.routers.kmeans_router import KMeansRouter
from trainer.routers.mlp_router import MLPRouter
from trainer.routers.shrinkage import shrink_toward

CALIBRATION_COLUMNS = ("prompt", "model", "score", "cost_usd")
#: Ridge penalties tried by leave-one-out on the calibration set (features are the trunk's outputs).
RIDGE_ALPHAS = tuple(float(a) for a in np.logspace(-1, 5, 13))
#: Fewest calibration queries for the query-dependent (ridge) part of a new MLP head; below it the
#: head is the prior plus the shrunk offset.
MIN_RIDGE_SAMPLES = 5


@dataclass(frozen=True)
class Calibration:
    """A validated calibration set for one new model.

    Attributes
    ----------
    model : str, the new model's id.
    prompts : tuple of str, length n (n may be 0).
    accuracy : ndarray of shape (n,), float64 in [0, 1], the observed scores.
    cost : ndarray of shape (n,), float64 >= 0, USD per query.
    source : str, where it came from (for messages and provenance).
    """

    model: str
    prompts: tuple[str, ...]
    accuracy: np.ndarray
    cost: np.ndarray
    source: str = "<memory>"

    @property
    def n(self) -> int:
        return len(self.prompts)


def check_new_model(model: str, pool) -> str:
    """``model`` if it is a usable new model id for ``pool`` (sequence of str).

    Raises
    ------
    InvalidInputError
        Empty / whitespace id, or a model already in the pool.
    """
    if not isinstance(model, str) or not model.strip():
        raise InvalidInputError(f"--model must be a non-empty model id, got {model!r}")
    if model in tuple(pool):
        raise InvalidInputError(f"model {model!r} is already in the router's pool {list(pool)}; add-model adds a new "
                                "one (retrain, or run federated rounds, to update an existing model)")
    return model


def calibration_from_frame(frame, model: str, pool, source: str = "<frame>") -> Calibration:
    """Validate a calibration table (pandas DataFrame, columns :data:`CALIBRATION_COLUMNS`).

    Raises
    ------
    InvalidInputError
        A missing column; an empty / non-text prompt; a score that is missing, not a number or outside
        [0, 1]; a cost that is missing, not finite or negative (messages name the row, 0-based).
    UnknownModelError
        A row names another model than ``model``: one of the pool (its head is frozen: calibration
        rows are the new model's only) or one the router does not know.
    """
    import pandas as pd  # trainer extra (pandas), imported on use

    check_new_model(model, pool)
    missing = [c for c in CALIBRATION_COLUMNS if c not in frame.columns]
    if missing:
        raise InvalidInputError(f"{source}: missing column(s) {missing}; a calibration file has the columns "
                                f"{list(CALIBRATION_COLUMNS)} (one row per query of the new model)")
    prompts = []
    for i, p in enumerate(frame["prompt"].tolist()):
        if not isinstance(p, str) or not p.strip():
            raise InvalidInputError(f"{source}: row {i}: prompt must be non-empty text, got {p!r}")
        prompts.append(p)
    others = [str(m) for m in dict.fromkeys(frame["model"].tolist()) if str(m) != model]
    if others:
        in_pool = [m for m in others if m in tuple(pool)]
        unknown = [m for m in others if m not in tuple(pool)]
        raise UnknownModelError(
            f"{source}: every row must be for the new model {model!r}; found "
            + "; ".join(part for part in (
                f"pool models {in_pool} (their heads are frozen; calibrate the new model only)" if in_pool else "",
                f"unknown models {unknown}" if unknown else "") if part))
    values = {}
    for column, low, high in (("score", 0.0, 1.0), ("cost_usd", 0.0, MAX_COST_PER_QUERY_USD)):
        v = pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        bad = ~np.isfinite(v) | (v < low) | (v > high)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            rule = "a number in [0, 1]" if column == "score" else \
                f"a finite number of USD per query, >= 0 and <= {MAX_COST_PER_QUERY_USD:g}"
            shown = frame[column].iloc[i]
            shown = shown.item() if isinstance(shown, np.generic) else shown
            raise InvalidInputError(f"{source}: row {i}: {column} must be {rule}, got {shown!r}")
        values[column] = v
    return Calibration(model, tuple(prompts), values["score"], values["cost_usd"], source)


def load_calibration(path: str | Path, model: str, pool) -> Calibration:
    """Read and validate a calibration file (``.csv``, ``.parquet``, ``.jsonl``; see the module docstring).

    Raises
    ------
    InvalidInputError
        Unreadable file or unknown suffix, plus everything :func:`calibration_from_frame` raises.
    UnknownModelError
        See :func:`calibration_from_frame`.
    """
    import pandas as pd  # trainer extra (pandas), imported on use

    path = Path(path)
    readers = {".csv": lambda p: pd.read_csv(p, dtype={"prompt": str, "model": str}, keep_default_na=False,
                                             na_values={"score": [""], "cost_usd": [""]}),
               ".parquet": pd.read_parquet, ".jsonl": lambda p: pd.read_json(p, lines=True)}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise InvalidInputError(f"--calibration {path}: unknown suffix {path.suffix!r}; use .csv, .parquet or .jsonl")
    try:
        frame = reader(path)
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"--calibration {path}: cannot read it ({type(exc).__name__}: {exc})") from exc
    return calibration_from_frame(frame, model, pool, str(path))


def resolve_price(calibration: Calibration, price_usd: float | None) -> float:
    """The new model's price, USD per query: ``price_usd`` if given, else the calibration rows' mean cost.

    Raises
    ------
    InvalidInputError
        ``price_usd`` is not a finite number in [0, :data:`sdk.eval_log.MAX_COST_PER_QUERY_USD`] (1000),
        or it is None and the calibration set is empty
        (a model without a price: its cost prior would be unknown).
    """
    if price_usd is not None:
        return _price(price_usd, "--price")
    if calibration.n == 0:
        raise InvalidInputError(f"model {calibration.model!r} has no price: the calibration set has no row to take "
                                "its mean cost from; give --price (USD per query)")
    return float(calibration.cost.mean())


def _check_arrays(router, embeddings: np.ndarray, accuracy: np.ndarray, cost: np.ndarray):
    x = np.asarray(embeddings, dtype=np.float32).reshape(-1, router.d_emb) if np.size(embeddings) == 0 \
        else np.asarray(embeddings, dtype=np.float32)
    acc, cst = np.asarray(accuracy, dtype=np.float64), np.asarray(cost, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != router.d_emb or acc.shape != (x.shape[0],) or cst.shape != (x.shape[0],):
        raise ShapeError(f"calibration embeddings must be (n, {router.d_emb}) with accuracy and cost (n,), got "
                         f"{x.shape}, {acc.shape}, {cst.shape}")
    if not (np.isfinite(x).all() and np.isfinite(acc).all() and np.isfinite(cst).all()):
        raise ShapeError("calibration embeddings, accuracy and cost must be finite")
    if (acc < 0).any() or (acc > 1).any() or (cst < 0).any():
        raise InvalidInputError("calibration accuracy must lie in [0, 1] and cost be >= 0 USD")
    return x, acc, cst


def _price(price_usd: object, name: str = "price_usd") -> float:
    price = finite_float(price_usd)
    if price is None or price < 0:
        raise InvalidInputError(f"{name} must be a finite number >= 0 (USD per query), got {price_usd!r}")
    if price > MAX_COST_PER_QUERY_USD:
        raise InvalidInputError(f"{name} must be at most {MAX_COST_PER_QUERY_USD:g} USD per query (no device log records "
                                f"a costlier query and the sync server refuses one), got {price_usd!r}")
    return price


def add_model_kmeans(router: KMeansRouter, model: str, embeddings: np.ndarray, accuracy: np.ndarray,
                     cost: np.ndarray, price_usd: float) -> KMeansRouter:
    """The K-means router with one more column of statistics (the new model's), appended last.

    Each calibration query goes to its nearest centroid; the new column holds its per-cell count and
    sums. Cell means come from :func:`trainer.routers.shrinkage.shrunk_means` with ``price_usd`` as the
    new model's price prior: with ``n`` observations the model-level accuracy is
    ``(S + kappa0 * Abar) / (n + kappa0)`` (``Abar`` the count-weighted mean accuracy of the pool) and
    the model-level cost ``(S_cost + kappa0 * price) / (n + kappa0)``; each cell then shrinks toward
    those with ``prior_strength`` pseudo-observations, as for every model.

    Parameters
    ----------
    router : KMeansRouter over n_models models.
    model : the new model id (not in the pool).
    embeddings : (n, d_emb) float32, the calibration queries (the router's embedder).
    accuracy, cost : (n,) float64, observed score in [0, 1] and cost in USD per query.
    price_usd : USD per query, finite >= 0.

    Returns
    -------
    KMeansRouter over n_models + 1 models; centroids, old statistics, shrinkage settings, embedder and
    provenance carried over.

    Raises
    ------
    InvalidInputError, ShapeError
        A model already in the pool, bad shapes or values, or a bad price.
    """
    check_new_model(model, router.models)
    x, acc, cst = _check_arrays(router, embeddings, accuracy, cost)
    k = router.centroids_.shape[0]
    cells = nearest_cell(x, router.centroids_) if x.shape[0] else np.zeros(0, dtype=np.int64)
    column = CellStatistics.from_samples(cells, np.zeros(x.shape[0], dtype=np.int64), acc, cst, k, 1)
    old = router.statistics_
    stats = CellStatistics(np.hstack([old.count, column.count]), np.hstack([old.sum_accuracy, column.sum_accuracy]),
                           np.hstack([old.sum_cost, column.sum_cost]))
    wider = KMeansRouter(router.centroids_, stats, (*router.models, model), router.prior_strength,
                         router.model_prior_strength, router.prior,
                         np.append(router.price_prior_, _price(price_usd)))
    wider.embedder, wider.provenance = router.embedder, router.provenance
    return wider


def _ridge_slope(features: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """Coefficients (d,) of a ridge regression of ``residual`` (n,) on ``features`` (n, d), centred,
    penalty chosen by leave-one-out among :data:`RIDGE_ALPHAS` (scikit-learn ``RidgeCV``)."""
    from sklearn.linear_model import RidgeCV  # trainer extra (scikit-learn), imported on use

    if features.shape[0] < MIN_RIDGE_SAMPLES or np.ptp(residual) == 0:
        return np.zeros(features.shape[1])
    return RidgeCV(alphas=RIDGE_ALPHAS, fit_intercept=True).fit(features, residual).coef_.astype(np.float64)


def _fit_row(features: np.ndarray, target: np.ndarray, prior_w: np.ndarray, prior_b: float, shared: np.ndarray,
             strength: float) -> tuple[np.ndarray, float]:
    """One new head ``(w, b)`` for ``y ~ (shared + w) . h + b``: the prior head ``(prior_w, prior_b)``
    plus a ridge slope on the residuals, and an offset shrunk toward 0 with ``strength`` pseudo-counts."""
    prior_pred = features @ (shared + prior_w) + prior_b
    residual = target - prior_pred
    slope = _ridge_slope(features, residual)
    rest = residual - features @ slope
    offset = float(shrink_toward(rest.sum(), rest.shape[0], 0.0, strength))
    return prior_w + slope, prior_b + offset


def add_model_mlp(router: MLPRouter, model: str, embeddings: np.ndarray, accuracy: np.ndarray,
                  cost: np.ndarray, price_usd: float, prior_strength: float = 10.0) -> MLPRouter:
    """The MLP router with one more accuracy head and cost head (the new model's), appended last.

    The trunk ``h``, the shared accuracy part ``u`` and every old head are copied bit for bit. With
    ``h_i = h(x_i)`` (eval mode) of the calibration queries:

    - cost scale ``s = (S_cost + kappa0 * price) / (n + kappa0)`` USD (the price shrunk toward the
      observed mean cost), so the cost head predicts cost / s as the old heads do;
    - accuracy head ``(w, b)``: prior ``w0, b0`` = mean of the observed old heads (the pool's mean
      predicted accuracy), plus a ridge slope on the residuals ``y_i - (u + w0) . h_i - b0`` (penalty
      by leave-one-out, none below :data:`MIN_RIDGE_SAMPLES` rows), plus the remaining mean residual
      shrunk toward 0 with ``kappa0 = prior_strength`` pseudo-observations;
    - cost head: the same fit on ``cost_i / s`` with the mean of the old cost heads as prior.

    Parameters
    ----------
    router : MLPRouter over n_models models.
    model : the new model id (not in the pool).
    embeddings : (n, d_emb) float32, the calibration queries (the router's embedder).
    accuracy, cost : (n,) float64, observed score in [0, 1] and cost in USD per query.
    price_usd : USD per query, finite >= 0.
    prior_strength : kappa0 >= 0 (default: ``MLPRouterConfig.model_prior_strength``).

    Returns
    -------
    MLPRouter over n_models + 1 models (the new model ``available``), embedder and provenance carried over.

    Raises
    ------
    InvalidInputError, ShapeError
        A model already in the pool, bad shapes or values, a bad price, or no observed old model.
    """
    import torch  # trainer extra (torch), imported on use

    check_new_model(model, router.models)
    x, acc, cst = _check_arrays(router, embeddings, accuracy, cost)
    price = _price(price_usd)
    old = router.available_
    if not old.any():
        raise InvalidInputError("the router has no observed model to take the prior head from")
    state = router.state()
    with torch.no_grad():
        h = router.network.eval().trunk(torch.from_numpy(np.ascontiguousarray(x))).numpy().astype(np.float64)
    scale = float(shrink_toward(cst.sum(), cst.shape[0], price, prior_strength))
    shared = state["shared_accuracy.weight"].astype(np.float64)[0]
    new_state = dict(state)
    targets = {"accuracy_head": acc, "cost_head": cst / scale if scale > 0 else np.zeros_like(cst)}
    for head, target in targets.items():
        weight, bias = state[f"{head}.weight"].astype(np.float64), state[f"{head}.bias"].astype(np.float64)
        base = shared if head == "accuracy_head" else np.zeros_like(shared)
        w, b = _fit_row(h, target, weight[old].mean(axis=0), float(bias[old].mean()), base, prior_strength)
        new_state[f"{head}.weight"] = np.vstack([state[f"{head}.weight"], w[None, :].astype(np.float32)])
        new_state[f"{head}.bias"] = np.append(state[f"{head}.bias"], np.float32(b))
    wider = MLPRouter(new_state, (*router.models, model), router.d_emb, np.append(router.cost_scale_, scale),
                      np.append(router.available_, True), router.hidden, router.dropout)
    wider.embedder, wider.provenance = router.embedder, router.provenance
    return wider


__all__ = [
    "CALIBRATION_COLUMNS",
    "Calibration",
    "add_model_kmeans",
    "add_model_mlp",
    "calibration_from_frame",
    "check_new_model",
    "load_calibration",
    "resolve_price",
]
