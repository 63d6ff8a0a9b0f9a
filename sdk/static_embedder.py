"""Static (model2vec) sentence embeddings on the device: Hugging Face ``tokenizers`` + a numpy table.

A static embedder (model2vec, Tulkens & van Dongen 2024, "Model2Vec: distill a small fast model
from any sentence transformer") holds one vector per vocabulary token, distilled from a
sentence-transformer: every token is embedded alone by the transformer, the vectors are reduced
by PCA and weighted by SIF (Arora et al. 2017, sec. 3; model2vec folds the weights into the
vectors). A text's embedding is the **mean of its tokens' vectors, L2-normalised**. This module
computes it exactly as ``model2vec.StaticModel.encode`` does (model2vec 0.9, ``_encode_batch``):

1. tokenise with the model's ``tokenizer.json``, **no special tokens**, no padding, no truncation;
2. drop the unknown token (``[UNK]``) ids; a text made **only** of unknown tokens (e.g. only emoji,
   which the MiniLM vocabulary lacks: ``"🙂🙂"``) keeps one, so its embedding is the ``[UNK]`` row,
   normalised (model2vec returns the zero vector, which has no direction to route by; the ONNX
   embedder embeds such a text as ``[UNK]`` tokens, and the trainer,
   ``trainer.static_embedder.encode_static``, does the same as here);
3. mean of the table rows of the remaining ids (float32 arithmetic on the float16 values here and in
   the trainer, which widens model2vec's table the same way, ``trainer.static_embedder``);
4. divide by ``norm + 1e-32``.

What text is read: the **whole query**, up to its last :data:`~sdk.embedder.MAX_QUERY_CHARS`
(65,536) characters; the trainer (``trainer.static_embedder``) applies the same cap before
``StaticModel.encode(max_length=None)``. A token spans at least one character, so the manifest's
``max_tokens`` for this kind is that character cap (an upper bound, not a truncation in tokens).

Table files (numpy ``.npy``, no pickles), read in place from the verified bytes (``np.frombuffer``:
no zip, no CRC, no copy): ``static_table.f16.npy`` holds the (vocab, dim) float16 table as
model2vec distils it; ``static_table.int8.npy`` holds (vocab,) records ``(scale float32, q (dim,)
int8)`` (:func:`int8_record`), row ``i`` being ``q[i] * scale[i]`` (symmetric per-row quantisation,
:func:`quantize_rows`). The manifest's ``embedder.files`` maps the SDK precision ``"fp32"`` (the
unquantised table: stored float16, computed in float32) and ``"int8"`` to them. Bundles exported
before this format carry ``.npz`` tables (``vectors`` float16, or ``vectors`` int8 + ``scales``
float32); :func:`decode_table` still reads them.

Tokenizer: ``tokenizer.json`` (Hugging Face ``tokenizers``), or, for a WordPiece tokenizer, the
same tokenizer in two files that load faster (the manifest's ``embedder.tokenizer_files``,
:data:`SPLIT_TOKENIZER_FILES`): ``static_tokenizer.json``, the tokenizer JSON whose WordPiece
vocabulary holds only the added tokens (normaliser, pre-tokeniser, added tokens, WordPiece
settings), and ``static_vocab.txt``, the WordPiece vocabulary (line ``i`` = token id ``i``), read by
``tokenizers``' own ``WordPiece.from_file``: 38% fewer instructions than parsing the whole JSON,
whose vocabulary ``tokenizers`` deserialises through three intermediate maps (callgrind, the
29,525-token MiniLM vocabulary). The export writes the split only when the tokenizer rebuilt from
the two files serialises to exactly the original JSON (:func:`split_wordpiece`).
"""

from __future__ import annotations

import io
import math
import zipfile
from typing import Sequence

import numpy as np
from numpy.lib import format as npy_format

from sdk.artefact_kind import ArtefactKind, LoadContext
from sdk.builtin_kinds import TOKENIZER_FILE
from sdk.embedder import MAX_QUERY_CHARS, check_unknown_token, load_tokenizer
from sdk.errors import BundleError, InvalidInputError, InvalidQueryError
from sdk.verified_file import VerifiedFile

#: Bundle file of each table precision (the manifest's ``embedder.files``).
STATIC_TABLE_FILES = {"fp32": "static_table.f16.npy", "int8": "static_table.int8.npy"}
#: The WordPiece tokenizer in two files (the manifest's ``embedder.tokenizer_files``; see the module docstring).
SPLIT_TOKENIZER_FILES = {"pipeline": "static_tokenizer.json", "vocab": "static_vocab.txt"}
#: First bytes of a ``.npy`` file (numpy format spec, ``numpy.lib.format``).
NPY_MAGIC = b"\x93NUMPY"
#: model2vec's normalisation guard: ``x / (||x|| + 1e-32)``.
NORM_EPS = 1e-32


