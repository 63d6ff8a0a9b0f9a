"""Embedder kinds on the trainer side (family ``embedder`` of :mod:`trainer.kinds`).

An embedder kind turns the training texts into exactly the embeddings the device's kind of the
same name computes (:mod:`sdk.kinds`), names its cache namespace and writes the ``embedder`` entry
of ``router.json`` that ``export`` reads. Built in: ``onnx`` (sentence-transformers + torch here,
the ONNX graph on the device; :mod:`trainer.embeddings`) and ``static`` (model2vec;
:mod:`trainer.static_embedder`).

:class:`EmbedderConfig` (which embedder, how it reads text) lives here with the kinds it names;
:mod:`trainer.embeddings` re-exports it.

The kind is named by the ``--embedder`` string: ``"<kind>:<spec>"`` for a registered embedder kind
other than ``onnx`` (``static:all-MiniLM-L6-v2``), anything else is a sentence-transformer (kind
``onnx``) given by folder, short name or hub id.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from sdk.errors import InvalidInputError
from trainer import kinds
from trainer.embedder_paths import DEFAULT_EMBEDDER, default_cache_dir

EMBEDDER_FAMILY = "embedder"
#: The kind of an ``--embedder`` string without a ``"<kind>:"`` prefix.
DEFAULT_KIND = "onnx"


class EmbedderTrainerKind(kinds.TrainerKind):
    """What an embedder kind supplies to the trainer. ``spec`` is the ``--embedder`` string after
    the ``"<kind>:"`` prefix (the whole string for the default kind)."""

    family: ClassVar[str] = EMBEDDER_FAMILY

    @abc.abstractmethod
    def cache_namespace(self, config: EmbedderConfig, spec: str, cache_dir: Path) -> str:
        """Key prefix of this embedder's rows in the embedding cache: distinct for every model,
        text rule and pooling that gives different vectors."""

    @abc.abstractmethod
    def encode(self, config: EmbedderConfig, spec: str, texts: list[str], cache_dir: Path,
               show_progress: bool) -> np.ndarray:
        """Embeddings of validated non-blank ``texts``: (n, d_emb) float32, rows L2-normalised."""

    @abc.abstractmethod
    def router_entry(self, config: EmbedderConfig, spec: str, dim: int, cache_dir: Path) -> dict:
        """The ``embedder`` entry of ``router.json``: ``name``, ``dim``, ``max_tokens``,
        ``truncation_side``, ``pooling``, ``normalised`` and the kind's own fields."""

    def reading(self, config: EmbedderConfig) -> str:
        """What of each text it reads, for progress messages (default: the last ``max_tokens`` tokens)."""
        return f"last {config.max_tokens} tokens"


def kind_of(model: str) -> tuple[EmbedderTrainerKind, str]:
    """``(kind, spec)`` named by an ``--embedder`` string (see module docstring)."""
    prefix, sep, rest = model.partition(":")
    if sep and prefix in kinds.names(EMBEDDER_FAMILY) and prefix != DEFAULT_KIND:
        return kinds.get(prefix, family=EMBEDDER_FAMILY), rest  # type: ignore[return-value]
    return kinds.get(DEFAULT_KIND, family=EMBEDDER_FAMILY), model  # type: ignore[return-value]


@dataclass(frozen=True)
class EmbedderConfig:
    """Which embedder and how it reads text.

    model : local path, short name ``all-MiniLM-L6-v2`` or hub id (a sentence-transformer, kind
        ``onnx``), or ``"static:<model2vec folder or sentence-transformer>"`` (kind ``static``,
        :mod:`trainer.static_embedder`); see :func:`kind_of`.
    max_tokens : int, tokens read per text (MiniLM: 256); the static kind reads the whole text.
    truncation_side : ``"left"`` keeps the end of the text (see module docstring).
    batch_size : int, texts per forward pass.
    device : torch device string, e.g. ``"cpu"`` or ``"cuda"``.
    """

    model: str = DEFAULT_EMBEDDER
    max_tokens: int = 256
    truncation_side: str = "left"
    batch_size: int = 32
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.truncation_side not in ("left", "right"):
            raise InvalidInputError(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}")
        if self.max_tokens < 8:
            raise InvalidInputError(f"max_tokens must be >= 8, got {self.max_tokens}")

    @property
    def cache_namespace(self) -> str:
        """Cache namespace of a sentence-transformer (kind ``onnx``); other kinds name their own
        (:meth:`EmbedderTrainerKind.cache_namespace`)."""
        return f"{self.model}|{self.max_tokens}|{self.truncation_side}|mean|l2"

    @property
    def kind(self) -> EmbedderTrainerKind:
        """The embedder kind ``model`` names (:func:`kind_of`)."""
        return kind_of(self.model)[0]

    @property
    def spec(self) -> str:
        """``model`` without its ``"<kind>:"`` prefix."""
        return kind_of(self.model)[1]

    def router_entry(self, dim: int, cache_dir: Path | None = None) -> dict:
        """The ``embedder`` entry of ``router.json`` for routers trained on these embeddings."""
        return self.kind.router_entry(self, self.spec, dim, cache_dir or default_cache_dir())
