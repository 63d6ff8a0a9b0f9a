"""``Selector``: a trained binary preference selector on the device (FedPrism experts, paper 000 §3;
ARCHITECTURE.md §7): ``prefer(x, y_a, y_b)`` is the probability that ``y_a`` is the better response to ``x``.

Graph contract (``selector.onnx`` / ``selector.int8.onnx``, the backbone with its LoRA adapter merged + the head,
written by ``export.selector_export``): inputs ``input_ids_{a,b}``, ``attention_mask_{a,b}`` and optional
``token_type_ids_{a,b}`` (batch, seq_len) int64, the segments of (x, y_a) and (x, y_b) (:mod:`sdk.pair_encoding`),
and ``length_features`` (batch, F) float32 (:func:`sdk.pair_features.pair_features` of the manifest's
``selector.pair_features``); output ``logit`` (batch,) float32, the logit of P(y_a better), and optionally
``logit_ba`` (batch,) float32, the logit of P(y_b better) from the same segments with the features negated.
``prefer`` scores both orders, as FedPrism's Phase III does, and returns ``sigmoid((l(a, b) - l(b, a)) / 2)``, so
``prefer(x, a, b) + prefer(x, b, a) == 1``. Each pair runs alone (padding columns cut; an int8 graph's activation
scales span its whole input): batch 1 read from both outputs where the graph has ``logit_ba`` (2 segments
encoded), else batch 2 holding both orders (4 segments).

This module declares the family ``selector`` (``needs_embedder=False``: a bundle carries its own backbone and no
model table) and registers ``onnx_pair`` (one selector; ``selector.files`` maps precision -> file) and
:mod:`sdk.routed_selector`'s ``routed_onnx_pair``. The kind names the format, not the training method
(``selector.method``).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from sdk import bundle_manifest as fmt
from sdk import kinds
from sdk.artefact_kind import utf8_file
from sdk.bundle_manifest import need
from sdk.errors import InvalidInputError
from sdk.pair_encoding import PairEncodingConfig
from sdk.pair_scorer import (  # noqa: F401 - the graph contract's names, public here
    FAMILY, KIND, MANIFEST_KEY, OPTIONAL_INPUTS, OUTPUT_NAME, REQUIRED_INPUTS, SELECTOR_FILES, SWAPPED_OUTPUT_NAME,
    OnnxPairScorer, manifest_feature_names, selector_section,
)
from sdk.embedder import check_text
from sdk.routed_selector import KIND as ROUTED_KIND
from sdk.routed_selector import RoutedOnnxPairSelectorKind

#: ``precision="auto"`` loads the first of these the bundle ships.
AUTO_PRECISIONS = ("int8", "fp32")


@runtime_checkable
class SelectorScorer(Protocol):
    """Runtime of a selector kind: ``logits(x, y_a, y_b) -> (l(a, b), l(b, a))``, each the logit of "the first
    response is better". Texts are validated non-blank ``str``; one with no readable token raises
    :class:`~sdk.errors.InvalidInputError` naming it."""

    def logits(self, x: str, y_a: str, y_b: str) -> tuple[float, float]: ...


class OnnxPairSelectorKind(kinds.ArtefactKind):
    """``selector/onnx_pair``: ``tokenizer.json`` + ``selector.onnx`` and/or ``selector.int8.onnx``
    (``selector.files`` maps precision -> file) -> :class:`OnnxPairScorer`. Not federated over HTTPS."""

    family = FAMILY
    name = KIND

    def precisions(self, manifest: dict[str, Any]) -> tuple[str, ...]:
        return tuple(manifest["selector"]["files"])

    def files(self, manifest: dict[str, Any], precision: str) -> tuple[str, ...]:
        return (fmt.TOKENIZER_FILE, manifest["selector"]["files"][precision])

    def check_manifest(self, manifest: dict[str, Any]) -> None:
        sel = selector_section(manifest)
        need(isinstance(sel.get("files"), dict) and sel["files"], "selector.files must map precision -> file name")
        for precision, name in sel["files"].items():
            need(precision in SELECTOR_FILES and fmt.is_plain_file_name(name) and name in manifest["files"],
                 f"selector file {name!r:.80} ({precision!r}) is not a file name listed in files, of a precision "
                 f"in {sorted(SELECTOR_FILES)}")
        need(fmt.TOKENIZER_FILE in manifest["files"], f"{fmt.TOKENIZER_FILE} is not listed in files")

    def load(self, context: kinds.LoadContext) -> OnnxPairScorer:
        sel = context.manifest["selector"]
        return OnnxPairScorer(utf8_file(context, fmt.TOKENIZER_FILE), context.files[sel["files"][context.precision]],
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

    def __init__(self, manifest: dict[str, Any], scorer: SelectorScorer, precision: str) -> None:
        self._manifest = manifest
        self._scorer = scorer
        self.precision = precision
        self.bundle_version = int(manifest["bundle_version"])
        self.name = manifest["selector"]["name"]
        self.kind = manifest[MANIFEST_KEY]

    @property
    def manifest(self) -> dict[str, Any]:
        """A copy of the bundle's verified manifest."""
        return copy.deepcopy(self._manifest)

    @classmethod
    def load(cls, bundle_dir: str | os.PathLike[str], public_key: fmt.PublicKey, *, precision: str = "auto",
             intra_op_threads: int = 1, inter_op_threads: int = 1, min_bundle_version: int = 1) -> Selector:
        """Verify and load the selector bundle at ``bundle_dir`` (``fedroute export --selector``), as
        :meth:`sdk.Router.load` (:func:`sdk.kinds.load_bundle`); ``precision``: ``"int8"``, ``"fp32"`` or
        ``"auto"`` (int8 when the bundle has it).

        Raises
        ------
        BundleError
            Signature or a used file's sha256 does not verify, a file is missing, corrupt or unloadable, the
            bundle carries no selector, the precision is absent, the bundle is too old, or the graph is not the
            selector contract.
        InvalidInputError
            ``precision``, a thread count or ``min_bundle_version`` is not valid.
        """
        loaded = kinds.load_bundle(bundle_dir, public_key, FAMILY, precision=precision, preference=AUTO_PRECISIONS,
                                   intra_op_threads=intra_op_threads, inter_op_threads=inter_op_threads,
                                   min_bundle_version=min_bundle_version)
        return cls(loaded.manifest, loaded.runtimes[FAMILY], loaded.precision)

    # -- prediction ---------------------------------------------------------------------------

    def logits(self, x: str, y_a: str, y_b: str) -> tuple[float, float]:
        """The graph's logits for both orders: ``(l(a, b), l(b, a))``, each the logit of "first better".
        Raises InvalidInputError for a text that is not a non-blank str, not valid Unicode, or has no readable token."""
        return self._scorer.logits(check_text(x, "x"), check_text(y_a, "y_a"), check_text(y_b, "y_b"))

    def route(self, x: str) -> int | None:
        """Router index of the expert that scores prompt ``x`` (a routed bundle's prompt router's choice; a single
        selector's ``selector.expert``, None outside a run). Raises InvalidInputError for an unreadable ``x``."""
        x = check_text(x, "x")
        route = getattr(self._scorer, "route", None)
        expert: int | None = int(route(x)) if route is not None else self._manifest["selector"]["expert"]
        return expert

    def prefer(self, x: str, y_a: str, y_b: str, generator_a: str | None = None, generator_b: str | None = None) -> float:
        """Probability in [0, 1] that ``y_a`` is a better response to prompt ``x`` than ``y_b``:
        ``sigmoid((l(a, b) - l(b, a)) / 2 + prior)``, so ``prefer(x, a, b) == 1 - prefer(x, b, a)`` (generators
        swapped with them). ``generator_a`` / ``generator_b`` name the models that wrote the responses (as a router
        that picked them knows): with a bundle of a ``generator_prior`` run and both names in its strengths table,
        ``prior = gamma_k (beta_A - beta_B)`` (:mod:`sdk.routed_selector`); otherwise (None, an unknown name, a bundle
        without the table) ``prior = 0``.

        Raises
        ------
        InvalidInputError
            A text that is not a non-blank str, not valid Unicode, or has no token the tokenizer can read.
        """
        texts = check_text(x, "x"), check_text(y_a, "y_a"), check_text(y_b, "y_b")
        with_prior = getattr(self._scorer, "prior_logits", None)
        l_ab, l_ba, prior = with_prior(*texts, generator_a, generator_b) if with_prior else (*self._scorer.logits(*texts), 0.0)
        return _sigmoid(0.5 * (l_ab - l_ba) + prior)

    def prefer_many(self, x: Sequence[str], y_a: Sequence[str], y_b: Sequence[str],
                    generator_a: Sequence[str | None] | None = None,
                    generator_b: Sequence[str | None] | None = None) -> npt.NDArray[np.float64]:
        """:meth:`prefer` of n pairs: (n,) float64; ``generator_a`` / ``generator_b``: None or n names (or None).
        Raises InvalidInputError for sequences of different lengths or an invalid text (named ``y_a[i]``, or
        ``pair i: ...`` for one with no readable token)."""
        gen_a = [None] * len(x) if generator_a is None else generator_a
        gen_b = [None] * len(x) if generator_b is None else generator_b
        named = (("x", x), ("y_a", y_a), ("y_b", y_b), ("generator_a", gen_a), ("generator_b", gen_b))
        bad = [f"{name} must be a list of str, got {type(seq).__name__}" for name, seq in named
               if isinstance(seq, str) or not isinstance(seq, Sequence)]
        if bad or len({len(seq) for _, seq in named}) > 1:
            raise InvalidInputError(bad[0] if bad else "x, y_a, y_b (and generators) must have one length, got "
                                    + ", ".join(str(len(seq)) for _, seq in named))
        for i, texts in enumerate(zip(x, y_a, y_b)):
            for name, text in zip(("x", "y_a", "y_b"), texts):
                check_text(text, f"{name}[{i}]")
        out = np.empty(len(x), dtype=np.float64)
        for i, (p, a, b, g_a, g_b) in enumerate(zip(x, y_a, y_b, gen_a, gen_b)):
            try:
                out[i] = self.prefer(p, a, b, g_a, g_b)
            except InvalidInputError as exc:  # a text with no readable token: say which pair
                raise InvalidInputError(f"pair {i}: {exc}") from exc
        return out


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))

