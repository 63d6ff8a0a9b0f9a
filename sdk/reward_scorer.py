"""``RewardScorer``: a client's own MoR reward model and the federated client router, on the device.

A reward-scorer bundle (family ``reward_scorer``, kind ``mor``: the manifest says
``"reward_scorer_kind": "mor"``, :mod:`sdk.kinds`; written by :mod:`export.reward_export`) lets a device
score its own (prompt, response) pairs locally, with numpy, onnxruntime and tokenizers only (MoR,
paper 001: the reward model never leaves its client). This module declares the family (runtime
interface :class:`RewardGraphs`) and registers its two kinds at import: ``mor`` (:class:`MoRRewardScorerKind`,
an MLP reward model on the pair features, files below) and ``mor_lora`` (:class:`MoRLoRARewardScorerKind`,
a LoRA-tuned encoder with its adapter merged: ``reward.onnx`` reads the tokenised pair instead, see
:class:`sdk.pair_tokenizer.PairTokenizer` and :func:`check_lora_reward_manifest`; ``reward_tokenizer.json`` is its tokenizer).

- ``tokenizer.json`` + ``embedder.onnx``: the frozen sentence encoder ``e(.)`` (as :class:`sdk.Router`);
- ``reward.onnx``: input ``features (batch, d_in) float32`` -> outputs ``raw (batch,)`` (the
  Bradley-Terry reward ``R_k(x, y)``) and ``reward (batch,)`` (``(R_k - mu_k) / (sigma_k + eps)``,
  clipped when the client clips: the normalised score the client returns to the server);
- ``client_router.onnx``: input ``features (batch, d_in) float32`` -> output ``logits (batch, K)``,
  the federated router ``g_phi`` over the K clients.

The features are the trainer's ``Enc(x, y) = [e(x), e(y), l(y)]`` (``trainer.rewards.pair_features``):
the embeddings of the prompt and of the response, then, when the manifest's ``features.length_features``
is true, ``l(y) = log1p([characters, words, lines](y)) / length_scale`` from
:func:`sdk.pair_encoding.length_features_many`, measured on the full response. A response that is empty
or whitespace only is read as ``"(empty)"``, exactly as the trainer does.

Loading verifies the signature and every hash before any file is used (:func:`sdk.bundle_manifest.read_verified`;
the kind's :meth:`MoRRewardScorerKind.check_manifest` checks its fields), then that the graphs' inputs,
outputs and widths agree with the manifest; any failure raises :class:`~sdk.errors.BundleError` and
nothing is half-loaded.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from sdk import bundle_manifest as fmt
from sdk import kinds
from sdk.artefact_kind import ArtefactKind, LoadContext
from sdk.embedder import FLOAT, INT64, MAX_QUERY_CHARS, check_graph_inputs, inference_session, load_tokenizer, run_session, session_options
from sdk.arrays import finite_rows
from sdk.errors import BundleError, InvalidInputError, InvalidQueryError
from sdk.pair_encoding import length_features_many
from sdk.pair_tokenizer import PairTokenizer
from sdk.real_numbers import finite_float

FAMILY = "reward_scorer"
KIND = "mor"
REWARD_FILE = "reward.onnx"
CLIENT_ROUTER_FILE = "client_router.onnx"
EMPTY_RESPONSE = "(empty)"


def check_reward_manifest(manifest: dict) -> None:
    """The ``reward_scorer/mor`` fields of a manifest (after the common schema): ``client``,
    ``clients``, ``features``, ``reward`` and the two graph files.

    Raises
    ------
    BundleError
        The first violation, naming the field.
    """
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise BundleError(f"manifest: {what}")

    clients = manifest.get("clients")
    need(isinstance(clients, list) and len(clients) >= 2 and all(isinstance(c, str) and c for c in clients)
         and len(set(clients)) == len(clients), "clients must list >= 2 distinct client names")
    client = manifest.get("client")
    need(isinstance(client, dict) and isinstance(client.get("index"), int) and not isinstance(client.get("index"), bool)
         and 0 <= client["index"] < len(clients) and client.get("name") == clients[client["index"]],
         "client must be {name, index} with clients[index] == name")
    features = manifest.get("features")
    need(isinstance(features, dict) and isinstance(features.get("length_features"), bool)
         and isinstance(features.get("d_in"), int) and features["d_in"] > 0,
         "features must hold length_features (bool) and d_in (int > 0)")
    if features["length_features"]:
        scale = finite_float(features.get("length_scale"))
        need(scale is not None and scale > 0, "features.length_scale must be a finite number > 0")
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

    def reward(self, features: np.ndarray, prompts: list[str] | None, responses: list[str] | None) -> dict[str, np.ndarray]: ...

    def logits(self, features: np.ndarray) -> np.ndarray: ...


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
    for name, value in (("prompts", prompts), ("responses", responses)):
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise InvalidQueryError(f"{name} must be a list of str, got {type(value).__name__}")
    if len(prompts) != len(responses):
        raise InvalidQueryError(f"{len(prompts)} prompts but {len(responses)} responses")
    if len(prompts) == 0:
        raise InvalidQueryError("prompts is empty")
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not isinstance(p, str):
            raise InvalidQueryError(f"prompts[{i}] must be a str, got {type(p).__name__}")
        if not p.strip():
            raise InvalidQueryError(f"prompts[{i}] is empty or whitespace only; there is nothing to score")
        if not isinstance(r, str):
            raise InvalidQueryError(f"responses[{i}] must be a str, got {type(r).__name__}")
        for name, text in (("prompts", p), ("responses", r)):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidQueryError(f"{name}[{i}] is not valid Unicode ({exc.reason} at position {exc.start})") from exc
    return list(prompts), [r if r.strip() else EMPTY_RESPONSE for r in responses]


class _Graph:
    """One ONNX graph with a single ``features (batch, d_in)`` input; checks its outputs on load."""

    def __init__(self, model: bytes, what: str, d_in: int, outputs: dict[str, int | None], options) -> None:
        self._session = inference_session(model, options, what)
        check_graph_inputs(self._session, {"features": FLOAT}, {}, what)
        shape = self._session.get_inputs()[0].shape
        width = shape[-1] if shape else None
        if isinstance(width, int) and width != d_in:
            raise BundleError(f"{what}: input width {width}, the manifest declares d_in {d_in}")
        have = {o.name: o for o in self._session.get_outputs()}
        for name, last in outputs.items():
            if name not in have:
                raise BundleError(f"{what}: no output {name!r} (outputs: {sorted(have)})")
            shape = have[name].shape
            if last is not None and shape and isinstance(shape[-1], int) and shape[-1] != last:
                raise BundleError(f"{what}: output {name!r} has width {shape[-1]}, expected {last}")
        self._outputs = list(outputs)
        self._widths, self._what = dict(outputs), what

    def run(self, features: np.ndarray) -> dict[str, np.ndarray]:
        """The outputs for ``features`` (n, d_in) float32, each as float32.

        Raises
        ------
        BundleError
            onnxruntime fails to run the graph, or an output with a declared width has another
            shape than (n, width).
        """
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

    def reward(self, features: np.ndarray, prompts=None, responses=None) -> dict[str, np.ndarray]:
        out = self._reward.run(features)
        return {"raw": out["raw"].reshape(-1), "reward": out["reward"].reshape(-1)}

    def logits(self, features: np.ndarray) -> np.ndarray:
        return self._router.run(features)["logits"]


class MoRRewardScorerKind(ArtefactKind):
    """``reward_scorer/mor``: a client's MLP reward model on pair features + the client router (MoR)."""

    family = FAMILY
    name = KIND

    def files(self, manifest: dict, precision: str) -> tuple[str, ...]:
        return (REWARD_FILE, CLIENT_ROUTER_FILE)

    def check_manifest(self, manifest: dict) -> None:
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


