"""The interfaces of an artefact kind on the device (ARCHITECTURE.md §9); the registry is :mod:`sdk.kinds`.

- :class:`ArtefactKind`: what a kind supplies to the SDK (the bundle files it reads, its manifest
  checks, a loader returning its runtime, an optional device round handler);
- one runtime interface per family: :class:`RouterScorer` (routers), :class:`Embedder` (embedders);
- :class:`LoadContext`: the verified inputs a loader gets.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


# -- runtime interfaces, one per family -------------------------------------------------------


@runtime_checkable
class RouterScorer(Protocol):
    """Runtime of a router kind on the device: embeddings -> accuracy and cost per model.

    ``predict(embeddings)`` takes an ndarray of shape (n_queries, d_emb), float32, finite (already
    validated by :class:`sdk.Router`) and returns ``(accuracy, cost, cells)``: accuracy in [0, 1] and
    cost in USD per query, each an ndarray of shape (n_queries, n_models), float64 (NaN = no
    estimate, never chosen), in the manifest's model order; ``cells`` an ndarray of shape
    (n_queries,), int64 (Voronoi cell per query) for partition-based kinds, else None.
    """

    def predict(self, embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]: ...


@runtime_checkable
class Embedder(Protocol):
    """Runtime of an embedder kind: ``embed(texts)`` -> ndarray of shape (n, d_emb), float32, unit
    L2 norm; ``n_tokens(texts)`` -> tokens read per text (after truncation). Texts are already
    validated non-blank ``str``."""

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...

    def n_tokens(self, texts: Sequence[str]) -> list[int]: ...


@dataclass(frozen=True)
class LoadContext:
    """What a kind's :meth:`ArtefactKind.load` gets: verified inputs, nothing else.

    Attributes
    ----------
    manifest : dict, the signature-verified manifest.
    files : mapping file name -> bytes, the files :meth:`ArtefactKind.files` asked for, each
        verified against its sha256.
    models : tuple of str, the manifest's model ids, in order (the column order of every score).
    embedder : dict, the manifest's ``embedder`` entry (``name``, ``dim``, ``max_tokens``, ...).
    options : for kinds that run ONNX graphs (threads chosen by the app): onnxruntime ``SessionOptions``
        or an :class:`sdk.embedder.SessionThreads`; pass it to :func:`sdk.embedder.inference_session`,
        which accepts both (so that a kind running no graph never imports onnxruntime).
    precision : a key of the manifest's ``embedder.files`` (``"fp32"``, ``"int8"``, ``"int8-all"``),
        the embedder precision chosen at load time.
    paths : mapping file name -> :class:`sdk.verified_file.VerifiedFile`, the files of
        :meth:`ArtefactKind.path_files` when the caller opened them by path (verified, still open;
        load them from ``library_path``, then call ``check_unchanged()``); such a file is then not
        in ``files``. Empty when the caller read every file as bytes.
    """

    manifest: dict
    files: Mapping[str, bytes]
    models: tuple[str, ...]
    embedder: dict
    options: Any = None
    precision: str = "fp32"
    paths: Mapping[str, Any] = field(default_factory=dict)


class ArtefactKind(abc.ABC):
    """One kind of one family on the device. Subclass, set ``family`` and ``name``, implement
    :meth:`files` and :meth:`load`; register an instance with :func:`register`.

    Attributes
    ----------
    family : str, e.g. ``"router"``.
    name : str, the kind, e.g. ``"kmeans"`` (the value of ``"<family>_kind"`` in the manifest).
    round_handler : a :class:`sdk.device_rounds.DeviceRoundHandler` when the kind is federated over
        HTTPS (the sync client hands it rounds whose ``kind`` is this name), else None.
    """

    family: str = ""
    name: str = ""
    round_handler: Any = None

    @abc.abstractmethod
    def files(self, manifest: dict, precision: str) -> tuple[str, ...]:
        """Names of the bundle files :meth:`load` reads (each must be listed in the manifest)."""

    def path_files(self, manifest: dict, precision: str) -> tuple[str, ...]:
        """Of :meth:`files`, the large ones :meth:`load` can open by path (given in
        :attr:`LoadContext.paths` rather than as bytes, so they are never held in Python memory).
        Default: none."""
        return ()

    def check_manifest(self, manifest: dict) -> None:
        """Check the manifest fields this kind needs beyond the common schema (default: none).

        Raises
        ------
        BundleError
            A field is missing or invalid (the message names it).
        """

    @abc.abstractmethod
    def load(self, context: LoadContext) -> Any:
        """The runtime object (the family's interface: :class:`RouterScorer`, :class:`Embedder`, ...).

        Raises
        ------
        BundleError
            The files do not load or disagree with the manifest (models, embedder, shapes).
        """
