"""Static (model2vec) sentence embeddings on the device: Hugging Face ``tokenizers`` + a numpy table.

A static embedder (model2vec, Tulkens & van Dongen 2024, "Model2Vec: distill a small fast model
from any sentence transformer") holds one vector per vocabulary token, distilled from a
sentence-transformer: every token is embedded alone by the transformer, the vectors are reduced
by PCA and weighted by SIF (Arora et al. 2017, sec. 3; model2vec folds the weights into the
vectors). A text's embedding is the **mean of its tokens' vectors, L2-normalised**. This module
computes it exactly as ``model2vec.StaticModel.encode`` does (model2vec 0.9, ``_encode_batch``):

1. tokenise with the model's ``tokenizer.json``, **no special tokens**, no padding, no truncation;
2. drop the unknown token (``[UNK]``) ids;
3. mean of the table rows of the remaining ids (float32 arithmetic on the float16 values here and in
   the trainer, which widens model2vec's table the same way, ``trainer.static_embedder``);
4. divide by ``norm + 1e-32``.

What text is read: the **whole query**, up to its last :data:`~sdk.embedder.MAX_QUERY_CHARS`
(65,536) characters; the trainer (``trainer.static_embedder``) applies the same cap before
``StaticModel.encode(max_length=None)``. A token spans at least one character, so the manifest's
``max_tokens`` for this kind is that character cap (an upper bound, not a truncation in tokens).

Table files (``.npz``, no pickles): ``static_table.f16.npz`` holds ``vectors`` (vocab, dim)
float16 as model2vec distils it; ``static_table.int8.npz`` holds ``vectors`` (vocab, dim) int8
and ``scales`` (vocab,) float32, row ``i`` being ``vectors[i] * scales[i]`` (symmetric per-row
quantisation, :func:`quantize_rows`). The manifest's ``embedder.files`` maps the SDK precision
``"fp32"`` (the unquantised table: stored float16, computed in float32) and ``"int8"`` to them.
"""

from __future__ import annotations

import io
import zipfile
from typing import Sequence

import numpy as np

from sdk.artefact_kind import ArtefactKind, LoadContext
from sdk.builtin_kinds import TOKENIZER_FILE
from sdk.embedder import MAX_QUERY_CHARS, load_tokenizer
from sdk.errors import BundleError, InvalidInputError, InvalidQueryError

#: Bundle file of each table precision (the manifest's ``embedder.files``).
STATIC_TABLE_FILES = {"fp32": "static_table.f16.npz", "int8": "static_table.int8.npz"}
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


def encode_table(vectors: np.ndarray, precision: str) -> bytes:
    """The bytes of a table file: ``precision`` ``"fp32"`` (float16 ``vectors``) or ``"int8"``
    (``vectors`` int8 + ``scales`` float32, :func:`quantize_rows`).

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
        np.savez(buf, vectors=v.astype(np.float16))
    else:
        q, scales = quantize_rows(v)
        np.savez(buf, vectors=q, scales=scales)
    return buf.getvalue()


def decode_table(data: bytes, dim: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Read a table file: ``(vectors, scales)``, vectors (vocab, dim) float16 or int8 (then
    scales (vocab,) float32, finite and > 0), else scales None.

    Raises
    ------
    BundleError
        Not an ``.npz`` (or one needing pickles), missing or extra arrays, wrong dtype or shape,
        a dimension other than ``dim``, non-finite values.
    """
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise BundleError(f"static table is not a readable .npz ({type(exc).__name__}: {exc})") from exc
    vectors = arrays.get("vectors")
    if vectors is None or vectors.ndim != 2 or vectors.shape[0] < 1:
        raise BundleError("static table: 'vectors' must be a non-empty 2-D array")
    if vectors.shape[1] != dim:
        raise BundleError(f"static table has dimension {vectors.shape[1]}, the manifest declares {dim}")
    if vectors.dtype == np.float16 and set(arrays) == {"vectors"}:
        if not np.isfinite(vectors).all():
            raise BundleError("static table: vectors hold NaN or inf")
        return vectors, None
    if vectors.dtype == np.int8 and set(arrays) == {"vectors", "scales"}:
        scales = arrays["scales"]
        if scales.dtype != np.float32 or scales.shape != (vectors.shape[0],):
            raise BundleError(f"static table: scales must be ({vectors.shape[0]},) float32, "
                              f"got {scales.shape} {scales.dtype}")
        if not (np.isfinite(scales).all() and (scales > 0).all()):
            raise BundleError("static table: scales must be finite and > 0")
        return vectors, scales
    raise BundleError(f"static table: expected float16 'vectors' or int8 'vectors' + float32 'scales', got "
                      f"{ {k: str(a.dtype) for k, a in arrays.items()} }")


