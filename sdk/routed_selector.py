"""FedPrism on the device: the ``selector/routed_onnx_pair`` kind (paper 000 §3.2-3.3; ARCHITECTURE.md §7).

A routed selector bundle carries what the trainer's :class:`trainer.experts.fedprism.FedPrismTrainer`
uses to score a pair, and :meth:`sdk.Selector.prefer` runs it in the trainer's order:

1. **Prompt embedding** ``e(x)``: the frozen sentence embedder the router was trained on (MiniLM, mean
   pooled, L2-normalised, 256 tokens, left truncation: ``trainer.embeddings.EmbedderConfig``), as an ONNX
   graph with output ``sentence_embedding`` run by :class:`sdk.embedder.OnnxEmbedder` (files
   ``prompt_embedder.onnx`` / ``prompt_embedder.int8.onnx`` + ``prompt_embedder_tokenizer.json``).
2. **Route**: ``k* = argmax_k (W2 tanh(W1 e + b1) + b2)_k`` (with ``prompt_router.role_scale``, ``e`` is the
   embedding followed by ``role_scale * log(1 + count)`` of each of ``prompt_router.role_tags`` in the prompt,
   :func:`role_counts`: chat transcripts apart from instructions) (``trainer.experts.prompt_router.PromptRouter``,
   ``prompt_router.npz``: ``w1`` (hidden, dim), ``b1`` (hidden,), ``w2`` (M, hidden), ``b2`` (M,), float32),
   the argmax taken over the experts the bundle ships (all M by default; a top-k bundle ships the k experts
   the router sends most validation prompts to, and a prompt whose best expert is not shipped goes to the
   best shipped one); ties go to the lower index, as in torch.
3. **Score**: expert ``k*`` is an ``onnx_pair`` graph (:class:`sdk.pair_scorer.OnnxPairScorer`, the contract of
   :mod:`sdk.selector`; files ``expert_<k>.onnx`` / ``expert_<k>.int8.onnx``) run on both orders.

Manifest: ``"selector_kind": "routed_onnx_pair"`` and ``"selector"`` = ``{"name", "backbone", "method",
"expert": null, "experts": [k, ...] (router indices shipped, ascending), "n_experts": M, "top_k": k or null,
"files": {precision: ["expert_<k>.onnx", ...]}, "prompt_embedder": {"files": {precision: file},
"tokenizer", "dim", "max_tokens", "truncation_side"}, "prompt_router": {"file", "hidden"}, "pair_encoding",
"pair_features", "n_length_features", "pooling", "lora"}``, plus ``tokenizer.json`` (the experts' backbone tokenizer).

A run trained with ``FedPrismConfig.generator_prior`` adds ``"generator_prior": {"strengths": {generator: beta},
"weights": [gamma_k, one per router index]}`` (Bradley-Terry strengths in logit units from the clients' summed win
counts): when both generators of a pair are named and in ``strengths``, ``prefer`` adds
``gamma_k* (beta_A - beta_B)`` to the expert's logit ``(l(a, b) - l(b, a)) / 2``; otherwise it adds nothing, as the
trainer's ``g = 0`` for an unknown generator.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import numpy.typing as npt

from sdk import bundle_manifest as fmt
from sdk import kinds
from sdk.artefact_kind import utf8_file
from sdk.arrays import is_npz
from sdk.bundle_manifest import need
from sdk.embedder import OnnxEmbedder
from sdk.errors import BundleError
from sdk.pair_encoding import PairEncodingConfig
from sdk.pair_scorer import FAMILY, SELECTOR_FILES, OnnxPairScorer, manifest_feature_names, selector_section

F32 = npt.NDArray[np.float32]

KIND = "routed_onnx_pair"
ROUTER_FILE = "prompt_router.npz"
EMBEDDER_TOKENIZER_FILE = "prompt_embedder_tokenizer.json"
EMBEDDER_FILES = {"fp32": "prompt_embedder.onnx", "int8": "prompt_embedder.int8.onnx"}
ROUTER_ARRAYS = ("w1", "b1", "w2", "b2")
#: role tags of chat transcripts (HH-RLHF's "Human:" / "Assistant:", Vicuna's "USER:" / "ASSISTANT:", Alpaca's "###")
ROLE_TAGS = ("Human:", "Assistant:", "USER:", "ASSISTANT:", "### Instruction", "### Response")


def role_counts(prompts: list[str], tags: tuple[str, ...] = ROLE_TAGS) -> F32:
    """``log(1 + count)`` of each tag in each prompt: (n, len(tags)) float32."""
    return np.log1p(np.array([[p.count(t) for t in tags] for p in prompts], dtype=np.float32))


def expert_file(k: int, precision: str) -> str:
    """File name of expert ``k``'s graph: ``expert_<k>.onnx`` (fp32) or ``expert_<k>.int8.onnx``."""
    return SELECTOR_FILES[precision].replace("selector", f"expert_{k}")


