"""Routing metrics, exactly as defined in ``shared/METRICS.md`` (one function per metric).

Accuracy-cost curve of a router on a test set: for each lambda of :func:`lambda_grid`, the router
decides one model per query, giving the point ``(mean cost, mean accuracy)``. The frontier is the
upper concave hull of those points, made non-decreasing; :func:`normalised_auc` integrates it over
the cost normalised by the cheapest and the most expensive single model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sdk.errors import InvalidInputError, ShapeError
from sdk.utility import _decide_unchecked, check_lambda


def lambda_grid(n_points: int = 100, low: float = 1e-2, high: float = 1e7) -> np.ndarray:
    """``{0} U {n_points log-spaced in [low, high]}`` in USD^-1 (METRICS.md step 1).

    Returns
    -------
    ndarray of shape (n_points + 1,), float64, ascending, first element 0.
    """
    return np.concatenate([[0.0], np.logspace(np.log10(low), np.log10(high), n_points)])


def _check_eval(acc: np.ndarray, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    acc = np.asarray(acc, dtype=np.float64)
    cost = np.asarray(cost, dtype=np.float64)
    if acc.ndim != 2 or acc.shape != cost.shape:
        raise ShapeError(f"true acc and cost must be (n_queries, n_models), got {acc.shape}, {cost.shape}")
    if not (np.isfinite(acc).all() and np.isfinite(cost).all()):
        raise ShapeError("true acc and cost must be finite: evaluate on fully labelled rows")
    return acc, cost


def curve_points(
    pred_accuracy: np.ndarray,
    pred_cost: np.ndarray,
    true_accuracy: np.ndarray,
    true_cost: np.ndarray,
    lambdas: np.ndarray | None = None,
) -> np.ndarray:
    """Accuracy-cost points of a router over a lambda grid (METRICS.md step 2).

    Parameters
    ----------
    pred_accuracy, pred_cost : ndarray of shape (n_queries, n_models), the router's predictions
        (cost in USD per query; NaN = no estimate, never chosen).
    true_accuracy, true_cost : ndarray of shape (n_queries, n_models), finite, the test labels.
    lambdas : ndarray of shape (n_lambdas,), USD^-1; default :func:`lambda_grid`.

    Returns
    -------
    ndarray of shape (n_lambdas, 2), float64: columns (mean cost USD, mean accuracy).
    """
    true_accuracy, true_cost = _check_eval(true_accuracy, true_cost)
    pa = np.asarray(pred_accuracy, dtype=np.float64)
    pc = np.asarray(pred_cost, dtype=np.float64)
    if pa.shape != true_accuracy.shape or pc.shape != true_accuracy.shape:
        raise ShapeError(f"predictions {pa.shape}/{pc.shape} do not match labels {true_accuracy.shape}")
    lambdas = lambda_grid() if lambdas is None else np.asarray(lambdas, dtype=np.float64)
    rows = np.arange(pa.shape[0])
    points = np.empty((lambdas.shape[0], 2))
    for j, lam in enumerate(lambdas):
        choice = _decide_unchecked(pa - check_lambda(float(lam)) * pc, pc)
        points[j] = true_cost[rows, choice].mean(), true_accuracy[rows, choice].mean()
    return points


def frontier(points: np.ndarray) -> np.ndarray:
    """Upper concave hull of (cost, accuracy) points, made non-decreasing (METRICS.md step 3).

    Parameters
    ----------
    points : ndarray of shape (n_points, 2), columns (cost, accuracy).

    Returns
    -------
    ndarray of shape (n_vertices, 2): hull vertices by increasing cost, accuracy strictly
    increasing; the frontier is flat at the last vertex's accuracy to its right.
    """
    pts = np.asarray(points, dtype=np.float64)
    if pts.ndim != 2 or pts.shape[1] != 2 or pts.shape[0] == 0:
        raise ShapeError(f"points must have shape (n_points, 2) with n_points >= 1, got {pts.shape}")
    # Sort by cost, then by accuracy descending so that the best point of equal cost comes first.
    order = np.lexsort((-pts[:, 1], pts[:, 0]))
    pts = pts[order]
    hull: list[np.ndarray] = []
    for p in pts:
        if hull and p[0] == hull[-1][0]:
            continue  # same cost, lower or equal accuracy
        # Pop while the last vertex lies on or below the chord from the one before it to p.
        while len(hull) >= 2:
            o, a = hull[-2], hull[-1]
            cross = (a[0] - o[0]) * (p[1] - o[1]) - (a[1] - o[1]) * (p[0] - o[0])
            if cross >= 0:
                hull.pop()
            else:
                break
        hull.append(p)
    h = np.array(hull)
    # Running maximum: keep vertices up to the first that reaches the best accuracy.
    best = int(np.argmax(h[:, 1]))
    return h[: best + 1]


def _frontier_value(h: np.ndarray, x: float) -> float:
    """Frontier accuracy at cost ``x``: 0 left of the cheapest vertex, flat right of the last."""
    if x < h[0, 0]:
        return 0.0
    if x >= h[-1, 0]:
        return float(h[-1, 1])
    return float(np.interp(x, h[:, 0], h[:, 1]))


def normalise_cost(cost: np.ndarray, c_lo: float, c_hi: float) -> np.ndarray:
    """``u = (c - c_lo) / (c_hi - c_lo)`` (METRICS.md step 4)."""
    if not c_hi > c_lo:
        raise InvalidInputError(f"c_hi={c_hi} must be > c_lo={c_lo}")
    return (np.asarray(cost, dtype=np.float64) - c_lo) / (c_hi - c_lo)


def normalised_auc(points: np.ndarray, c_lo: float, c_hi: float) -> float:
    """Normalised area under the accuracy-cost frontier (METRICS.md steps 3-5).

    Parameters
    ----------
    points : ndarray of shape (n_points, 2), columns (mean cost USD, mean accuracy).
    c_lo, c_hi : float, USD, lowest and highest mean cost among the single models on the test set.

    Returns
    -------
    float, ``integral_0^1 H(u) du`` in [0, 1]; points with ``u < 0`` are clipped to 0.
    """
    pts = np.asarray(points, dtype=np.float64).copy()
    pts[:, 0] = np.maximum(normalise_cost(pts[:, 0], c_lo, c_hi), 0.0)
    h = frontier(pts)
    # Integrate the piecewise-linear H over [0, 1] exactly: knots = vertices clipped to [0, 1].
    knots = np.unique(np.clip(np.concatenate([h[:, 0], [0.0, 1.0]]), 0.0, 1.0))
    values = np.array([_frontier_value(h, x) for x in knots])
    area = 0.0
    for x0, x1, y0, y1 in zip(knots[:-1], knots[1:], values[:-1], values[1:]):
        if x0 < h[0, 0] <= x1:
            # H jumps from 0 to the first vertex at h[0, 0] (= x1 here, since it is a knot).
            y0 = 0.0
        area += 0.5 * (y0 + y1) * (x1 - x0) if x0 >= h[0, 0] else 0.0
    return float(area)


def single_model_points(true_accuracy: np.ndarray, true_cost: np.ndarray) -> np.ndarray:
    """(mean cost USD, mean accuracy) of each single model, shape (n_models, 2)."""
    acc, cost = _check_eval(true_accuracy, true_cost)
    return np.stack([cost.mean(axis=0), acc.mean(axis=0)], axis=1)


def cost_range(true_accuracy: np.ndarray, true_cost: np.ndarray) -> tuple[float, float]:
    """(c_lo, c_hi): lowest and highest mean cost (USD) among the single models."""
    pts = single_model_points(true_accuracy, true_cost)
    return float(pts[:, 0].min()), float(pts[:, 0].max())


def accuracy_at_best_cost(points: np.ndarray, true_accuracy: np.ndarray, true_cost: np.ndarray) -> float:
    """Frontier accuracy at the mean cost of the most accurate single model (METRICS.md step 7)."""
    single = single_model_points(true_accuracy, true_cost)
    best = single[_most_accurate(single)]
    return _frontier_value(frontier(points), float(best[0]))


def cost_at_best_accuracy(points: np.ndarray, true_accuracy: np.ndarray, true_cost: np.ndarray) -> float:
    """Lowest cost at which the frontier reaches the most accurate single model's accuracy,
    as a fraction of that model's mean cost; ``inf`` if never (METRICS.md step 7)."""
    single = single_model_points(true_accuracy, true_cost)
    best_cost, best_acc = single[_most_accurate(single)]
    h = frontier(points)
    if h[-1, 1] < best_acc:
        return float("inf")
    i = int(np.argmax(h[:, 1] >= best_acc))
    if i == 0:
        c = h[0, 0]
    else:
        (c0, a0), (c1, a1) = h[i - 1], h[i]
        c = c0 + (best_acc - a0) * (c1 - c0) / (a1 - a0)
    return float(c / best_cost)