def vocab_size(tokenizer) -> int:
    """Token ids a ``tokenizers.Tokenizer`` can emit, added tokens included: the value of
    ``get_vocab_size(with_added_tokens=True)`` without that call's cost (it copies the whole
    vocabulary into a dict: 28 ms for the 29,525-token MiniLM table at load ~8 on 2 cores): the
    model's vocabulary plus the added tokens whose ids lie beyond it (an added token with a smaller
    id is one of the model's tokens, e.g. ``[PAD]``)."""
    n = tokenizer.get_vocab_size(with_added_tokens=False)
    return n + sum(1 for i in tokenizer.get_added_tokens_decoder() if i >= n)


class StaticEmbedder:
    """Query -> L2-normalised mean of its tokens' static vectors, shape (n_queries, dim) float32.

    Parameters
    ----------
    tokenizer_json : str, the model's ``tokenizer.json`` (Hugging Face ``tokenizers``).
    table : bytes of a table file (see module docstring).
    dim : int, the embedding dimension the manifest declares.

    Raises
    ------
    BundleError
        The tokenizer or table cannot be loaded, or the table's rows do not match the tokenizer's
        vocabulary size, or its dimension is not ``dim``.

    Thread safety: :meth:`embed` may run from several threads at once (nothing changes after
    construction).
    """

    def __init__(self, tokenizer_json: str, table: bytes, dim: int) -> None:
        tokenizer = load_tokenizer(tokenizer_json)
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tokenizer = tokenizer
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
        encodings = self._tokenizer.encode_batch([t[-MAX_QUERY_CHARS:] for t in texts], add_special_tokens=False)
        out = []
        for i, enc in enumerate(encodings):
            ids = np.asarray(enc.ids, dtype=np.int64)
            if self._unk_id is not None:
                ids = ids[ids != self._unk_id]
            if ids.size == 0:
                raise InvalidQueryError(
                    f"query at position {first_position + i} has no token the static embedder knows in its last "
                    f"{MAX_QUERY_CHARS} characters (only whitespace, control or unknown characters?)")
            out.append(ids)
        return out

    def n_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens read per text (unknown tokens dropped, no special tokens)."""
        return [int(ids.size) for ids in self._ids(list(texts))]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embeddings of already validated, non-blank ``texts``: (n, dim) float32, unit L2 norm.

        Raises
        ------
        InvalidQueryError
            A text with no known token (see :meth:`_ids`).
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
    """``embedder/static``: ``tokenizer.json`` + ``static_table.f16.npz`` and/or
    ``static_table.int8.npz`` (the manifest's ``embedder.files`` maps precision -> file) ->
    :class:`StaticEmbedder`."""

    family = "embedder"
    name = "static"

    def files(self, manifest: dict, precision: str) -> tuple[str, ...]:
        return (TOKENIZER_FILE, manifest["embedder"]["files"][precision])

    def check_manifest(self, manifest: dict) -> None:
        if TOKENIZER_FILE not in manifest["files"]:
            raise BundleError(f"manifest: {TOKENIZER_FILE} is not listed in files")
        for precision in manifest["embedder"]["files"]:
            if precision not in STATIC_TABLE_FILES:
                raise BundleError(f"manifest: static embedder precision {precision!r} is not one of "
                                  f"{sorted(STATIC_TABLE_FILES)}")

    def load(self, context: LoadContext) -> StaticEmbedder:
        emb = context.embedder
        try:
            tokenizer_json = context.files[TOKENIZER_FILE].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BundleError(f"tokenizer.json is not UTF-8 ({exc})") from exc
        return StaticEmbedder(tokenizer_json, context.files[emb["files"][context.precision]], emb["dim"])
