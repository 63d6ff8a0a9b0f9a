"""Embedder kinds on the export side (family ``embedder`` of :mod:`export.kinds`).

An embedder export kind builds the bundle's embedder files and its manifest ``embedder`` entry
from the ``embedder`` entry the trainer wrote into ``router.json``, and checks a staged bundle's
embedder against the trainer's embeddings (:func:`export.parity.check_embedder`; a router's own
gate, :func:`export.parity.check_bundle`, measures the same cosine on the way to its decisions).

- ``onnx``: the sentence-transformer exported by optimum, fused (:mod:`export.embedder_fusion`) (+ int8 by
  onnxruntime), :mod:`export.embedder_onnx`;
- ``static``: the model2vec table (float16, + int8 with per-row scales, ``.npy``) and its tokenizer
  (a WordPiece one split in two files that load faster, :func:`split_wordpiece`; else ``tokenizer.json``),
  :mod:`sdk.static_embedder` (format) and :mod:`trainer.static_embedder` (the table the routers trained on).
"""

from __future__ import annotations

import abc
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from export import kinds, parity
from export.embedder_onnx import QUANTISED_PRECISIONS, ExportedEmbedder, export_embedder, quantize_precision
from export.errors import ExportError
from sdk import bundle_manifest as fmt
from sdk import kinds as sdk_kinds
from sdk.embedder import MAX_QUERY_CHARS
from sdk.errors import BundleError
from sdk.static_embedder import SPLIT_TOKENIZER_FILES, STATIC_TABLE_FILES, encode_table, load_split_tokenizer
from sdk.verified_file import VerifiedFile
from trainer.embedder_paths import default_cache_dir
from trainer.embeddings import EmbedderConfig, resolve_model_path
from trainer.static_embedder import model_digest

EMBEDDER_FAMILY = "embedder"


@dataclass(frozen=True)
class BundleEmbedder:
    """An embedder ready for a bundle.

    Attributes
    ----------
    files : {file name: bytes}, the embedder's bundle files.
    entry : dict, the manifest's ``embedder`` entry (``name``, ``dim``, ``max_tokens``,
        ``truncation_side``, ``pooling``, ``normalised``, ``files`` precision -> file name, and the
        kind's own fields).
    kind : str, the embedder kind's name.
    """

    files: dict[str, bytes]
    entry: dict
    kind: str = "onnx"

    @property
    def dim(self) -> int:
        return int(self.entry["dim"])


class EmbedderExportKind(kinds.ExportKind):
    """What an embedder kind supplies to ``export``: :meth:`build` the bundle's embedder."""

    family = EMBEDDER_FAMILY
    precisions: tuple[str, ...] = ()  # quantised precisions the kind can ship besides fp32

    @abc.abstractmethod
    def build(self, trained: dict, config: EmbedderConfig, scratch: Path, quantised: Sequence[str],
              cache_dir: Path | None, progress: Callable[[str], None] = print) -> BundleEmbedder:
        """The embedder of routers trained with ``trained`` (``router.json``'s ``embedder`` entry),
        shipped at ``fp32`` plus each precision in ``quantised`` (e.g. ``("int8",)``).

        Raises
        ------
        ExportError
            The embedder cannot be rebuilt as trained (e.g. a different static table), or the kind
            has no such quantised precision.
        """

    def files(self, artefact: BundleEmbedder) -> dict[str, bytes]:
        return dict(artefact.files)

    def manifest_fields(self, artefact: BundleEmbedder) -> dict:
        return {sdk_kinds.manifest_key(self.family): self.name}

    def parity(self, bundle_dir, public_key, artefact, reference, test, precisions, progress=print) -> dict:
        return parity.check_embedder(bundle_dir, public_key, reference, list(test.prompts), precisions, progress)