def _most_accurate(single: np.ndarray) -> int:
    """Index of the most accurate single model; ties go to the cheaper one."""
    return int(np.lexsort((single[:, 0], -single[:, 1]))[0])


def gain(auc: float, auc_zero: float, auc_oracle: float) -> float:
    """Share of the oracle's headroom over the zero router: ``(AUC - AUC_zero) / (AUC_oracle - AUC_zero)``."""
    if not auc_oracle > auc_zero:
        raise ShapeError(f"auc_oracle={auc_oracle} must exceed auc_zero={auc_zero}")
    return float((auc - auc_zero) / (auc_oracle - auc_zero))


def weak_strong_pair(single: np.ndarray, weak_cost_share: float = 0.1) -> tuple[int, int]:
    """RouteLLM's (Ong et al. 2024) weak/strong pair (METRICS.md "Savings an app developer reads").

    Parameters
    ----------
    single : ndarray of shape (n_models, 2), (mean cost USD, mean accuracy) of each single model on
        the train split (:func:`single_model_points`).
    weak_cost_share : the weak model's mean cost is at most this share of the strong one's.

    Returns
    -------
    (weak, strong) : model indices; strong = the most accurate model (ties: the cheaper), weak = the
    most accurate model costing at most ``weak_cost_share`` x the strong one (ties: the cheaper).
    Every other model maps onto the same normalised cost axis through its mean cost.

    Raises
    ------
    InvalidInputError
        No model costs that little.
    """
    strong = _most_accurate(single)
    cheap = np.flatnonzero(single[:, 0] <= weak_cost_share * single[strong, 0])
    if cheap.size == 0:
        raise InvalidInputError(f"no model costs at most {weak_cost_share} x the strong model's "
                                f"{single[strong, 0]:.3g} USD (cheapest {single[:, 0].min():.3g} USD)")
    return int(cheap[_most_accurate(single[cheap])]), strong


