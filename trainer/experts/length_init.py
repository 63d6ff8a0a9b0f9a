"""Federated length-only start of the experts: FedAvg of client-local logistic regressions.

Design notes: docs/prism.md (Module notes).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sdk.errors import InvalidInputError, ShapeError

__all__ = ["client_length_coefs", "fedavg_length_coefs", "federated_logistic_fit", "pooled_expert_coefs",
           "saved_length_prior", "upload_bytes"]


def client_length_coefs(features: np.ndarray, labels: np.ndarray, assign: np.ndarray, n_experts: int,
                        C: float = 1.0) -> dict[int, tuple[np.ndarray, float]]:
    """One client's local length-only regressions, one per expert its pairs were routed to.

    Parameters
    ----------
    features : ndarray (n, F), float, pair features of the client's pairs (``SelectorConfig.pair_features``).
    labels : ndarray (n,), {0, 1}, 1 = A better.
    assign : ndarray (n,), int, expert of each pair (in ``[0, n_experts)``).
    n_experts : int >= 1.
    C : float > 0, inverse L2 strength (scikit-learn).

    Returns
    -------
    dict expert -> (coef ndarray (F,) float64, n_pairs float): only experts with >= 1 pair.

    Raises
    ------
    ShapeError
        Lengths or feature shape disagree.
    InvalidInputError
        An expert index outside ``[0, n_experts)``, a label not in {0, 1}, or ``C <= 0``.
    """
    from sklearn.linear_model import LogisticRegression  # sklearn: optional heavy dependency, imported on use

    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels).astype(np.float64)
    a = np.asarray(assign).astype(np.int64)
    if x.ndim != 2 or len(x) != len(y) or len(x) != len(a):
        raise ShapeError(f"features {x.shape}, labels {y.shape}, assign {a.shape} must share their first axis")
    if len(a) and (a.min() < 0 or a.max() >= n_experts):
        raise InvalidInputError(f"expert indices outside [0, {n_experts})")
    if not np.isin(y, (0.0, 1.0)).all():
        raise InvalidInputError("labels must be 0 or 1")
    if not C > 0:
        raise InvalidInputError(f"C must be > 0, got {C!r}")
    out = {}
    for k in np.unique(a):
        sel = a == k
        xs = np.concatenate([x[sel], -x[sel]])
        ys = np.concatenate([y[sel], 1.0 - y[sel]]).astype(np.int64)
        lr = LogisticRegression(C=C, fit_intercept=False).fit(xs, ys)
        out[int(k)] = (lr.coef_[0].copy(), float(sel.sum()))
    return out


def fedavg_length_coefs(client_coefs: Sequence[dict[int, tuple[np.ndarray, float]]], n_experts: int,
                        n_features: int = 3) -> np.ndarray:
    """Server side: per expert, the pair-count-weighted mean of the clients' coefficients.

    Returns ndarray (n_experts, n_features), float64; rows of experts no client sent stay 0.

    Raises
    ------
    InvalidInputError
        An expert index outside ``[0, n_experts)`` or a count <= 0.
    ShapeError
        A coefficient vector of the wrong size.
    """
    num = np.zeros((n_experts, n_features))
    den = np.zeros(n_experts)
    for coefs in client_coefs:
        for k, (w, n) in coefs.items():
            if not 0 <= k < n_experts:
                raise InvalidInputError(f"expert {k} outside [0, {n_experts})")
            if not n > 0:
                raise InvalidInputError(f"expert {k}: count must be > 0, got {n!r}")
            w = np.asarray(w, dtype=np.float64)
            if w.shape != (n_features,):
                raise ShapeError(f"expert {k}: coefficients of shape {w.shape}, expected ({n_features},)")
            num[k] += n * w
            den[k] += n
    out = np.zeros_like(num)
    nz = den > 0
    out[nz] = num[nz] / den[nz, None]
    return out


def client_loss_grad(features: np.ndarray, labels: np.ndarray, w: np.ndarray) -> tuple[float, np.ndarray]:
    """What one client sends per evaluation of :func:`federated_logistic_fit`: the logistic loss of
    ``sigmoid(f . w)`` summed over its pairs **and their position-swapped copies** (each copy has the same
    loss term, so twice the pairs' sum) and its gradient.

    features (n, F) float64, labels (n,) {0, 1}, w (F,) -> (loss float, gradient ndarray (F,) float64).
    """
    z = features @ w
    loss = 2.0 * float(np.sum(np.logaddexp(0.0, z) - labels * z))
    grad = 2.0 * features.T @ (1.0 / (1.0 + np.exp(-z)) - labels)
    return loss, grad


def federated_logistic_fit(parts: Sequence[tuple[np.ndarray, np.ndarray]], C: float,
                           center: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """The exact federated L2 logistic regression (no intercept) on the pooled pairs of ``parts``:

    ``w* = argmin_w sum_c L_c(w) + ||w - center||^2 / (2 C)``, ``L_c`` = :func:`client_loss_grad` of client
    ``c`` (its pairs and their swapped copies). With ``center = 0`` this is scikit-learn's
    ``LogisticRegression(C, fit_intercept=False)`` on all clients' pairs and swapped copies pooled (test:
    ``tests/test_prism_pooled_fit.py``), i.e. the centralised structure-feature fit with ``C`` doubled,
    while no pair leaves a client: the server runs L-BFGS (scipy, ``L-BFGS-B``, Byrd et al. 1995); each
    function evaluation is one round in which every client returns ``(L_c(w), grad L_c(w))`` at the
    server's ``w`` (F + 1 floats). A FedAvg of local fits (:func:`fedavg_length_coefs`) is not this
    optimum: with tens of pairs per client and 11 features each local fit is noisy and the average
    inherits it.

    Parameters
    ----------
    parts : sequence of (features ndarray (n_c, F) float, labels ndarray (n_c,) {0, 1}), one per client
        (clients with no pair may be left out; at least one pair in all).
    C : float > 0, inverse strength of the pull towards ``center``.
    center : ndarray (F,) or None (zeros): the point the penalty pulls towards (the global fit for the
        pooled per-expert heads of :func:`pooled_expert_coefs`).

    Returns
    -------
    (w ndarray (F,) float64, evaluations int: the rounds of (loss, gradient) uploads it took).
    """
    from scipy.optimize import minimize  # scipy: optional heavy dependency, imported on use

    parts = [(np.asarray(x, np.float64), np.asarray(y, np.float64)) for x, y in parts if len(y)]
    n_f = parts[0][0].shape[1]
    c0 = np.zeros(n_f) if center is None else np.asarray(center, np.float64)

    def objective(w):
        d = w - c0
        loss, grad = float(d @ d) / (2 * C), d / C
        for x, y in parts:
            l_c, g_c = client_loss_grad(x, y, w)
            loss, grad = loss + l_c, grad + g_c
        return loss, grad

    res = minimize(objective, c0.copy(), jac=True, method="L-BFGS-B", options={"maxiter": 500, "gtol": 1e-8})
    return res.x, int(res.nfev)


def pooled_expert_coefs(features: np.ndarray, labels: np.ndarray, assign: np.ndarray,
                        clients: Sequence[np.ndarray], n_experts: int, C: float,
                        pool_C: float | None) -> tuple[np.ndarray, int]:
    """Per-expert start of the heads' feature path ``v_k`` from the exact federated fits.

    ``v_g`` = :func:`federated_logistic_fit` on every client pair (``C``); then, per expert ``k``,
    ``v_k = argmin_v sum_{pairs routed to k} L(v) + ||v - v_g||^2 / (2 pool_C)`` (the same fit, pulled
    towards the global one: a hierarchical / shrinkage prior; ``pool_C -> 0`` gives every expert ``v_g``,
    ``pool_C = None`` gives every expert ``v_g`` as it is). An expert no pair is routed to gets ``v_g``.

    Parameters
    ----------
    features : (n, F) float, labels : (n,) {0, 1}, assign : (n,) int expert of each pair (indexed like
    ``features``); clients : index arrays into them, one per client; n_experts : M; C, pool_C : > 0.

    Returns
    -------
    (coefs ndarray (n_experts, F) float64, evaluations int: all rounds of (loss, gradient) uploads).
    """
    glob, n_eval = federated_logistic_fit([(features[c], labels[c]) for c in clients], C)
    out = np.tile(glob, (n_experts, 1))
    if pool_C is None:
        return out, n_eval
    for k in range(n_experts):
        parts = [(features[c[assign[c] == k]], labels[c[assign[c] == k]]) for c in clients]
        if sum(len(y) for _, y in parts):
            out[k], n = federated_logistic_fit(parts, pool_C, center=glob)
            n_eval += n
    return out, n_eval


def upload_bytes(client_coefs: Sequence[dict[int, tuple[np.ndarray, float]]]) -> int:
    """Bytes the clients send for the length start: (coefficients + count) as float32 per expert."""
    return int(sum(4 * (np.asarray(w).size + 1) for coefs in client_coefs for w, _ in coefs.values()))


def read_length_prior(folder: str | Path) -> dict[str, np.ndarray] | None:
    """The per-domain length priors saved with a ``length_prior='domain'`` run (``length_prior.json``:
    ``{"domains": [str], "coefs": [[F floats] per domain]}``): {domain: ndarray (F,) float32}; None for a
    run without the file.

    Raises
    ------
    InvalidInputError
        The file is unreadable or not that layout (names the file): a truncated or hand-edited copy used
        to end in a JSONDecodeError / KeyError traceback, and a non-finite or short weight vector went
        into every prediction.
    """
    path = Path(folder) / "length_prior.json"
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
        domains, coefs = saved["domains"], np.asarray(saved["coefs"], dtype=np.float64)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # JSON / Unicode errors are ValueErrors
        raise InvalidInputError(f"{path}: not the length_prior.json of `fedroute prism train` "
                                f"({type(exc).__name__}: {exc}); rerun it") from exc
    if (not isinstance(domains, list) or not all(isinstance(d, str) for d in domains) or len(set(domains)) != len(domains)
            or coefs.shape != (len(domains), _n_features(Path(folder))) or not np.isfinite(coefs).all()):
        raise InvalidInputError(f"{path}: expected distinct domain names and one row of finite weights per domain, "
                                f"got domains {domains!r:.80} and weights of shape {coefs.shape}; rerun `fedroute prism train`")
    return {d: coefs[i].astype(np.float32) for i, d in enumerate(domains)}


def _n_features(folder: Path) -> int:
    """Pair features of the run's selector (``selector_config.json`` beside the prior; 3 without one)."""
    from trainer.experts.selector import load_selector_config  # imports torch: on use only

    config = folder / "selector_config.json"
    return len(load_selector_config(config).pair_features) if config.exists() else 3


def saved_length_prior(folder: str | Path, domain: str) -> np.ndarray | None:
    """The fixed per-domain length prior of a run saved with ``length_prior='domain'``
    (``length_prior.json``): the weights of ``domain``, ndarray (F,) float32; None for a run without it.

    Raises
    ------
    InvalidInputError
        ``domain`` is not in the saved prior, or the file is not readable (:func:`read_length_prior`).
    """
    priors = read_length_prior(folder)
    if priors is None:
        return None
    if domain not in priors:
        raise InvalidInputError(f"{Path(folder) / 'length_prior.json'}: no length prior for domain {domain!r} "
                                f"(has {list(priors)})")
    return priors[domain]