def onnx_embedder(exported: ExportedEmbedder, quantised: Mapping[str, Path] | Path | None, name: str,
                  max_tokens: int, truncation_side: str) -> BundleEmbedder:
    """The bundle embedder of an optimum export and its quantised variants (precision -> ONNX file;
    a single path means ``int8``).

    Raises
    ------
    ExportError
        A precision that is not one of :data:`export.embedder_onnx.QUANTISED_PRECISIONS`.
    """
    files = {fmt.TOKENIZER_FILE: exported.tokenizer.read_bytes(),
             fmt.EMBEDDER_FILES["fp32"]: exported.model.read_bytes()}
    precisions = {"fp32": fmt.EMBEDDER_FILES["fp32"]}
    if quantised is not None and not isinstance(quantised, Mapping):
        quantised = {"int8": quantised}
    for precision, path in (quantised or {}).items():
        if precision not in QUANTISED_PRECISIONS:
            raise ExportError(f"unknown quantised precision {precision!r}; known: {sorted(QUANTISED_PRECISIONS)}")
        files[fmt.EMBEDDER_FILES[precision]] = Path(path).read_bytes()
        precisions[precision] = fmt.EMBEDDER_FILES[precision]
    entry = {"name": name, "dim": exported.dim, "max_tokens": int(max_tokens), "truncation_side": truncation_side,
             "pooling": "mean", "normalised": True, "files": precisions}
    return BundleEmbedder(files, entry, "onnx")


def check_quantised(kind: EmbedderExportKind, quantised: Sequence[str]) -> None:
    """Refuse quantised precisions that ``kind`` does not ship (``kind.precisions``).

    Raises
    ------
    ExportError
        One of ``quantised`` is not in ``kind.precisions``.
    """
    unknown = [p for p in quantised if p not in kind.precisions]
    if unknown:
        raise ExportError(f"unknown precision(s) {unknown} for the {kind.name} embedder; fp32 is always shipped, "
                          f"and the quantised ones are {list(kind.precisions)}")


class OnnxEmbedderExportKind(EmbedderExportKind):
    """``embedder/onnx``: optimum's ONNX export of the sentence-transformer, fused by onnxruntime's
    transformer optimizer (:mod:`export.embedder_fusion`, every precision), + onnxruntime int8."""

    name = "onnx"

    precisions = tuple(QUANTISED_PRECISIONS)
    #: fuse the graph before quantising (issue 13: int8-all ``choose()`` 2-6% faster, same parity).
    fuse_graph = True

    def build(self, trained, config, scratch, quantised, cache_dir, progress=print):
        check_quantised(self, quantised)
        progress(f"exporting embedder {config.model} to ONNX with optimum (opset 17)")
        exported = export_embedder(resolve_model_path(config.model), Path(scratch) / "embedder", config.max_tokens,
                                   config.truncation_side, fuse=self.fuse_graph)
        if exported.fused_ops:
            progress("fused the encoder graph (onnxruntime transformer optimizer): "
                     + ", ".join(f"{n} {op}" for op, n in exported.fused_ops.items() if n))
        models = {}
        for precision in quantised:
            progress(f"quantising the embedder to {precision} (onnxruntime dynamic, per-channel int8 weights)")
            models[precision] = quantize_precision(exported.model, Path(scratch) / fmt.EMBEDDER_FILES[precision],
                                                   precision)
        return onnx_embedder(exported, models, config.model, config.max_tokens, config.truncation_side)

    def manifest_fields(self, artefact):
        return {}  # the default embedder kind: manifests stay as before embedder kinds existed


