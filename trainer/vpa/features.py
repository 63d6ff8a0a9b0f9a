"""Features ``phi(x, y)`` of each response of each pair, for the personalised reward models (issue 28).

``phi(x, y) = [e(x), e(y), l(y), s(y), p(y)]``: the project's pair features (:class:`trainer.rewards.pair_features.PairEncoder`:
frozen all-MiniLM-L6-v2 embeddings of the prompt and of the response, from the embedding cache, and the
response's length ``l(y)``) and, when ``structure=True``, ``s(y)``: ``log1p`` counts of a few surface
markers of refusing or complying (:data:`STRUCTURE_PATTERNS`, case-insensitive regular expressions) divided by
4, and ``p(y)``: the response features of :mod:`sdk.pair_features` (:data:`PAIR_FEATURE_NAMES`: its
:data:`~sdk.pair_features.DEFAULT_FEATURES` less the three length columns, which ``l(y)`` already holds; markdown,
repetition, refusal phrases, ...), each column divided by its standard deviation over the responses (no label is read). MiniLM reads 256 tokens of each text; the
markers are counted over the whole response. Which of ``s(y)`` and ``p(y)`` are used (:data:`STRUCTURES`) is
chosen on validation by the oracle's accuracy (``fedroute vpa train`` reports every oracle) and is the same for
every method.

:func:`reduce_embeddings` then projects ``e(x)`` and ``e(y)`` each onto its first ``n_components`` principal
components (scikit-learn PCA fitted on the training pairs only: :class:`EmbeddingProjection`), which makes the
small models of the federated simulation about six times cheaper on CPU; length and marker columns are kept as
they are. :func:`raw_features` is ``phi`` before the scaling of ``p(y)`` and the projection: what a device computes
from text (:class:`FeatureTransform` then gives ``phi``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from sklearn.decomposition import PCA

from sdk.pair_features import DEFAULT_FEATURES, response_features_many
from sdk.pair_encoding import LENGTH_FEATURE_NAMES
from trainer.rewards.pair_features import PairEncoder

#: Surface markers of ``s(y)``, in column order.
STRUCTURE_PATTERNS = {
    "apology": r"\b(sorry|apologi[sz]e)\b",
    "refusal": r"\b(can't|cannot|can not|won't|unable|not able to|shouldn't|should not|don't think|i'd rather not)\b",
    "harm_words": r"\b(illegal|harmful|dangerous|unethical|inappropriate|wrong|hurt|violence|crime|police|law)\b",
    "question": r"\?",
    "compliance": r"\b(here's|here is|here are|you can|you could|you might|try|first|step|sure|yes|ok|okay)\b",
    "digits": r"\d",
    "second_person": r"\byou(r)?\b",
    "first_person": r"\b(i|i'm|me|my)\b",
    "negation": r"\b(no|not|never|don't|doesn't|isn't)\b",
}
#: The :mod:`sdk.pair_features` columns of ``p(y)``, in column order.
PAIR_FEATURE_NAMES = tuple(n for n in DEFAULT_FEATURES if n not in LENGTH_FEATURE_NAMES)
#: Feature sets: which of ``s(y)`` (markers) and ``p(y)`` (pair features) follow ``[e(x), e(y), l(y)]``.
STRUCTURES = ("none", "markers", "pair_features", "both")
_COMPILED = [re.compile(p, re.IGNORECASE) for p in STRUCTURE_PATTERNS.values()]
STRUCTURE_SCALE = 4.0


def structure_features(responses: Sequence[str]) -> np.ndarray:
    """``s(y)``: ndarray of shape (n, len(STRUCTURE_PATTERNS)), float32, ``log1p(count) / 4`` per marker."""
    counts = np.array([[len(p.findall(r)) for p in _COMPILED] for r in responses], dtype=np.float64)
    return (np.log1p(counts) / STRUCTURE_SCALE).astype(np.float32)


def raw_features(prompts: Sequence[str], responses: Sequence[str], encoder: PairEncoder) -> np.ndarray:
    """``[e(x), e(y), l(y), s(y), p(y)]`` of n (prompt, response) with ``p(y)`` unscaled: (n, d_raw) float64."""
    return np.concatenate([encoder.encode(prompts, responses), structure_features(responses),
                           response_features_many(prompts, responses, PAIR_FEATURE_NAMES)], axis=1)


def _scales(p: np.ndarray) -> np.ndarray:
    return np.maximum(p.std(0), 1e-3)


def pair_feature_scales(pairs: pd.DataFrame) -> np.ndarray:
    """Divisors of the ``p(y)`` columns (:func:`pair_features`): their standard deviation over both responses of
    every pair, at least 1e-3; shape (len(PAIR_FEATURE_NAMES),) float64."""
    return _scales(response_features_many(list(pairs["prompt"]) * 2, list(pairs["response_a"]) + list(pairs["response_b"]),
                                          PAIR_FEATURE_NAMES))


def pair_features(pairs: pd.DataFrame, encoder: PairEncoder | None = None) -> np.ndarray:
    """``phi`` of both responses of every pair, with both ``s(y)`` and ``p(y)`` (:func:`select_structure` drops them).

    Parameters
    ----------
    pairs : pairs frame (needs ``prompt``, ``response_a``, ``response_b``).
    encoder : PairEncoder (default: MiniLM, 256 tokens, left truncation, length features, the default cache).

    Returns
    -------
    ndarray of shape (n_pairs, 2, d_in), float32; ``[:, 0]`` response_a, ``[:, 1]`` response_b.
    """
    n, n_p = len(pairs), len(PAIR_FEATURE_NAMES)
    phi = raw_features(list(pairs["prompt"]) * 2, list(pairs["response_a"]) + list(pairs["response_b"]),
                       encoder or PairEncoder())
    phi[:, -n_p:] /= _scales(phi[:, -n_p:])
    return np.stack([phi[:n], phi[n:]], axis=1).astype(np.float32)


def select_structure(phi: np.ndarray, structure: str) -> np.ndarray:
    """``phi`` of :func:`pair_features` (after :func:`reduce_embeddings` or not) keeping the columns of ``structure``
    (one of :data:`STRUCTURES`)."""
    n_s, n_p = len(STRUCTURE_PATTERNS), len(PAIR_FEATURE_NAMES)
    d = phi.shape[-1]
    keep = list(range(d - n_s - n_p))
    if structure in ("markers", "both"):
        keep += range(d - n_s - n_p, d - n_p)
    if structure in ("pair_features", "both"):
        keep += range(d - n_p, d)
    return phi[..., keep]


@dataclass(frozen=True)
class EmbeddingProjection:
    """PCA of the ``e(x)`` and ``e(y)`` blocks: ``mean`` (2, d_emb) and ``components`` (2, n_components, d_emb),
    float32 (scikit-learn's ``mean_`` and ``components_`` of the prompt and the response block);
    a block ``e`` becomes ``e @ components.T - mean @ components.T`` (scikit-learn's ``transform``, same order)."""

    mean: np.ndarray
    components: np.ndarray

    def apply(self, phi: np.ndarray) -> np.ndarray:
        """``phi`` (..., 2 * d_emb + k) with its two embedding blocks projected: (..., 2 * n_components + k) float32."""
        d = self.mean.shape[1]
        blocks = [phi[..., i * d:(i + 1) * d] @ self.components[i].T - self.mean[i] @ self.components[i].T for i in (0, 1)]
        return np.concatenate(blocks + [phi[..., 2 * d:]], axis=-1).astype(np.float32)


def fit_projection(phi: np.ndarray, train_rows: np.ndarray, n_components: int, d_emb: int = 384) -> EmbeddingProjection:
    """:class:`EmbeddingProjection` fitted on the pairs ``train_rows`` of ``phi`` (n_pairs, 2, 2 * d_emb + k)."""
    fit = phi[train_rows].reshape(-1, phi.shape[-1])
    pcas = [PCA(n_components=n_components, random_state=0).fit(fit[:, lo:lo + d_emb]) for lo in (0, d_emb)]
    return EmbeddingProjection(np.stack([p.mean_ for p in pcas]).astype(np.float32),
                               np.stack([p.components_ for p in pcas]).astype(np.float32))


def reduce_embeddings(phi: np.ndarray, train_rows: np.ndarray, n_components: int, d_emb: int = 384) -> np.ndarray:
    """PCA of the ``e(x)`` and ``e(y)`` blocks of ``phi`` (module docstring).

    phi : ndarray of shape (n_pairs, 2, 2 * d_emb + k), float32; train_rows : int indices of the pairs the PCA
    is fitted on. Returns ndarray of shape (n_pairs, 2, 2 * n_components + k), float32.
    """
    return fit_projection(phi, train_rows, n_components, d_emb).apply(phi)


@dataclass(frozen=True)
class FeatureTransform:
    """:func:`raw_features` (after :func:`select_structure`) -> the ``phi`` a model was trained on: ``p(y)``
    divided by ``scales`` (None when ``structure`` drops ``p(y)``), then ``projection`` (None: no PCA).
    ``d_emb``: width of one embedding block."""

    structure: str
    scales: np.ndarray | None
    projection: EmbeddingProjection | None
    d_emb: int = 384

    def apply(self, raw: np.ndarray) -> np.ndarray:
        """raw : (..., d_raw) of :func:`raw_features` after :func:`select_structure` of ``structure``.
        Returns ``phi`` (..., d_in) float32."""
        raw = np.array(raw, dtype=np.float64)
        if self.scales is not None:
            raw[..., -len(self.scales):] /= self.scales
        raw = raw.astype(np.float32)
        return raw if self.projection is None else self.projection.apply(raw)
