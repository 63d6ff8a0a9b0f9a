"""The routed reward of MoR (paper 001, Sec. "GRPO with MoR"): the router picks or mixes client
reward models per (prompt, response).

``RoutedReward(router, reward_models, encoder, mode)``; ``reward(prompts, responses) -> ndarray (n,) float32``:

- ``mode="sparse"`` (what the paper runs): ``k* = argmax_k g_phi(x, y)_k`` and the reward is client
  k*'s normalised score ``R_bar_k*(x, y)``; only client k* is queried for that pair.
- ``mode="soft"``: ``R_mix = sum_k softmax(g_phi(x, y))_k R_bar_k(x, y)`` (paper 001, Eq. ``R_mix``);
  every client is queried.

``temperature`` T divides the logits before the softmax (soft weights ``softmax(z / T)``; T < 1 sharpens
towards sparse routing, T > 1 flattens towards AvgRM). ``route_by="prompt"`` routes the responses of one call
that share a prompt together: each gets the mean of their routing probabilities (sparse: the top-1 client of
that mean, so a group of responses to one prompt, e.g. a GRPO group or a preference pair, is scored by one
client on one scale). ``route_by="response"`` (default) is the paper's per-(x, y) routing.

``normalise=False`` uses raw rewards (the "w/o Norm" ablation). ``queries_`` counts, per client, the
pairs it was asked to score (the communication of reward queries); ``last_choice_`` holds the chosen
client index per pair of the last call.

Saved layout (:func:`save_mixture` / :func:`load_mixture`)::

    DIR/mixture.json   {"format_version": 1, "mode": "sparse"|"soft", "normalise": bool,
                        "temperature": float (default 1), "route_by": "response"|"prompt" (default "response"),
                        "client_names": [K str], "embedder": {EmbedderConfig fields},
                        "length_features": bool,
                        "router": "router", "clients": {"<name>": "clients/<name>"}}
    DIR/router/        ClientRouter.save layout (router.json, router.safetensors)
    DIR/clients/<name>/ reward model layout of trainer.rewards.reward_models (reward_model.json + weights)

The router reads ``PairEncoder(EmbedderConfig(**embedder)).encode(prompts, responses)``, i.e.
``[e(x), e(y), l(y)]`` of width 2 * 384 + 3 for MiniLM (``2 * 384`` when ``length_features`` is false); client ``k`` of the router's logits is
``client_names[k]``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from sdk.errors import InvalidInputError, ShapeError
from trainer.embeddings import EmbedderConfig
from trainer.rewards.client_router import ClientRouter
from trainer.rewards.pair_features import PairEncoder
from trainer.rewards.reward_models import ClientRewardModel, MLPRewardModel, load_reward_model

MODES = ("sparse", "soft")
ROUTE_BY = ("response", "prompt")
FORMAT_VERSION = 1


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of (n, K) logits, float64."""
    z = np.asarray(logits, dtype=np.float64)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