def split_wordpiece(tokenizer_json: str, scratch: Path) -> dict[str, bytes] | None:
    """The two files of a WordPiece tokenizer (:data:`sdk.static_embedder.SPLIT_TOKENIZER_FILES`):
    the pipeline JSON, whose WordPiece vocabulary keeps only the added tokens (and the unknown
    token), and the vocabulary as text, one token per line (line ``i`` = id ``i``), the
    ``vocab.txt`` format ``tokenizers.models.WordPiece.from_file`` reads.

    ``None`` (ship ``tokenizer.json`` as it is) when the model is not WordPiece, its ids are not
    0..n-1, a token would not survive a line (empty, a line break, trailing whitespace), or the
    tokenizer rebuilt from the two files, both ways the SDK reads them
    (:func:`sdk.static_embedder.load_split_tokenizer`: from a verified file by path and from bytes),
    does not serialise to exactly the original JSON. ``scratch``: a folder for the by-path check.
    """
    from tokenizers import Tokenizer  # native library, imported where a tokenizer is handled

    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    if model.get("type") != "WordPiece" or not isinstance(model.get("vocab"), dict):
        return None
    vocab = model["vocab"]
    ordered = sorted(vocab, key=vocab.get)
    if [vocab[t] for t in ordered] != list(range(len(ordered))):
        return None
    if any(not t or "\n" in t or "\r" in t or t != t.rstrip() for t in ordered):
        return None
    # the added tokens keep their ids (those beyond the vocabulary too: from the pipeline alone
    # tokenizers would renumber them after its smaller vocabulary), and the unknown token
    kept = {a["content"]: a["id"] for a in spec.get("added_tokens", [])}
    if any(vocab.get(t, i) != i for t, i in kept.items()):
        return None
    if model.get("unk_token") in vocab:
        kept[model["unk_token"]] = vocab[model["unk_token"]]
    pipeline = {**spec, "model": {**model, "vocab": dict(sorted(kept.items(), key=lambda kv: kv[1]))}}
    pipeline_json = json.dumps(pipeline, ensure_ascii=False)
    vocab_txt = "".join(t + "\n" for t in ordered).encode("utf-8")
    original = json.loads(Tokenizer.from_str(tokenizer_json).to_str())
    path = Path(scratch) / SPLIT_TOKENIZER_FILES["vocab"]
    path.write_bytes(vocab_txt)
    try:
        with VerifiedFile(path, hashlib.sha256(vocab_txt).hexdigest(), len(vocab_txt)) as opened:
            by_path = load_split_tokenizer(pipeline_json, opened)
        rebuilt = (by_path, load_split_tokenizer(pipeline_json, vocab_txt))
    except BundleError:
        return None
    if any(json.loads(r.to_str()) != original for r in rebuilt):
        return None
    return {SPLIT_TOKENIZER_FILES["pipeline"]: pipeline_json.encode("utf-8"), SPLIT_TOKENIZER_FILES["vocab"]: vocab_txt}


class StaticEmbedderExportKind(EmbedderExportKind):
    """``embedder/static``: the model2vec table the routers trained on (checked by its sha256),
    as ``static_table.f16.npy`` (+ ``static_table.int8.npy`` with ``int8``) and the tokenizer
    (``static_tokenizer.json`` + ``static_vocab.txt`` for WordPiece, :func:`split_wordpiece`; else
    ``tokenizer.json``)."""

    name = "static"

    precisions = ("int8",)

    def build(self, trained, config, scratch, quantised, cache_dir, progress=print):
        check_quantised(self, quantised)
        int8 = "int8" in quantised
        kind = config.kind
        model = kind.model(config.spec, cache_dir or default_cache_dir())
        digest = model_digest(model)
        if trained.get("table_sha256") != digest:
            raise ExportError(f"static table {digest[:16]}… of {config.model!r} is not the one the router trained on "
                              f"({str(trained.get('table_sha256'))[:16]}…); retrain or pass the model2vec folder used")
        progress(f"writing the static table of {config.model} ({model.stored_table.shape[0]} tokens x "
                 f"{model.stored_table.shape[1]}, float16{' + int8' if int8 else ''})")
        precisions = ("fp32", "int8") if int8 else ("fp32",)
        tokenizer_json = model.tokenizer.to_str()
        split = split_wordpiece(tokenizer_json, Path(scratch))
        files = dict(split) if split else {fmt.TOKENIZER_FILE: tokenizer_json.encode("utf-8")}
        for p in precisions:
            files[STATIC_TABLE_FILES[p]] = encode_table(model.stored_table, p)
        entry = {"name": config.model, "dim": int(model.stored_table.shape[1]), "max_tokens": MAX_QUERY_CHARS,
                 "truncation_side": "left", "pooling": "mean", "normalised": True,
                 "files": {p: STATIC_TABLE_FILES[p] for p in precisions}, "table_sha256": digest}
        if split:
            entry["tokenizer_files"] = dict(SPLIT_TOKENIZER_FILES)
        return BundleEmbedder(files, entry, self.name)


for _kind in (OnnxEmbedderExportKind(), StaticEmbedderExportKind()):
    kinds.register(_kind)