def quantize_rows(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row int8 quantisation of a table.

    Parameters
    ----------
    vectors : (vocab, dim) float array, finite.

    Returns
    -------
    (q, scales): q (vocab, dim) int8 in [-127, 127], scales (vocab,) float32 = max |row| / 127
    (1 for an all-zero row), so that ``q * scales[:, None]`` approximates ``vectors`` within
    ``scales / 2`` per entry.

    Raises
    ------
    InvalidInputError
        ``vectors`` is not 2-D or holds NaN/inf.
    """
    v = np.asarray(vectors, dtype=np.float32)
    if v.ndim != 2 or not np.isfinite(v).all():
        raise InvalidInputError(f"vectors must be a finite 2-D array, got shape {v.shape}")
    scales = np.abs(v).max(axis=1) / 127.0
    scales = np.where(scales > 0, scales, 1.0).astype(np.float32)
    q = np.clip(np.rint(v / scales[:, None]), -127, 127).astype(np.int8)
    return q, scales


def int8_record(dim: int) -> np.dtype:
    """The record of an int8 table row: ``scale`` float32 (little-endian) then ``q`` (dim,) int8."""
    return np.dtype([("scale", "<f4"), ("q", "i1", (int(dim),))])


def encode_table(vectors: np.ndarray, precision: str) -> bytes:
    """The bytes of a table file (``.npy``): precision ``"fp32"``, the (vocab, dim) float16 table;
    ``"int8"``, (vocab,) :func:`int8_record` records (:func:`quantize_rows`).

    Raises
    ------
    InvalidInputError
        Unknown precision or a non-finite / non-2-D table.
    """
    if precision not in STATIC_TABLE_FILES:
        raise InvalidInputError(f"precision must be one of {sorted(STATIC_TABLE_FILES)}, got {precision!r}")
    v = np.asarray(vectors)
    if v.ndim != 2 or not np.isfinite(v.astype(np.float32)).all():
        raise InvalidInputError(f"vectors must be a finite 2-D array, got shape {v.shape}")
    buf = io.BytesIO()
    if precision == "fp32":
        np.save(buf, v.astype("<f2"), allow_pickle=False)
    else:
        q, scales = quantize_rows(v)
        rows = np.empty(q.shape[0], dtype=int8_record(q.shape[1]))
        rows["scale"], rows["q"] = scales, q
        np.save(buf, rows, allow_pickle=False)
    return buf.getvalue()


def decode_table(data: bytes, dim: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Read a table file: ``(vectors, scales)``, vectors (vocab, dim) float16 or int8 (then
    scales (vocab,) float32, finite and > 0), else scales None. A ``.npy`` table is read in place:
    the arrays are read-only views of ``data`` (no copy). A ``.npz`` (bundles exported before the
    ``.npy`` tables) is read with ``np.load``.

    Raises
    ------
    BundleError
        Neither a ``.npy`` nor an ``.npz`` (or one needing pickles), a size other than its header
        declares, missing or extra arrays, wrong dtype or shape, a dimension other than ``dim``,
        non-finite values.
    """
    vectors, scales = _npy_table(data, dim) if data[:len(NPY_MAGIC)] == NPY_MAGIC else _npz_table(data)
    if vectors.ndim != 2 or vectors.shape[0] < 1:
        raise BundleError("static table: 'vectors' must be a non-empty 2-D array")
    if vectors.shape[1] != dim:
        raise BundleError(f"static table has dimension {vectors.shape[1]}, the manifest declares {dim}")
    if vectors.dtype == np.float16 and scales is None:
        if not np.isfinite(vectors).all():
            raise BundleError("static table: vectors hold NaN or inf")
        return vectors, None
    if vectors.dtype == np.int8 and scales is not None:
        if scales.dtype != np.float32 or scales.shape != (vectors.shape[0],):
            raise BundleError(f"static table: scales must be ({vectors.shape[0]},) float32, "
                              f"got {scales.shape} {scales.dtype}")
        if not (np.isfinite(scales).all() and (scales > 0).all()):
            raise BundleError("static table: scales must be finite and > 0")
        return vectors, scales
    raise BundleError(f"static table: expected float16 vectors or int8 vectors + float32 scales, got "
                      f"{vectors.dtype} vectors{'' if scales is None else ' + ' + str(scales.dtype) + ' scales'}")


def _npy_table(data: bytes, dim: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(vectors, scales or None) viewed in place from a ``.npy`` table (header read by numpy's own
    ``numpy.lib.format``)."""
    stream = io.BytesIO(data)
    try:
        version = npy_format.read_magic(stream)
        if version == (1, 0):
            shape, fortran_order, dtype = npy_format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran_order, dtype = npy_format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"format version {version} is not 1.0 or 2.0")
    except Exception as exc:  # a malformed header: ValueError, EOFError, SyntaxError or tokenize.TokenError
        raise BundleError(f"static table is not a readable .npy ({type(exc).__name__}: {exc})") from exc
    if fortran_order or dtype.hasobject:
        raise BundleError("static table: a C-order array without objects is expected")
    if any(n < 0 for n in shape):
        raise BundleError(f"static table: its header declares a negative shape {shape}")
    count = math.prod(shape)  # Python ints: a huge declared shape cannot wrap around to a small count
    if len(data) - stream.tell() != count * dtype.itemsize:
        raise BundleError(f"static table holds {len(data) - stream.tell()} data bytes, its header declares "
                          f"{count * dtype.itemsize}")
    array = np.frombuffer(data, dtype=dtype, count=count, offset=stream.tell()).reshape(shape)
    if dtype.names is None:
        return array, None
    if dtype.names != ("scale", "q") or array.ndim != 1:
        raise BundleError(f"static table: expected a 2-D float16 array or 1-D (scale, q) records, got {dtype} {shape}")
    q_dim = dtype["q"].shape
    if dtype != int8_record(q_dim[0] if len(q_dim) == 1 else dim):
        raise BundleError(f"static table: records must be {int8_record(dim)}, got {dtype}")
    return array["q"], array["scale"]


def _npz_table(data: bytes) -> tuple[np.ndarray, np.ndarray | None]:
    """(vectors, scales or None) from an ``.npz`` table (bundles exported before the ``.npy`` tables)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise BundleError(f"static table is not a readable .npy or .npz ({type(exc).__name__}: {exc})") from exc
    if set(arrays) not in ({"vectors"}, {"vectors", "scales"}):
        raise BundleError(f"static table: expected arrays 'vectors' (+ 'scales' for int8), got {sorted(arrays)}")
    vectors = arrays["vectors"]
    if vectors.dtype == np.int8 and "scales" not in arrays:
        raise BundleError("static table: int8 vectors need float32 'scales'")
    return vectors, arrays.get("scales")


def vocab_size(tokenizer) -> int:
    """Token ids a ``tokenizers.Tokenizer`` can emit, added tokens included: the value of
    ``get_vocab_size(with_added_tokens=True)`` without that call's cost (it copies the whole
    vocabulary into a dict: 28 ms for the 29,525-token MiniLM table at load ~8 on 2 cores): the
    model's vocabulary plus the added tokens whose ids lie beyond it (an added token with a smaller
    id is one of the model's tokens, e.g. ``[PAD]``)."""
    n = tokenizer.get_vocab_size(with_added_tokens=False)
    return n + sum(1 for i in tokenizer.get_added_tokens_decoder() if i >= n)


def load_split_tokenizer(pipeline_json: str, vocab: VerifiedFile | bytes):
    """A WordPiece ``tokenizers.Tokenizer`` from its two files (:data:`SPLIT_TOKENIZER_FILES`): the
    pipeline JSON (its WordPiece vocabulary holds only the added tokens) and the vocabulary, one
    token per line, line ``i`` being id ``i``.

    ``vocab`` opened by path (a :class:`~sdk.verified_file.VerifiedFile`, as ``Router.load`` opens
    it) is read by ``tokenizers.models.WordPiece.from_file`` from the verified descriptor's path;
    as bytes (a caller that read every file into memory), the same lines are passed to
    ``WordPiece(vocab)`` (the export writes only tokens that a line holds unchanged: no line
    breaks, no trailing whitespace).

    Raises
    ------
    BundleError
        The pipeline is not a tokenizer JSON with a WordPiece model, the vocabulary cannot be read
        or lacks the unknown token, the file changed after it was verified, or an added token's id
        differs from its id in the vocabulary.
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
            vocab.check_unchanged()
        else:
            lines = vocab.decode("utf-8").split("\n")
            if lines and lines[-1] == "":
                lines.pop()
            tokenizer.model = WordPiece({token: i for i, token in enumerate(lines)}, **options)
    except BundleError:
        raise
    except Exception as exc:  # tokenizers raises a bare Exception on an unreadable file
        raise BundleError(f"{name} cannot be loaded ({exc})") from exc
    check_unknown_token(tokenizer, name)
    n = tokenizer.get_vocab_size(with_added_tokens=False)
    for token_id, added in tokenizer.get_added_tokens_decoder().items():
        if token_id < n and tokenizer.model.token_to_id(added.content) != token_id:
            raise BundleError(f"{name}: added token {added.content!r} has id {token_id} in the pipeline, "
                              f"{tokenizer.model.token_to_id(added.content)} in the vocabulary")
    return tokenizer


class StaticEmbedder:
    """Query -> L2-normalised mean of its tokens' static vectors, shape (n_queries, dim) float32.

    Parameters
    ----------
    tokenizer : the model's ``tokenizer.json`` text, or a ``tokenizers.Tokenizer`` already built
        (:func:`load_split_tokenizer`); its padding and truncation are turned off.
    table : bytes of a table file (see module docstring); a ``.npy`` table is used in place (the
        bytes stay referenced, not copied).
    dim : int, the embedding dimension the manifest declares.

    Raises
    ------
    BundleError
        The tokenizer or table cannot be loaded, or the table's rows do not match the tokenizer's
        vocabulary size, or its dimension is not ``dim``.

    Thread safety: :meth:`embed` may run from several threads at once (nothing changes after
    construction).
    """

    def __init__(self, tokenizer, table: bytes, dim: int) -> None:
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

    def _ids(self, texts: Sequence[str], first_position: int = 0) -> list[np.ndarray]:
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
            # The row count was checked against the tokenizer's vocabulary size at load, but a
            # vocabulary whose ids skip numbers can still name a row beyond the table.
            if ids.max() >= self._vectors.shape[0]:
                raise BundleError(f"the tokenizer gave token id {int(ids.max())}, beyond the static table's "
                                  f"{self._vectors.shape[0]} rows (tokenizer and table do not belong together)")
            out.append(ids)
        return out

    def n_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens read per text (unknown tokens dropped, no special tokens; 1 for a text of unknown
        tokens only, embedded as ``[UNK]``).

        Raises
        ------
        InvalidQueryError, BundleError
            As :meth:`embed`.
        """
        return [int(ids.size) for ids in self._ids(list(texts))]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embeddings of already validated, non-blank ``texts``: (n, dim) float32, unit L2 norm.

        Raises
        ------
        InvalidQueryError
            A text that gives no token at all (only whitespace or control characters). A text of
            unknown tokens only (e.g. emoji) is not refused: it is embedded as the ``[UNK]`` row.
        BundleError
            The tokenizer gave a token id beyond the table's rows (a tokenizer whose ids skip
            numbers, shipped with a table of another vocabulary).
        """
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
    """``embedder/static``: the tokenizer (``tokenizer.json``, or the two files of the manifest's
    ``embedder.tokenizer_files``) + ``static_table.f16.npy`` and/or ``static_table.int8.npy`` (the
    manifest's ``embedder.files`` maps precision -> file; ``.npz`` in bundles exported before) ->
    :class:`StaticEmbedder`. A split tokenizer's vocabulary is opened by path (:meth:`path_files`)."""

    family = "embedder"
    name = "static"

    def files(self, manifest: dict, precision: str) -> tuple[str, ...]:
        split = manifest["embedder"].get("tokenizer_files")
        tokenizer = (split["pipeline"], split["vocab"]) if split else (TOKENIZER_FILE,)
        return (*tokenizer, manifest["embedder"]["files"][precision])

    def path_files(self, manifest: dict, precision: str) -> tuple[str, ...]:
        split = manifest["embedder"].get("tokenizer_files")
        return (split["vocab"],) if split else ()

    def check_manifest(self, manifest: dict) -> None:
        split = manifest["embedder"].get("tokenizer_files")
        if split is None:
            if TOKENIZER_FILE not in manifest["files"]:
                raise BundleError(f"manifest: {TOKENIZER_FILE} is not listed in files")
        elif not (isinstance(split, dict) and set(split) == set(SPLIT_TOKENIZER_FILES)
                  and all(isinstance(n, str) and n in manifest["files"] for n in split.values())):
            raise BundleError(f"manifest: embedder.tokenizer_files must map {sorted(SPLIT_TOKENIZER_FILES)} to "
                              f"files listed in files, got {split!r}")
        for precision in manifest["embedder"]["files"]:
            if precision not in STATIC_TABLE_FILES:
                raise BundleError(f"manifest: static embedder precision {precision!r} is not one of "
                                  f"{sorted(STATIC_TABLE_FILES)}")

    def load(self, context: LoadContext) -> StaticEmbedder:
        emb = context.embedder
        split = emb.get("tokenizer_files")
        name = split["pipeline"] if split else TOKENIZER_FILE
        try:
            tokenizer_json = context.files[name].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BundleError(f"{name} is not UTF-8 ({exc})") from exc
        if split:
            vocab = context.paths.get(split["vocab"]) or context.files[split["vocab"]]
            tokenizer = load_split_tokenizer(tokenizer_json, vocab)
        else:
            tokenizer = load_tokenizer(tokenizer_json)
        return StaticEmbedder(tokenizer, context.files[emb["files"][context.precision]], emb["dim"])
