"""``RewardScorer``: a client's own MoR reward model and the federated client router, on the device (MoR,
paper 001: the reward model never leaves its client).

This module declares the family ``reward_scorer`` (runtime interface :class:`RewardGraphs`; bundles written by
:mod:`export.reward_export`) and registers its kinds: ``mor`` (an MLP reward model on the pair features) and
``mor_lora`` (a LoRA-tuned encoder with its adapter merged, reading the tokenised pair,
:class:`sdk.pair_tokenizer.PairTokenizer`, with ``reward_tokenizer.json``). Files: ``tokenizer.json`` +
``embedder.onnx`` (the frozen sentence encoder ``e(.)``); ``reward.onnx``: ``features (batch, d_in) float32`` ->
``raw (batch,)`` (the Bradley-Terry reward ``R_k(x, y)``) and ``reward (batch,)`` (``(R_k - mu_k) / (sigma_k +
eps)``, clipped when the client clips); ``client_router.onnx``: ``features`` -> ``logits (batch, K)``, the router
``g_phi`` over the K clients. The features are the trainer's ``Enc(x, y) = [e(x), e(y), l(y)]``
(``trainer.rewards.pair_features``), ``l(y) = log1p([characters, words, lines](y)) / length_scale`` when
``features.length_features`` is true; a blank response is read as ``"(empty)"``, as the trainer does.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from sdk import bundle_manifest as fmt
from sdk import kinds
from sdk.artefact_kind import ArtefactKind, LoadContext, utf8_file
from sdk.arrays import finite_rows
from sdk.bundle_manifest import need
from sdk.embedder import (FLOAT, INT64, MAX_QUERY_CHARS, SessionThreads, check_graph_inputs, check_text,
                          inference_session, load_tokenizer, run_session)
from sdk.errors import BundleError, InvalidInputError, InvalidQueryError
from sdk.pair_encoding import length_features_many
from sdk.pair_tokenizer import PairTokenizer
from sdk.real_numbers import finite_float

FAMILY = "reward_scorer"
KIND = "mor"
REWARD_FILE = "reward.onnx"
CLIENT_ROUTER_FILE = "client_router.onnx"
EMPTY_RESPONSE = "(empty)"

F32 = npt.NDArray[np.float32]


def check_reward_manifest(manifest: dict[str, Any]) -> None:
    """The ``reward_scorer/mor`` fields: ``client``, ``clients``, ``features``, ``reward`` and the two graph files.
    Raises BundleError naming the first field that violates its rule."""
    clients: Any = manifest.get("clients")
    need(isinstance(clients, list) and len(clients) >= 2 and all(isinstance(c, str) and c for c in clients)
         and len(set(clients)) == len(clients), "clients must list >= 2 distinct client names")
    client: Any = manifest.get("client")
    need(isinstance(client, dict) and type(client.get("index")) is int and 0 <= client["index"] < len(clients)
         and client.get("name") == clients[client["index"]], "client must be {name, index} with clients[index] == name")
    features: Any = manifest.get("features")
    need(isinstance(features, dict) and isinstance(features.get("length_features"), bool)
         and isinstance(features.get("d_in"), int) and features["d_in"] > 0,
         "features must hold length_features (bool) and d_in (int > 0)")
    scale = finite_float(features.get("length_scale"))
    need(not features["length_features"] or (scale is not None and scale > 0),
         "features.length_scale must be a finite number > 0")
    expected = 2 * manifest["embedder"]["dim"] + (3 if features["length_features"] else 0)
    need(features["d_in"] == expected, f"features.d_in {features['d_in']} != 2 * embedder.dim"
         f"{' + 3' if features['length_features'] else ''} = {expected}")
    reward = manifest.get("reward")
    need(isinstance(reward, dict) and isinstance(reward.get("arch"), str), "reward must be an object with arch")
    for name in (REWARD_FILE, CLIENT_ROUTER_FILE):
        need(name in manifest["files"], f"{name} is not listed in files")
    need("fp32" in manifest["embedder"]["files"], "a reward scorer ships the fp32 embedder")


@runtime_checkable
class RewardGraphs(Protocol):
    """Runtime of a ``reward_scorer`` kind.

    ``reward(features, prompts, responses) -> {"raw": (n,), "reward": (n,)}`` float32: the raw and the
    normalised reward of this client. ``features`` (n, d_in) float32 are finite (validated by
    :class:`RewardScorer`); ``prompts``, ``responses`` are the n validated texts (blank responses read as
    ``"(empty)"``), or None when the caller has features only (a kind that reads the texts then raises
    :class:`~sdk.errors.InvalidQueryError`).

    ``logits(features) -> (n, K)`` float32: the client router's logits.
    """

    def reward(self, features: F32, prompts: list[str] | None, responses: list[str] | None) -> dict[str, F32]: ...

    def logits(self, features: F32) -> F32: ...


@dataclass(frozen=True)
class ClientChoice:
    """The federated router's choice for one pair.

    index : int, the client the router would ask (argmax of the logits).
    name : its name.
    logits : tuple of K floats, the router's logits.
    own : True when the router picks this device's own client.
    """

    index: int
    name: str
    logits: tuple[float, ...]
    own: bool


def _check_texts(prompts: object, responses: object) -> tuple[list[str], list[str]]:
    bad = [f"{name} must be a non-empty list of str, got {type(value).__name__}" for name, value in
           (("prompts", prompts), ("responses", responses)) if isinstance(value, str) or not isinstance(value, Sequence)
           or len(value) == 0]
    if bad or len(prompts) != len(responses):  # type: ignore[arg-type]
        raise InvalidQueryError("; ".join(bad) or f"{len(prompts)} prompts but {len(responses)} responses")  # type: ignore[arg-type]
    out: list[str] = []
    for i, (p, r) in enumerate(zip(prompts, responses)):  # type: ignore[call-overload]
        check_text(p, f"prompts[{i}]", InvalidQueryError, "; there is nothing to score")
        blank = isinstance(r, str) and not r.strip()
        out.append(EMPTY_RESPONSE if blank else check_text(r, f"responses[{i}]", InvalidQueryError))
    return list(prompts), out  # type: ignore[call-overload]


class _Graph:
    """One ONNX graph with a single ``features (batch, d_in)`` input; checks its outputs on load."""

    def __init__(self, model: bytes, what: str, d_in: int, outputs: dict[str, int | None],
                 options: SessionThreads | None) -> None:
        self._session = inference_session(model, options, what)
        check_graph_inputs(self._session, {"features": FLOAT}, {}, what)
        widths = {o.name: (o.shape or [None])[-1] for o in self._session.get_outputs()}
        declared = {"features": (self._session.get_inputs()[0].shape or [None])[-1], **widths}
        for name, want in {"features": d_in, **outputs}.items():
            if name not in declared or (want is not None and isinstance(declared[name], int) and declared[name] != want):
                raise BundleError(f"{what}: {name!r} of width {want or 'any'} expected (the manifest's d_in and "
                                  f"clients), the graph has widths {declared}")
        self._outputs = list(outputs)
        self._widths, self._what = dict(outputs), what

    def run(self, features: F32) -> dict[str, F32]:
        """The outputs for ``features`` (n, d_in) float32, each as float32. Raises BundleError when the graph
        fails or an output with a declared width is not (n, width)."""
        values = run_session(self._session, self._outputs, {"features": features}, self._what)
        out = {n: np.asarray(v, dtype=np.float32) for n, v in zip(self._outputs, values)}
        for name, width in self._widths.items():
            if width is not None and out[name].shape != (features.shape[0], width):
                raise BundleError(f"{self._what}: output {name!r} has shape {out[name].shape}, expected "
                                  f"({features.shape[0]}, {width})")
        return out


class _MoRGraphs:
    """``reward.onnx`` (on the pair features) + ``client_router.onnx`` as one :class:`RewardGraphs`."""

    def __init__(self, reward: _Graph, router: _Graph) -> None:
        self._reward, self._router = reward, router

    def reward(self, features: F32, prompts: list[str] | None = None,
               responses: list[str] | None = None) -> dict[str, F32]:
        out = self._reward.run(features)
        return {"raw": out["raw"].reshape(-1), "reward": out["reward"].reshape(-1)}

    def logits(self, features: F32) -> F32:
        return self._router.run(features)["logits"]


class MoRRewardScorerKind(ArtefactKind):
    """``reward_scorer/mor``: a client's MLP reward model on pair features + the client router (MoR)."""

    family = FAMILY
    name = KIND

    def files(self, manifest: dict[str, Any], precision: str) -> tuple[str, ...]:
        return (REWARD_FILE, CLIENT_ROUTER_FILE)

    def check_manifest(self, manifest: dict[str, Any]) -> None:
        check_reward_manifest(manifest)

    def load(self, context: LoadContext) -> _MoRGraphs:
        manifest = context.manifest
        d_in, n_clients = manifest["features"]["d_in"], len(manifest["clients"])
        reward = _Graph(context.files[REWARD_FILE], REWARD_FILE, d_in, {"raw": None, "reward": None}, context.options)
        router = _Graph(context.files[CLIENT_ROUTER_FILE], CLIENT_ROUTER_FILE, d_in, {"logits": n_clients},
                        context.options)
        return _MoRGraphs(reward, router)


