"""Sentence embeddings on the device: Hugging Face ``tokenizers`` + an ONNX encoder in onnxruntime.

The ONNX graph written by ``export`` (optimum's sentence-transformers exporter) holds the whole
sentence-transformers pipeline: transformer, attention-masked mean pooling and L2 normalisation,
output ``sentence_embedding (batch, dim) float32``. Pooling and normalisation therefore live in the
graph, in one place, and this module only tokenises and runs it.

Truncation: a query longer than ``max_tokens`` tokens (special tokens included) is truncated, not
rejected. With ``truncation_side="left"`` (the trainer's setting) the *last* tokens are kept, where
the question of a long few-shot prompt sits, read from at most the query's last 65,536 characters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from sdk.errors import BundleError, InvalidInputError, InvalidQueryError
from sdk.real_numbers import shown
from sdk.verified_file import VerifiedFile


def load_tokenizer(tokenizer_json: str, file_name: str = "tokenizer.json"):
    """A ``tokenizers.Tokenizer`` from a bundle's tokenizer JSON (``file_name`` names it in errors),
    with the file's own padding and truncation settings still on: callers set their own.

    Raises
    ------
    BundleError
        The JSON is not a tokenizer the ``tokenizers`` library can load, or its model names an
        unknown token that its vocabulary lacks (:func:`check_unknown_token`).
    """
    from tokenizers import Tokenizer  # native library: loaded with the first bundle, not by `import sdk`

    try:
        tokenizer = Tokenizer.from_str(tokenizer_json)
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise BundleError(f"{file_name} cannot be loaded ({exc})") from exc
    check_unknown_token(tokenizer, file_name)
    return tokenizer


def check_unknown_token(tokenizer, file_name: str = "tokenizer.json") -> None:
    """Refuse a tokenizer whose model (WordPiece, WordLevel, BPE) names an unknown token that is not
    in its vocabulary: ``tokenizers`` loads it, then fails (a bare ``Exception``) on the first query
    holding a word it does not know.

    Raises
    ------
    BundleError
        The unknown token is missing from the vocabulary.
    """
    unk = getattr(tokenizer.model, "unk_token", None)
    if unk and tokenizer.token_to_id(unk) is None:
        raise BundleError(f"{file_name}: the unknown token {unk!r:.40} is not in the vocabulary (an unknown word "
                          "in a query could not be tokenised)")

OUTPUT = "sentence_embedding"
#: onnxruntime's names of the element types the SDK feeds.
INT64 = "tensor(int64)"
FLOAT = "tensor(float)"
#: Largest onnxruntime thread count accepted: far above any device's cores; a larger number is a bug
#: (onnxruntime would try to start that many threads, or fail on a count beyond its C int).
MAX_THREADS = 1024
#: With left truncation a query is read from at most its last this many characters (64 Ki).
MAX_QUERY_CHARS = 65_536
#: Tails tried in turn by left truncation, in characters per kept token (``* max_tokens``), before
#: the whole text (:meth:`OnnxEmbedder._encode`). A tail of 6 characters per token was exact for
#: 99.3-100% of the texts longer than it (RouterBench train prompts, AlpacaEval instructions, HH
#: prompts; 5 per token: 88-99.9%) at 32 tokens, and tokenising it takes about half the time of the
#: 12 per token tried before (``benchmarks/tail_tokenisation.py``, docs/benchmarks.md).
TAIL_CHARS_PER_TOKEN = (6, 24)
#: Token budget of one batched encoder call: ``embed`` runs at most ``max(1, RUN_TOKENS // max_tokens)``
#: texts at once (32 at 64 tokens). The encoder's activations grow with the texts of a call (attention:
#: texts x heads x tokens^2): one call for 1,000 (prompt, response) pairs of ``RewardScorer.score_batch``
#: peaked at 3.8 GB, so a list of 10,000 would exhaust a device's memory.
RUN_TOKENS = 2048


def check_threads(intra_op_threads: int = 1, inter_op_threads: int = 1) -> tuple[int, int]:
    """``(intra_op_threads, inter_op_threads)`` if both are integers >= 1 (no onnxruntime import).

    Raises
    ------
    InvalidInputError
        A thread count that is not an integer in [1, :data:`MAX_THREADS`].
    """
    for name, value in (("intra_op_threads", intra_op_threads), ("inter_op_threads", inter_op_threads)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
            raise InvalidInputError(f"{name} must be an integer in [1, {MAX_THREADS}], got {shown(value)}")
    return intra_op_threads, inter_op_threads


def session_options(intra_op_threads: int = 1, inter_op_threads: int = 1):
    """onnxruntime ``SessionOptions`` with the given thread counts (>= 1) and all graph optimisations.

    Raises
    ------
    InvalidInputError
        A thread count that is not an integer in [1, :data:`MAX_THREADS`].
    """
    check_threads(intra_op_threads, inter_op_threads)
    import onnxruntime as ort  # heavy native library: loaded with the first ONNX graph, not by `import sdk`

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = intra_op_threads
    opts.inter_op_num_threads = inter_op_threads
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return opts


@dataclass(frozen=True)
class SessionThreads:
    """Thread counts for onnxruntime sessions, checked (>= 1) without importing onnxruntime.

    What :class:`sdk.Router` passes to the kinds as :attr:`~sdk.artefact_kind.LoadContext.options`:
    :func:`inference_session` turns it into ``SessionOptions`` (:func:`session_options`) when a kind
    actually creates a session, so a bundle whose kinds run no ONNX graph (a static embedder with a
    K-means router) never imports onnxruntime (~53 ms of a cold start as issue 13 measured it; a static
    K-means load peaked at 95 MB RSS with it, 69 MB now).

    Raises
    ------
    InvalidInputError
        A thread count that is not an integer in [1, :data:`MAX_THREADS`].
    """

    intra_op_threads: int = 1
    inter_op_threads: int = 1

    def __post_init__(self) -> None:
        check_threads(self.intra_op_threads, self.inter_op_threads)


#: onnxruntime graph optimisers the SDK's sessions leave out. ``SkipLayerNormFusion`` would fuse each
#: residual ``Add`` + ``LayerNormalization`` into one ``SkipLayerNormalization``, whose CPU kernel in
#: onnxruntime 1.32 is the slower of the two: 84 us against 19-26 us for ``Add`` + ``LayerNormalization``
#: on a (1, 32, 384) float32 input, one thread (Xeon with AVX-512, 2026-12-02; a fused int8-all
#: MiniLM encoder ran 18% faster with its 12 ``SkipLayerNormalization`` nodes split back, see
#: docs/benchmarks.md). The exporter no longer writes that op either (:mod:`export.embedder_fusion`);
#: older bundles that hold it still run.
DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)


def inference_session(model: bytes | VerifiedFile, options, what: str):
    """An onnxruntime CPU session from model bytes or a verified open file.

    ``options``: onnxruntime ``SessionOptions``, a :class:`SessionThreads` (turned into them here)
    or None (onnxruntime's defaults).

    A :class:`~sdk.verified_file.VerifiedFile` is loaded from its ``library_path`` (the open
    descriptor's path: no copy of the model in Python memory), then ``check_unchanged()`` confirms
    the file is the one that was verified. The graph optimisers in :data:`DISABLED_OPTIMIZERS` are
    left out.

    Raises
    ------
    BundleError
        onnxruntime cannot load the model, or the verified file changed before it was loaded.
    """
    import onnxruntime as ort  # heavy native library: loaded with the first ONNX graph, not by `import sdk`

    if isinstance(options, SessionThreads):
        options = session_options(options.intra_op_threads, options.inter_op_threads)
    source = model.library_path if isinstance(model, VerifiedFile) else model
    try:
        session = ort.InferenceSession(source, sess_options=options, providers=["CPUExecutionProvider"],
                                       disabled_optimizers=list(DISABLED_OPTIMIZERS))
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/... classes
        raise BundleError(f"{what}: onnxruntime cannot load it ({exc})") from exc
    if isinstance(model, VerifiedFile):
        model.check_unchanged()
    return session


def check_graph_inputs(session, required: Mapping[str, str], optional: Mapping[str, str], what: str) -> frozenset[str]:
    """The input names of an onnxruntime ``session``, after checking them against a graph contract.

    Parameters
    ----------
    required, optional : input name -> onnxruntime element type (``"tensor(int64)"``,
        ``"tensor(float)"``); the graph must declare every required input and may declare optional
        ones, nothing else, each of its type (so a graph that onnxruntime would refuse to run on the
        SDK's feeds is refused at load, not on the first query).
    what : names the graph in errors.

    Raises
    ------
    BundleError
        A required input missing, an input outside the contract, or one of another element type.
    """
    declared = {i.name: i.type for i in session.get_inputs()}
    contract = {**optional, **required}
    missing = [n for n in required if n not in declared]
    extra = [n for n in declared if n not in contract]
    if missing or extra:
        raise BundleError(f"{what}: inputs {sorted(declared)} are not the contract: needs {list(required)}"
                          f"{f' (+ optionally {list(optional)})' if optional else ''}"
                          f"{f'; missing {missing}' if missing else ''}{f'; unexpected {extra}' if extra else ''}")
    wrong = {n: t for n, t in declared.items() if t != contract[n]}
    if wrong:
        raise BundleError(f"{what}: input {next(iter(wrong))!r} is {next(iter(wrong.values()))}, "
                          f"expected {contract[next(iter(wrong))]}")
    return frozenset(declared)


def run_session(session, outputs: list[str], feeds: Mapping[str, np.ndarray], what: str) -> list:
    """``session.run(outputs, feeds)``, with onnxruntime's failures on the SDK's (validated) feeds
    re-raised as :class:`BundleError`: the graph and the bundle's declarations disagree (e.g. a
    ``max_tokens`` beyond the encoder's position table, token ids beyond its vocabulary).

    Raises
    ------
    BundleError
        onnxruntime failed to run the graph.
    """
    try:
        return session.run(outputs, dict(feeds))
    except Exception as exc:  # onnxruntime raises its own InvalidArgument/RuntimeException/Fail classes
        raise BundleError(f"{what}: onnxruntime failed to run the graph on this input "
                          f"({type(exc).__name__}: {str(exc)[:300]}); the bundle's graph and its manifest "
                          "or tokenizer do not agree") from exc


class OnnxEmbedder:
    """Query -> L2-normalised sentence embedding, shape (n_queries, dim) float32.

    Parameters
    ----------
    tokenizer_json : str, the ``tokenizer.json`` of the embedder (Hugging Face ``tokenizers``).
    model : bytes or :class:`~sdk.verified_file.VerifiedFile`, the ONNX encoder with output
        ``sentence_embedding`` (see :func:`inference_session`).
    dim : int, the embedding dimension the bundle declares.
    max_tokens : int, tokens kept per query, special tokens included.
    truncation_side : ``"left"`` (keep the end) or ``"right"`` (keep the start).
    options : onnxruntime ``SessionOptions`` (see :func:`session_options`).
    batched : run several texts in one padded call (at most ``RUN_TOKENS // max_tokens`` per call, so
        memory stays bounded however many texts ``embed`` is given). Off for dynamically quantised (int8) graphs:
        their activation scales are computed over the whole input tensor, padding included, so a
        text's embedding would depend on the other texts of its batch; each text then runs alone
        and ``embed(texts)`` equals ``[embed([t]) for t in texts]`` exactly.

    Raises
    ------
    BundleError
        The tokenizer or the graph cannot be loaded, or the graph's inputs (names, int64 types),
        output (name, rank 2) or dimension do not match what the bundle declares.

    Thread safety: :meth:`embed` may be called from several threads at once (the tokenizer is
    configured once here and only read afterwards; onnxruntime's ``run`` is thread-safe).
    """

    def __init__(self, tokenizer_json: str, model: bytes | VerifiedFile, dim: int, max_tokens: int,
                 truncation_side: str, options, batched: bool = True) -> None:
        tokenizer = load_tokenizer(tokenizer_json)
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_tokens, direction=truncation_side)
        pad_id = tokenizer.token_to_id("[PAD]")
        self._pad_id = 0 if pad_id is None else pad_id
        tokenizer.enable_padding(pad_id=self._pad_id, pad_token="[PAD]")
        self._tokenizer = tokenizer
        self._session = inference_session(model, options, "embedder")
        inputs = check_graph_inputs(self._session, {"input_ids": INT64, "attention_mask": INT64},
                                    {"token_type_ids": INT64}, "embedder")
        self._token_types = "token_type_ids" in inputs
        outputs = {o.name: o for o in self._session.get_outputs()}
        if OUTPUT not in outputs:
            raise BundleError(f"embedder has no '{OUTPUT}' output (outputs: {sorted(outputs)})")
        shape = outputs[OUTPUT].shape
        if shape and len(shape) != 2:  # an unknown rank (no shape) is checked on the first run
            raise BundleError(f"embedder output '{OUTPUT}' has shape {shape}, expected (batch, {dim}) "
                              "(token embeddings instead of pooled sentence embeddings?)")
        graph_dim = shape[-1] if shape else None
        if isinstance(graph_dim, int) and graph_dim != dim:
            raise BundleError(f"embedder outputs dimension {graph_dim}, the manifest declares {dim}")
        self.dim = int(dim)
        self.max_tokens = int(max_tokens)
        self.truncation_side = truncation_side
        self.batched = batched

    def _tokenize(self, texts: list[str]) -> list:
        """The tokenizer's encodings of ``texts`` (one text: ``encode``, which skips the batch
        machinery: ~0.05 ms less a query)."""
        if len(texts) == 1:
            return [self._tokenizer.encode(texts[0])]
        return self._tokenizer.encode_batch(texts)

    def n_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text after truncation (special tokens included)."""
        return [sum(e.attention_mask) for e in self._encode(list(texts))]

    def _encode(self, texts: list[str], first_position: int = 0):
        """Tokenise with truncation to ``max_tokens``.

        With left truncation (keep the end) a query is read from its last :data:`MAX_QUERY_CHARS`
        characters, which bounds the time a multi-megabyte query takes; within those, the last
        ``max_tokens`` tokens are kept. Tokenising a 2,000-character prompt to keep its last 32
        tokens costs far more than tokenising a short tail, so the tails of
        :data:`TAIL_CHARS_PER_TOKEN` ``* max_tokens`` characters are tried first, shortest first. That
        shortcut is exact: BERT-style normalisation and pre-tokenisation act per character and per
        word, so only the (possibly broken) first word of a tail can differ from the full text's
        tokens, and a tail is used only when it was itself truncated and that first word was
        truncated away (word id 0 is not among the kept tokens). Otherwise the next, longer tail is
        tried, and last the whole (capped) text.

        Raises
        ------
        InvalidQueryError
            A text with no token left after normalisation (e.g. only control characters).
        """
        if self.truncation_side != "left":
            return self._tokenize(texts)
        texts = [t[-MAX_QUERY_CHARS:] for t in texts]
        encodings: list = [None] * len(texts)
        pending = list(range(len(texts)))
        for per_token in (*TAIL_CHARS_PER_TOKEN, None):
            limit = None if per_token is None else per_token * self.max_tokens
            cut = [texts[i] if limit is None or len(texts[i]) <= limit else texts[i][-limit:] for i in pending]
            unresolved = []
            for i, short, enc in zip(pending, cut, self._tokenize(cut)):
                if len(short) < len(texts[i]) and (not enc.overflowing or 0 in enc.word_ids):
                    unresolved.append(i)  # the tail's first (perhaps broken) word is kept: not exact
                else:
                    encodings[i] = enc
            pending = unresolved
            if not pending:
                break
        for i, enc in enumerate(encodings):
            if sum(enc.attention_mask) <= 2:  # [CLS] and [SEP] only
                raise InvalidQueryError(
                    f"query at position {first_position + i} has no token the embedder can read in its last "
                    f"{MAX_QUERY_CHARS} characters (only whitespace, control or zero-width characters?)")
        if len({len(e.ids) for e in encodings}) > 1:  # mixed paths: pad again to one length
            longest = max(len(e.ids) for e in encodings)
            for e in encodings:
                e.pad(longest, pad_id=self._pad_id, pad_token="[PAD]")
        return encodings

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embeddings of already validated, non-empty ``texts``: (n, dim) float32, unit L2 norm.

        Raises
        ------
        InvalidQueryError
            A text with no token the embedder can read (see :meth:`_encode`).
        BundleError
            onnxruntime fails to run the graph (:func:`run_session`), or it returns another shape
            or NaN/inf.
        """
        texts = list(texts)
        step = max(1, RUN_TOKENS // self.max_tokens) if self.batched else 1
        if len(texts) <= step:
            return self._run(self._encode(texts))
        return np.concatenate([self._run(self._encode(texts[j : j + step], j)) for j in range(0, len(texts), step)])

    def _run(self, encodings) -> np.ndarray:
        feeds = {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
        }
        if self._token_types:
            feeds["token_type_ids"] = np.array([e.type_ids for e in encodings], dtype=np.int64)
        (out,) = run_session(self._session, [OUTPUT], feeds, "embedder")
        out = np.asarray(out, dtype=np.float32)
        if out.shape != (len(encodings), self.dim):
            raise BundleError(f"embedder returned shape {out.shape}, expected ({len(encodings)}, {self.dim})")
        if not np.isfinite(out).all():
            raise BundleError("embedder returned NaN or inf for a valid query (a corrupt encoder graph)")
        return out