def check_lora_reward_manifest(manifest: dict) -> None:
    """:func:`check_reward_manifest`, plus the ``mor_lora`` fields: ``reward.encoder`` =
    ``{"base_model": str, "max_tokens": int in [2, 65536], "truncation_side": "left"|"right", "length_term": bool,
    "lora": {...}}`` and ``reward_tokenizer.json`` among the files.

    Raises
    ------
    BundleError
        The first violation, naming the field.
    """
    check_reward_manifest(manifest)
    enc = manifest["reward"].get("encoder")
    ok = (isinstance(enc, dict) and isinstance(enc.get("base_model"), str)
          and isinstance(enc.get("max_tokens"), int) and not isinstance(enc.get("max_tokens"), bool)
          and 2 <= enc["max_tokens"] <= MAX_QUERY_CHARS
          and enc.get("truncation_side") in ("left", "right") and isinstance(enc.get("length_term"), bool))
    if not ok:
        raise BundleError(f"manifest: reward.encoder must hold base_model (str), max_tokens (int in [2, {MAX_QUERY_CHARS}]), "
                          "truncation_side ('left'|'right') and length_term (bool)")
    if enc["length_term"] and not manifest["features"].get("length_scale"):
        raise BundleError("manifest: reward.encoder.length_term needs features.length_scale")
    if REWARD_TOKENIZER_FILE not in manifest["files"]:
        raise BundleError(f"manifest: {REWARD_TOKENIZER_FILE} is not listed in files")