kinds.register_family(FAMILY, RewardGraphs, loader="sdk.RewardScorer.load")
if KIND not in kinds.names(FAMILY):
    kinds.register(MoRRewardScorerKind())


# -- kind "mor_lora": a LoRA-tuned encoder reward model (adapter merged) reading the tokenised pair ------------

LORA_KIND = "mor_lora"
REWARD_TOKENIZER_FILE = "reward_tokenizer.json"
#: Inputs of the ``mor_lora`` ``reward.onnx``; token types and lengths are fed only when the graph declares them.
LORA_REQUIRED_INPUTS = ("input_ids", "attention_mask")
LORA_OPTIONAL_INPUTS = ("token_type_ids", "lengths")


def check_lora_reward_manifest(manifest: dict[str, Any]) -> None:
    """:func:`check_reward_manifest` plus ``reward.encoder`` = ``{"base_model": str, "max_tokens": int in [2, 65536],
    "truncation_side": "left"|"right", "length_term": bool, "lora": {...}}`` and ``reward_tokenizer.json``.
    Raises BundleError naming the first field that violates its rule."""
    check_reward_manifest(manifest)
    enc = manifest["reward"].get("encoder")
    need(isinstance(enc, dict) and isinstance(enc.get("base_model"), str) and type(enc.get("max_tokens")) is int
         and 2 <= enc["max_tokens"] <= MAX_QUERY_CHARS and enc.get("truncation_side") in ("left", "right")
         and isinstance(enc.get("length_term"), bool),
         f"reward.encoder must hold base_model (str), max_tokens (int in [2, {MAX_QUERY_CHARS}]), truncation_side "
         "('left'|'right') and length_term (bool)")
    need(not enc["length_term"] or manifest["features"].get("length_scale"),
         "reward.encoder.length_term needs features.length_scale")
    need(REWARD_TOKENIZER_FILE in manifest["files"], f"{REWARD_TOKENIZER_FILE} is not listed in files")