def load_router_arrays(data: bytes, dim: int, n_experts: int) -> dict[str, F32]:
    """The four float32 arrays of ``prompt_router.npz``, shapes checked against ``dim`` and ``n_experts``.
    Raises BundleError for a file that is not such an ``.npz`` or holds non-finite values."""
    try:
        if not is_npz(data):
            raise ValueError("not an .npz archive")
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k], dtype=np.float32) for k in ROUTER_ARRAYS}
        hidden = arrays["b1"].shape[0] if arrays["b1"].ndim == 1 else -1
        want = {"w1": (hidden, dim), "b1": (hidden,), "w2": (n_experts, hidden), "b2": (n_experts,)}
        problem = next((f"{k} has shape {arrays[k].shape}, expected {shape} and finite values" for k, shape in want.items()
                        if arrays[k].shape != shape or not np.isfinite(arrays[k]).all()), None)
    except (KeyError, ValueError, OSError) as exc:
        problem = f"does not hold {ROUTER_ARRAYS} ({exc})"
    if problem:
        raise BundleError(f"{ROUTER_FILE}: {problem}")
    return arrays


class RoutedPairScorer:
    """The ``selector/routed_onnx_pair`` runtime: prompt ``embedder`` -> prompt ``router`` (:func:`load_router_arrays`)
    -> the routed one of the shipped ``experts`` (router index -> scorer)."""

    def __init__(self, embedder: OnnxEmbedder, router: dict[str, F32], experts: dict[int, OnnxPairScorer],
                 generator_prior: dict[str, Any] | None = None, roles: tuple[tuple[str, ...], float] = ((), 0.0)) -> None:
        self._embedder = embedder
        self._router = router
        self._experts = experts
        self._shipped = np.array(sorted(experts), dtype=np.int64)
        self._strengths: dict[str, float] = {} if generator_prior is None else generator_prior["strengths"]
        self._weights: list[float] = [] if generator_prior is None else generator_prior["weights"]
        self._tags, self._role_scale = roles

    def router_logits(self, x: str) -> F32:
        """The prompt router's logits for prompt ``x``: ndarray (M,) float32 (every expert, shipped or not)."""
        e = self._embedder.embed([x])[0]
        if self._tags:
            e = np.concatenate([e, self._role_scale * role_counts([x], self._tags)[0]])
        r = self._router
        logits: F32 = np.tanh(r["w1"] @ e + r["b1"]) @ r["w2"].T + r["b2"]
        return logits

    def route(self, x: str) -> int:
        """Router index of the expert that scores prompt ``x`` (argmax over the shipped experts)."""
        return int(self._shipped[np.argmax(self.router_logits(x)[self._shipped])])

    def logits(self, x: str, y_a: str, y_b: str) -> tuple[float, float]:
        """(l(a, b), l(b, a)) of the routed expert (:meth:`sdk.pair_scorer.OnnxPairScorer.logits`)."""
        l_ab, l_ba, _ = self.prior_logits(x, y_a, y_b, None, None)
        return l_ab, l_ba

    def prior_logits(self, x: str, y_a: str, y_b: str, generator_a: str | None,
                     generator_b: str | None) -> tuple[float, float, float]:
        """(l(a, b), l(b, a), prior): the routed expert's logits and its generator-prior logit
        ``gamma_k (beta_A - beta_B)`` (0.0 unless both generators are names in the bundle's strengths table)."""
        k = self.route(x)
        l_ab, l_ba = self._experts[k].logits(x, y_a, y_b)
        beta_a, beta_b = self._strengths.get(generator_a or ""), self._strengths.get(generator_b or "")
        prior = 0.0 if beta_a is None or beta_b is None else self._weights[k] * (beta_a - beta_b)
        return l_ab, l_ba, float(prior)


