"""Client reward models of MoR (paper 001, Sec. "Reward Model Initialization"): Bradley-Terry training,
local z-normalisation and optional clipping.

Two architectures (the paper's "structurally heterogeneous reward models"): ``mlp``, :class:`MLPRewardModel`
on the frozen pair features ``[e(x), e(y)]`` of :class:`trainer.rewards.pair_features.PairEncoder`; ``lora``,
:class:`LoRARewardModel`, the MiniLM encoder fine-tuned with LoRA (peft) on ``(prompt, response)``, mean-pooled,
then a linear head. Both minimise ``L = -mean log sigmoid(R(x, y+) - R(x, y-))`` (paper 001, ``L_RM``;
:func:`bradley_terry_loss`) and answer ``(R - mu_k) / (sigma_k + eps)`` (paper 001, ``R_bar_k``) with the
client's own score statistics, clipped to ``[-clip, clip]`` when set. ``RewardModelConfig.length_prior`` adds a
length term started from the client's length-only fit (:func:`fit_length_prior`). Scores are float32 (n,);
raw scores are Bradley-Terry logits, normalised ones client standard deviations. Saved layout: docs/mor.md.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from sdk.errors import InvalidInputError, ShapeError
from sdk.pair_tokenizer import PairTokenizer
from sdk.real_numbers import finite_float
from trainer.config_fields import check_bool, check_int, check_real
from trainer.embeddings import EmbedderConfig, resolve_model_path
from trainer.rewards.pair_features import PairEncoder, check_pair_texts, check_texts
from trainer.preference_metrics import pairwise_accuracy as metric
from trainer.rewards.pair_features import LENGTH_SCALE
from trainer.rewards.pair_features import response_lengths

ARCHS = ("mlp", "lora")
FORMAT_VERSION = 1


# --------------------------------------------------------------------------- data and loss


@dataclass(frozen=True)
class PreferencePairs:
    """Preference tuples ``(x, y+, y-)`` of one client.

    prompts, chosen, rejected : tuples of n str (``chosen[i]`` preferred over ``rejected[i]``).
    prompt_ids : tuple of n hashable ids, not None (pairs sharing a prompt share an id; splits are by prompt).

    Raises InvalidInputError: a field that is not a tuple or list (a str would be read as its
    characters), lengths that differ, a text that is not a str (None, NaN from a missing cell, a
    number) or an id that is None or unhashable.
    """

    prompts: tuple
    chosen: tuple
    rejected: tuple
    prompt_ids: tuple

    def __post_init__(self) -> None:
        for name in ("prompts", "chosen", "rejected", "prompt_ids"):
            if not isinstance(getattr(self, name), (tuple, list)):
                raise InvalidInputError(f"PreferencePairs.{name} must be a tuple, got {type(getattr(self, name)).__name__}")
        n = len(self.prompts)
        for name in ("chosen", "rejected", "prompt_ids"):
            if len(getattr(self, name)) != n:
                raise InvalidInputError(f"PreferencePairs: {n} prompts but {len(getattr(self, name))} {name}")
        for name in ("prompts", "chosen", "rejected"):
            check_texts(f"PreferencePairs.{name}", getattr(self, name))
        for i, pid in enumerate(self.prompt_ids):
            if pid is None or not isinstance(pid, Hashable):
                raise InvalidInputError(f"PreferencePairs.prompt_ids[{i}] must be a hashable id, got {pid!r}")

    @property
    def n_pairs(self) -> int:
        return len(self.prompts)

    def subset(self, index: Sequence[int] | np.ndarray) -> PreferencePairs:
        idx = [int(i) for i in np.asarray(index).ravel()]
        return PreferencePairs(*(tuple(getattr(self, f)[i] for i in idx) for f in ("prompts", "chosen", "rejected", "prompt_ids")))

    def split_by_prompt(self, fraction: float, rng: np.random.Generator) -> tuple[PreferencePairs, PreferencePairs]:
        """(rest, part): ``part`` holds the pairs of a random ``fraction`` of the distinct prompts."""
        if not 0.0 < fraction < 1.0:
            raise InvalidInputError(f"fraction must be in (0, 1), got {fraction}")
        ids = np.array(sorted(set(self.prompt_ids), key=str), dtype=object)
        if len(ids) < 2:
            raise InvalidInputError(f"split_by_prompt needs >= 2 distinct prompts, got {len(ids)}")
        n_part = min(max(1, int(round(fraction * len(ids)))), len(ids) - 1)
        part_ids = set(rng.permutation(ids)[:n_part].tolist())
        mask = np.array([p in part_ids for p in self.prompt_ids])
        return self.subset(np.flatnonzero(~mask)), self.subset(np.flatnonzero(mask))

    @classmethod
    def from_frame(cls, frame) -> PreferencePairs:
        """From a pairs DataFrame (``trainer.data.preferences`` schema: ``prompt_id, prompt,
        response_a, response_b, label`` with label 1 = a preferred, 0 = b preferred).

        Raises InvalidInputError: ``frame`` is not a DataFrame, a column is missing, a label is not 0/1
        or a text is not a str (see the class).
        """
        if not hasattr(frame, "columns"):
            raise InvalidInputError(f"PreferencePairs.from_frame needs a pandas DataFrame, got {type(frame).__name__}")
        missing = {"prompt_id", "prompt", "response_a", "response_b", "label"} - set(frame.columns)
        if missing:
            raise InvalidInputError(f"pairs frame lacks columns {sorted(missing)}")
        label = frame["label"].to_numpy()
        if not np.isin(label, (0, 1)).all():
            raise InvalidInputError(f"label must be 0 or 1, got {sorted(set(label.tolist()) - {0, 1})[:5]}")
        a, b = frame["response_a"].tolist(), frame["response_b"].tolist()
        chosen = tuple(x if lab == 1 else y for x, y, lab in zip(a, b, label))
        rejected = tuple(y if lab == 1 else x for x, y, lab in zip(a, b, label))
        return cls(tuple(frame["prompt"].tolist()), chosen, rejected, tuple(frame["prompt_id"].tolist()))


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry negative log-likelihood ``-mean log sigmoid(r+ - r-)`` (paper 001, ``L_RM``).

    r_chosen, r_rejected : tensors of shape (n,), the raw rewards of the preferred and the rejected
    responses. Returns a scalar tensor (nats per pair).
    """
    return -nn.functional.logsigmoid(r_chosen - r_rejected).mean()