class _LoRARewardGraph:
    """``reward.onnx`` of kind ``mor_lora``: tokenised pair (+ ``lengths (batch, 3)`` float32) -> ``raw``,
    ``reward`` (batch,) float32. Checks its inputs and outputs on load."""

    def __init__(self, model: bytes, tokenizer: PairTokenizer, length_scale: float, options, batch_size: int = 16) -> None:
        self._session = inference_session(model, options, REWARD_FILE)
        inputs = [i.name for i in self._session.get_inputs()]
        check_graph_inputs(self._session, dict.fromkeys(LORA_REQUIRED_INPUTS, INT64),
                           {n: FLOAT if n == "lengths" else INT64 for n in LORA_OPTIONAL_INPUTS}, REWARD_FILE)
        outputs = {o.name for o in self._session.get_outputs()}
        if not {"raw", "reward"} <= outputs:
            raise BundleError(f"{REWARD_FILE}: no outputs 'raw' and 'reward' (outputs: {sorted(outputs)})")
        self._inputs, self._tokenizer = inputs, tokenizer
        self._length_scale, self._batch = float(length_scale), int(batch_size)

    def __call__(self, prompts: list[str], responses: list[str]) -> dict[str, np.ndarray]:
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

    def reward(self, features: np.ndarray, prompts=None, responses=None) -> dict[str, np.ndarray]:
        if prompts is None or responses is None:
            raise InvalidQueryError("this client's reward model (kind 'mor_lora') reads the prompt and response "
                                    "texts: pass them with the features")
        return self._reward(list(prompts), list(responses))

    def logits(self, features: np.ndarray) -> np.ndarray:
        return self._router.run(features)["logits"]