def apgr(points: np.ndarray, weak: np.ndarray, strong: np.ndarray) -> float:
    """Average performance gap recovered (RouteLLM, Ong et al. 2024, Sec. 5.1).

    ``PGR(c) = (H(c) - acc_weak) / (acc_strong - acc_weak)`` on the router's frontier H (METRICS.md
    steps 3 and 5: 0 left of its cheapest point, flat right of its last), with cost normalised so
    the weak model's mean cost is 0 and the strong one's is 1 (points cheaper than the weak model
    clipped to 0); ``APGR = integral_0^1 PGR(c) dc``, exact for the piecewise-linear frontier.

    Parameters
    ----------
    points : ndarray of shape (n_points, 2), (mean cost USD, mean accuracy) of the router on test.
    weak, strong : ndarray of shape (2,), (mean cost USD, mean accuracy) of the pair on the same test set.

    Returns
    -------
    float (1 = the strong model's accuracy from the weak model's cost on; 0 = no gain over weak).
    """
    (c_w, a_w), (c_s, a_s) = weak, strong
    return (normalised_auc(points, c_w, c_s) - a_w) / (a_s - a_w)


def cpt(points: np.ndarray, weak: np.ndarray, strong: np.ndarray, share: float) -> float:
    """Call-performance threshold CPT(x%) (RouteLLM, Ong et al. 2024, Sec. 5.1): the smallest
    normalised cost c (weak model = 0, strong = 1, as :func:`apgr`) with ``PGR(c) >= share``;
    ``inf`` if the frontier never reaches it. ``share`` = 0.5 for CPT(50%), 0.8 for CPT(80%)."""
    (c_w, a_w), (c_s, a_s) = weak, strong
    pts = np.asarray(points, dtype=np.float64).copy()
    pts[:, 0] = np.maximum(normalise_cost(pts[:, 0], c_w, c_s), 0.0)
    h = frontier(pts)
    target = a_w + share * (a_s - a_w)
    if h[-1, 1] < target:
        return float("inf")
    i = int(np.argmax(h[:, 1] >= target))
    if i == 0:
        return float(h[0, 0])
    (c0, y0), (c1, y1) = h[i - 1], h[i]
    return float(c0 + (target - y0) * (c1 - c0) / (y1 - y0))