class _LoRARewardGraph:
    """``reward.onnx`` of kind ``mor_lora``: tokenised pair (+ ``lengths (batch, 3)`` float32) -> ``raw``,
    ``reward`` (batch,) float32. Checks its inputs and outputs on load."""

    def __init__(self, model: bytes, tokenizer: PairTokenizer, length_scale: float, options: SessionThreads | None,
                 batch_size: int = 16) -> None:
        self._session = inference_session(model, options, REWARD_FILE)
        inputs = [i.name for i in self._session.get_inputs()]
        check_graph_inputs(self._session, dict.fromkeys(LORA_REQUIRED_INPUTS, INT64),
                           {n: FLOAT if n == "lengths" else INT64 for n in LORA_OPTIONAL_INPUTS}, REWARD_FILE)
        outputs = {o.name for o in self._session.get_outputs()}
        if not {"raw", "reward"} <= outputs:
            raise BundleError(f"{REWARD_FILE}: no outputs 'raw' and 'reward' (outputs: {sorted(outputs)})")
        self._inputs, self._tokenizer = inputs, tokenizer
        self._length_scale, self._batch = float(length_scale), int(batch_size)

    def __call__(self, prompts: list[str], responses: list[str]) -> dict[str, F32]:
        raw, reward = [], []
        for s in range(0, len(prompts), self._batch):
            p, r = prompts[s : s + self._batch], responses[s : s + self._batch]
            feeds = self._tokenizer(p, r)
            feeds["lengths"] = (length_features_many(r, [""] * len(r)) / self._length_scale).astype(np.float32)
            a, b = run_session(self._session, ["raw", "reward"], {k: feeds[k] for k in self._inputs}, REWARD_FILE)
            raw.append(np.asarray(a, dtype=np.float32).reshape(-1))
            reward.append(np.asarray(b, dtype=np.float32).reshape(-1))
        return {"raw": np.concatenate(raw), "reward": np.concatenate(reward)}


