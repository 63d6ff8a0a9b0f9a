"""Embedder kinds on the trainer side (family ``embedder`` of :mod:`trainer.kinds`).

An embedder kind turns the training texts into exactly the embeddings the device's kind of the
same name computes (:mod:`sdk.kinds`), names its cache namespace and writes the ``embedder`` entry
of ``router.json`` that ``export`` reads. Built in: ``onnx`` (sentence-transformers + torch here,
the ONNX graph on the device; :mod:`trainer.embeddings`) and ``static`` (model2vec;
:mod:`trainer.static_embedder`).

The kind is named by the ``--embedder`` string: ``"<kind>:<spec>"`` for a registered embedder kind
other than ``onnx`` (``static:all-MiniLM-L6-v2``), anything else is a sentence-transformer (kind
``onnx``) given by folder, short name or hub id.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from trainer import kinds

if TYPE_CHECKING:  # trainer.embeddings imports this module; its config is only a type here
    from trainer.embeddings import EmbedderConfig

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
