"""Sentence embeddings on the device: Hugging Face ``tokenizers`` + an ONNX encoder in onnxruntime, and the
onnxruntime session helpers every kind uses.

The graph (optimum's sentence-transformers export) holds transformer, masked mean pooling and L2 normalisation
(output ``sentence_embedding (batch, dim) float32``); this module tokenises and runs it. A query longer than
``max_tokens`` tokens is truncated; ``truncation_side="left"`` keeps the last tokens, read from at most the
query's last 65,536 characters.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from sdk.errors import BundleError, InvalidInputError, InvalidQueryError
from sdk.real_numbers import shown
from sdk.verified_file import VerifiedFile

if TYPE_CHECKING:
    import onnxruntime as ort
    from tokenizers import Encoding, Tokenizer


def check_text(value: object, name: str, error: type[InvalidInputError] = InvalidInputError, why: str = "") -> str:
    """``value`` if it is a non-blank ``str`` that encodes as UTF-8, else ``error`` naming ``name``."""
    text = value if isinstance(value, str) else ""
    problem = (f"must be a str, got {type(value).__name__}" if not isinstance(value, str)
               else f"is empty or whitespace only{why}" if not text.strip() else None)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        problem = f"is not valid Unicode ({exc.reason} at position {exc.start})"
    if problem:
        raise error(f"{name} {problem}")
    return text


def load_tokenizer(tokenizer_json: str, file_name: str = "tokenizer.json") -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from a bundle's tokenizer JSON (``file_name`` names it in errors), its own
    padding and truncation still on. Raises BundleError if it does not load or lacks its unknown token."""
    from tokenizers import Tokenizer  # native library: loaded with the first bundle, not by `import sdk`

    try:
        tokenizer = Tokenizer.from_str(tokenizer_json)
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise BundleError(f"{file_name} cannot be loaded ({exc})") from exc
    check_unknown_token(tokenizer, file_name)
    return tokenizer


def check_unknown_token(tokenizer: Tokenizer, file_name: str = "tokenizer.json") -> None:
    """Raise BundleError if the model's unknown token is not in its vocabulary (``tokenizers`` would fail on
    the first unknown word of a query)."""
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


@dataclass(frozen=True)
class SessionThreads:
    """onnxruntime thread counts, checked without importing onnxruntime: a bundle whose kinds run no graph
    (a static embedder with a K-means router) never imports it (~53 ms of a cold start).

    Raises
    ------
    InvalidInputError
        A thread count that is not an integer in [1, :data:`MAX_THREADS`].
    """

    intra_op_threads: int = 1
    inter_op_threads: int = 1

    def __post_init__(self) -> None:
        for name, value in (("intra_op_threads", self.intra_op_threads), ("inter_op_threads", self.inter_op_threads)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
                raise InvalidInputError(f"{name} must be an integer in [1, {MAX_THREADS}], got {shown(value)}")


def session_options(intra_op_threads: int = 1, inter_op_threads: int = 1) -> ort.SessionOptions:
    """The one onnxruntime ``SessionOptions`` of the SDK: these thread counts (:class:`SessionThreads`), all
    graph optimisations. Raises InvalidInputError on a thread count outside [1, :data:`MAX_THREADS`]."""
    SessionThreads(intra_op_threads, inter_op_threads)
    import onnxruntime as ort  # heavy native library: loaded with the first ONNX graph, not by `import sdk`

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = intra_op_threads
    opts.inter_op_num_threads = inter_op_threads
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return opts


#: onnxruntime graph optimisers left out: onnxruntime 1.32's CPU ``SkipLayerNormalization`` kernel is slower
#: than ``Add`` + ``LayerNormalization`` (84 against 19-26 us on (1, 32, 384); docs/benchmarks.md).
DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)


def inference_session(model: bytes | VerifiedFile, options: SessionThreads | ort.SessionOptions | None,
                      what: str) -> ort.InferenceSession:
    """An onnxruntime CPU session from model bytes or a verified open file (loaded by its ``library_path``, then
    ``check_unchanged()``); ``options`` None is onnxruntime's defaults.

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


def check_graph_inputs(session: ort.InferenceSession, required: Mapping[str, str], optional: Mapping[str, str],
                       what: str) -> frozenset[str]:
    """The input names of ``session`` once they match the contract (name -> element type: every ``required``,
    perhaps ``optional`` ones, nothing else). Raises BundleError naming the graph ``what`` otherwise."""
    declared = {i.name: i.type for i in session.get_inputs()}
    contract = {**optional, **required}
    missing = [n for n in required if n not in declared]
    extra = [n for n in declared if n not in contract]
    wrong = {n: t for n, t in declared.items() if n in contract and t != contract[n]}
    if missing or extra or wrong:
        raise BundleError(f"{what}: inputs {declared} are not the contract: needs {dict(required)}"
                          f"{f' (+ optionally {dict(optional)})' if optional else ''}"
                          f"{f'; missing {missing}' if missing else ''}{f'; unexpected {extra}' if extra else ''}"
                          f"{f'; of another type {list(wrong)}' if wrong else ''}")
    return frozenset(declared)


def run_session(session: ort.InferenceSession, outputs: list[str], feeds: Mapping[str, npt.NDArray[Any]],
                what: str) -> list[Any]:
    """``session.run(outputs, feeds)``; onnxruntime's failures on validated feeds are a BundleError (the graph
    and the bundle's declarations disagree, e.g. a ``max_tokens`` beyond the position table)."""
    try:
        return list(session.run(outputs, dict(feeds)))
    except Exception as exc:  # onnxruntime raises its own InvalidArgument/RuntimeException/Fail classes
        raise BundleError(f"{what}: onnxruntime failed to run the graph on this input "
                          f"({type(exc).__name__}: {str(exc)[:300]}); the bundle's graph and its manifest "
                          "or tokenizer do not agree") from exc