class RoutedReward:
    """Routed reward over client reward models (module docstring).

    router : ClientRouter with ``n_clients == len(reward_models)``.
    reward_models : sequence of K ClientRewardModel, in the router's client order.
    encoder : PairEncoder producing the router's input features.
    mode : ``"sparse"`` or ``"soft"``; normalise : use ``R_bar_k`` (True) or raw ``R_k`` (False).
    temperature : softmax temperature of the routing probabilities (> 0). route_by : ``"response"`` or
    ``"prompt"`` (module docstring).
    """

    def __init__(self, router: ClientRouter, reward_models: Sequence[ClientRewardModel], encoder: PairEncoder,
                 mode: str = "sparse", normalise: bool = True, temperature: float = 1.0, route_by: str = "response") -> None:
        if mode not in MODES:
            raise InvalidInputError(f"mode must be one of {list(MODES)}, got {mode!r}")
        if route_by not in ROUTE_BY or not float(temperature) > 0:
            raise InvalidInputError(f"route_by must be one of {list(ROUTE_BY)} and temperature > 0, got {route_by!r}, {temperature}")
        self.temperature, self.route_by = float(temperature), route_by
        if router.n_clients != len(reward_models):
            raise ShapeError(f"router has {router.n_clients} clients but {len(reward_models)} reward models were given")
        self.router, self.reward_models, self.encoder = router, list(reward_models), encoder
        self.mode, self.normalise = mode, bool(normalise)
        self.queries_ = np.zeros(len(self.reward_models), dtype=np.int64)
        self.last_choice_: np.ndarray | None = None

    @property
    def client_names(self) -> list[str]:
        return list(self.router.client_names)

    def route(self, prompts: Sequence[str], responses: Sequence[str], features: np.ndarray | None = None) -> np.ndarray:
        """Router logits (n, K) float32 for the pairs (``features`` skips the encoder)."""
        if features is None:
            features = self.encoder.encode(prompts, responses)
        return self.router.logits(features)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], features: np.ndarray | None = None,
                 logits: np.ndarray | None = None) -> np.ndarray:
        """Routed rewards of the pairs.

        Parameters
        ----------
        prompts, responses : sequences of n str.
        features : optional (n, d_in) float32 router features (else encoded here).
        logits : optional (n, K) router logits (e.g. after an online update); overrides the router.

        Returns ndarray of shape (n,), float32. Raises InvalidInputError on length mismatch or n = 0.
        """
        prompts, responses = list(prompts), list(responses)
        if len(prompts) != len(responses) or not prompts:
            raise InvalidInputError(f"need n >= 1 prompts and as many responses, got {len(prompts)} and {len(responses)}")
        if logits is None:
            logits = self.route(prompts, responses, features)
        logits = np.asarray(logits)
        if logits.shape != (len(prompts), len(self.reward_models)):
            raise ShapeError(f"logits must have shape ({len(prompts)}, {len(self.reward_models)}), got {logits.shape}")
        out = np.zeros(len(prompts), dtype=np.float64)
        w = self.weights(prompts, logits)
        choice = np.argmax(w, axis=1)
        if self.mode == "sparse":
            for k in np.unique(choice):
                idx = np.flatnonzero(choice == k)
                out[idx] = self._ask(int(k), [prompts[i] for i in idx], [responses[i] for i in idx], features, idx)
        else:
            for k in range(len(self.reward_models)):
                out += w[:, k] * self._ask(k, prompts, responses, features, np.arange(len(prompts)))
        self.last_choice_ = choice
        return out.astype(np.float32)

    def weights(self, prompts: Sequence[str], logits: np.ndarray) -> np.ndarray:
        """Routing probabilities (n, K) float64: ``softmax(logits / temperature)``; with ``route_by="prompt"``
        each row replaced by the mean of the rows of the responses to the same prompt string."""
        w = softmax(np.asarray(logits, dtype=np.float64) / self.temperature)
        if self.route_by == "prompt":
            groups: dict[str, list[int]] = {}
            for i, p in enumerate(prompts):
                groups.setdefault(p, []).append(i)
            for idx in groups.values():
                w[idx] = w[idx].mean(axis=0)
        return w

    def _ask(self, k: int, prompts, responses, features, idx) -> np.ndarray:
        self.queries_[k] += len(prompts)
        rm = self.reward_models[k]
        if isinstance(rm, MLPRewardModel) and features is not None and features.shape[1] == rm.d_in \
                and rm.encoder.identity == self.encoder.identity:
            raw = rm.raw_scores_from_features(features[idx])  # same features: skip re-encoding
            return rm.normaliser_(raw, self.normalise).astype(np.float64)
        return rm.score(prompts, responses, normalise=self.normalise).astype(np.float64)


def save_mixture(mixture: RoutedReward, directory: Path) -> Path:
    """Write the module docstring's layout into ``directory`` (created; files replaced atomically)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = mixture.client_names
    if len(set(names)) != len(names) or any("/" in n or n in ("", ".", "..") for n in names):
        raise InvalidInputError(f"client names must be distinct folder names, got {names}")
    mixture.router.save(directory / "router")
    for name, rm in zip(names, mixture.reward_models):
        rm.save(directory / "clients" / name)
    meta = {"format_version": FORMAT_VERSION, "mode": mixture.mode, "normalise": mixture.normalise,
            "temperature": mixture.temperature, "route_by": mixture.route_by,
            "client_names": names, "embedder": asdict(mixture.encoder.embedder),
            "length_features": mixture.encoder.length_features, "router": "router",
            "clients": {n: f"clients/{n}" for n in names}}
    tmp = directory / "mixture.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(directory / "mixture.json")
    return directory


def load_mixture(directory: Path, cache_dir: Path | None = None, mode: str | None = None) -> RoutedReward:
    """Load a saved mixture (``mode`` overrides the saved one). Raises InvalidInputError on a missing
    ``mixture.json`` or a format version other than 1."""
    directory = Path(directory)
    path = directory / "mixture.json"
    if not path.is_file():
        raise InvalidInputError(f"no mixture.json in {str(directory)!r}")
    meta = json.loads(path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise InvalidInputError(f"{path}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    encoder = PairEncoder(EmbedderConfig(**meta["embedder"]), cache_dir, length_features=meta["length_features"])
    router = ClientRouter.load(directory / meta["router"])
    rms = [load_reward_model(directory / meta["clients"][n], cache_dir) for n in meta["client_names"]]
    for rm in rms:
        if isinstance(rm, MLPRewardModel):
            rm.encoder = PairEncoder(rm.encoder.embedder, cache_dir, length_features=rm.encoder.length_features)
    return RoutedReward(router, rms, encoder, mode or meta["mode"], meta["normalise"], meta.get("temperature", 1.0),
                        meta.get("route_by", "response"))
