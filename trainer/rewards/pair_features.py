"""Features of a (prompt, response) pair: the frozen-encoder representation ``h = Enc(x, y)`` of MoR
(paper 001, Sec. "Routing Network Federated Learning"), used by the router and the MLP reward models.

``Enc(x, y) = [e(x), e(y), l(y)]``: the all-MiniLM-L6-v2 embeddings of the prompt and of the response
(mean-pooled, L2-normalised, left truncation, :mod:`trainer.embeddings`) side by side, then (unless
``length_features=False``) the response's length ``l(y) = [log1p(characters), log1p(words),
log1p(lines)] / 8`` (:func:`sdk.pair_encoding.length_features` against the empty string, scaled to
about unit range). The encoder reads at most 256 tokens, so without ``l(y)`` a reward model could
not see how long a response is, which decides much of this data (``trainer.length_baseline``). Embedding the
two texts apart keeps the prompt in view however long the response is, and lets a prompt shared by
many responses be embedded once (the SQLite cache of :func:`trainer.embeddings.embed_texts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sdk.errors import InvalidInputError
from trainer.embeddings import EmbedderConfig, embed_texts
from sdk.pair_encoding import length_features_many
from sdk.pair_features import check_feature_names, response_features_many


def check_pair_texts(prompts: Sequence[str], responses: Sequence[str]) -> None:
    """Raise InvalidInputError unless ``prompts`` and ``responses`` are equally long (n >= 1) sequences of str.

    A None or NaN (a missing cell of a frame) would otherwise be embedded as ``"(empty)"``, and a
    shorter list would be paired up silently to its length.
    """
    if len(prompts) != len(responses):
        raise InvalidInputError(f"{len(prompts)} prompts but {len(responses)} responses")
    if len(prompts) == 0:
        raise InvalidInputError("scoring needs at least one (prompt, response) pair, got 0")
    for name, texts in (("prompts", prompts), ("responses", responses)):
        check_texts(name, texts)


def check_texts(name: str, texts: Sequence) -> None:
    """Raise InvalidInputError naming ``name[i]`` for the first item of ``texts`` that is not a str."""
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise InvalidInputError(f"{name}[{bad}] must be a str, got {texts[bad]!r}")


@dataclass
class PairEncoder:
    """``encode(prompts, responses) -> ndarray (n, 2 * d_emb + 3) float32`` (``2 * d_emb`` without length).

    embedder : EmbedderConfig of the frozen sentence encoder (default MiniLM, 256 tokens, left).
    cache_dir : folder of the embedding cache (default :func:`trainer.embeddings.default_cache_dir`).
    show_progress : tqdm bar while embedding cache misses.
    length_features : append ``l(y)`` (3 columns).
    pair_features : None, or names of :data:`sdk.pair_features.FEATURE_NAMES`: with ``length_features`` the
        appended columns are ``phi(x, y) / 8`` of those names (:func:`sdk.pair_features.response_features_many`;
        its first three, the length features, are ``l(y)``) instead of ``l(y)``.
    """

    embedder: EmbedderConfig = field(default_factory=EmbedderConfig)
    cache_dir: Path | None = None
    show_progress: bool = False
    length_features: bool = True
    pair_features: tuple[str, ...] | None = None
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.pair_features is not None:
            self.pair_features = check_feature_names(self.pair_features)

    @property
    def n_feature_columns(self) -> int:
        """Trailing feature columns of :meth:`encode` (0 without ``length_features``)."""
        if not self.length_features:
            return 0
        return 3 if self.pair_features is None else len(self.pair_features)

    def feature_columns(self, prompts: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        """The trailing columns of :meth:`encode` alone: (n, n_feature_columns) float32 (no embedding)."""
        if self.pair_features is None:
            return response_lengths(responses)
        # phi(x, y) of a pair already seen is reused: the regexes cost ~1 ms per response and every pool pair is
        # encoded several times per seed (reward model, router, baselines, evaluation)
        keys = list(zip(prompts, responses))
        missing = [k for k in dict.fromkeys(keys) if k not in self._memo]
        if len(self._memo) + len(missing) > MEMO_PAIRS:
            self._memo.clear()
            missing = list(dict.fromkeys(keys))
        if missing:
            phi = response_features_many([x for x, _ in missing], [y for _, y in missing], self.pair_features)
            self._memo.update(zip(missing, (phi / LENGTH_SCALE).astype(np.float32)))
        return np.stack([self._memo[k] for k in keys])

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        """Parameters: prompts, responses : sequences of n non-empty str.

        Returns ndarray of shape (n, 2 * d_emb + 3), float32: ``[e(prompt), e(response), l(response)]``
        per row (``(n, 2 * d_emb)`` when ``length_features`` is False).

        Raises InvalidInputError: lengths differ, a text is not a str, or a text is empty (a whitespace-only response is
        encoded as the single token ``"(empty)"`` rather than refused, since HH-RLHF holds a few).
        """
        check_pair_texts(prompts, responses)
        responses = [r if isinstance(r, str) and r.strip() else "(empty)" for r in responses]
        uniq = list(dict.fromkeys(list(prompts) + responses))
        vecs = embed_texts(uniq, self.embedder, self.cache_dir, show_progress=self.show_progress)
        index = {t: i for i, t in enumerate(uniq)}
        ep = vecs[[index[p] for p in prompts]]
        er = vecs[[index[r] for r in responses]]
        parts = [ep, er]
        if self.length_features:
            parts.append(self.feature_columns(prompts, responses))
        return np.concatenate(parts, axis=1).astype(np.float32)

    @property
    def identity(self) -> dict:
        """The embedder identity recorded in saved artefacts (a device must embed the same way)."""
        return {"model": self.embedder.model, "max_tokens": self.embedder.max_tokens,
                "truncation_side": self.embedder.truncation_side, "pooling": "mean", "normalised": True,
                "layout": "concat(e(prompt), e(response)" + (", log1p([chars, words, lines](response)) / 8)" if self.length_features else ")"),
                "length_features": self.length_features,
                **({"pair_features": list(self.pair_features)} if self.pair_features is not None else {})}


#: Scale of the length columns: log1p counts / LENGTH_SCALE.
LENGTH_SCALE = 8.0
#: Pairs whose ``phi(x, y)`` a PairEncoder keeps (cleared when full; the full MoR pool has ~45k).
MEMO_PAIRS = 200_000


def response_lengths(responses: Sequence[str]) -> np.ndarray:
    """``[log1p(characters), log1p(words), log1p(lines)] / 8`` of each response: (n, 3) float32."""

    return (length_features_many(list(responses), [""] * len(responses)) / LENGTH_SCALE).astype(np.float32)
