"""The ``onnx_pair`` graph's runtime (one binary preference selector as an onnxruntime session) and the manifest
checks shared by the selector kinds of :mod:`sdk.selector` and :mod:`sdk.routed_selector`; the graph contract is
in :mod:`sdk.selector`'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from sdk.bundle_manifest import need
from sdk.embedder import (FLOAT, INT64, MAX_QUERY_CHARS, SessionThreads, check_graph_inputs, inference_session,
                          load_tokenizer, run_session)
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
#: Optional output: l(b, a) from the same segments as ``logit``, so one row per pair is fed instead of both orders.
SWAPPED_OUTPUT_NAME = "logit_ba"


def selector_section(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's ``selector`` object, with a non-empty ``name`` and the checked ``pair_features`` and
    ``pair_encoding`` (BundleError otherwise)."""
    sel: Any = manifest.get("selector")
    need(isinstance(sel, dict), "selector must be an object")
    need(isinstance(sel.get("name"), str) and sel["name"], "selector.name must be a non-empty string")
    manifest_feature_names(sel)
    need(isinstance(sel.get("pair_encoding"), dict), "selector.pair_encoding must be an object")
    try:
        PairEncodingConfig(**sel["pair_encoding"])
    except (TypeError, InvalidInputError) as exc:
        raise BundleError(f"manifest: selector.pair_encoding is invalid ({exc})") from exc
    checked: dict[str, Any] = sel
    return checked


def manifest_feature_names(selector: dict[str, Any]) -> tuple[str, ...]:
    """The head's pair features: ``pair_features`` (checked names; the 3 length features when absent), counted by
    ``n_length_features``. Raises BundleError otherwise."""
    try:
        names = check_feature_names(selector.get("pair_features", LENGTH_FEATURE_NAMES))
    except (InvalidInputError, TypeError) as exc:
        raise BundleError(f"manifest: selector.pair_features is invalid ({exc})") from exc
    need(selector.get("n_length_features") == len(names), f"selector.n_length_features must be {len(names)} "
         f"(the pair features), got {selector.get('n_length_features')!r}")
    return names


class OnnxPairScorer:
    """The ``selector/onnx_pair`` runtime: tokenizer + pair encoding + one onnxruntime session (``what`` names the
    graph in errors); ``feature_names`` are fed as its ``length_features`` input (batch, len(feature_names)).

    Raises
    ------
    BundleError
        The tokenizer or graph does not load, a special token of ``encoding`` is not in the vocabulary, or the
        graph's inputs or outputs are not the contract.
    """

    def __init__(self, tokenizer_json: str, model: bytes, encoding: PairEncodingConfig, options: SessionThreads | None,
                 what: str, feature_names: Sequence[str] = LENGTH_FEATURE_NAMES) -> None:
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
        self._both_orders = SWAPPED_OUTPUT_NAME in outputs
        self._what = what
        self._feature_names = tuple(feature_names)

    def _feeds(self, prompt: str, first: Sequence[str], second: Sequence[str]) -> dict[str, npt.NDArray[Any]]:
        n = len(first)
        seg_first = self._encoder.encode_segments([prompt] * n, list(first))
        seg_second = self._encoder.encode_segments([prompt] * n, list(second))
        self._check_readable(seg_first, seg_second)
        feeds = {f"{k}_a": v for k, v in seg_first.items()}
        feeds.update({f"{k}_b": v for k, v in seg_second.items()})
        # Cut the padding columns that no segment uses: exact (attention and pooling are masked), faster,
        # and a quantised graph's activation scales then see real tokens only.
        used = int(max(seg_first["attention_mask"].sum(1).max(), seg_second["attention_mask"].sum(1).max()))
        feeds = {k: v[:, :used] for k, v in feeds.items()}
        feeds["length_features"] = pair_features_many([prompt] * n, list(first), list(second), self._feature_names)
        return {k: v for k, v in feeds.items() if k in self._inputs}

    def _check_readable(self, seg_a: dict[str, npt.NDArray[np.int64]], seg_b: dict[str, npt.NDArray[np.int64]]) -> None:
        """Refuse a pair whose prompt or a response gave no token (only control or zero-width characters); the
        first rows of ``seg_a`` and ``seg_b`` are the segments of (x, y_a) and (x, y_b)."""
        mask = seg_a["attention_mask"][0].sum()
        response_tokens = [seg["token_type_ids"][0].sum() - 1 for seg in (seg_a, seg_b)]  # each ends with a separator
        prompt_tokens = mask - response_tokens[0] - 2 - (self._encoder.config.prefix_token is not None)
        unreadable = [name for name, n in (("x", prompt_tokens), ("y_a", response_tokens[0]),
                                           ("y_b", response_tokens[1])) if n <= 0]
        if unreadable:
            raise InvalidInputError(
                f"{unreadable[0]} has no token the selector's tokenizer can read (only control or zero-width "
                f"characters in the {MAX_QUERY_CHARS:,} characters read?); there is nothing to compare")

    def logits(self, x: str, y_a: str, y_b: str) -> tuple[float, float]:
        """(l(a, b), l(b, a)) in one call (each pair runs alone): of batch 1 read from ``logit`` and ``logit_ba``
        where the graph has both, else of batch 2 (both orders). Raises InvalidInputError naming a text with no
        readable token, BundleError when the graph fails or returns other than two finite logits."""
        if self._both_orders:
            out = np.concatenate(run_session(self._session, [OUTPUT_NAME, SWAPPED_OUTPUT_NAME],
                                             self._feeds(x, [y_a], [y_b]), self._what), axis=None)
        else:
            out = run_session(self._session, [OUTPUT_NAME], self._feeds(x, [y_a, y_b], [y_b, y_a]), self._what)[0]
        out = np.asarray(out, dtype=np.float64).reshape(-1)
        if out.shape != (2,) or not np.isfinite(out).all():
            raise BundleError(f"selector returned {out!r}, expected two finite logits")
        return float(out[0]), float(out[1])