class _LoRAMoRGraphs:
    """``mor_lora``'s reward graph (reads the texts) + ``client_router.onnx`` (reads the features)."""

    def __init__(self, reward: _LoRARewardGraph, router: _Graph) -> None:
        self._reward, self._router = reward, router

    def reward(self, features: F32, prompts: list[str] | None = None,
               responses: list[str] | None = None) -> dict[str, F32]:
        if prompts is None or responses is None:
            raise InvalidQueryError("this client's reward model (kind 'mor_lora') reads the prompt and response "
                                    "texts: pass them with the features")
        return self._reward(list(prompts), list(responses))

    def logits(self, features: F32) -> F32:
        return self._router.run(features)["logits"]


class MoRLoRARewardScorerKind(ArtefactKind):
    """``reward_scorer/mor_lora``: a client's LoRA-tuned encoder reward model (adapter merged into the
    encoder, mean pooling, linear head and optional length term; ``reward.onnx`` on the tokenised pair,
    ``reward_tokenizer.json``) + the client router on the pair features (as ``mor``)."""

    family = FAMILY
    name = LORA_KIND

    def files(self, manifest: dict[str, Any], precision: str) -> tuple[str, ...]:
        return (REWARD_FILE, CLIENT_ROUTER_FILE, REWARD_TOKENIZER_FILE)

    def check_manifest(self, manifest: dict[str, Any]) -> None:
        check_lora_reward_manifest(manifest)

    def load(self, context: LoadContext) -> _LoRAMoRGraphs:
        manifest = context.manifest
        enc, features = manifest["reward"]["encoder"], manifest["features"]
        tokenizer_json = utf8_file(context, REWARD_TOKENIZER_FILE)
        try:
            tokenizer = PairTokenizer(load_tokenizer(tokenizer_json, REWARD_TOKENIZER_FILE), enc["max_tokens"], enc["truncation_side"])
        except InvalidInputError as exc:
            raise BundleError(f"manifest: reward.encoder: {exc}") from exc
        reward = _LoRARewardGraph(context.files[REWARD_FILE], tokenizer, features.get("length_scale", 1.0), context.options)
        router = _Graph(context.files[CLIENT_ROUTER_FILE], CLIENT_ROUTER_FILE, features["d_in"],
                        {"logits": len(manifest["clients"])}, context.options)
        return _LoRAMoRGraphs(reward, router)


if LORA_KIND not in kinds.names(FAMILY):
    kinds.register(MoRLoRARewardScorerKind())


