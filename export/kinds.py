"""Artefact kinds as plugins, the export side (ARCHITECTURE.md §9).

Same ``(family, name)`` keys as :mod:`sdk.kinds` and :mod:`trainer.kinds`. An export kind turns
the trainer's artefact into the bundle's files and manifest fields, and owns the parity gate
that a staged bundle must pass (measured through the SDK, as an app loads it) before it is
written. ``fedroute export`` and publishing a federated round both go through it.

Built in: ``router/kmeans`` (``kmeans.npz``) and ``router/mlp`` (``router.onnx``), see
:mod:`export.router_export`. See ``docs/plugins.md``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from export import parity
from export.router_export import kmeans_to_npz, mlp_to_onnx
from sdk import kinds as sdk_kinds
from sdk.kind_registry import KindRegistry, UnknownKindError

ROUTER_FAMILY = "router"


class ExportKind(abc.ABC):
    """What a kind supplies to ``export``: its files, its manifest fields, its parity gate."""

    family: ClassVar[str] = ""
    name: ClassVar[str] = ""

    @abc.abstractmethod
    def files(self, artefact: Any) -> dict[str, bytes]:
        """The kind's bundle files, name -> bytes (names as :meth:`sdk.kinds.ArtefactKind.files` reads them).

        Raises
        ------
        ExportError
            The artefact cannot be exported (e.g. no embedder identity).
        """

    def manifest_fields(self, artefact: Any) -> dict:
        """Manifest fields of the kind (default: ``{"<family>_kind": name}``)."""
        return {sdk_kinds.manifest_key(self.family): self.name}

    @abc.abstractmethod
    def parity(self, bundle_dir: Path, public_key, artefact: Any, reference: np.ndarray, test,
               precisions: Sequence[str], progress: Callable[[str], None] = print) -> dict:
        """Parity report of the staged bundle against the trainer's ``artefact``: a dict with at
        least ``passed`` (bool) and ``failures`` (list of str); a failed gate writes nothing."""


class RouterExportKind(ExportKind):
    """A router kind: parity by :func:`export.parity.check_bundle` (embedder cosine, decision
    agreement over the METRICS.md lambda grid, AUC gap); subclasses give the files and the
    per-model mean cost the price table shows."""

    family = ROUTER_FAMILY

    @abc.abstractmethod
    def mean_costs(self, router: Any) -> list[float | None]:
        """Per-model mean cost per query in the router's training logs (USD), None if never observed."""

    def parity(self, bundle_dir, public_key, artefact, reference, test, precisions, progress=print) -> dict:
        return parity.check_bundle(bundle_dir, public_key, artefact, reference, test, precisions, progress=progress)


#: The export layer's kinds.
REGISTRY: KindRegistry[ExportKind] = KindRegistry("export", ExportKind)


def register(kind: ExportKind, *, replace: bool = False) -> ExportKind:
    """Register an export kind (see :meth:`sdk.kind_registry.KindRegistry.register`)."""
    return REGISTRY.register(kind, replace=replace)


def get(name: str, family: str = ROUTER_FAMILY) -> ExportKind:
    """The export kind ``name``; :class:`~sdk.kind_registry.UnknownKindError` lists the valid ones."""
    return REGISTRY.get(family, name)


def unregister(name: str, family: str = ROUTER_FAMILY) -> None:
    """Remove a kind (tests)."""
    REGISTRY.unregister(family, name)


class KMeansExportKind(RouterExportKind):
    """``router/kmeans`` -> ``kmeans.npz`` (:func:`export.router_export.kmeans_to_npz`)."""

    name = "kmeans"

    def files(self, artefact):
        return {sdk_kinds.get(self.family, self.name).file: kmeans_to_npz(artefact)}

    def mean_costs(self, router):
        # the observed mean per model; for a model added with a price (add-model), the price shrunk
        # toward its observations (KMeansRouter.model_costs)
        return [float(c) if np.isfinite(c) else None for c in router.model_costs()]


class MlpExportKind(RouterExportKind):
    """``router/mlp`` -> ``router.onnx`` (:func:`export.router_export.mlp_to_onnx`)."""

    name = "mlp"

    def files(self, artefact):
        return {sdk_kinds.get(self.family, self.name).file: mlp_to_onnx(artefact)}

    def mean_costs(self, router):
        return [float(s) if ok and np.isfinite(s) else None for s, ok in zip(router.cost_scale_, router.available_)]


for _kind in (KMeansExportKind(), MlpExportKind()):
    register(_kind)

__all__ = ["REGISTRY", "ExportKind", "RouterExportKind", "UnknownKindError", "get", "register", "unregister"]
