"""Static (model2vec) sentence embeddings on the device: Hugging Face ``tokenizers`` + a numpy table.

A static embedder (Tulkens & van Dongen 2024, "Model2Vec") holds one PCA-reduced, SIF-weighted vector per
vocabulary token (Arora et al. 2017, sec. 3). A text's embedding is computed as ``model2vec.StaticModel.encode``
does (model2vec 0.9, ``_encode_batch``): tokenise the last :data:`~sdk.embedder.MAX_QUERY_CHARS` characters with
no special tokens, padding or truncation; drop ``[UNK]`` ids (a text of unknown tokens only keeps one: the
``[UNK]`` row, where model2vec gives the zero vector); mean of the rows in float32; divide by ``norm + 1e-32``.
Table files (``.npy``, read in place) and the split WordPiece tokenizer: docs/static_embedder.md.
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from numpy.lib import format as npy_format

from sdk.artefact_kind import ArtefactKind, LoadContext, utf8_file
from sdk.bundle_manifest import TOKENIZER_FILE, need
from sdk.embedder import MAX_QUERY_CHARS, check_unknown_token, load_tokenizer
from sdk.errors import BundleError, InvalidQueryError
from sdk.verified_file import VerifiedFile

if TYPE_CHECKING:
    from tokenizers import Tokenizer

#: Bundle file of each table precision (the manifest's ``embedder.files``).
STATIC_TABLE_FILES = {"fp32": "static_table.f16.npy", "int8": "static_table.int8.npy"}
#: The WordPiece tokenizer in two files (the manifest's ``embedder.tokenizer_files``; see the module docstring).
SPLIT_TOKENIZER_FILES = {"pipeline": "static_tokenizer.json", "vocab": "static_vocab.txt"}
#: First bytes of a ``.npy`` file (numpy format spec, ``numpy.lib.format``).
NPY_MAGIC = b"\x93NUMPY"
#: model2vec's normalisation guard: ``x / (||x|| + 1e-32)``.
NORM_EPS = 1e-32


def quantize_rows(vectors: npt.ArrayLike) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
    """Symmetric per-row int8 quantisation of a finite (vocab, dim) table: ``(q, scales)``, q (vocab, dim) int8 in
    [-127, 127], scales (vocab,) float32 = max |row| / 127 (1 for a zero row); ``q * scales[:, None]`` is within
    ``scales / 2`` of ``vectors``. Inputs validated by the caller (the exporter)."""
    v = np.asarray(vectors, dtype=np.float32)
    scales = np.abs(v).max(axis=1) / 127.0
    scales = np.where(scales > 0, scales, 1.0).astype(np.float32)
    q = np.clip(np.rint(v / scales[:, None]), -127, 127).astype(np.int8)
    return q, scales


def int8_record(dim: int) -> np.dtype[np.void]:
    """The record of an int8 table row: ``scale`` float32 (little-endian) then ``q`` (dim,) int8."""
    return np.dtype([("scale", "<f4"), ("q", "i1", (int(dim),))])


def encode_table(vectors: npt.ArrayLike, precision: str) -> bytes:
    """The bytes of a table file (``.npy``): ``"fp32"``, the (vocab, dim) float16 table; ``"int8"``, (vocab,)
    :func:`int8_record` records (:func:`quantize_rows`). Inputs validated by the caller (the exporter)."""
    v = np.asarray(vectors)
    buf = io.BytesIO()
    if precision == "fp32":
        np.save(buf, v.astype("<f2"), allow_pickle=False)
    else:
        q, scales = quantize_rows(v)
        rows = np.empty(q.shape[0], dtype=int8_record(q.shape[1]))
        rows["scale"], rows["q"] = scales, q
        np.save(buf, rows, allow_pickle=False)
    return buf.getvalue()


def _table_rule(cond: object, what: str) -> None:
    if not cond:
        raise BundleError(f"static table: {what}")


def decode_table(data: bytes, dim: int) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32] | None]:
    """A table file as ``(vectors, scales)``: vectors (vocab, dim) float16, scales None; or int8 vectors and (vocab,)
    float32 scales, finite and > 0. A ``.npy`` is viewed in place (read-only, no copy); an ``.npz`` (older bundles)
    is read with ``np.load``. Raises BundleError for any other content, shape, dtype or ``dim``."""
    vectors, scales = _npy_table(data, dim) if data[:len(NPY_MAGIC)] == NPY_MAGIC else _npz_table(data)
    _table_rule(vectors.ndim == 2 and vectors.shape[0] >= 1, "'vectors' must be a non-empty 2-D array")
    _table_rule(vectors.shape[1] == dim, f"dimension {vectors.shape[1]}, the manifest declares {dim}")
    kind = (vectors.dtype.str, None if scales is None else (scales.dtype.str, scales.shape))
    _table_rule(kind in (("<f2", None), ("|i1", ("<f4", (vectors.shape[0],)))),
                f"expected float16 vectors or int8 vectors + ({vectors.shape[0]},) float32 scales, got {vectors.dtype} "
                f"vectors{'' if scales is None else f' + {scales.shape} {scales.dtype} scales'}")
    _table_rule(np.isfinite(vectors if scales is None else scales).all(), "vectors or scales hold NaN or inf")
    _table_rule(scales is None or (scales > 0).all(), "scales must be finite and > 0")
    return vectors, scales


def _npy_table(data: bytes, dim: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any] | None]:
    """(vectors, scales or None) viewed in place from a ``.npy`` table (header read by ``numpy.lib.format``)."""
    stream = io.BytesIO(data)
    try:
        version = npy_format.read_magic(stream)
        read_header = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}[version]
        shape, fortran_order, dtype = read_header(stream)
    except Exception as exc:  # a malformed header: KeyError, ValueError, EOFError, SyntaxError, tokenize.TokenError
        raise BundleError(f"static table is not a readable .npy ({type(exc).__name__}: {exc})") from exc
    _table_rule(not fortran_order and not dtype.hasobject, "a C-order array without objects is expected")
    _table_rule(all(n >= 0 for n in shape), f"its header declares a negative shape {shape}")
    count = math.prod(shape)  # Python ints: a huge declared shape cannot wrap around to a small count
    _table_rule(len(data) - stream.tell() == count * dtype.itemsize,
                f"holds {len(data) - stream.tell()} data bytes, its header declares {count * dtype.itemsize}")
    array = np.frombuffer(data, dtype=dtype, count=count, offset=stream.tell()).reshape(shape)
    if dtype.names is None:
        return array, None
    q_dim = dtype["q"].shape if "q" in dtype.names else ()
    _table_rule(array.ndim == 1 and dtype == int8_record(q_dim[0] if len(q_dim) == 1 else dim),
                f"expected a 2-D float16 array or 1-D (scale, q) records {int8_record(dim)}, got {dtype} {shape}")
    return array["q"], array["scale"]


def _npz_table(data: bytes) -> tuple[npt.NDArray[Any], npt.NDArray[Any] | None]:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise BundleError(f"static table is not a readable .npy or .npz ({type(exc).__name__}: {exc})") from exc
    _table_rule(set(arrays) in ({"vectors"}, {"vectors", "scales"}),
                f"expected arrays 'vectors' (+ 'scales' for int8), got {sorted(arrays)}")
    return arrays["vectors"], arrays.get("scales")


def vocab_size(tokenizer: Tokenizer) -> int:
    """``get_vocab_size(with_added_tokens=True)`` without its copy of the vocabulary (28 ms for MiniLM's): the
    model's tokens plus the added tokens with ids beyond them."""
    n: int = tokenizer.get_vocab_size(with_added_tokens=False)
    return n + sum(1 for i in tokenizer.get_added_tokens_decoder() if i >= n)


def load_split_tokenizer(pipeline_json: str, vocab: VerifiedFile | bytes) -> Tokenizer:
    """A WordPiece ``tokenizers.Tokenizer`` from its two files (:data:`SPLIT_TOKENIZER_FILES`): the pipeline JSON
    and the vocabulary (line ``i`` = id ``i``), read by ``WordPiece.from_file`` from a verified open file's path,
    or from bytes.

    Raises
    ------
    BundleError
        The pipeline's model is not WordPiece, the vocabulary cannot be read or lacks the unknown token, the file
        changed after it was verified, or an added token's id differs in the vocabulary.
    """
    from tokenizers.models import WordPiece  # native library: loaded with the first bundle, not by `import sdk`

    name = SPLIT_TOKENIZER_FILES["vocab"]
    tokenizer = load_tokenizer(pipeline_json, SPLIT_TOKENIZER_FILES["pipeline"])
    settings = tokenizer.model
    if not isinstance(settings, WordPiece):
        raise BundleError(f"{SPLIT_TOKENIZER_FILES['pipeline']}: the model must be WordPiece, got "
                          f"{type(settings).__name__}")
    options = {"unk_token": settings.unk_token, "continuing_subword_prefix": settings.continuing_subword_prefix,
               "max_input_chars_per_word": settings.max_input_chars_per_word}
    try:
        if isinstance(vocab, VerifiedFile):
            tokenizer.model = WordPiece.from_file(vocab.library_path, **options)
        else:
            lines = vocab.decode("utf-8").split("\n")
            if lines and lines[-1] == "":
                lines.pop()
            tokenizer.model = WordPiece({token: i for i, token in enumerate(lines)}, **options)
    except Exception as exc:  # tokenizers raises a bare Exception on an unreadable file
        raise BundleError(f"{name} cannot be loaded ({exc})") from exc
    if isinstance(vocab, VerifiedFile):
        vocab.check_unchanged()
    check_unknown_token(tokenizer, name)
    n = tokenizer.get_vocab_size(with_added_tokens=False)
    for token_id, added in tokenizer.get_added_tokens_decoder().items():
        if token_id < n and tokenizer.model.token_to_id(added.content) != token_id:
            raise BundleError(f"{name}: added token {added.content!r} has id {token_id} in the pipeline, "
                              f"{tokenizer.model.token_to_id(added.content)} in the vocabulary")
    return tokenizer


class StaticEmbedder:
    """Query -> L2-normalised mean of its tokens' static vectors, (n_queries, dim) float32; thread-safe.

    ``tokenizer``: ``tokenizer.json`` text or a built ``tokenizers.Tokenizer``; ``table``: a table file's bytes
    (:func:`decode_table`; a ``.npy`` is used in place).

    Raises
    ------
    BundleError
        The tokenizer or table does not load, or the table's rows or dimension do not match the tokenizer or ``dim``.
    """

    def __init__(self, tokenizer: str | Tokenizer, table: bytes, dim: int) -> None:
        if isinstance(tokenizer, str):
            tokenizer = load_tokenizer(tokenizer)
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tokenizer = tokenizer
        # The same ids without the character offsets the table lookup never reads: 0.61 against 0.74 ms
        # for a median 2,000-character RouterBench prompt (tokenizers 0.22; the method is newer than
        # the oldest tokenizers the SDK accepts, hence the fallback).
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        vectors, self._scales = decode_table(table, int(dim))
        # float16 arithmetic is slow in numpy (no hardware half floats): the float16 table is widened
        # to float32 once (2x its file size in memory; 0.3 -> 0.06 ms per 500-token query); int8 stays
        # int8 (its rows are widened per query).
        self._vectors = vectors.astype(np.float32) if self._scales is None else vectors
        vocab = vocab_size(tokenizer)
        if self._vectors.shape[0] != vocab:
            raise BundleError(f"static table has {self._vectors.shape[0]} rows, the tokenizer {vocab} tokens")
        unk = getattr(tokenizer.model, "unk_token", None)
        self._unk_id = tokenizer.token_to_id(unk) if unk else None
        self.dim = int(dim)
        self.max_tokens = MAX_QUERY_CHARS

    def _ids(self, texts: Sequence[str], first_position: int = 0) -> list[npt.NDArray[np.int64]]:
        encodings = self._encode_batch([t[-MAX_QUERY_CHARS:] for t in texts], add_special_tokens=False)
        out = []
        for i, enc in enumerate(encodings):
            ids = np.asarray(enc.ids, dtype=np.int64)
            if self._unk_id is not None:
                known = ids[ids != self._unk_id]
                # Only unknown tokens (e.g. "🙂🙂"): the unknown token's own row, as the ONNX embedder
                # embeds [UNK] (module docstring, step 2).
                ids = known if known.size or not ids.size else ids[:1]
            if ids.size == 0:
                raise InvalidQueryError(  # the ONNX embedder's message (sdk.embedder)
                    f"query at position {first_position + i} has no token the embedder can read in its last "
                    f"{MAX_QUERY_CHARS} characters (only whitespace, control or zero-width characters?)")
            if ids.max() >= self._vectors.shape[0]:
                raise BundleError(f"the tokenizer gave token id {int(ids.max())}, beyond the static table's "
                                  f"{self._vectors.shape[0]} rows (tokenizer and table do not belong together)")
            out.append(ids)
        return out

    def n_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens read per text (unknown tokens dropped; 1 for a text of unknown tokens only). Raises as :meth:`embed`."""
        return [int(ids.size) for ids in self._ids(list(texts))]

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Embeddings of validated ``texts``: (n, dim) float32, unit L2 norm. Raises InvalidQueryError for a text
        with no token at all, BundleError for a token id beyond the table's rows."""
        rows = []
        for ids in self._ids(list(texts)):
            if self._scales is None:
                rows.append(self._vectors[ids].mean(axis=0))
            else:  # mean of scale_i * q_i as one (n,) @ (n, dim) product: no (n, dim) float temporary scaled
                rows.append(self._scales[ids] @ self._vectors[ids].astype(np.float32) / np.float32(ids.size))
        out = np.stack(rows).astype(np.float32)
        out /= np.linalg.norm(out, axis=1, keepdims=True) + np.float32(NORM_EPS)
        return out


class StaticEmbedderKind(ArtefactKind):
    """``embedder/static``: ``tokenizer.json`` (or the split files of ``embedder.tokenizer_files``, the vocabulary
    opened by path) + the table of each precision (``embedder.files``) -> :class:`StaticEmbedder`."""

    family = "embedder"
    name = "static"

    def precisions(self, manifest: dict[str, Any]) -> tuple[str, ...]:
        return tuple(manifest["embedder"]["files"])

    def files(self, manifest: dict[str, Any], precision: str) -> tuple[str, ...]:
        split = manifest["embedder"].get("tokenizer_files")
        tokenizer = (split["pipeline"], split["vocab"]) if split else (TOKENIZER_FILE,)
        return (*tokenizer, manifest["embedder"]["files"][precision])

    def path_files(self, manifest: dict[str, Any], precision: str) -> tuple[str, ...]:
        split = manifest["embedder"].get("tokenizer_files")
        return (split["vocab"],) if split else ()

    def check_manifest(self, manifest: dict[str, Any]) -> None:
        split = manifest["embedder"].get("tokenizer_files")
        need(TOKENIZER_FILE in manifest["files"] if split is None else
             isinstance(split, dict) and set(split) == set(SPLIT_TOKENIZER_FILES)
             and all(isinstance(n, str) and n in manifest["files"] for n in split.values()),
             f"embedder.tokenizer_files must map {sorted(SPLIT_TOKENIZER_FILES)} to files listed in files, got "
             f"{split!r}" if split is not None else f"{TOKENIZER_FILE} is not listed in files")
        for precision in manifest["embedder"]["files"]:
            need(precision in STATIC_TABLE_FILES,
                 f"static embedder precision {precision!r} is not one of {sorted(STATIC_TABLE_FILES)}")

    def load(self, context: LoadContext) -> StaticEmbedder:
        emb = context.embedder
        split = emb.get("tokenizer_files")
        tokenizer_json = utf8_file(context, split["pipeline"] if split else TOKENIZER_FILE)
        if split:
            vocab = context.paths.get(split["vocab"]) or context.files[split["vocab"]]
            tokenizer = load_split_tokenizer(tokenizer_json, vocab)
        else:
            tokenizer = load_tokenizer(tokenizer_json)
        return StaticEmbedder(tokenizer, context.files[emb["files"][context.precision]], emb["dim"])