class MoRLoRARewardScorerKind(ArtefactKind):
    """``reward_scorer/mor_lora``: a client's LoRA-tuned encoder reward model (adapter merged into the
    encoder, mean pooling, linear head and optional length term; ``reward.onnx`` on the tokenised pair,
    ``reward_tokenizer.json``) + the client router on the pair features (as ``mor``)."""

    family = FAMILY
    name = LORA_KIND

    def files(self, manifest: dict, precision: str) -> tuple[str, ...]:
        return (REWARD_FILE, CLIENT_ROUTER_FILE, REWARD_TOKENIZER_FILE)

    def check_manifest(self, manifest: dict) -> None:
        check_lora_reward_manifest(manifest)

    def load(self, context: LoadContext) -> _LoRAMoRGraphs:
        manifest = context.manifest
        enc, features = manifest["reward"]["encoder"], manifest["features"]
        try:
            tokenizer_json = context.files[REWARD_TOKENIZER_FILE].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BundleError(f"{REWARD_TOKENIZER_FILE} is not UTF-8 text ({exc})") from exc
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
    """A client's reward model and the client router, loaded from a verified bundle. Use :meth:`load`.

    Attributes
    ----------
    client_name, client_index : this device's client.
    client_names : tuple of the K client names, in the router's order.
    bundle_version : int.
    d_in : width of the pair features.

    Thread-safe after loading (no state changes; onnxruntime's ``run`` is thread-safe).
    """

    def __init__(self, manifest: dict, embedder, graphs: RewardGraphs) -> None:
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
    def manifest(self) -> dict:
        """A copy of the bundle's verified manifest."""
        return copy.deepcopy(self._manifest)

    @classmethod
    def load(cls, bundle_dir, public_key, *, intra_op_threads: int = 1, inter_op_threads: int = 1,
             min_bundle_version: int = 1) -> RewardScorer:
        """Verify and load the reward-scorer bundle at ``bundle_dir``.

        Parameters
        ----------
        bundle_dir : path of a bundle written by ``fedroute mor export``.
        public_key : path of ``signing.pub``, its PEM text (str or bytes) or an ``Ed25519PublicKey``.
        intra_op_threads, inter_op_threads : onnxruntime thread counts, integers in [1, 1024].
        min_bundle_version : refuse a bundle older than this (a replayed, superseded bundle).

        Raises
        ------
        BundleError
            Signature or a sha256 does not verify, a file is missing or unloadable, the bundle is not a
            reward scorer (e.g. a router bundle), is older than ``min_bundle_version``, or its graphs
            disagree with the manifest (input width, number of clients).
        InvalidInputError
            A thread count or ``min_bundle_version`` that is not valid.
        """
        if isinstance(min_bundle_version, bool) or not isinstance(min_bundle_version, int):
            raise InvalidInputError(f"min_bundle_version must be an int, got {min_bundle_version!r}")
        options = session_options(intra_op_threads, inter_op_threads)

        def files_needed(manifest: dict):
            if manifest["bundle_version"] < min_bundle_version:
                raise BundleError(f"bundle version {manifest['bundle_version']} is older than "
                                  f"min_bundle_version {min_bundle_version} (a superseded bundle)")
            found = kinds.manifest_kinds(manifest)
            if FAMILY not in found:
                raise kinds.carries_no(FAMILY, found)
            return tuple(name for family, kind in found.items()
                         for name in kinds.get(family, kind).files(manifest, "fp32"))

        verified = fmt.read_verified(bundle_dir, public_key, wanted=files_needed)
        manifest = verified.manifest
        embedder = kinds.load_artefact(kinds.EMBEDDER_FAMILY, manifest, verified.files, options=options, precision="fp32")
        graphs = kinds.load_artefact(FAMILY, manifest, verified.files, options=options)
        return cls(manifest, embedder, graphs)

    # -- features --------------------------------------------------------------------------------

    def features(self, prompts: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        """The pair features ``[e(x), e(y), l(y)]``: ndarray of shape (n, d_in), float32.

        Raises
        ------
        InvalidQueryError
            Not two lists of str of the same non-zero length, or a blank prompt.
        """
        prompts, responses = _check_texts(prompts, responses)
        return self._features(prompts, responses)

    def _features(self, prompts: list[str], responses: list[str]) -> np.ndarray:
        texts = list(dict.fromkeys(prompts + responses))
        try:
            vecs = self._embedder.embed(texts)
        except InvalidQueryError as exc:  # its "position" counts the de-duplicated texts: name the caller's
            raise InvalidQueryError(f"{self._unreadable(prompts, responses)} has no token the embedder can read "
                                    "(only whitespace, control or zero-width characters?)") from exc
        row = {t: i for i, t in enumerate(texts)}
        parts = [vecs[[row[p] for p in prompts]], vecs[[row[r] for r in responses]]]
        if self._length:

            parts.append(length_features_many(responses, [""] * len(responses)) / self._length_scale)
        out = np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.float32)
        if out.shape[1] != self.d_in:
            raise BundleError(f"features have width {out.shape[1]}, the bundle declares {self.d_in}")
        return out

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

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str], *, normalised: bool = True) -> np.ndarray:
        """This client's reward of each pair: ndarray of shape (n,), float32.

        ``normalised=True`` (default) gives the z-normalised (and clipped, if the client clips) score
        the client would return to the server; False the raw Bradley-Terry reward.

        Raises
        ------
        InvalidQueryError
        InvalidInputError
            ``normalised`` is not a bool (None or 0 was taken as False).
        """
        if not isinstance(normalised, (bool, np.bool_)):
            raise InvalidInputError(f"normalised must be True or False, got {type(normalised).__name__} "
                                    f"{normalised!r:.80}")
        prompts, responses = _check_texts(prompts, responses)
        out = self._graphs.reward(self._features(prompts, responses), prompts, responses)
        return out["reward" if normalised else "raw"]

    def score(self, prompt: str, response: str, *, normalised: bool = True) -> float:
        """:meth:`score_batch` of one pair, as a float.

        Raises
        ------
        InvalidQueryError, InvalidInputError
        """
        return float(self.score_batch([prompt], [response], normalised=normalised)[0])

    def route_batch(self, prompts: Sequence[str], responses: Sequence[str]) -> list[ClientChoice]:
        """The federated router's client choice for each pair.

        Raises
        ------
        InvalidQueryError
        """
        prompts, responses = _check_texts(prompts, responses)
        logits = self._graphs.logits(self._features(prompts, responses))
        picks = logits.argmax(axis=1)
        return [ClientChoice(int(k), self.client_names[int(k)], tuple(float(v) for v in row), int(k) == self.client_index)
                for k, row in zip(picks, logits)]

    def route(self, prompt: str, response: str) -> ClientChoice:
        """:meth:`route_batch` of one pair.

        Raises
        ------
        InvalidQueryError
        """
        return self.route_batch([prompt], [response])[0]

    def scores_from_features(self, features: np.ndarray, prompts: Sequence[str] | None = None,
                             responses: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Outputs of the graphs for precomputed features (n, d_in) float32: ``raw``, ``reward`` (n,),
        ``logits`` (n, K). For parity checks against the trainer on the same features. A reward model
        that reads the texts (kind ``mor_lora``) needs the n ``prompts`` and ``responses`` too.

        Raises
        ------
        ShapeError
            Wrong shape or non-finite values.
        InvalidQueryError
            Texts that are not valid (or missing, for a kind that reads them), or not n of them.
        """
        features = finite_rows(features, self.d_in, "features")
        if prompts is not None or responses is not None:
            prompts, responses = _check_texts(prompts, responses)
            if len(prompts) != features.shape[0]:
                raise InvalidQueryError(f"{len(prompts)} pairs of texts for {features.shape[0]} rows of features")
        return self._graphs.reward(features, prompts, responses) | {"logits": self._graphs.logits(features)}

    def __repr__(self) -> str:
        return (f"RewardScorer(client={self.client_name!r}, clients={len(self.client_names)}, "
                f"bundle_version={self.bundle_version}, arch={self._manifest['reward']['arch']!r})")