def cost_saved_at_best_acc(cost_at_best_acc: np.ndarray) -> tuple[float, float]:
    """``cost_saved_at_best_acc = 1 - cost@best_acc`` over seeds (METRICS.md "Savings").

    Parameters
    ----------
    cost_at_best_acc : ndarray of shape (n_seeds,), :func:`cost_at_best_accuracy` per seed (inf = never).

    Returns
    -------
    (median saving, never_reaches_best_share) : the median over seeds of ``1 - cost@best_acc``
    (a seed that never reaches it counts as -inf, so the median is -inf when most never do), and
    the share of seeds whose frontier never reaches the best single model's accuracy.
    """
    c = np.asarray(cost_at_best_acc, dtype=np.float64)
    return float(np.median(1.0 - c)), float(np.isinf(c).mean())


@dataclass(frozen=True)
class CurveReport:
    """Metrics of one accuracy-cost curve on one test set."""

    points: np.ndarray  # (n_lambdas, 2) mean cost USD, mean accuracy
    auc: float
    acc_at_best_cost: float
    cost_at_best_acc: float

    def to_dict(self) -> dict[str, object]:
        return {
            "auc": self.auc,
            "acc_at_best_cost": self.acc_at_best_cost,
            "cost_at_best_acc": self.cost_at_best_acc,
            "points": self.points.tolist(),
        }


def report_points(points: np.ndarray, true_accuracy: np.ndarray, true_cost: np.ndarray) -> CurveReport:
    """All METRICS.md curve metrics of ``points`` (shape (n_points, 2)) on the given test labels."""
    c_lo, c_hi = cost_range(true_accuracy, true_cost)
    return CurveReport(
        points=np.asarray(points, dtype=np.float64),
        auc=normalised_auc(points, c_lo, c_hi),
        acc_at_best_cost=accuracy_at_best_cost(points, true_accuracy, true_cost),
        cost_at_best_acc=cost_at_best_accuracy(points, true_accuracy, true_cost),
    )


def evaluate_router(
    pred_accuracy: np.ndarray, pred_cost: np.ndarray, true_accuracy: np.ndarray, true_cost: np.ndarray
) -> CurveReport:
    """Curve metrics of a router's predictions (shape (n_queries, n_models)) on the test labels."""
    return report_points(curve_points(pred_accuracy, pred_cost, true_accuracy, true_cost), true_accuracy, true_cost)


def oracle_report(true_accuracy: np.ndarray, true_cost: np.ndarray) -> CurveReport:
    """Oracle reference: the router that knows the true accuracy and cost of every query."""
    return evaluate_router(true_accuracy, true_cost, true_accuracy, true_cost)


def zero_router_report(true_accuracy: np.ndarray, true_cost: np.ndarray) -> CurveReport:
    """Zero-router reference (RouterBench): the hull of the single models' points."""
    return report_points(single_model_points(true_accuracy, true_cost), true_accuracy, true_cost)


def random_router_report(true_accuracy: np.ndarray, true_cost: np.ndarray) -> CurveReport:
    """Random reference: a uniformly random model per query; its expected point is the mean over models."""
    single = single_model_points(true_accuracy, true_cost)
    return report_points(single.mean(axis=0, keepdims=True), true_accuracy, true_cost)
