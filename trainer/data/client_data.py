"""A client's local log of sparse evaluations, as the trainer sees it in simulation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sdk.cell_statistics import CellStatistics
from sdk.errors import ShapeError


@dataclass(frozen=True)
class ClientData:
    """Sparse evaluations held by one client: each query was sent to exactly one model.

    Attributes
    ----------
    embeddings : ndarray of shape (n_samples, d_emb), float32, L2-normalised query embeddings.
    model : ndarray of shape (n_samples,), int64, index of the model the query was sent to.
    accuracy : ndarray of shape (n_samples,), float64 in [0, 1], observed score.
    cost : ndarray of shape (n_samples,), float64, observed cost in USD.
    """

    embeddings: np.ndarray
    model: np.ndarray
    accuracy: np.ndarray
    cost: np.ndarray

    def __post_init__(self) -> None:
        n = self.embeddings.shape[0]
        if self.embeddings.ndim != 2 or any(a.shape != (n,) for a in (self.model, self.accuracy, self.cost)):
            raise ShapeError(
                "embeddings must be (n_samples, d_emb) and model/accuracy/cost (n_samples,), got "
                f"{self.embeddings.shape}, {self.model.shape}, {self.accuracy.shape}, {self.cost.shape}"
            )

    @property
    def n_samples(self) -> int:
        return int(self.embeddings.shape[0])

    def subset(self, index: np.ndarray) -> ClientData:
        return ClientData(self.embeddings[index], self.model[index], self.accuracy[index], self.cost[index])

    def split(self, val_fraction: float, rng: np.random.Generator) -> tuple[ClientData, ClientData]:
        """(train, validation) split; validation gets ``floor(val_fraction * n)`` samples."""
        perm = rng.permutation(self.n_samples)
        n_val = int(np.floor(val_fraction * self.n_samples))
        return self.subset(np.sort(perm[n_val:])), self.subset(np.sort(perm[:n_val]))

    @staticmethod
    def pool(parts: Sequence[ClientData]) -> ClientData:
        """All clients' logs in one (the centralised setting)."""
        return ClientData(
            np.concatenate([p.embeddings for p in parts]),
            np.concatenate([p.model for p in parts]),
            np.concatenate([p.accuracy for p in parts]),
            np.concatenate([p.cost for p in parts]),
        )

    def model_statistics(self, n_models: int):
        """Per-model count and sums as a one-cell :class:`sdk.CellStatistics` (privacy-safe aggregate)."""
        return CellStatistics.from_samples(
            np.zeros(self.n_samples, dtype=np.int64), self.model, self.accuracy, self.cost, 1, n_models
        )