def pairwise_accuracy(score_chosen: np.ndarray, score_rejected: np.ndarray) -> float:
    """Share of pairs with ``score(x, y_w) > score(x, y_l)``, a tie counting 0.5 (METRICS.md), via the
    project's one metric function :func:`trainer.preference_metrics.pairwise_accuracy`.

    score_chosen, score_rejected : arrays of shape (n,). Raises ShapeError on n = 0, a shape mismatch or NaN.
    """

    sc, sr = np.asarray(score_chosen, dtype=np.float64), np.asarray(score_rejected, dtype=np.float64)
    if sc.shape != sr.shape:
        raise ShapeError(f"chosen scores {sc.shape} and rejected scores {sr.shape} differ in shape")
    return metric(0.5 + 0.5 * np.sign(sc - sr), np.ones(sc.shape, dtype=np.int64))


# --------------------------------------------------------------------------- normalisation


@dataclass(frozen=True)
class ScoreNormaliser:
    """Local z-normalisation ``(r - mean) / (std + eps)``, then optional clipping to ``[-clip, clip]``.

    mean, std : statistics of the client's raw scores over its own training responses.
    """

    mean: float
    std: float
    eps: float = 1e-6
    clip: float | None = None

    def __post_init__(self) -> None:
        mean, std = finite_float(self.mean), finite_float(self.std)
        if mean is None or std is None or std < 0:
            raise InvalidInputError(f"normaliser needs finite mean and std >= 0, got mean={self.mean!r}, std={self.std!r}")
        if finite_float(self.eps) is None or self.eps < 0:
            raise InvalidInputError(f"normaliser eps={self.eps!r} should be a finite number >= 0")
        if self.std + self.eps == 0:
            raise InvalidInputError("normaliser has std=0 (constant raw scores) and eps=0: z-scores would divide by zero; "
                                    "use eps > 0")
        if self.clip is not None and not (finite_float(self.clip) or 0.0) > 0:
            raise InvalidInputError(f"clip must be a finite number > 0 or None, got {self.clip!r}")

    @classmethod
    def fit(cls, raw: np.ndarray, eps: float = 1e-6, clip: float | None = None) -> ScoreNormaliser:
        """Statistics of ``raw`` (shape (n,), n >= 2): population std (ddof = 0)."""
        raw = np.asarray(raw, dtype=np.float64)
        if raw.ndim != 1 or raw.size < 2:
            raise InvalidInputError(f"normaliser needs >= 2 raw scores, got shape {raw.shape}")
        return cls(float(raw.mean()), float(raw.std()), eps, clip)

    def __call__(self, raw: np.ndarray, normalise: bool = True) -> np.ndarray:
        """(n,) float32: z-scores (or raw scores when ``normalise`` is False), clipped when ``clip`` is set."""
        out = np.asarray(raw, dtype=np.float64)
        if normalise:
            out = (out - self.mean) / (self.std + self.eps)
        if self.clip is not None:
            out = np.clip(out, -self.clip, self.clip)
        return out.astype(np.float32)


# --------------------------------------------------------------------------- models


