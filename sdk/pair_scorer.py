"""The ``onnx_pair`` graph's runtime: one binary preference selector as an onnxruntime session.

Shared by the selector kinds of :mod:`sdk.selector` (one selector) and :mod:`sdk.routed_selector` (FedPrism's
prompt router + experts, each expert an ``onnx_pair`` graph); the graph contract is in :mod:`sdk.selector`'s
docstring. Only numpy, onnxruntime and ``tokenizers`` are used.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sdk.embedder import FLOAT, INT64, MAX_QUERY_CHARS, check_graph_inputs, inference_session, load_tokenizer, run_session
from sdk.errors import BundleError, InvalidInputError
from sdk.pair_encoding import LENGTH_FEATURE_NAMES, PairEncoder, PairEncodingConfig
from sdk.pair_features import check_feature_names, pair_features_many

FAMILY = "selector"
KIND = "onnx_pair"
MANIFEST_KEY = f"{FAMILY}_kind"
SELECTOR_FILES = {"fp32": "selector.onnx", "int8": "selector.int8.onnx"}
REQUIRED_INPUTS = ("input_ids_a", "attention_mask_a", "input_ids_b", "attention_mask_b", "length_features")
#: Fed only when the graph declares them (a causal-LM backbone has no token types; the exporter drops them).
OPTIONAL_INPUTS = ("token_type_ids_a", "token_type_ids_b")
OUTPUT_NAME = "logit"


def need(cond: bool, what: str) -> None:
    """Raise ``BundleError("manifest: <what>")`` unless ``cond``: one manifest rule of a selector bundle."""
    if not cond:
        raise BundleError(f"manifest: {what}")


def selector_section(manifest: dict) -> dict:
    """The manifest's ``selector`` object, checked to be an object with a non-empty ``name``.

    Raises
    ------
    BundleError
    """
    sel = manifest.get("selector")
    need(isinstance(sel, dict), "selector must be an object")
    need(isinstance(sel.get("name"), str) and sel["name"], "selector.name must be a non-empty string")
    return sel


def manifest_feature_names(selector: dict) -> tuple[str, ...]:
    """The head's pair features of a selector manifest entry: ``pair_features`` (checked names), or the 3 length
    features for a bundle written before it was recorded; ``n_length_features`` must count them.

    Raises
    ------
    BundleError
        Unknown or repeated names, or a count that differs.
    """
    try:
        names = check_feature_names(selector.get("pair_features", LENGTH_FEATURE_NAMES))
    except (InvalidInputError, TypeError) as exc:
        raise BundleError(f"manifest: selector.pair_features is invalid ({exc})") from exc
    if selector.get("n_length_features") != len(names):
        raise BundleError(f"manifest: selector.n_length_features must be {len(names)} (the pair features), "
                          f"got {selector.get('n_length_features')!r}")
    return names


def check_text(value: object, name: str) -> str:
    """Return ``value`` if it is a non-blank ``str`` that encodes as UTF-8.

    Raises
    ------
    InvalidInputError
        Not a ``str``, empty / whitespace only, or holding lone surrogates.
    """
    if not isinstance(value, str):
        raise InvalidInputError(f"{name} must be a str, got {type(value).__name__}")
    if not value.strip():
        raise InvalidInputError(f"{name} is empty or whitespace only")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"{name} is not valid Unicode ({exc.reason} at position {exc.start})") from exc
    return value


class OnnxPairScorer:
    """The ``selector/onnx_pair`` runtime: tokenizer + pair encoding + one onnxruntime session.

    Parameters
    ----------
    tokenizer_json : str, the backbone's ``tokenizer.json``.
    model : bytes, the ONNX graph (module docstring).
    encoding : PairEncodingConfig
    options : onnxruntime ``SessionOptions``.
    what : str, names the graph in error messages.
    feature_names : the head's pair features (:mod:`sdk.pair_features` names, the manifest's
        ``selector.pair_features``; the 3 length features for bundles that do not list them), fed as the graph's
        ``length_features`` input of shape (batch, len(feature_names)).

    Raises
    ------
    BundleError
        The tokenizer or graph does not load, a special token of ``encoding`` is not in the vocabulary,
        or the graph's inputs (names, element types)/outputs are not the contract.
    """

    def __init__(self, tokenizer_json: str, model: bytes, encoding: PairEncodingConfig, options, what: str,
                 feature_names: Sequence[str] = LENGTH_FEATURE_NAMES) -> None:
        tokenizer = load_tokenizer(tokenizer_json)
        try:
            self._encoder = PairEncoder(tokenizer, encoding)
        except InvalidInputError as exc:  # a special token missing from the vocabulary
            raise BundleError(f"selector.pair_encoding does not fit tokenizer.json ({exc})") from exc
        self._session = inference_session(model, options, what)
        names = check_graph_inputs(
            self._session, {n: FLOAT if n == "length_features" else INT64 for n in REQUIRED_INPUTS},
            dict.fromkeys(OPTIONAL_INPUTS, INT64), what)
        outputs = [o.name for o in self._session.get_outputs()]
        if OUTPUT_NAME not in outputs:
            raise BundleError(f"{what}: no '{OUTPUT_NAME}' output (outputs: {outputs})")
        self._inputs = names
        self._what = what
        self._feature_names = tuple(feature_names)

    def _feeds(self, prompt: str, first: Sequence[str], second: Sequence[str]) -> dict[str, np.ndarray]:
        n = len(first)
        seg_first = self._encoder.encode_segments([prompt] * n, list(first))
        seg_second = self._encoder.encode_segments([prompt] * n, list(second))
        self._check_readable(seg_first)
        feeds = {f"{k}_a": v for k, v in seg_first.items()}
        feeds.update({f"{k}_b": v for k, v in seg_second.items()})
        # Cut the padding columns that no segment uses: exact (attention and pooling are masked), faster,
        # and a quantised graph's activation scales then see real tokens only.
        used = int(max(seg_first["attention_mask"].sum(1).max(), seg_second["attention_mask"].sum(1).max()))
        feeds = {k: v[:, :used] for k, v in feeds.items()}
        feeds["length_features"] = pair_features_many([prompt] * n, list(first), list(second), self._feature_names)
        return {k: v for k, v in feeds.items() if k in self._inputs}

    def _check_readable(self, seg: dict[str, np.ndarray]) -> None:
        """Refuse a pair whose prompt or a response gave no token (rows of ``seg``: (x, y_a), (x, y_b)).

        A text of control or zero-width characters only (``"\\x00"``, ``"\\u200b"``) passes
        :func:`check_text` but the tokenizer drops every character: the graph would then score an
        empty prompt or response, which :func:`check_text` refuses when it is written ``""``.
        """
        mask, types = seg["attention_mask"].sum(1), seg["token_type_ids"].sum(1)
        response_tokens = types - 1  # the response part ends with one separator
        prompt_tokens = mask - types - 1 - (self._encoder.config.prefix_token is not None)
        unreadable = [name for name, n in (("x", prompt_tokens[0]), ("y_a", response_tokens[0]),
                                           ("y_b", response_tokens[1])) if n <= 0]
        if unreadable:
            raise InvalidInputError(
                f"{unreadable[0]} has no token the selector's tokenizer can read (only control or zero-width "
                f"characters in the {MAX_QUERY_CHARS:,} characters read?); there is nothing to compare")

    def logits(self, x: str, y_a: str, y_b: str) -> tuple[float, float]:
        """(l(a, b), l(b, a)) in one call of batch 2 (module docstring: each pair runs alone).

        Raises
        ------
        InvalidInputError
            ``x``, ``y_a`` or ``y_b`` has no token the tokenizer can read (e.g. only control or
            zero-width characters), named in the message.
        BundleError
            onnxruntime fails to run the graph, or it returns other than two finite logits.
        """
        out = run_session(self._session, [OUTPUT_NAME], self._feeds(x, [y_a, y_b], [y_b, y_a]), self._what)[0]
        out = np.asarray(out, dtype=np.float64).reshape(-1)
        if out.shape != (2,) or not np.isfinite(out).all():
            raise BundleError(f"selector returned {out!r}, expected two finite logits")
        return float(out[0]), float(out[1])
