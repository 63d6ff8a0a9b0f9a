"""Nearest-centroid (Voronoi cell) lookup shared by the K-means router on device and in training.

Paper 002, "Federated hierarchical clustering": a query belongs to the Voronoi cell of its nearest
global centroid (squared Euclidean distance); ties go to the lower cell index.
"""

from __future__ import annotations

import numpy as np

from sdk.errors import ShapeError


def nearest_cell(embeddings: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Index of the nearest centroid for each embedding.

    Parameters
    ----------
    embeddings : ndarray of shape (n_queries, d_emb), float32 or float64, finite.
    centroids : ndarray of shape (n_cells, d_emb), float32 or float64, finite.

    Returns
    -------
    ndarray of shape (n_queries,), int64, cell indices in ``[0, n_cells)``.

    Raises
    ------
    ShapeError
        Not 2-D, dimensions differ, no centroids, or non-finite values.
    """
    x = np.asarray(embeddings, dtype=np.float64)
    c = np.asarray(centroids, dtype=np.float64)
    if x.ndim != 2 or c.ndim != 2:
        raise ShapeError(
            f"embeddings and centroids must be 2-D, got shapes {x.shape} and {c.shape}"
        )
    if x.shape[1] != c.shape[1]:
        raise ShapeError(
            f"embedding dimension {x.shape[1]} differs from centroid dimension {c.shape[1]}"
        )
    if c.shape[0] == 0:
        raise ShapeError("centroids must hold at least one cell, got 0")
    if not (np.isfinite(x).all() and np.isfinite(c).all()):
        raise ShapeError("embeddings and centroids must be finite")
    return _nearest_cell_unchecked(x, c)


def _nearest_cell_unchecked(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Kernel of :func:`nearest_cell`; does not validate."""
    # ||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2; ||x||^2 is constant per row and dropped.
    d2 = (c * c).sum(axis=1)[None, :] - 2.0 * (x @ c.T)
    return np.argmin(d2, axis=1).astype(np.int64)