class ClientRewardModel(ABC):
    """A client's reward model ``R_k(x, y)``; ``normaliser_`` is set by the trainer.

    :meth:`score` is what the client answers to a query; :meth:`raw_scores` is ``R_k`` itself.
    """

    arch: str = ""
    normaliser_: ScoreNormaliser | None = None
    #: The DP-SGD guarantee of a model trained with it (``epsilon``, ``delta``, ``noise_multiplier``,
    #: ``max_grad_norm``, ``epochs``, ``batch_size``, ``n_pairs``, ``accountant``), saved with the model; None otherwise.
    privacy_: dict | None = None

    @abstractmethod
    def raw_scores(self, prompts: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        """ndarray of shape (n,), float32: the raw Bradley-Terry rewards."""

    def score(self, prompts: Sequence[str], responses: Sequence[str], normalise: bool = True) -> np.ndarray:
        """ndarray (n,) float32: ``(R - mu_k) / (sigma_k + eps)`` (raw R when ``normalise`` is False),
        clipped if the normaliser has a clip. Raises InvalidInputError before :meth:`fit_normaliser`."""
        if self.normaliser_ is None:
            raise InvalidInputError("the reward model has no normaliser yet: call fit_normaliser on its training pairs")
        return self.normaliser_(self.raw_scores(prompts, responses), normalise)

    def fit_normaliser(self, pairs: PreferencePairs, eps: float = 1e-6, clip: float | None = None) -> ScoreNormaliser:
        """Set ``normaliser_`` from the raw scores of all 2 n training responses (y+ and y-)."""
        raw = self.raw_scores(list(pairs.prompts) * 2, list(pairs.chosen) + list(pairs.rejected))
        self.normaliser_ = ScoreNormaliser.fit(raw, eps, clip)
        return self.normaliser_

    def _meta(self) -> dict:
        n = self.normaliser_
        if n is None:
            raise InvalidInputError("cannot save a reward model without a normaliser")
        return {"format_version": FORMAT_VERSION, "arch": self.arch, "mean": n.mean, "std": n.std,
                "eps": n.eps, "clip": n.clip, "privacy": self.privacy_}

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write the module docstring's layout into ``directory`` (created)."""

    @abstractmethod
    def n_parameters(self) -> int:
        """Trainable parameters (what FedAvg of reward models would have to ship)."""


#: Length columns ``l(y)`` at the end of the MLP pair features (:func:`trainer.rewards.pair_features.response_lengths`).
N_LENGTH_COLUMNS = 3


def fit_length_prior(len_chosen: np.ndarray, len_rejected: np.ndarray, C: float = 1.0) -> np.ndarray:
    """The client's own length-only Bradley-Terry model, fitted locally on its training pairs.

    ``P(y+ > y-) = sigmoid(w . (l(y+) - l(y-)))`` with ``l`` the (n, 3) length columns of
    :func:`trainer.rewards.pair_features.response_lengths` (log1p counts / ``LENGTH_SCALE``); the MLE is
    scikit-learn's ``LogisticRegression(C, fit_intercept=False)`` on the symmetrised rows
    ``[d; -d]`` with labels ``[1; 0]``, ``d = (l(y+) - l(y-)) * LENGTH_SCALE`` (the unscaled log-length
    differences of :class:`trainer.length_baseline.LengthBaseline`, so ``C`` means the same there).

    len_chosen, len_rejected : (n, F) arrays, n >= 1 (F = 3 length columns, or the encoder's pair-feature
    columns, :attr:`PairEncoder.n_feature_columns`). Returns ndarray (F,) float64, the weight on the
    SCALED columns (``coef * LENGTH_SCALE``). Raises InvalidInputError on a shape mismatch or C <= 0.
    """
    from sklearn.linear_model import LogisticRegression  # sklearn: optional heavy dependency, imported on use


    lc, lr_ = np.asarray(len_chosen, dtype=np.float64), np.asarray(len_rejected, dtype=np.float64)
    if lc.shape != lr_.shape or lc.ndim != 2 or lc.shape[0] < 1:
        raise InvalidInputError(f"length columns must both have shape (n >= 1, F), got {lc.shape} and {lr_.shape}")
    if not C > 0:
        raise InvalidInputError(f"C must be > 0, got {C}")
    d = (lc - lr_) * LENGTH_SCALE
    if not np.any(d):
        return np.zeros(d.shape[1])
    x = np.concatenate([d, -d])
    y = np.concatenate([np.ones(len(d), dtype=np.int64), np.zeros(len(d), dtype=np.int64)])
    coef = LogisticRegression(C=C, fit_intercept=False, tol=1e-8, max_iter=1000).fit(x, y).coef_[0]
    return coef * LENGTH_SCALE


class _MLP(nn.Module):
    """``R(h) = net(h) [+ w_len . h[..., -3:]]``: the MLP, plus (``length_term``) a linear term on the
    three length columns ``l(y)`` of the pair features (:func:`fit_length_prior` initialises it)."""

    def __init__(self, d_in: int, hidden: int, dropout: float, length_term: bool = False,
                 n_columns: int = N_LENGTH_COLUMNS) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, 1))
        self.length = nn.Linear(n_columns, 1, bias=False) if length_term else None
        self.n_columns = n_columns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.net(x).squeeze(-1)
        if self.length is not None:
            r = r + self.length(x[..., -self.n_columns:]).squeeze(-1)
        return r


class _PairMargin(nn.Module):
    """(n, 2, d) features of (chosen, rejected) -> (n,) margins ``R(x, y+) - R(x, y-)``: one row per
    pair, so DP-SGD clips per pair."""

    def __init__(self, mlp: _MLP) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.mlp(x)
        return r[:, 0] - r[:, 1]


