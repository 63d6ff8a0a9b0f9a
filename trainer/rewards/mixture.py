"""The routed reward of MoR (paper 001, Sec. "GRPO with MoR"): the router picks or mixes client
reward models per (prompt, response).

``RoutedReward(router, reward_models, encoder, mode)``; ``reward(prompts, responses) -> ndarray (n,) float32``.
How logits become rewards is :class:`trainer.rewards.routing_rule.RoutingRule` (sparse: top-1 client, only it
is asked; soft: ``sum_k softmax(z / T)_k R_bar_k``), the one code path the evaluation and GRPO's reward
function use too. ``variants`` holds one RoutingRule per mode (chosen on validation by ``fedroute mor train``);
``mode`` picks the active one. ``normalise=False`` uses raw rewards (the "w/o Norm" ablation); ``queries_``
counts, per client, the pairs it was asked to score; ``last_choice_`` the client chosen per pair of the last call.
The router reads ``PairEncoder(EmbedderConfig(**embedder)).encode(prompts, responses)``; client ``k`` of its
logits is ``client_names[k]``. Saved layout (:func:`save_mixture` / :func:`load_mixture`): docs/mor.md.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from sdk.atomic_write import replace_dir
from sdk.errors import InvalidInputError, ShapeError
from trainer.embeddings import EmbedderConfig
from trainer.report import write_json, write_text
from trainer.rewards.client_router import ClientRouter
from trainer.rewards.pair_features import PairEncoder
from trainer.rewards.reward_models import ClientRewardModel, MLPRewardModel, load_reward_model
from trainer.rewards.routing_rule import MODES, ROUTE_BY, RoutingRule, prompt_groups, softmax  # noqa: F401 (re-exported)

FORMAT_VERSION = 1


class RoutedReward:
    """Routed reward over client reward models (module docstring).

    router : ClientRouter with ``n_clients == len(reward_models)``.
    reward_models : sequence of K ClientRewardModel, in the router's client order.
    encoder : PairEncoder producing the router's input features.
    mode : ``"sparse"`` or ``"soft"``, the active variant; normalise : use ``R_bar_k`` (True) or raw ``R_k`` (False).
    temperature, route_by : the rule of both modes when ``variants`` is None (RoutingRule).
    variants : optional {mode: RoutingRule} (e.g. chosen on validation); missing modes use temperature / route_by.

    Raises InvalidInputError (bad mode, temperature, route_by or a variant of the wrong mode), ShapeError
    (router and reward models disagree on K).
    """

    def __init__(self, router: ClientRouter, reward_models: Sequence[ClientRewardModel], encoder: PairEncoder,
                 mode: str = "sparse", normalise: bool = True, temperature: float = 1.0, route_by: str = "response",
                 variants: Mapping[str, RoutingRule] | None = None) -> None:
        self.variants = {m: RoutingRule(m, temperature, route_by) for m in MODES} | dict(variants or {})
        if mode not in MODES or any(m not in MODES or r.mode != m for m, r in self.variants.items()):
            raise InvalidInputError(f"mode must be one of {list(MODES)} and each variant of its own mode, got {mode!r}, "
                                    f"{self.variants}")
        if router.n_clients != len(reward_models):
            raise ShapeError(f"router has {router.n_clients} clients but {len(reward_models)} reward models were given")
        self.router, self.reward_models, self.encoder = router, list(reward_models), encoder
        self.rule: RoutingRule = self.variants[mode]
        self.normalise = bool(normalise)
        self.queries_ = np.zeros(len(self.reward_models), dtype=np.int64)
        self.last_choice_: np.ndarray | None = None

    @property
    def mode(self) -> str:
        return self.rule.mode

    @property
    def temperature(self) -> float:
        return self.rule.temperature

    @property
    def route_by(self) -> str:
        return self.rule.route_by

    @property
    def client_names(self) -> list[str]:
        return list(self.router.client_names)

    def with_mode(self, mode: str) -> RoutedReward:
        """The same router, reward models and variants with ``mode``'s variant active (a new object)."""
        return RoutedReward(self.router, self.reward_models, self.encoder, mode, self.normalise, variants=self.variants)

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
        out, choice = self.rule.combine(self.weights(prompts, logits), lambda k, rows: self._ask(
            k, [prompts[i] for i in rows], [responses[i] for i in rows], features, rows))
        self.last_choice_ = choice
        return out.astype(np.float32)

    def weights(self, prompts: Sequence[str], logits: np.ndarray) -> np.ndarray:
        """Routing probabilities (n, K) float64 of the active rule (:meth:`RoutingRule.weights`, the responses
        of one prompt string forming a group)."""
        return self.rule.weights(logits, prompt_groups(prompts))

    def score_client(self, k: int, prompts: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        """Client ``k``'s score (normalised unless ``normalise=False``) of the pairs: (n,) float64."""
        return self._ask(k, list(prompts), list(responses), None, None)

    def _ask(self, k: int, prompts, responses, features, idx) -> np.ndarray:
        self.queries_[k] += len(prompts)
        rm = self.reward_models[k]
        if isinstance(rm, MLPRewardModel) and features is not None and features.shape[1] == rm.d_in \
                and rm.encoder.identity == self.encoder.identity:
            raw = rm.raw_scores_from_features(features[idx])  # same features: skip re-encoding
            return rm.normaliser_(raw, self.normalise).astype(np.float64)
        return rm.score(prompts, responses, normalise=self.normalise).astype(np.float64)


def save_mixture(mixture: RoutedReward, directory: Path, selection: Mapping | None = None,
                 records: Mapping[str, Mapping] | None = None) -> Path:
    """Write the module docstring's layout into ``directory`` (created; parts staged and swapped in, module docstring).
    ``selection`` (JSON-serialisable) records how the variants were chosen (``mixture.json["selection"]``);
    ``records`` ({file name: JSON object}, e.g. ``mor_config.json``, ``train_metrics.json``; NaN and inf
    written as strings) are removed with the old ``mixture.json`` before the parts are swapped in and
    written before the new ``mixture.json``, so a kill or a failed save leaves no record of an older run
    beside a newer mixture (nor beside a folder without ``mixture.json``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = mixture.client_names
    if len(set(names)) != len(names) or any("/" in n or n in ("", ".", "..") for n in names):
        raise InvalidInputError(f"client names must be distinct folder names, got {names}")
    staged = directory / ".mixture.partial"  # the module docstring's swap
    shutil.rmtree(staged, ignore_errors=True)
    mixture.router.save(staged / "router")
    for name, rm in zip(names, mixture.reward_models):
        rm.save(staged / "clients" / name)
    for name in ("mixture.json", *(records or {})):
        (directory / name).unlink(missing_ok=True)
    for part in ("router", "clients"):
        replace_dir(staged / part, directory / part)
    staged.rmdir()
    for name, record in (records or {}).items():
        write_json(directory / name, record)
    meta = {"format_version": FORMAT_VERSION, "mode": mixture.mode, "normalise": mixture.normalise,
            "temperature": mixture.temperature, "route_by": mixture.route_by,
            "variants": {m: r.to_dict() for m, r in mixture.variants.items()},
            "client_names": names, "embedder": asdict(mixture.encoder.embedder),
            "length_features": mixture.encoder.length_features, "router": "router",
            "clients": {n: f"clients/{n}" for n in names}}
    if selection is not None:
        meta["selection"] = dict(selection)
    write_text(directory / "mixture.json", json.dumps(meta, indent=2))  # atomic, synced; no temporary file left
    return directory


def _load_part(folder: Path, load):
    """``load()`` of the router or a client reward model saved in ``folder``; a file of it that is missing,
    truncated or foreign (JSON, safetensors or state-dict errors), a tensor of another shape (ShapeError), or a
    weight holding NaN or inf, becomes one InvalidInputError naming the folder (and the tensor) instead of the
    library's traceback or a late NaN."""
    from safetensors import SafetensorError  # safetensors: optional heavy dependency, imported on use

    import torch  # torch: optional heavy dependency, imported on use (the parts are torch modules)

    try:
        part = load()
    except ShapeError as exc:  # a tensor of another shape: its message names the tensor, not the folder
        raise ShapeError(f"{folder}: {exc}; not a part of this mixture? rerun `fedroute mor train`") from exc
    except InvalidInputError:  # these name their file already
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
        # torch's state-dict error puts the tensor in its second line ('size mismatch for net.3.weight: ...')
        detail = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())[:500]
        raise InvalidInputError(f"{folder}: cannot load this part of the mixture ({type(exc).__name__}: {detail}); "
                                "a copy cut short? rerun `fedroute mor train`") from exc
    module = part if isinstance(part, torch.nn.Module) else getattr(part, "module", None)
    if isinstance(module, torch.nn.Module):  # a NaN weight loaded, and `mor export` failed late on a NaN parity diff
        bad = next((k for k, v in module.state_dict().items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
        if bad is not None:
            raise InvalidInputError(f"{folder}: tensor {bad!r} holds NaN or inf; a corrupt copy or a diverged training "
                                    "run? rerun `fedroute mor train`")
    return part


def load_mixture(directory: Path, cache_dir: Path | None = None, mode: str | None = None) -> RoutedReward:
    """Load a saved mixture. ``mode`` overrides the saved active mode and takes that mode's saved variant
    (e.g. the soft temperature chosen on validation). Raises InvalidInputError on a missing, unreadable or
    incomplete ``mixture.json``, a format version other than 1 or a bad variant, or a router or client
    folder whose files are missing, truncated, not of this mixture or hold a NaN or inf weight (the message
    names the folder), or a ``length_features`` that does not fit the router's input width."""
    directory = Path(directory)
    path = directory / "mixture.json"
    if not path.is_file():
        raise InvalidInputError(f"no mixture.json in {str(directory)!r}")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidInputError(f"{path}: unreadable ({type(exc).__name__}: {exc}); rerun `fedroute mor train`") from exc
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise InvalidInputError(f"{path}: format_version {version!r}, expected {FORMAT_VERSION}")
    try:
        encoder = PairEncoder(EmbedderConfig(**meta["embedder"]), cache_dir, length_features=meta["length_features"])
        router_dir = directory / meta["router"]
        client_dirs = [directory / meta["clients"][n] for n in meta["client_names"]]
        variants = {m: RoutingRule(**v) for m, v in meta.get("variants", {}).items()}
        rule = (mode or meta["mode"], meta["normalise"], meta.get("temperature", 1.0), meta.get("route_by", "response"))
    except (KeyError, TypeError, AttributeError) as exc:  # a missing key or a value of the wrong type
        raise InvalidInputError(f"{path}: not a mixture written by `fedroute mor train` "
                                f"({type(exc).__name__}: {exc}); rerun it") from exc
    router = _load_part(router_dir, lambda: ClientRouter.load(router_dir))
    extra = 3 if encoder.length_features else 0  # the router reads 2 * d_emb (+ 3 length columns) inputs
    if (router.d_in - extra) % 2:  # else torch's shape error at the first reward (after GRPO's policy is built)
        raise InvalidInputError(f"{path}: length_features {str(encoder.length_features).lower()} gives the router "
                                f"2 * d_emb{' + 3' if extra else ''} inputs (an {'odd' if extra else 'even'} number), but "
                                f"{meta['router']}/router.json has d_in {router.d_in}; rerun `fedroute mor train`")
    rms = [_load_part(d, lambda d=d: load_reward_model(d, cache_dir)) for d in client_dirs]
    for rm in rms:
        if isinstance(rm, MLPRewardModel):
            rm.encoder = PairEncoder(rm.encoder.embedder, cache_dir, length_features=rm.encoder.length_features)
    return RoutedReward(router, rms, encoder, *rule, variants)