class RewardScorer:
    """A client's reward model and the client router from a verified bundle (use :meth:`load`); thread-safe.

    Attributes: ``client_name``, ``client_index`` (this device's client), ``client_names`` (the K clients in the
    router's order), ``bundle_version``, ``d_in`` (width of the pair features).
    """

    def __init__(self, manifest: dict[str, Any], embedder: kinds.Embedder, graphs: RewardGraphs) -> None:
        self._manifest = copy.deepcopy(manifest)
        self._embedder, self._graphs = embedder, graphs
        self.client_names = tuple(manifest["clients"])
        self.client_index = int(manifest["client"]["index"])
        self.client_name = manifest["client"]["name"]
        self.bundle_version = int(manifest["bundle_version"])
        features = manifest["features"]
        self.d_in = int(features["d_in"])
        self._length = bool(features["length_features"])
        self._length_scale = float(features.get("length_scale", 1.0))

    @property
    def manifest(self) -> dict[str, Any]:
        """A copy of the bundle's verified manifest."""
        return copy.deepcopy(self._manifest)

    @classmethod
    def load(cls, bundle_dir: str | os.PathLike[str], public_key: fmt.PublicKey, *, intra_op_threads: int = 1,
             inter_op_threads: int = 1, min_bundle_version: int = 1) -> RewardScorer:
        """Verify and load the reward-scorer bundle at ``bundle_dir`` (``fedroute mor export``), as
        :meth:`sdk.Router.load` (:func:`sdk.kinds.load_bundle`; the fp32 embedder).

        Raises
        ------
        BundleError
            Signature or a used file's sha256 does not verify, a file is missing or unloadable, the bundle is not
            a reward scorer, is older than ``min_bundle_version``, or its graphs disagree with the manifest.
        InvalidInputError
            A thread count or ``min_bundle_version`` that is not valid.
        """
        loaded = kinds.load_bundle(bundle_dir, public_key, FAMILY, intra_op_threads=intra_op_threads,
                                   inter_op_threads=inter_op_threads, min_bundle_version=min_bundle_version)
        return cls(loaded.manifest, loaded.runtimes[kinds.EMBEDDER_FAMILY], loaded.runtimes[FAMILY])

    # -- features --------------------------------------------------------------------------------

    def features(self, prompts: Sequence[str], responses: Sequence[str]) -> F32:
        """The pair features ``[e(x), e(y), l(y)]``: (n, d_in) float32. Raises InvalidQueryError unless given two
        lists of str of one non-zero length, with no blank prompt."""
        prompts, responses = _check_texts(prompts, responses)
        return self._features(prompts, responses)

    def _features(self, prompts: list[str], responses: list[str]) -> F32:
        texts = list(dict.fromkeys(prompts + responses))
        try:
            vecs = self._embedder.embed(texts)
        except InvalidQueryError as exc:  # its "position" counts the de-duplicated texts: name the caller's
            raise InvalidQueryError(f"{self._unreadable(prompts, responses)} has no token the embedder can read "
                                    "(only whitespace, control or zero-width characters?)") from exc
        row = {t: i for i, t in enumerate(texts)}
        parts: list[npt.NDArray[Any]] = [vecs[[row[p] for p in prompts]], vecs[[row[r] for r in responses]]]
        if self._length:
            parts.append(length_features_many(responses, [""] * len(responses)) / self._length_scale)
        return np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.float32)  # width checked by the manifest

    def _unreadable(self, prompts: list[str], responses: list[str]) -> str:
        """``prompts[i]`` or ``responses[i]``, the first text the embedder refuses (called after it refused one)."""
        for name, texts in (("prompts", prompts), ("responses", responses)):
            for i, text in enumerate(texts):
                try:
                    self._embedder.embed([text])
                except InvalidQueryError:
                    return f"{name}[{i}]"
        return "a text"  # not reached: the batch was refused for one of its texts

    # -- scores and routing ------------------------------------------------------------------------

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str], *, normalised: bool = True) -> F32:
        """This client's reward of each pair, (n,) float32: z-normalised (and clipped, if the client clips), as the
        client returns it to the server, or the raw Bradley-Terry reward (``normalised=False``).
        Raises InvalidQueryError, or InvalidInputError when ``normalised`` is not a bool."""
        if not isinstance(normalised, (bool, np.bool_)):
            raise InvalidInputError(f"normalised must be True or False, got {type(normalised).__name__} "
                                    f"{normalised!r:.80}")
        prompts, responses = _check_texts(prompts, responses)
        out = self._graphs.reward(self._features(prompts, responses), prompts, responses)
        return out["reward" if normalised else "raw"]

    def score(self, prompt: str, response: str, *, normalised: bool = True) -> float:
        """:meth:`score_batch` of one pair, as a float. Raises InvalidQueryError, InvalidInputError."""
        return float(self.score_batch([prompt], [response], normalised=normalised)[0])

    def route_batch(self, prompts: Sequence[str], responses: Sequence[str]) -> list[ClientChoice]:
        """The federated router's client choice for each pair. Raises InvalidQueryError."""
        prompts, responses = _check_texts(prompts, responses)
        logits = self._graphs.logits(self._features(prompts, responses))
        picks = logits.argmax(axis=1)
        return [ClientChoice(int(k), self.client_names[int(k)], tuple(float(v) for v in row), int(k) == self.client_index)
                for k, row in zip(picks, logits)]

    def route(self, prompt: str, response: str) -> ClientChoice:
        """:meth:`route_batch` of one pair. Raises InvalidQueryError."""
        return self.route_batch([prompt], [response])[0]

    def scores_from_features(self, features: npt.ArrayLike, prompts: Sequence[str] | None = None,
                             responses: Sequence[str] | None = None) -> dict[str, F32]:
        """The graphs' outputs ``raw``, ``reward`` (n,) and ``logits`` (n, K) for precomputed (n, d_in) float32
        features (parity checks); a kind that reads the texts (``mor_lora``) needs the n ``prompts`` and ``responses``.

        Raises
        ------
        ShapeError
            Wrong shape or non-finite values.
        InvalidQueryError
            Texts that are not valid (or missing, for a kind that reads them), or not n of them.
        """
        x = finite_rows(features, self.d_in, "features")
        texts: tuple[list[str] | None, list[str] | None] = (None, None)
        if prompts is not None or responses is not None:
            texts = _check_texts(prompts, responses)
            if len(texts[0]) != x.shape[0]:
                raise InvalidQueryError(f"{len(texts[0])} pairs of texts for {x.shape[0]} rows of features")
        return self._graphs.reward(x, *texts) | {"logits": self._graphs.logits(x)}

    def __repr__(self) -> str:
        return (f"RewardScorer(client={self.client_name!r}, clients={len(self.client_names)}, "
                f"bundle_version={self.bundle_version}, arch={self._manifest['reward']['arch']!r})")

