"""The kinds the SDK ships: routers ``kmeans`` and ``mlp`` (paper 002), embedder ``onnx``; :mod:`sdk.kinds`
registers :data:`BUILTIN_KINDS`."""

from __future__ import annotations

import importlib
from functools import cached_property
from typing import Any

from sdk.artefact_kind import ArtefactKind, LoadContext, utf8_file
from sdk.bundle_manifest import TOKENIZER_FILE, need
from sdk.embedder import OnnxEmbedder
from sdk.scorers import KMeansScorer, MlpScorer


class _OneFileRouterKind(ArtefactKind):
    """A router kind reading one bundle file; federated by the :mod:`sdk.device_rounds` class ``handler``."""

    family = "router"
    file = ""
    handler = ""

    @cached_property
    def round_handler(self) -> Any:  # built on first use: the sync's imports only
        return getattr(importlib.import_module("sdk.device_rounds"), self.handler)()

    def files(self, manifest: dict[str, Any], precision: str) -> tuple[str, ...]:
        return (self.file,)

    def check_manifest(self, manifest: dict[str, Any]) -> None:
        need(self.file in manifest["files"], f"{self.file} is not listed in files")


class KMeansRouterKind(_OneFileRouterKind):
    """``router/kmeans``: ``kmeans.npz`` -> :class:`sdk.scorers.KMeansScorer`; federated by statistics."""

    name, file, handler = "kmeans", "kmeans.npz", "KMeansRoundHandler"

    def load(self, context: LoadContext) -> KMeansScorer:
        return KMeansScorer(context.files[self.file], context.models, context.embedder)


class MlpRouterKind(_OneFileRouterKind):
    """``router/mlp``: ``router.onnx`` -> :class:`sdk.scorers.MlpScorer`; federated by FedAvg."""

    name, file, handler = "mlp", "router.onnx", "MlpRoundHandler"

    def load(self, context: LoadContext) -> MlpScorer:
        return MlpScorer(context.files[self.file], context.models, context.embedder, context.options)


class OnnxEmbedderKind(ArtefactKind):
    """``embedder/onnx``: ``tokenizer.json`` + the encoder of each precision (the manifest's ``embedder.files``;
    opened by path) -> :class:`sdk.embedder.OnnxEmbedder` (only the fp32 graph embeds a batch in one call)."""

    family = "embedder"
    name = "onnx"

    def precisions(self, manifest: dict[str, Any]) -> tuple[str, ...]:
        return tuple(manifest["embedder"]["files"])

    def files(self, manifest: dict[str, Any], precision: str) -> tuple[str, ...]:
        return (TOKENIZER_FILE, manifest["embedder"]["files"][precision])

    def path_files(self, manifest: dict[str, Any], precision: str) -> tuple[str, ...]:
        return (manifest["embedder"]["files"][precision],)

    def check_manifest(self, manifest: dict[str, Any]) -> None:
        need(TOKENIZER_FILE in manifest["files"], f"{TOKENIZER_FILE} is not listed in files")

    def load(self, context: LoadContext) -> OnnxEmbedder:
        emb = context.embedder
        model_file = emb["files"][context.precision]
        return OnnxEmbedder(utf8_file(context, TOKENIZER_FILE), context.paths.get(model_file) or context.files[model_file],
                            emb["dim"], emb["max_tokens"], emb["truncation_side"], context.options,
                            batched=context.precision == "fp32")


BUILTIN_KINDS: tuple[ArtefactKind, ...] = (KMeansRouterKind(), MlpRouterKind(), OnnxEmbedderKind())