class MLPRewardModel(ClientRewardModel):
    """MLP on frozen pair features. ``encoder`` embeds (prompt, response) pairs; ``module`` maps
    (n, 2 d_emb) float32 features to (n,) raw rewards."""

    arch = "mlp"

    def __init__(self, encoder: PairEncoder, d_in: int, hidden: int = 256, dropout: float = 0.1,
                 length_term: bool = False) -> None:
        if length_term and not encoder.length_features:
            raise InvalidInputError("length_term needs the length columns: PairEncoder(length_features=True)")
        self.encoder = encoder
        self.d_in, self.hidden, self.dropout = int(d_in), int(hidden), float(dropout)
        self.length_term = bool(length_term)
        self.module = _MLP(self.d_in, self.hidden, self.dropout, self.length_term, encoder.n_feature_columns or N_LENGTH_COLUMNS)
        self.normaliser_ = None

    def init_length_prior(self, weight: np.ndarray) -> None:
        """Start from the length-only (or pair-feature) model: the feature term's weights := ``weight`` (F,),
        the MLP's output layer := 0, so ``R(h) = weight . l(y)`` until training moves the MLP (the residual)."""
        if self.module.length is None:
            raise InvalidInputError("init_length_prior needs a model built with length_term=True")
        w = np.asarray(weight, dtype=np.float32).reshape(1, self.module.n_columns)
        with torch.no_grad():
            self.module.length.weight.copy_(torch.from_numpy(w))
            self.module.net[3].weight.zero_()
            self.module.net[3].bias.zero_()

    def raw_scores_from_features(self, features: np.ndarray) -> np.ndarray:
        """features : (n, d_in) float32 -> raw rewards (n,) float32. Raises ShapeError-like InvalidInputError on d_in."""
        features = np.asarray(features, dtype=np.float32)
        if features.ndim != 2 or features.shape[1] != self.d_in:
            raise InvalidInputError(f"features must have shape (n, {self.d_in}), got {features.shape}")
        self.module.eval()
        with torch.no_grad():
            return self.module(torch.from_numpy(features)).numpy().astype(np.float32)

    def raw_scores(self, prompts, responses) -> np.ndarray:
        return self.raw_scores_from_features(self.encoder.encode(prompts, responses))

    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def save(self, directory: Path) -> None:
        from safetensors.torch import save_file  # safetensors: optional heavy dependency, imported on use

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.module.state_dict().items()}
        _atomic(directory / "weights.safetensors", lambda p: save_file(state, str(p)))
        meta = self._meta() | {"d_in": self.d_in, "hidden": self.hidden, "dropout": self.dropout, "length_term": self.length_term,
                               "embedder": asdict(self.encoder.embedder),
                               "length_features": self.encoder.length_features}
        if self.encoder.pair_features is not None:
            meta["pair_features"] = list(self.encoder.pair_features)
        _atomic_text(directory / "reward_model.json", json.dumps(meta, indent=2))

    @classmethod
    def load(cls, directory: Path, cache_dir: Path | None = None) -> MLPRewardModel:
        from safetensors.torch import load_file  # safetensors: optional heavy dependency, imported on use

        meta = _read_meta(directory, "mlp")
        encoder = PairEncoder(EmbedderConfig(**meta["embedder"]), cache_dir, length_features=meta["length_features"],
                              pair_features=meta.get("pair_features"))
        model = cls(encoder, meta["d_in"], meta["hidden"], meta["dropout"], meta.get("length_term", False))
        model.module.load_state_dict(load_file(str(Path(directory) / "weights.safetensors")))
        model.normaliser_ = ScoreNormaliser(meta["mean"], meta["std"], meta["eps"], meta["clip"])
        model.privacy_ = meta.get("privacy")
        return model


