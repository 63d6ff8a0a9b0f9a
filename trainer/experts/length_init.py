"""Federated length-only start of the experts: FedAvg of client-local logistic regressions.

Design notes: docs/prism.md (Module notes).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sdk.errors import InvalidInputError, ShapeError

__all__ = ["client_length_coefs", "fedavg_length_coefs", "saved_length_prior", "upload_bytes"]


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
