"""The contract every router shares: predict accuracy and cost per model; decide by utility once.

A router maps query embeddings of shape (n_queries, d_emb) to predicted accuracy in [0, 1] and
predicted cost in USD per query, both of shape (n_queries, n_models). The decision
``argmax_m A - lam * C`` (with the METRICS.md tie-break) is :func:`sdk.decide`, built once here.
"""

from __future__ import annotations

import abc
import json
from pathlib import Path

import numpy as np

from sdk.atomic_write import write_atomic
from sdk.errors import InvalidInputError, ShapeError
from sdk.utility import decide

ROUTER_FILE = "router.json"


class Router(abc.ABC):
    """Base class: subclasses set ``kind`` and implement :meth:`predict`, :meth:`save`, :meth:`load`."""

    kind: str = ""
    models: tuple[str, ...]
    d_emb: int
    #: Which embedder produced the training embeddings (name, dim, max_tokens, truncation side);
    #: saved in ``router.json`` so that ``export`` can bundle the matching embedder.
    embedder: dict | None = None
    #: Where the router's training data came from (``train``/``test`` file paths, seed); saved in
    #: ``router.json`` so that ``export`` can find real prompts for its parity checks.
    provenance: dict | None = None

    @abc.abstractmethod
    def _predict(self, embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Kernel of :meth:`predict`; embeddings already validated."""

    def predict(self, embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Predicted (accuracy, cost USD), each of shape (n_queries, n_models), float64.

        NaN marks a model the router has no estimate for (never chosen by :meth:`decide`).

        Raises
        ------
        ShapeError
            ``embeddings`` is not (n_queries, d_emb) or holds non-finite values.
        """
        x = np.asarray(embeddings, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.d_emb:
            raise ShapeError(f"embeddings must have shape (n_queries, {self.d_emb}), got {x.shape}")
        if not np.isfinite(x).all():
            raise ShapeError("embeddings must be finite")
        return self._predict(x)

    def decide(self, embeddings: np.ndarray, lam: float) -> np.ndarray:
        """Chosen model index per query, shape (n_queries,), int64 (see :func:`sdk.decide`)."""
        acc, cost = self.predict(embeddings)
        return decide(acc, cost, lam)

    @abc.abstractmethod
    def save(self, directory: Path) -> None:
        """Write the router to ``directory`` (``router.json`` + weights)."""

    def _write_meta(self, directory: Path, extra: dict) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"kind": self.kind, "models": list(self.models), "d_emb": self.d_emb, **extra}
        if getattr(self, "embedder", None) is not None:
            meta["embedder"] = self.embedder
        if getattr(self, "provenance", None) is not None:
            meta["provenance"] = self.provenance
        write_atomic(directory / ROUTER_FILE, json.dumps(meta, indent=2, sort_keys=True).encode("utf-8"))


def read_meta(directory: Path) -> dict:
    """``router.json`` of a saved router; raises InvalidInputError if absent or unreadable."""
    path = Path(directory) / ROUTER_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"{path}: not a saved fedroute router ({exc})") from exc