class OnnxEmbedder:
    """Query -> L2-normalised sentence embedding, (n_queries, dim) float32; thread-safe.

    ``model``: the encoder (:func:`inference_session`); ``max_tokens``: tokens kept per query, special tokens
    included; ``batched``: several texts per padded call (at most ``RUN_TOKENS // max_tokens``). Off for
    dynamically quantised graphs, whose activation scales span the whole input: each text then runs alone.

    Raises
    ------
    BundleError
        The tokenizer or the graph does not load, or its inputs, output or dimension are not the bundle's.
    """

    def __init__(self, tokenizer_json: str, model: bytes | VerifiedFile, dim: int, max_tokens: int,
                 truncation_side: str, options: SessionThreads | ort.SessionOptions | None,
                 batched: bool = True) -> None:
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
        outputs = {o.name: o.shape for o in self._session.get_outputs()}
        shape = outputs.get(OUTPUT, ())  # an unknown rank (no shape) is checked on the first run
        if OUTPUT not in outputs or (shape and (len(shape) != 2 or shape[-1] not in (dim, None) and
                                                isinstance(shape[-1], int))):
            raise BundleError(f"embedder output '{OUTPUT}' has shape {outputs.get(OUTPUT, f'(missing: outputs {outputs})')}, "
                              f"expected (batch, {dim}) (token embeddings instead of pooled sentence embeddings?)")
        self.dim = int(dim)
        self.max_tokens = int(max_tokens)
        self.truncation_side = truncation_side
        self.batched = batched

    def _tokenize(self, texts: list[str]) -> list[Encoding]:
        """Encodings of ``texts`` (one text: ``encode``, ~0.05 ms faster than the batch call)."""
        if len(texts) == 1:
            return [self._tokenizer.encode(texts[0])]
        return list(self._tokenizer.encode_batch(texts))

    def n_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text after truncation (special tokens included)."""
        return [sum(e.attention_mask) for e in self._encode(list(texts))]

    def _encode(self, texts: list[str], first_position: int = 0) -> list[Encoding]:
        """Tokenise with truncation to ``max_tokens``; raise InvalidQueryError for a text with no token left.

        Left truncation reads a query's last :data:`MAX_QUERY_CHARS` characters, trying the tails of
        :data:`TAIL_CHARS_PER_TOKEN` ``* max_tokens`` characters first. Exact: normalisation and pre-tokenisation
        act per character and word, and a tail is used only when its (perhaps broken) first word was truncated
        away (word id 0 not kept).
        """
        if self.truncation_side != "left":
            return self._tokenize(texts)
        texts = [t[-MAX_QUERY_CHARS:] for t in texts]
        encodings: list[Encoding | None] = [None] * len(texts)
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
        done = [e for e in encodings if e is not None]
        for i, enc in enumerate(done):
            if sum(enc.attention_mask) <= 2:  # [CLS] and [SEP] only
                raise InvalidQueryError(
                    f"query at position {first_position + i} has no token the embedder can read in its last "
                    f"{MAX_QUERY_CHARS} characters (only whitespace, control or zero-width characters?)")
        if len({len(e.ids) for e in done}) > 1:  # mixed paths: pad again to one length
            longest = max(len(e.ids) for e in done)
            for e in done:
                e.pad(longest, pad_id=self._pad_id, pad_token="[PAD]")
        return done

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Embeddings of validated ``texts``: (n, dim) float32, unit L2 norm. Raises InvalidQueryError for a text
        with no readable token, BundleError when the graph fails or returns another shape or NaN/inf."""
        texts = list(texts)
        step = max(1, RUN_TOKENS // self.max_tokens) if self.batched else 1
        if len(texts) <= step:
            return self._run(self._encode(texts))
        return np.concatenate([self._run(self._encode(texts[j : j + step], j)) for j in range(0, len(texts), step)])

    def _run(self, encodings: list[Encoding]) -> npt.NDArray[np.float32]:
        feeds = {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
        }
        if self._token_types:
            feeds["token_type_ids"] = np.array([e.type_ids for e in encodings], dtype=np.int64)
        (out,) = run_session(self._session, [OUTPUT], feeds, "embedder")
        out = np.asarray(out, dtype=np.float32)
        if out.shape != (len(encodings), self.dim) or not np.isfinite(out).all():
            raise BundleError(f"embedder returned NaN or inf for a valid query, or shape {out.shape} instead of "
                              f"({len(encodings)}, {self.dim}) (a corrupt encoder graph)")
        return out
