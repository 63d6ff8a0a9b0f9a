"""The kinds the SDK ships: routers ``kmeans`` and ``mlp`` (paper 002), embedder ``onnx``.

Each is an :class:`sdk.artefact_kind.ArtefactKind`; :mod:`sdk.kinds` registers :data:`BUILTIN_KINDS`.
"""

from __future__ import annotations

from functools import cached_property

from sdk.artefact_kind import ArtefactKind, LoadContext
from sdk.embedder import OnnxEmbedder
from sdk.errors import BundleError
from sdk.scorers import KMeansScorer, MlpScorer

TOKENIZER_FILE = "tokenizer.json"


class KMeansRouterKind(ArtefactKind):
    """``router/kmeans``: ``kmeans.npz`` -> :class:`sdk.scorers.KMeansScorer`; federated by statistics."""

    family = "router"
    name = "kmeans"
    file = "kmeans.npz"

    @cached_property
    def round_handler(self):
        """:class:`sdk.device_rounds.KMeansRoundHandler` (built on first use)."""
        from sdk.device_rounds import KMeansRoundHandler  # sync only: msgpack, sqlite3; not on the routing path

        return KMeansRoundHandler()

    def files(self, manifest: dict, precision: str) -> tuple[str, ...]:
        return (self.file,)

    def check_manifest(self, manifest: dict) -> None:
        if self.file not in manifest["files"]:
            raise BundleError(f"manifest: {self.file} is not listed in files")

    def load(self, context: LoadContext) -> KMeansScorer:
        return KMeansScorer(context.files[self.file], context.models, context.embedder)


class MlpRouterKind(ArtefactKind):
    """``router/mlp``: ``router.onnx`` -> :class:`sdk.scorers.MlpScorer`; federated by FedAvg."""

    family = "router"
    name = "mlp"
    file = "router.onnx"

    @cached_property
    def round_handler(self):
        """:class:`sdk.device_rounds.MlpRoundHandler` (built on first use)."""
        from sdk.device_rounds import MlpRoundHandler  # sync only: msgpack, sqlite3; not on the routing path

        return MlpRoundHandler()

    def files(self, manifest: dict, precision: str) -> tuple[str, ...]:
        return (self.file,)

    def check_manifest(self, manifest: dict) -> None:
        if self.file not in manifest["files"]:
            raise BundleError(f"manifest: {self.file} is not listed in files")

    def load(self, context: LoadContext) -> MlpScorer:
        return MlpScorer(context.files[self.file], context.models, context.embedder, context.options)


class OnnxEmbedderKind(ArtefactKind):
    """``embedder/onnx``: ``tokenizer.json`` + ``embedder.onnx`` (fp32), ``embedder.int8.onnx`` and/or
    ``embedder.int8-all.onnx`` (the manifest's ``embedder.files`` maps precision -> file) ->
    :class:`sdk.embedder.OnnxEmbedder`. The encoder can be opened by path (:meth:`path_files`);
    only the fp32 graph embeds a batch in one padded call (dynamically quantised ones run one text
    at a time, see :class:`~sdk.embedder.OnnxEmbedder`)."""

    family = "embedder"
    name = "onnx"

    def files(self, manifest: dict, precision: str) -> tuple[str, ...]:
        return (TOKENIZER_FILE, manifest["embedder"]["files"][precision])

    def path_files(self, manifest: dict, precision: str) -> tuple[str, ...]:
        return (manifest["embedder"]["files"][precision],)

    def check_manifest(self, manifest: dict) -> None:
        if TOKENIZER_FILE not in manifest["files"]:
            raise BundleError(f"manifest: {TOKENIZER_FILE} is not listed in files")

    def load(self, context: LoadContext) -> OnnxEmbedder:
        emb = context.embedder
        try:
            tokenizer_json = context.files[TOKENIZER_FILE].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BundleError(f"tokenizer.json is not UTF-8 ({exc})") from exc
        model_file = emb["files"][context.precision]
        model = context.paths.get(model_file) or context.files[model_file]
        return OnnxEmbedder(tokenizer_json, model, emb["dim"],
                            emb["max_tokens"], emb["truncation_side"], context.options,
                            batched=context.precision == "fp32")


BUILTIN_KINDS: tuple[ArtefactKind, ...] = (KMeansRouterKind(), MlpRouterKind(), OnnxEmbedderKind())