class RoutedOnnxPairSelectorKind(kinds.ArtefactKind):
    """``selector/routed_onnx_pair`` (module docstring) -> :class:`RoutedPairScorer`; registered by :mod:`sdk.selector`
    with the family. Not federated over HTTPS."""

    family = FAMILY
    name = KIND

    def precisions(self, manifest: dict[str, Any]) -> tuple[str, ...]:
        sel = manifest["selector"]
        return tuple(p for p in sel["files"] if p in sel["prompt_embedder"]["files"])

    def files(self, manifest: dict[str, Any], precision: str) -> tuple[str, ...]:
        sel = manifest["selector"]
        emb = sel["prompt_embedder"]
        return (fmt.TOKENIZER_FILE, EMBEDDER_TOKENIZER_FILE, emb["files"][precision], ROUTER_FILE,
                *sel["files"][precision])

    def check_manifest(self, manifest: dict[str, Any]) -> None:
        files = manifest["files"]
        sel = selector_section(manifest)
        n: Any = sel.get("n_experts")
        need(isinstance(n, int) and not isinstance(n, bool) and n >= 1, "selector.n_experts must be an int >= 1")
        shipped: Any = sel.get("experts")
        need(isinstance(shipped, list) and shipped and all(isinstance(k, int) and 0 <= k < n for k in shipped)
             and shipped == sorted(set(shipped)), "selector.experts must list distinct router indices in [0, n_experts), ascending")
        need(isinstance(sel.get("files"), dict) and sel["files"], "selector.files must map precision -> expert files")
        for precision, names in sel["files"].items():
            need(precision in SELECTOR_FILES, f"selector.files precision {precision!r} is not one of {sorted(SELECTOR_FILES)}")
            need(names == [expert_file(k, precision) for k in shipped],
                 f"selector.files[{precision!r}] must name the shipped experts' graphs in order")
            need(all(name in files for name in names), f"a {precision} expert graph is not listed in files")
        emb: Any = sel.get("prompt_embedder")
        need(isinstance(emb, dict) and isinstance(emb.get("files"), dict), "selector.prompt_embedder.files must be an object")
        for precision, name in emb["files"].items():
            need(precision in EMBEDDER_FILES and name == EMBEDDER_FILES[precision] and name in files,
                 f"selector.prompt_embedder file {name!r:.80} ({precision}) is not {EMBEDDER_FILES.get(precision)} in files")
        need(isinstance(emb.get("dim"), int) and emb["dim"] >= 1, "selector.prompt_embedder.dim must be an int >= 1")
        need(isinstance(emb.get("max_tokens"), int) and emb["max_tokens"] >= 8, "selector.prompt_embedder.max_tokens must be an int >= 8")
        need(emb.get("truncation_side") in ("left", "right"), "selector.prompt_embedder.truncation_side must be left or right")
        for name in (fmt.TOKENIZER_FILE, EMBEDDER_TOKENIZER_FILE, ROUTER_FILE):
            need(name in files, f"{name} is not listed in files")
        pr: Any = sel.get("prompt_router")
        need(isinstance(pr, dict) and isinstance(pr.get("role_tags", []), list) and all(isinstance(t, str) and t for t in pr.get("role_tags", []))
             and _finite(pr.get("role_scale", 0.0)), "selector.prompt_router.role_tags must list tags and role_scale be finite")
        prior: Any = sel.get("generator_prior", {"strengths": {}, "weights": [0.0] * n})
        need(isinstance(prior, dict) and isinstance(prior.get("strengths"), dict) and isinstance(prior.get("weights"), list)
             and len(prior["weights"]) == n and all(isinstance(k, str) for k in prior["strengths"])
             and all(_finite(v) for v in [*prior["strengths"].values(), *prior["weights"]]),
             "selector.generator_prior must hold strengths (generator -> finite number) and n_experts finite weights")

    def load(self, context: kinds.LoadContext) -> RoutedPairScorer:
        sel, precision = context.manifest["selector"], context.precision
        emb = sel["prompt_embedder"]
        tokenizer_json = utf8_file(context, fmt.TOKENIZER_FILE)
        embedder = OnnxEmbedder(utf8_file(context, EMBEDDER_TOKENIZER_FILE), context.files[emb["files"][precision]], emb["dim"], emb["max_tokens"],
                                emb["truncation_side"], context.options, batched=precision == "fp32")
        tags = tuple(sel["prompt_router"].get("role_tags", ()))
        router = load_router_arrays(context.files[ROUTER_FILE], emb["dim"] + len(tags), sel["n_experts"])
        encoding = PairEncodingConfig(**sel["pair_encoding"])
        names = manifest_feature_names(sel)
        experts = {k: OnnxPairScorer(tokenizer_json, context.files[name], encoding, context.options,
                                     f"expert {k} ({precision})", names)
                   for k, name in zip(sel["experts"], sel["files"][precision])}
        return RoutedPairScorer(embedder, router, experts, sel.get("generator_prior"),
                                (tags, float(sel["prompt_router"].get("role_scale", 0.0))))


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and bool(np.isfinite(v))