class _LoRAScorer(nn.Module):
    def __init__(self, encoder: nn.Module, d_model: int, length_term: bool = False) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(d_model, 1)
        self.length = nn.Linear(N_LENGTH_COLUMNS, 1, bias=False) if length_term else None

    def forward(self, input_ids, attention_mask, lengths: torch.Tensor | None = None, **extra) -> torch.Tensor:
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(out.dtype)
        pooled = (out * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        r = self.head(pooled).squeeze(-1)
        if self.length is not None:
            r = r + self.length(lengths).squeeze(-1)
        return r


class LoRARewardModel(ClientRewardModel):
    """A sentence encoder (default all-MiniLM-L6-v2) with LoRA adapters (peft) and a linear head,
    reading the tokenised pair ``(prompt, response)`` (``max_tokens`` in all, truncated on the left)."""

    arch = "lora"

    def __init__(self, base_model: str = "all-MiniLM-L6-v2", max_tokens: int = 128, lora_r: int = 8,
                 lora_alpha: int = 16, lora_dropout: float = 0.05, batch_size: int = 32, adapter_dir: Path | None = None,
                 length_term: bool = False) -> None:
        from peft import LoraConfig, PeftModel, get_peft_model  # peft: optional heavy dependency, imported on use
        from transformers import AutoModel, AutoTokenizer  # transformers: optional heavy dependency, imported on use

        self.base_model, self.max_tokens = base_model, int(max_tokens)
        self.lora_r, self.lora_alpha, self.lora_dropout = int(lora_r), int(lora_alpha), float(lora_dropout)
        self.batch_size = int(batch_size)
        path = resolve_model_path(base_model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.truncation_side = "left"
        # The device's pair tokenisation (longest_first to max_tokens, cost linear in the texts' length):
        # the trainer and the exported bundle agree by construction.
        self.pair_tokenizer = PairTokenizer(self.tokenizer.backend_tokenizer, self.max_tokens, "left")
        base = AutoModel.from_pretrained(path)
        if adapter_dir is None:
            cfg = LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                             target_modules=["query", "value"], bias="none")
            encoder = get_peft_model(base, cfg)
        else:
            encoder = _load_adapter(PeftModel, base, Path(adapter_dir))
        self.length_term = bool(length_term)
        self.module = _LoRAScorer(encoder, base.config.hidden_size, self.length_term)
        self.normaliser_ = None

    def init_length_prior(self, weight: np.ndarray) -> None:
        """As :meth:`MLPRewardModel.init_length_prior`: length term := ``weight`` (3,), head := 0."""
        if self.module.length is None:
            raise InvalidInputError("init_length_prior needs a model built with length_term=True")
        w = np.asarray(weight, dtype=np.float32).reshape(1, N_LENGTH_COLUMNS)
        with torch.no_grad():
            self.module.length.weight.copy_(torch.from_numpy(w))
            self.module.head.weight.zero_()
            self.module.head.bias.zero_()

    def tokenize(self, prompts: Sequence[str], responses: Sequence[str]) -> dict:
        """``input_ids``, ``attention_mask``, ``token_type_ids`` (n, seq) int64 tensors (raises
        InvalidInputError when the two lists differ in length, :class:`sdk.pair_tokenizer.PairTokenizer`)."""
        feeds = self.pair_tokenizer(list(prompts), [r if r.strip() else "(empty)" for r in responses])
        return {k: torch.from_numpy(v) for k, v in feeds.items()}

    def forward_texts(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        """(n,) tensor of raw rewards with gradients (training mode is the caller's)."""
        lengths = None
        if self.length_term:

            lengths = torch.from_numpy(response_lengths([r if r.strip() else "(empty)" for r in responses]))
        return self.module(**self.tokenize(prompts, responses), lengths=lengths)

    def raw_scores(self, prompts, responses) -> np.ndarray:
        check_pair_texts(prompts, responses)
        self.module.eval()
        out = []
        with torch.no_grad():
            for s in range(0, len(prompts), self.batch_size):
                out.append(self.forward_texts(prompts[s : s + self.batch_size], responses[s : s + self.batch_size]).numpy())
        return np.concatenate(out).astype(np.float32)

    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters() if p.requires_grad)

    def save(self, directory: Path) -> None:
        from safetensors.torch import save_file  # safetensors: optional heavy dependency, imported on use

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.module.encoder.save_pretrained(str(directory / "adapter"))
        head = {k: v.detach().contiguous() for k, v in self.module.head.state_dict().items()}
        _atomic(directory / "head.safetensors", lambda p: save_file(head, str(p)))
        if self.module.length is not None:
            length = {"weight": self.module.length.weight.detach().contiguous()}
            _atomic(directory / "length.safetensors", lambda p: save_file(length, str(p)))
        meta = self._meta() | {"length_term": self.length_term, "base_model": self.base_model, "max_tokens": self.max_tokens, "truncation_side": "left",
                               "lora_r": self.lora_r, "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout}
        _atomic_text(directory / "reward_model.json", json.dumps(meta, indent=2))

    @classmethod
    def load(cls, directory: Path, cache_dir: Path | None = None) -> LoRARewardModel:
        from safetensors.torch import load_file  # safetensors: optional heavy dependency, imported on use

        directory = Path(directory)
        meta = _read_meta(directory, "lora")
        model = cls(meta["base_model"], meta["max_tokens"], meta["lora_r"], meta["lora_alpha"], meta["lora_dropout"],
                    adapter_dir=directory / "adapter", length_term=meta.get("length_term", False))
        model.module.head.load_state_dict(load_file(str(directory / "head.safetensors")))
        if model.module.length is not None:
            model.module.length.load_state_dict(load_file(str(directory / "length.safetensors")))
        model.normaliser_ = ScoreNormaliser(meta["mean"], meta["std"], meta["eps"], meta["clip"])
        return model


def _load_adapter(peft_model, base, adapter_dir: Path):
    """``PeftModel.from_pretrained(base, adapter_dir)``, strict: InvalidInputError naming the file and tensors when
    ``adapter_model.safetensors`` lacks a LoRA tensor of the model, holds an extra one or one of another shape."""
    from peft import get_peft_model_state_dict  # peft: optional heavy dependency, imported on use
    from safetensors import safe_open  # safetensors: optional heavy dependency, imported on use

    file = adapter_dir / "adapter_model.safetensors"
    hint = "an adapter saved over another base model, or a copy cut short?"
    try:
        encoder = peft_model.from_pretrained(base, str(adapter_dir))
    except RuntimeError as exc:  # torch's load_state_dict: "size mismatch for ..."
        detail = " ".join(str(exc).split())[:300]
        raise InvalidInputError(f"{file}: not the adapter of this reward model ({detail}); {hint}") from exc
    if file.is_file():  # (peft refused a folder without it above)
        with safe_open(str(file), "pt") as f:
            found = set(f.keys())
        expected = set(get_peft_model_state_dict(encoder))
        if found != expected:
            missing, extra = sorted(expected - found), sorted(found - expected)
            raise InvalidInputError(f"{file}: not the adapter of this reward model ({len(missing)} tensor(s) missing, "
                                    f"e.g. {missing[:2]}; {len(extra)} unexpected, e.g. {extra[:2]}); {hint}")
    return encoder


def load_reward_model(directory: Path, cache_dir: Path | None = None) -> ClientRewardModel:
    """Load a saved client reward model of either architecture.

    Raises InvalidInputError: no ``reward_model.json``, an unknown arch (lists the valid ones) or format version.
    """
    arch = _read_meta(directory, None)["arch"]
    return {"mlp": MLPRewardModel, "lora": LoRARewardModel}[arch].load(Path(directory), cache_dir)


def _read_meta(directory: Path, arch: str | None) -> dict:
    path = Path(directory) / "reward_model.json"
    if not path.is_file():
        raise InvalidInputError(f"no reward_model.json in {str(directory)!r}")
    meta = json.loads(path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise InvalidInputError(f"{path}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    if meta.get("arch") not in ARCHS or (arch is not None and meta["arch"] != arch):
        raise InvalidInputError(f"{path}: arch {meta.get('arch')!r}, expected one of {list(ARCHS) if arch is None else [arch]}")
    return meta


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)


def _atomic_text(path: Path, text: str) -> None:
    _atomic(path, lambda p: p.write_text(text))


# --------------------------------------------------------------------------- training


@dataclass
class RewardModelConfig:
    """How a client trains its reward model.

    arch : ``"mlp"`` or ``"lora"`` (module docstring).
    epochs : maximum passes over the training pairs.
    batch_size : pairs per step.
    lr, weight_decay : AdamW (torch) settings; weight decay is the L2 defence of the privacy audit.
    dropout : MLP dropout (``mlp`` only).
    hidden : MLP width (``mlp`` only).
    early_stopping : hold out ``val_fraction`` of the client's prompts, keep the epoch with the lowest
        validation BT loss, stop after ``patience`` epochs without improvement. False: train on all
        pairs for ``epochs`` epochs (the naive setting of the audit).
    clip : clip normalised scores to ``[-clip, clip]`` (None: no clipping).
    base_model, max_tokens, lora_r, lora_alpha, lora_dropout : ``lora`` only.
    dp_noise_multiplier : if set (``mlp`` only), train with DP-SGD (Abadi et al. 2016) through Opacus:
        per-pair gradients clipped to ``dp_max_grad_norm``, Gaussian noise of std
        ``dp_noise_multiplier * dp_max_grad_norm``, Poisson sampling of batches, ``epochs`` passes, no
        early stopping (all training pairs are used); the RDP accountant's epsilon at ``dp_delta``
        (default 1 / n_pairs) is stored in ``RewardModelTrainer.epsilon_``.
    length_prior : add a linear term on the response's length columns ``l(y)`` to the reward and start
        from the client's own length-only Bradley-Terry fit on its training pairs
        (:func:`fit_length_prior`, L2 strength ``1 / length_prior_C``): length weights := the fit, the
        MLP's (LoRA head's) output layer := 0, so the untrained model ranks pairs exactly as the local
        length-only model does and training learns the residual. Local, no privacy cost; not with DP-SGD
        (the fit would not be private).
    keep_start : with early stopping, the untrained starting point (epoch "-1"; with ``length_prior`` the
        local length-only model itself) is a candidate of the validation-loss selection too, so training
        is kept only if it lowers the client's validation Bradley-Terry loss below the start's.
    seed : initialisation and shuffling seed.
    """

    arch: str = "mlp"
    epochs: int = 40
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 1e-2
    dropout: float = 0.1
    hidden: int = 256
    early_stopping: bool = True
    val_fraction: float = 0.15
    patience: int = 4
    clip: float | None = None
    eps: float = 1e-6
    base_model: str = "all-MiniLM-L6-v2"
    max_tokens: int = 128
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    length_prior: bool = False
    length_prior_C: float = 1.0
    keep_start: bool = False
    dp_noise_multiplier: float | None = None
    dp_max_grad_norm: float = 1.0
    dp_delta: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "hidden", "patience", "max_tokens", "lora_r"):
            check_int(self, name, 1)
        check_int(self, "seed", 0)
        for name in ("early_stopping", "length_prior", "keep_start"):
            check_bool(self, name)
        check_real(self, "lr", 0, low_open=True)
        check_real(self, "lora_alpha", 0, low_open=True)
        check_real(self, "length_prior_C", 0, low_open=True)
        check_real(self, "dp_max_grad_norm", 0, low_open=True)
        check_real(self, "weight_decay", 0)
        check_real(self, "eps", 0)
        check_real(self, "dropout", 0, 1, high_open=True)
        check_real(self, "lora_dropout", 0, 1, high_open=True)
        check_real(self, "val_fraction", 0, 1, low_open=True, high_open=True)
        check_real(self, "clip", 0, low_open=True, optional=True)
        check_real(self, "dp_noise_multiplier", 0, low_open=True, optional=True)
        check_real(self, "dp_delta", 0, 1, low_open=True, high_open=True, optional=True)
        if self.dp_noise_multiplier is not None and (self.arch != "mlp" or self.dp_noise_multiplier <= 0 or self.dp_max_grad_norm <= 0):
            raise InvalidInputError(f"DP-SGD needs arch 'mlp', dp_noise_multiplier > 0 and dp_max_grad_norm > 0; got arch={self.arch!r}, "
                                    f"dp_noise_multiplier={self.dp_noise_multiplier}, dp_max_grad_norm={self.dp_max_grad_norm}")
        if self.arch not in ARCHS:
            raise InvalidInputError(f"arch must be one of {list(ARCHS)}, got {self.arch!r}")
        if self.length_prior and (self.dp_noise_multiplier is not None or not self.length_prior_C > 0):
            raise InvalidInputError(f"length_prior needs no DP-SGD and length_prior_C > 0; got dp_noise_multiplier="
                                    f"{self.dp_noise_multiplier}, length_prior_C={self.length_prior_C}")


@dataclass
class RewardModelTrainer:
    """Trains one client's reward model with the Bradley-Terry loss, then fits its normaliser.

    ``train(pairs) -> ClientRewardModel``; ``history_`` holds per-epoch train/validation losses.
    """

    args: RewardModelConfig = field(default_factory=RewardModelConfig)
    encoder: PairEncoder = field(default_factory=PairEncoder)
    show_progress: bool = False

    def train(self, pairs: PreferencePairs) -> ClientRewardModel:
        """Raises InvalidInputError: fewer than 4 pairs (or 2 prompts when early stopping)."""
        a = self.args
        if not isinstance(pairs, PreferencePairs):
            raise InvalidInputError(f"train needs PreferencePairs (PreferencePairs.from_frame(df) for a pairs frame), "
                                    f"got {type(pairs).__name__}")
        if pairs.n_pairs < 4:
            raise InvalidInputError(f"a reward model needs >= 4 training pairs, got {pairs.n_pairs}")
        rng = np.random.default_rng(a.seed)
        torch.manual_seed(a.seed)
        dp = a.dp_noise_multiplier is not None
        fit, val = pairs.split_by_prompt(a.val_fraction, rng) if a.early_stopping and not dp else (pairs, None)
        if dp:
            model = self._train_mlp_dp(fit)
        elif a.arch == "mlp":
            self._train_mlp(fit, val, rng)
            model = self.model_
        else:
            model = LoRARewardModel(a.base_model, a.max_tokens, a.lora_r, a.lora_alpha, a.lora_dropout,
                                    length_term=a.length_prior)
            if a.length_prior:
                model.init_length_prior(self.length_prior_(fit))
            self._train_lora(model, fit, val, rng)
        model.fit_normaliser(pairs, a.eps, a.clip)
        return model

    def length_prior_(self, fit: PreferencePairs) -> np.ndarray:
        """Weights of :func:`fit_length_prior` on ``fit`` (the pairs the model trains on): (3,) on the length
        columns, or (F,) on the MLP's pair-feature columns when the encoder has ``pair_features``."""
        if self.args.arch == "mlp":
            cols = lambda ys: self.encoder.feature_columns(fit.prompts, ys)  # noqa: E731
        else:
            cols = response_lengths
        self.length_weight_ = fit_length_prior(cols(fit.chosen), cols(fit.rejected), self.args.length_prior_C)
        return self.length_weight_

    def _loop(self, module: nn.Module, n_fit: int, batch_loss, val_loss, rng: np.random.Generator) -> None:
        a = self.args
        opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=a.lr, weight_decay=a.weight_decay)
        best, best_state, bad = math.inf, None, 0
        self.history_: list[dict] = []
        if val_loss is not None and a.keep_start:
            module.eval()
            with torch.no_grad():
                best = float(val_loss())
            best_state = {k: t.detach().clone() for k, t in module.state_dict().items()}
            self.history_.append({"epoch": -1, "val_loss": best})
        for epoch in tqdm(range(a.epochs), desc=f"reward model ({a.arch})", disable=not self.show_progress, leave=False):
            module.train()
            order, total = rng.permutation(n_fit), 0.0
            for s in range(0, n_fit, a.batch_size):
                loss = batch_loss(order[s : s + a.batch_size])
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(module.parameters(), 1.0)
                opt.step()
                total += float(loss.detach()) * len(order[s : s + a.batch_size])
            record = {"epoch": epoch, "train_loss": total / n_fit}
            if val_loss is not None:
                module.eval()
                with torch.no_grad():
                    v = float(val_loss())
                record["val_loss"] = v
                if v < best - 1e-4:
                    best, bad = v, 0
                    best_state = {k: t.detach().clone() for k, t in module.state_dict().items()}
                else:
                    bad += 1
            self.history_.append(record)
            if val_loss is not None and bad >= a.patience:
                break
        if best_state is not None:
            module.load_state_dict(best_state)
        module.eval()

    def _train_mlp(self, fit: PreferencePairs, val: PreferencePairs | None, rng) -> None:
        enc = self.encoder.encode
        fc = torch.from_numpy(enc(fit.prompts, fit.chosen))
        fr = torch.from_numpy(enc(fit.prompts, fit.rejected))
        a = self.args
        self.model_ = model = MLPRewardModel(self.encoder, fc.shape[1], a.hidden, a.dropout, length_term=a.length_prior)
        if a.length_prior:
            model.init_length_prior(self.length_prior_(fit))
        m = model.module

        def batch_loss(idx):
            return bradley_terry_loss(m(fc[idx]), m(fr[idx]))

        val_loss = None
        if val is not None:
            vc, vr = torch.from_numpy(enc(val.prompts, val.chosen)), torch.from_numpy(enc(val.prompts, val.rejected))
            val_loss = lambda: bradley_terry_loss(m(vc), m(vr))  # noqa: E731
        self._loop(m, fit.n_pairs, batch_loss, val_loss, rng)

    def _train_mlp_dp(self, fit: PreferencePairs) -> MLPRewardModel:
        """DP-SGD (Opacus) on the Bradley-Terry loss; one privacy unit = one preference pair."""
        from opacus import PrivacyEngine  # opacus: optional heavy dependency, imported on use

        a = self.args
        enc = self.encoder.encode
        x = torch.from_numpy(np.stack([enc(fit.prompts, fit.chosen), enc(fit.prompts, fit.rejected)], axis=1))  # (n, 2, d)
        model = MLPRewardModel(self.encoder, x.shape[2], a.hidden, a.dropout)
        pair_module = _PairMargin(model.module)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=a.batch_size,
                                             generator=torch.Generator().manual_seed(a.seed))
        opt = torch.optim.AdamW(pair_module.parameters(), lr=a.lr, weight_decay=a.weight_decay)
        engine = PrivacyEngine(accountant="rdp")
        private, opt, loader = engine.make_private(module=pair_module, optimizer=opt, data_loader=loader,
                                                   noise_multiplier=a.dp_noise_multiplier, max_grad_norm=a.dp_max_grad_norm,
                                                   noise_generator=torch.Generator().manual_seed(a.seed + 1))
        self.history_ = []
        for epoch in tqdm(range(a.epochs), desc="reward model (mlp, DP-SGD)", disable=not self.show_progress, leave=False):
            private.train()
            total, seen = 0.0, 0
            for (xb,) in loader:
                if len(xb) == 0:
                    continue
                loss = -nn.functional.logsigmoid(private(xb)).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                total, seen = total + float(loss.detach()) * len(xb), seen + len(xb)
            self.history_.append({"epoch": epoch, "train_loss": total / max(seen, 1)})
        delta = a.dp_delta if a.dp_delta is not None else 1.0 / fit.n_pairs
        self.epsilon_ = float(engine.get_epsilon(delta))
        self.delta_ = delta
        model.privacy_ = {"epsilon": self.epsilon_, "delta": float(delta), "noise_multiplier": float(a.dp_noise_multiplier),
                          "max_grad_norm": float(a.dp_max_grad_norm), "epochs": int(a.epochs), "batch_size": int(a.batch_size),
                          "n_pairs": int(fit.n_pairs), "accountant": "rdp"}
        model.module.load_state_dict({k.removeprefix("_module.").removeprefix("mlp."): v
                                      for k, v in private.state_dict().items()})
        model.module.eval()
        return model

    def _train_lora(self, model: LoRARewardModel, fit: PreferencePairs, val: PreferencePairs | None, rng) -> None:
        def batch_loss(idx):
            p = [fit.prompts[i] for i in idx]
            rc = model.forward_texts(p, [fit.chosen[i] for i in idx])
            rr = model.forward_texts(p, [fit.rejected[i] for i in idx])
            return bradley_terry_loss(rc, rr)

        val_loss = None
        if val is not None:
            def val_loss():
                rc = model.raw_scores(list(val.prompts), list(val.chosen))
                rr = model.raw_scores(list(val.prompts), list(val.rejected))
                return bradley_terry_loss(torch.from_numpy(rc), torch.from_numpy(rr))
        self._loop(model.module, fit.n_pairs, batch_loss, val_loss, rng)
