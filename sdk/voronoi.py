"""Nearest-centroid (Voronoi cell) lookup shared by the K-means router on device and in training.

Paper 002, "Federated hierarchical clustering": a query belongs to the Voronoi cell of its nearest
global centroid (squared Euclidean distance); ties go to the lower cell index.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from sdk.errors import ShapeError

_Floats = npt.NDArray[np.floating]


def nearest_cell(embeddings: npt.ArrayLike, centroids: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Index of the nearest centroid for each embedding.

    ``embeddings`` (n_queries, d_emb) and ``centroids`` (n_cells >= 1, d_emb): float, finite. Returns
    (n_queries,) int64 in ``[0, n_cells)``. Raises ShapeError for other shapes or non-finite values.
    """
    x = np.asarray(embeddings, dtype=np.float64)
    c = np.asarray(centroids, dtype=np.float64)
    if x.ndim != 2 or c.ndim != 2 or x.shape[1] != c.shape[1] or c.shape[0] == 0 \
            or not (np.isfinite(x).all() and np.isfinite(c).all()):
        raise ShapeError(f"embeddings (n_queries, d_emb) and centroids (n_cells >= 1, d_emb) must be 2-D, "
                         f"finite and of one dimension, got shapes {x.shape} and {c.shape}")
    return CentroidTable(c).nearest(x)


class CentroidTable:
    """Finite (n_cells, d_emb) centroids (validated by the caller) in float64 with their squared norms,
    for repeated lookups on the device's per-query path."""

    def __init__(self, centroids: npt.ArrayLike) -> None:
        self.centroids = np.asarray(centroids, dtype=np.float64)
        self.sq_norms = (self.centroids * self.centroids).sum(axis=1)

    def nearest(self, embeddings: _Floats) -> npt.NDArray[np.int64]:
        """(n_queries,) int64 cell of each row of finite (n_queries, d_emb) ``embeddings``."""
        # ||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2; ||x||^2 is constant per row and dropped.
        d2: npt.NDArray[np.float64] = self.sq_norms[None, :] - 2.0 * (np.asarray(embeddings, dtype=np.float64)
                                                                       @ self.centroids.T)
        return np.asarray(np.argmin(d2, axis=1), dtype=np.int64)
