"""The interfaces of an artefact kind on the device (ARCHITECTURE.md §9); the registry is :mod:`sdk.kinds`.

:class:`ArtefactKind` is what a kind supplies (the bundle files it reads, its manifest checks, a loader, an
optional device round handler); :class:`RouterScorer` and :class:`Embedder` are the runtime interfaces of the
two built-in families; :class:`LoadContext` holds the verified inputs a loader gets.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from sdk.errors import BundleError

if TYPE_CHECKING:
    from sdk.embedder import SessionThreads
    from sdk.verified_file import VerifiedFile


@runtime_checkable
class RouterScorer(Protocol):
    """Runtime of a router kind: ``predict(embeddings (n, d_emb) float32, validated)`` -> ``(accuracy, cost, cells)``,
    accuracy in [0, 1] and cost in USD per query each (n, n_models) float64 (NaN = no estimate) in the manifest's
    model order; ``cells`` (n,) int64 for partition-based kinds, else None."""

    def predict(self, embeddings: npt.NDArray[np.float32]) -> tuple[
        npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.int64] | None]: ...


@runtime_checkable
class Embedder(Protocol):
    """Runtime of an embedder kind: ``embed(texts)`` -> (n, d_emb) float32, unit L2 norm; ``n_tokens(texts)`` ->
    tokens read per text. Texts are already validated non-blank ``str``."""

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]: ...

    def n_tokens(self, texts: Sequence[str]) -> list[int]: ...


@dataclass(frozen=True)
class LoadContext:
    """What :meth:`ArtefactKind.load` gets, all verified: the manifest, ``files`` (name -> bytes of
    :meth:`ArtefactKind.files`), ``models`` (the manifest's model ids: the column order of every score), the
    manifest's ``embedder`` entry, ``options`` (thread counts for :func:`sdk.embedder.inference_session`), the
    ``precision`` chosen, and ``paths`` (name -> open :class:`~sdk.verified_file.VerifiedFile` of
    :meth:`ArtefactKind.path_files`; such a file is then not in ``files``)."""

    manifest: dict[str, Any]
    files: Mapping[str, bytes]
    models: tuple[str, ...]
    embedder: dict[str, Any]
    options: SessionThreads | None = None
    precision: str = "fp32"
    paths: Mapping[str, VerifiedFile] = field(default_factory=dict)


def utf8_file(context: LoadContext, name: str) -> str:
    """The verified file ``name`` as text. Raises BundleError if it is not UTF-8."""
    try:
        return context.files[name].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BundleError(f"{name} is not UTF-8 ({exc})") from exc


class ArtefactKind(abc.ABC):
    """One kind of one family on the device: set ``family`` and ``name`` (the manifest's ``"<family>_kind"``
    value), implement :meth:`files` and :meth:`load`, register an instance with :func:`sdk.kinds.register`.
    ``round_handler``: a :class:`sdk.device_rounds.DeviceRoundHandler` when federated over HTTPS, else None."""

    family: str = ""
    name: str = ""
    round_handler: Any = None

    def precisions(self, manifest: dict[str, Any]) -> tuple[str, ...]:
        """Precisions the bundle ships for this kind, e.g. ``("fp32", "int8")``."""
        return ("fp32",)

    @abc.abstractmethod
    def files(self, manifest: dict[str, Any], precision: str) -> tuple[str, ...]:
        """Names of the bundle files :meth:`load` reads."""

    def path_files(self, manifest: dict[str, Any], precision: str) -> tuple[str, ...]:
        """Of :meth:`files`, those :meth:`load` opens by path (:attr:`LoadContext.paths`)."""
        return ()

    def check_manifest(self, manifest: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Check the fields this kind needs beyond the format's schema; raise BundleError naming the field."""

    @abc.abstractmethod
    def load(self, context: LoadContext) -> Any:
        """The runtime (the family's interface); raise BundleError when the files do not load or disagree."""
