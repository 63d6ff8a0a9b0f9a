"""``Selector``: a trained binary preference selector on the device (FedPrism experts, paper 000 §3;
ARCHITECTURE.md §7).

``Selector.load(bundle_dir, public_key)`` verifies a signed selector bundle (same manifest, signature
and hash checks as router bundles, :mod:`sdk.bundle_manifest`) and ``prefer(x, y_a, y_b)`` returns the
probability that ``y_a`` is the better response to ``x``. Only numpy, onnxruntime and ``tokenizers`` are
used (no torch).

The ONNX graph (``selector.onnx`` / ``selector.int8.onnx``, written by ``export.selector_export``) is the
backbone with its LoRA adapter merged, plus the classification head:

===================== ======================= ======= =====================================================
name                  shape                   dtype   meaning
===================== ======================= ======= =====================================================
input_ids_a           (batch, seq_len)        int64   segment of (x, y_a), :mod:`sdk.pair_encoding`
attention_mask_a      (batch, seq_len)        int64
token_type_ids_a      (batch, seq_len)        int64   (optional: absent for causal-LM backbones)
input_ids_b           (batch, seq_len)        int64   segment of (x, y_b)
attention_mask_b      (batch, seq_len)        int64
token_type_ids_b      (batch, seq_len)        int64   (optional)
length_features       (batch, F)              float32 :func:`sdk.pair_features.pair_features` (x, a, b) of the
                                                      F names in ``selector.pair_features`` (the 3 length features
                                                      :func:`sdk.pair_encoding.length_features` by default)
**logit** (output)    (batch,)                float32 logit of P(y_a better than y_b)
===================== ======================= ======= =====================================================

``prefer`` scores both orders, as FedPrism's Phase III does ("it computes the probability logits for both
response orders", paper 000 §3.3), and returns the trainer's symmetrised probability
(``trainer.experts.selector.PairSelector.pair_proba``): ``P = sigmoid((l(a, b) - l(b, a)) / 2)``, so
``prefer(x, a, b) + prefer(x, b, a) == 1`` exactly. Each pair runs alone (both orders in one call of
batch 2): a dynamically quantised (int8) graph computes activation scales over its whole input, so
batching unrelated pairs would make a pair's score depend on its neighbours. The padding columns that
neither segment uses are cut before the call (exact: attention and pooling are masked; the graph's
sequence axis is dynamic), which also keeps padding out of the int8 activation scales.

Plugin (ARCHITECTURE.md §9, ``docs/plugins.md``): this module declares the artefact family ``selector``
(runtime interface :class:`SelectorScorer`, ``needs_embedder=False``: a selector bundle carries its own
backbone and no query embedder or model table) and registers its kind ``onnx_pair``
(:class:`OnnxPairSelectorKind`, one selector); :mod:`sdk.routed_selector` registers ``routed_onnx_pair``
(FedPrism on the device: prompt embedder + prompt router + the experts, each an ``onnx_pair`` graph). The kind names the *format* (an ONNX pair classifier over the
:mod:`sdk.pair_encoding` segments), not the training method: a FedPrism expert and FedBis's global
selector are both ``onnx_pair``; the method is recorded in ``selector.method``.

Manifest fields of a selector bundle (besides ``format_version``, ``created_utc``, ``bundle_version``,
``files``, ``signature``): ``"selector_kind": "onnx_pair"`` and ``"selector"`` =
``{"name", "backbone", "method", "expert", "files": {precision: file}, "pair_encoding": {...},
"pair_features": [F names], "n_length_features": F, "pooling", "lora"}`` (a bundle without ``pair_features``
reads the 3 length features), plus ``tokenizer.json`` (the backbone's) among the files.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from sdk import bundle_manifest as fmt
from sdk import kinds
from sdk.embedder import session_options
from sdk.errors import BundleError, InvalidInputError
from sdk.pair_encoding import PairEncodingConfig
from sdk.pair_scorer import (  # noqa: F401 - the graph contract's names, public here as before
    FAMILY, KIND, MANIFEST_KEY, OPTIONAL_INPUTS, OUTPUT_NAME, REQUIRED_INPUTS, SELECTOR_FILES, OnnxPairScorer, check_text,
    manifest_feature_names, need, selector_section,
)
from sdk.routed_selector import KIND as ROUTED_KIND
from sdk.routed_selector import RoutedOnnxPairSelectorKind


@runtime_checkable
class SelectorScorer(Protocol):
    """Runtime of a selector kind: ``logits(x, y_a, y_b) -> (l(a, b), l(b, a))``, each the logit of
    "the first response is better" (floats). Texts are already validated non-blank ``str``; a text the
    kind cannot read (no token) raises :class:`~sdk.errors.InvalidInputError` naming ``x``, ``y_a`` or ``y_b``."""

    def logits(self, x: str, y_a: str, y_b: str) -> tuple[float, float]: ...


class OnnxPairSelectorKind(kinds.ArtefactKind):
    """``selector/onnx_pair``: ``tokenizer.json`` + ``selector.onnx`` and/or ``selector.int8.onnx``
    (``selector.files`` maps precision -> file) -> :class:`OnnxPairScorer`. Not federated over HTTPS."""

    family = FAMILY
    name = KIND
    round_handler = None

    def precisions(self, manifest: dict) -> tuple[str, ...]:
        """Precisions the bundle ships, e.g. ``("fp32", "int8")``."""
        return tuple(manifest["selector"]["files"])

    def files(self, manifest: dict, precision: str) -> tuple[str, ...]:
        return (fmt.TOKENIZER_FILE, manifest["selector"]["files"][precision])

    def check_manifest(self, manifest: dict) -> None:
        files = manifest["files"]
        sel = selector_section(manifest)
        need(isinstance(sel.get("files"), dict) and sel["files"], "selector.files must map precision -> file name")
        for precision, name in sel["files"].items():
            need(precision in SELECTOR_FILES,
                 f"selector.files precision {precision!r} is not one of {sorted(SELECTOR_FILES)}")
            need(fmt.is_plain_file_name(name) and name in files,
                 f"selector file {name!r:.80} ({precision}) is not a file name listed in files")
        manifest_feature_names(sel)
        enc = sel.get("pair_encoding")
        need(isinstance(enc, dict), "selector.pair_encoding must be an object")
        try:
            PairEncodingConfig(**enc)
        except (TypeError, InvalidInputError) as exc:
            raise BundleError(f"manifest: selector.pair_encoding is invalid ({exc})") from exc
        need(fmt.TOKENIZER_FILE in files, f"{fmt.TOKENIZER_FILE} is not listed in files")

    def load(self, context: kinds.LoadContext) -> OnnxPairScorer:
        sel = context.manifest["selector"]
        try:
            tokenizer_json = context.files[fmt.TOKENIZER_FILE].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BundleError(f"tokenizer.json is not UTF-8 ({exc})") from exc
        return OnnxPairScorer(tokenizer_json, context.files[sel["files"][context.precision]],
                              PairEncodingConfig(**sel["pair_encoding"]), context.options,
                              f"selector ({context.precision})", manifest_feature_names(sel))


kinds.register_family(FAMILY, SelectorScorer, needs_embedder=False, loader="sdk.Selector.load")
if KIND not in kinds.names(FAMILY):
    kinds.register(OnnxPairSelectorKind())
if ROUTED_KIND not in kinds.names(FAMILY):
    kinds.register(RoutedOnnxPairSelectorKind())


class Selector:
    """A verified selector bundle, ready to compare two responses. Use :meth:`load`.

    Attributes
    ----------
    precision : ``"fp32"`` or ``"int8"``, the graph in use.
    bundle_version : int
    name : str, the selector's name in the manifest (e.g. ``fedprism-expert-2``).
    kind : str, the manifest's ``selector_kind``.
    """

    def __init__(self, manifest: dict, scorer: SelectorScorer, precision: str) -> None:
        self._manifest = manifest
        self._scorer = scorer
        self.precision = precision
        self.bundle_version = int(manifest["bundle_version"])
        self.name = manifest["selector"]["name"]
        self.kind = manifest[MANIFEST_KEY]

    @property
    def manifest(self) -> dict:
        """A copy of the bundle's verified manifest."""
        return copy.deepcopy(self._manifest)

    @classmethod
    def load(cls, bundle_dir, public_key, *, precision: str = "auto", intra_op_threads: int = 1,
             inter_op_threads: int = 1, min_bundle_version: int = 1) -> Selector:
        """Verify and load the selector bundle at ``bundle_dir``.

        Parameters
        ----------
        bundle_dir : path of a bundle written by ``fedroute export --selector``.
        public_key : path of ``signing.pub``, its PEM text (str or bytes) or an ``Ed25519PublicKey``.
        precision : ``"int8"``, ``"fp32"`` or ``"auto"`` (int8 when the bundle has it).
        intra_op_threads, inter_op_threads : onnxruntime thread counts, integers in [1, 1024].
        min_bundle_version : refuse a bundle older than this (a replayed, superseded bundle).

        Raises
        ------
        BundleError
            Signature or a sha256 does not verify, a file is missing, corrupt or unloadable, the bundle
            carries no selector (e.g. a router bundle), the precision is absent, the bundle is too old,
            or the graph's inputs/outputs are not the selector contract.
        InvalidInputError
            ``precision`` or a thread count is not valid.
        """
        if precision not in ("auto", "int8", "fp32"):
            raise InvalidInputError(f"precision must be 'auto', 'int8' or 'fp32', got {precision!r}")
        if isinstance(min_bundle_version, bool) or not isinstance(min_bundle_version, int):
            raise InvalidInputError(f"min_bundle_version must be an int, got {min_bundle_version!r}")
        options = session_options(intra_op_threads, inter_op_threads)
        chosen: dict[str, str] = {}

        def files_needed(manifest: dict) -> tuple[str, ...]:
            # Called once the signature and the schema verified.
            found = kinds.manifest_kinds(manifest)
            if FAMILY not in found:
                raise kinds.carries_no(FAMILY, found)
            if manifest["bundle_version"] < min_bundle_version:
                raise BundleError(f"bundle version {manifest['bundle_version']} is older than "
                                  f"min_bundle_version {min_bundle_version} (a superseded bundle)")
            kind = kinds.get(FAMILY, found[FAMILY])
            available = kind.precisions(manifest)
            want = ("int8" if "int8" in available else "fp32") if precision == "auto" else precision
            if want not in available:
                raise BundleError(f"bundle has no {want} selector (it has {sorted(available)})")
            chosen["precision"] = want
            return kind.files(manifest, want)

        verified = fmt.read_verified(bundle_dir, public_key, wanted=files_needed)
        scorer = kinds.load_artefact(FAMILY, verified.manifest, verified.files, options=options,
                                     precision=chosen["precision"])
        return cls(verified.manifest, scorer, chosen["precision"])

    # -- prediction ---------------------------------------------------------------------------

    def logits(self, x: str, y_a: str, y_b: str) -> tuple[float, float]:
        """The graph's logits for both orders: ``(l(a, b), l(b, a))``, each the logit of "first better".

        Raises
        ------
        InvalidInputError
            A text that is not a non-blank str, is not valid Unicode, or has no token the tokenizer can
            read (only control or zero-width characters).
        """
        return self._scorer.logits(check_text(x, "x"), check_text(y_a, "y_a"), check_text(y_b, "y_b"))

    def route(self, x: str) -> int | None:
        """Router index of the expert that scores prompt ``x``: the prompt router's choice for a routed
        bundle (``routed_onnx_pair``, :mod:`sdk.routed_selector`), the manifest's ``selector.expert`` (None for a
        selector that is not one expert of a run) for a single selector.

        Raises
        ------
        InvalidInputError
            ``x`` is not a non-blank str, or has no token the prompt embedder can read.
        """
        x = check_text(x, "x")
        return self._scorer.route(x) if hasattr(self._scorer, "route") else self._manifest["selector"]["expert"]

    def prefer(self, x: str, y_a: str, y_b: str) -> float:
        """Probability that ``y_a`` is a better response to ``x`` than ``y_b``, in [0, 1].

        Both orders are scored: ``sigmoid((l(a, b) - l(b, a)) / 2)`` (module docstring), so
        ``prefer(x, a, b) == 1 - prefer(x, b, a)``.

        Parameters
        ----------
        x : str, the prompt (its last ``pair_encoding.prompt_tokens`` tokens are read).
        y_a, y_b : str, the two candidate responses (their first ``response_tokens`` tokens are read;
            their full lengths enter the length features).

        Raises
        ------
        InvalidInputError
            ``x``, ``y_a`` or ``y_b`` is not a str, is empty / whitespace only, is not valid Unicode, or
            has no token the tokenizer can read (only control or zero-width characters, e.g. ``"\\x00"``).
        """
        l_ab, l_ba = self.logits(x, y_a, y_b)
        return _sigmoid(0.5 * (l_ab - l_ba))

    def prefer_many(self, x: Sequence[str], y_a: Sequence[str], y_b: Sequence[str]) -> np.ndarray:
        """:meth:`prefer` of n pairs: ndarray of shape (n,), float64.

        Raises
        ------
        InvalidInputError
            The three sequences differ in length, or any text is invalid (named as ``y_a[i]``; every text
            is checked before the first pair is scored, except for a text with no readable token, which
            is found when its pair is tokenised and named as ``pair i: y_a ...``).
        """
        for name, seq in (("x", x), ("y_a", y_a), ("y_b", y_b)):
            if isinstance(seq, str) or not isinstance(seq, Sequence):
                raise InvalidInputError(f"{name} must be a list of str, got {type(seq).__name__}")
        if not (len(x) == len(y_a) == len(y_b)):
            raise InvalidInputError(f"x, y_a, y_b must have one length, got {len(x)}, {len(y_a)}, {len(y_b)}")
        for i, texts in enumerate(zip(x, y_a, y_b)):
            for name, text in zip(("x", "y_a", "y_b"), texts):
                check_text(text, f"{name}[{i}]")
        out = np.empty(len(x), dtype=np.float64)
        for i, (p, a, b) in enumerate(zip(x, y_a, y_b)):
            try:
                out[i] = self.prefer(p, a, b)
            except InvalidInputError as exc:  # a text with no readable token: say which pair
                raise InvalidInputError(f"pair {i}: {exc}") from exc
        return out


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))

