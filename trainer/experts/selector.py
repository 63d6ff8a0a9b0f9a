"""Binary preference selector: frozen backbone + LoRA adapter + a head that also sees length features.

One FedPrism expert (paper 000, Sec. 3.2: "M binary selectors sharing a frozen backbone, each a LoRA
adapter"; ARCHITECTURE.md §7) scores ``(x, y_A, y_B)`` and returns the logit of P(y_A better).

Design notes: docs/prism.md (Module notes).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from sdk.errors import InvalidInputError, ShapeError
from sdk.pair_encoding import LENGTH_FEATURE_NAMES, PairEncoder, PairEncodingConfig
from sdk.pair_features import check_feature_names, pair_features_many
from trainer.config_fields import check_bool, check_int, check_real, check_sequence
from trainer.data.errors import DataUnavailableError
from trainer.embeddings import resolve_model_path
from trainer.embedder_paths import local_model_problem, model_load_problem
from tokenizers import Tokenizer
import hashlib
import os
from trainer.report import write_text

__all__ = ["PairSelector", "SegmentStore", "SelectorConfig", "build_segment_store", "selector_for_backbone"]


@dataclass
class SelectorConfig:
    """Selector architecture (no model is loaded until :class:`PairSelector` is built).

    backbone : local path, ``'all-MiniLM-L6-v2'`` (the packaged copy) or a hub id.
    lora_r, lora_alpha, lora_dropout : LoRA rank, scaling numerator and dropout (paper: 8, 16, 0.05).
    lora_layers : tuple of layer indices with LoRA, or None for all layers.
    target_modules : module names LoRA wraps (BERT ``query``/``value``, Qwen ``q_proj``/``v_proj``).
    head_hidden : int, width of the head's tanh layer.
    pooling : ``'mean'`` or ``'last'``.
    cache_lower_layers : bool, run layers below ``min(lora_layers)`` once and cache them (CPU path).
    encoding : PairEncodingConfig, the token budget (shared with the SDK).
    pair_features : names of :data:`sdk.pair_features.FEATURE_NAMES`, the head's features ``f``
        (default the 3 length features; the device computes the same ones).
    """

    backbone: str = "all-MiniLM-L6-v2"
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_layers: tuple[int, ...] | None = (5,)
    target_modules: tuple[str, ...] = ("query", "value")
    head_hidden: int = 64
    pooling: str = "mean"
    cache_lower_layers: bool = True
    encoding: PairEncodingConfig = field(default_factory=PairEncodingConfig)
    pair_features: tuple[str, ...] = LENGTH_FEATURE_NAMES

    def __post_init__(self) -> None:
        if isinstance(self.encoding, dict):
            self.encoding = PairEncodingConfig(**self.encoding)
        check_sequence(self, "pair_features")
        self.pair_features = check_feature_names(self.pair_features)
        for name in ("lora_layers", "target_modules"):
            check_sequence(self, name, optional=True)
        if self.lora_layers is not None:
            self.lora_layers = tuple(int(i) for i in self.lora_layers)
            if not self.lora_layers or min(self.lora_layers) < 0:
                raise InvalidInputError(f"lora_layers must be non-empty indices >= 0 or None, got {self.lora_layers}")
        self.target_modules = tuple(self.target_modules)
        if self.pooling not in ("mean", "last"):
            raise InvalidInputError(f"pooling must be 'mean' or 'last', got {self.pooling!r}")
        if self.cache_lower_layers and self.lora_layers is None:
            raise InvalidInputError("cache_lower_layers=True needs lora_layers (the layers above the cache); "
                                    "with lora_layers=None set cache_lower_layers=False")
        check_int(self, "lora_r", 1)
        check_int(self, "head_hidden", 1)
        check_real(self, "lora_alpha", 0, low_open=True)
        check_real(self, "lora_dropout", 0, 1, high_open=True)
        check_bool(self, "cache_lower_layers")

    @classmethod
    def gpu_preset(cls, backbone: str = "Qwen/Qwen2-0.5B") -> SelectorConfig:
        """The paper-scale preset: a causal LM, LoRA on q/v of all layers, last-token pooling."""
        return cls(backbone=backbone, lora_layers=None, target_modules=("q_proj", "v_proj"), pooling="last",
                   cache_lower_layers=False, encoding=PairEncodingConfig.causal_lm_preset())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["lora_layers"] = None if self.lora_layers is None else list(self.lora_layers)
        d["target_modules"] = list(self.target_modules)
        d["pair_features"] = list(self.pair_features)
        return d


#: LoRA targets of the BERT layout (``embeddings`` + ``encoder.layer``, attention ``query``/``value``): the
#: families whose lower layers :meth:`PairSelector.lower_hidden` can cache.
BERT_TARGETS = ("query", "value")


def selector_for_backbone(config: SelectorConfig, backbone: str) -> SelectorConfig:
    """``config`` with ``backbone``, its LoRA targets fitted to the backbone's architecture (``fedroute prism
    train --backbone``; reads the backbone's ``config.json`` only, no weights).

    - A BERT-family encoder (peft's default LoRA targets for its ``model_type`` are ``query``/``value``:
      bert, roberta, electra, ...): on the CPU preset ``config`` as it is, with the backbone; under a
      preset made for a causal LM (``--preset gpu``) those targets, mean pooling and the ``[CLS] prompt
      [SEP] response [SEP]`` encoding with the preset's token budget (its LoRA layers and cache setting kept).
    - A causal LM peft knows (gpt2, llama, mistral, qwen2, ...), on either preset: peft's default
      targets for its type (gpt2 ``c_attn``, llama and qwen2 ``q_proj``/``v_proj``), last-token pooling,
      no prefix token, no cache of lower layers (BERT layout only); LoRA stays in the top layer when
      ``config`` puts it in some layers only. When the encoding's separator or pad token is not in the
      backbone's ``tokenizer.json`` (the GPU preset's ``<|endoftext|>`` is Qwen's), its end-of-sequence
      token is used. A Qwen2 on the GPU preset keeps the preset unchanged.

    Raises
    ------
    DataUnavailableError
        The backbone's configuration cannot be read.
    InvalidInputError
        Any other architecture (an encoder-decoder such as t5, a model type peft has no LoRA default
        for): the message names the model type and the supported families.
    """
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as TARGETS  # peft: optional heavy dependency, imported on use
    from transformers import AutoConfig  # transformers: optional heavy dependency, imported on use
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # transformers: as above

    path = resolve_model_path(backbone)
    problem = local_model_problem(path)
    if problem is not None:
        raise DataUnavailableError(f"cannot load the selector backbone {backbone!r} ({path!r}): {problem}; give such "
                                   "a folder or a hub id")
    try:
        model_config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise DataUnavailableError(f"cannot load the selector backbone {backbone!r} ({path!r}): "
                                   f"{model_load_problem(path, exc)}") from exc
    kind = model_config.model_type
    targets = tuple(TARGETS.get(kind, ()))
    out = replace(config, backbone=backbone)
    if targets == BERT_TARGETS:
        if config.target_modules == BERT_TARGETS:
            return out
        # a BERT under a causal-LM preset (gpu): BERT's targets, [CLS] layout, mean pooling
        bert_encoding = replace(PairEncodingConfig(), prompt_tokens=config.encoding.prompt_tokens,
                                response_tokens=config.encoding.response_tokens)
        return replace(out, target_modules=BERT_TARGETS, pooling="mean", encoding=bert_encoding)
    bert = sorted(k for k, v in TARGETS.items() if tuple(v) == BERT_TARGETS)
    causal = sorted(k for k in TARGETS if k in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and k not in bert)
    if not targets or kind not in causal or getattr(model_config, "is_encoder_decoder", False):
        raise InvalidInputError(f"--backbone {backbone}: a {kind!r} model is not supported as a selector backbone; "
                                f"supported: BERT-family encoders ({', '.join(bert)}) and causal LMs "
                                f"({', '.join(causal)})")
    encoding = replace(config.encoding, prefix_token=None)
    tok_file = Path(path) / "tokenizer.json"
    eos = getattr(model_config, "eos_token_id", None)
    if tok_file.exists() and isinstance(eos, int):
        tokenizer = Tokenizer.from_file(str(tok_file))
        end = tokenizer.id_to_token(eos)
        if end is not None:
            for name in ("sep_token", "pad_token"):
                if tokenizer.token_to_id(getattr(encoding, name)) is None:
                    encoding = replace(encoding, **{name: end})
    top = None if config.lora_layers is None else (model_config.num_hidden_layers - 1,)
    return replace(out, target_modules=targets, pooling="last", cache_lower_layers=False, lora_layers=top,
                   encoding=encoding)


def _layers_pattern(base: nn.Module, n_layers: int) -> str | None:
    """The last name of the backbone's list of ``n_layers`` transformer layers (BERT ``layer``, GPT-2
    ``h``, Llama ``layers``), for peft's ``layers_pattern``; None if there is no such list."""
    for name, module in base.named_modules():
        if name and isinstance(module, nn.ModuleList) and len(module) == n_layers:
            return name.rsplit(".", 1)[-1]
    return None


def _targets_conv1d(base: nn.Module, targets: Sequence[str]) -> bool:
    """True if the LoRA targets are transformers' ``Conv1D`` (GPT-2: weights stored (in, out))."""
    from transformers.pytorch_utils import Conv1D  # transformers: optional heavy dependency, imported on use

    return any(isinstance(m, Conv1D) for n, m in base.named_modules() if n.rsplit(".", 1)[-1] in targets)


def _mask_for_layers(base, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The attention mask the backbone's own forward gives its layers (BERT: sdpa 4-D or extended)."""
    if getattr(base, "attn_implementation", None) == "sdpa" and getattr(base, "position_embedding_type", "absolute") == "absolute":
        from transformers.modeling_attn_mask_utils import _prepare_4d_attention_mask_for_sdpa  # transformers: optional heavy dependency, imported on use

        out = _prepare_4d_attention_mask_for_sdpa(mask, dtype, tgt_len=mask.shape[1])
        return out
    return base.get_extended_attention_mask(mask, mask.shape)


class PairSelector(nn.Module):
    """One frozen backbone with one LoRA adapter and the pair head (design notes).

    Parameters
    ----------
    config : SelectorConfig
    seed : int, initialisation of LoRA and head.

    Raises
    ------
    DataUnavailableError
        The backbone or its ``tokenizer.json`` cannot be loaded.
    """

    def __init__(self, config: SelectorConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model  # peft: optional heavy dependency, imported on use
        from transformers import AutoModel  # transformers: optional heavy dependency, imported on use

        self.config = config = config or SelectorConfig()
        path = resolve_model_path(config.backbone)
        torch.manual_seed(seed)
        try:
            base = AutoModel.from_pretrained(path)
            tok_file = Path(path) / "tokenizer.json"
            if tok_file.exists():
                tokenizer = Tokenizer.from_file(str(tok_file))
            else:
                from transformers import AutoTokenizer  # transformers: optional heavy dependency, imported on use

                tokenizer = AutoTokenizer.from_pretrained(path).backend_tokenizer
        except (OSError, ValueError) as exc:
            raise DataUnavailableError(f"cannot load the selector backbone {config.backbone!r} ({path!r}): {exc}") from exc
        self.pair_encoder = PairEncoder(tokenizer, config.encoding)
        for p in base.parameters():
            p.requires_grad_(False)
        self.n_layers = base.config.num_hidden_layers
        if config.lora_layers is not None and max(config.lora_layers) >= self.n_layers:
            raise InvalidInputError(f"lora_layers {config.lora_layers} out of range for {self.n_layers} layers")
        lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                          target_modules=list(config.target_modules),
                          layers_to_transform=None if config.lora_layers is None else list(config.lora_layers),
                          # peft finds the layer index after a "<prefix>.<pattern>." only without it: a bare
                          # GPT-2 / Llama model's "h.5." / "layers.5." matched nothing (BERT's "encoder.layer.5." did)
                          layers_pattern=None if config.lora_layers is None else _layers_pattern(base, self.n_layers),
                          fan_in_fan_out=_targets_conv1d(base, config.target_modules))  # GPT-2's c_attn: peft warned and set it
        self.backbone = get_peft_model(base, lora)
        d = base.config.hidden_size
        self.hidden_size = d
        n_f = len(config.pair_features)
        self.head = nn.Sequential(nn.Linear(2 * d + n_f, config.head_hidden), nn.Tanh(),
                                  nn.Linear(config.head_hidden, 1))
        self.length_skip = nn.Linear(n_f, 1, bias=False)
        nn.init.zeros_(self.length_skip.weight)
        self.first_lora_layer = 0 if config.lora_layers is None else min(config.lora_layers)
        self.train(False)

    # ------------------------------------------------------------------ modes and state

    def train(self, mode: bool = True) -> PairSelector:
        """Head and LoRA dropout follow ``mode``; the frozen backbone stays in eval mode (no dropout)."""
        super().train(mode)
        self.backbone.eval()
        if mode:
            for name, module in self.backbone.named_modules():
                if "lora_dropout" in name:
                    module.train()
        return self

    @property
    def device(self) -> torch.device:
        """Where the selector's tensors live (``PairSelector.to(device)`` moves them; a
        :class:`SegmentStore` keeps its tensors on the CPU and moves each batch here)."""
        return self.head[0].weight.device

    @property
    def _base(self):
        return self.backbone.get_base_model()

    def _layers(self):
        base = self._base
        if hasattr(base, "encoder"):
            return base.encoder.layer
        return base.layers

    def trainable_names(self) -> list[str]:
        """Names of the expert's tensors (LoRA A/B and head), in a fixed order."""
        return [n for n, p in self.named_parameters() if p.requires_grad]

    def expert_state(self) -> dict[str, np.ndarray]:
        """The expert's trainable tensors: {name: ndarray float32}, copies."""
        return {n: p.detach().cpu().numpy().astype(np.float32).copy()
                for n, p in self.named_parameters() if p.requires_grad}

    def load_expert_state(self, state: dict[str, np.ndarray]) -> None:
        """Put an expert's tensors into the module.

        Raises
        ------
        ShapeError
            Names differ from :meth:`trainable_names` or a shape differs.
        """
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        if set(state) != set(params):
            raise ShapeError(f"expert state names differ: {sorted(set(state) ^ set(params))[:4]}")
        with torch.no_grad():
            for n, p in params.items():
                v = np.asarray(state[n])
                if v.shape != tuple(p.shape):
                    raise ShapeError(f"expert state {n!r} has shape {v.shape}, expected {tuple(p.shape)}")
                p.copy_(torch.from_numpy(v.astype(np.float32)))

    # ------------------------------------------------------------------ forward pieces

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.to(hidden.dtype)
        if self.config.pooling == "mean":
            return (hidden * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp_min(1.0)
        last = mask.sum(1).long() - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]

    @torch.no_grad()
    def lower_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states entering layer ``first_lora_layer`` (the frozen part), shape (n, seq_len, d), float32.

        Only for encoders with ``embeddings`` + ``encoder.layer`` (BERT family); no gradient.
        """
        base = self._base
        emb = base.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        ext = _mask_for_layers(base, attention_mask, emb.dtype)
        h = emb
        for layer in self._layers()[: self.first_lora_layer]:
            h = layer(h, attention_mask=ext)[0]
        return h

    def top_pooled(self, lower: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run layers ``first_lora_layer..`` on cached lower states and pool: shape (n, d)."""
        ext = _mask_for_layers(self._base, attention_mask, lower.dtype)
        h = lower
        for layer in self._layers()[self.first_lora_layer:]:
            h = layer(h, attention_mask=ext)[0]
        return self._pool(h, attention_mask)

    def full_pooled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The whole backbone (with LoRA) on token ids, pooled: shape (n, d)."""
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None and self.config.encoding.prefix_token is not None:
            kwargs["token_type_ids"] = token_type_ids
        out = self.backbone(**kwargs).last_hidden_state
        return self._pool(out, attention_mask)

    def pair_logits(self, h_a: torch.Tensor, h_b: torch.Tensor, feats: torch.Tensor,
                    prior: torch.Tensor | None = None, offset: torch.Tensor | None = None) -> torch.Tensor:
        """Logit of P(A better): h_a, h_b of shape (n, d), feats (n, F) -> (n,) (F = len(config.pair_features)).

        prior : optional (n, F) float32, fixed feature weights per pair (the per-domain length prior of
            ``FedPrismConfig.length_prior='domain'``): adds the offset ``prior . f``, no gradient, so the
            expert is that length-only logit plus its learned residual. Antisymmetric like ``v . f``.
        offset : optional (n,) float32, a fixed logit added as it is (the generator prior's ``gamma_k (beta_A -
            beta_B)`` of ``FedPrismConfig.generator_prior``); the swapped order passes its negation.
        """
        z = torch.cat([h_a, h_b, feats], dim=1)
        out = self.head(z).squeeze(1) + self.length_skip(feats).squeeze(1)
        if prior is not None:
            out = out + (prior.to(feats.dtype) * feats).sum(1)
        if offset is not None:
            out = out + offset.to(feats.dtype)
        return out

    def pair_loss(self, h_a: torch.Tensor, h_b: torch.Tensor, feats: torch.Tensor, label: torch.Tensor,
                  reduction: str = "mean", prior: torch.Tensor | None = None,
                  offset: torch.Tensor | None = None) -> torch.Tensor:
        """BCE on each pair and its position-swapped copy, averaged per pair (design notes).

        label : (n,) float 1.0 = A better; prior, offset : optional, see :meth:`pair_logits`. Returns a
        scalar, or (n,) with ``reduction='none'``.
        """
        lab = label.to(h_a.dtype)
        bce = nn.functional.binary_cross_entropy_with_logits
        neg = None if offset is None else -offset
        straight = bce(self.pair_logits(h_a, h_b, feats, prior, offset), lab, reduction="none")
        swapped = bce(self.pair_logits(h_b, h_a, -feats, prior, neg), 1.0 - lab, reduction="none")
        per = 0.5 * (straight + swapped)
        return per.mean() if reduction == "mean" else per

    def pair_proba(self, h_a: torch.Tensor, h_b: torch.Tensor, feats: torch.Tensor,
                   prior: torch.Tensor | None = None, offset: torch.Tensor | None = None) -> torch.Tensor:
        """Symmetrised P(A better) = sigmoid((logit(A,B) - logit(B,A)) / 2), shape (n,) (with ``offset``:
        ``sigmoid((l(A,B) - l(B,A)) / 2 + offset)``)."""
        neg = None if offset is None else -offset
        return torch.sigmoid(0.5 * (self.pair_logits(h_a, h_b, feats, prior, offset)
                                    - self.pair_logits(h_b, h_a, -feats, prior, neg)))

    # ------------------------------------------------------------------ saving

    def save_expert(self, state: dict[str, np.ndarray], out: Path) -> None:
        """Write one expert: ``adapter/`` (peft ``save_pretrained``: adapter_config.json +
        adapter_model.safetensors) and ``head.safetensors`` (``head.*`` and ``length_skip.weight``)."""
        from safetensors.numpy import save_file  # safetensors: optional heavy dependency, imported on use

        self.load_expert_state(state)
        out.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(str(out / "adapter"))
        head = {n: v for n, v in state.items() if n.startswith(("head.", "length_skip."))}
        save_file(head, str(out / "head.safetensors"))

    def load_expert(self, folder: Path) -> dict[str, np.ndarray]:
        """Read an expert written by :meth:`save_expert` and load it; returns its state.

        Both files must hold exactly this selector's tensors (peft alone loads an adapter leniently).

        Raises
        ------
        InvalidInputError
            ``adapter/adapter_model.safetensors`` or ``head.safetensors`` lacks a tensor of this
            selector or holds one it does not have, or a tensor holding NaN or inf (the message
            names the file and the tensors).
        ShapeError
            A tensor of another shape.
        """
        from peft import get_peft_model_state_dict, set_peft_model_state_dict  # peft: optional heavy dependency, imported on use
        from safetensors.numpy import load_file  # safetensors: optional heavy dependency, imported on use
        from safetensors.torch import load_file as load_torch  # safetensors: optional heavy dependency, imported on use

        folder = Path(folder)
        adapter_file, head_file = folder / "adapter" / "adapter_model.safetensors", folder / "head.safetensors"
        adapter, current = load_torch(str(adapter_file)), get_peft_model_state_dict(self.backbone)
        _check_tensor_names(adapter_file, set(adapter), set(current))
        head = load_file(str(head_file))
        _check_tensor_names(head_file, set(head),
                            {n for n in self.trainable_names() if n.startswith(("head.", "length_skip."))})
        for name, value in adapter.items():  # peft's load would raise a RuntimeError on another shape
            want = tuple(current[name].shape)
            if tuple(value.shape) != want:
                raise ShapeError(f"{adapter_file}: tensor {name!r} has shape {tuple(value.shape)}, expected {want}")
        for path, finite in ((adapter_file, {k: bool(torch.isfinite(v).all()) for k, v in adapter.items()}),
                             (head_file, {k: bool(np.isfinite(v).all()) for k, v in head.items()})):
            bad = next((name for name, ok in sorted(finite.items()) if not ok), None)
            if bad is not None:  # it loaded, and the export's parity step failed on "proba_a holds NaN or inf"
                raise InvalidInputError(f"{path}: tensor {bad!r} holds NaN or inf; a corrupt copy or a diverged "
                                        "training run? retrain the expert")
        set_peft_model_state_dict(self.backbone, adapter)
        state = self.expert_state()
        state.update(head)
        self.load_expert_state(state)
        return self.expert_state()


def _check_tensor_names(path: Path, found: set[str], expected: set[str]) -> None:
    """InvalidInputError naming ``path`` unless it holds exactly the ``expected`` tensor names."""
    if found != expected:
        missing, extra = sorted(expected - found), sorted(found - expected)
        raise InvalidInputError(f"{path}: not this selector's expert file ({len(missing)} tensor(s) missing, e.g. "
                                f"{missing[:2]}; {len(extra)} unexpected, e.g. {extra[:2]}); a truncated copy or an "
                                "expert of another selector config?")


# ---------------------------------------------------------------------- segment store


@dataclass
class SegmentStore:
    """The segments of a set of pairs, ready for the selector.

    All tensors stay on the CPU; :meth:`pooled` and :meth:`batch` move what a batch needs to the
    model's device (:attr:`PairSelector.device`).

    Attributes
    ----------
    input_ids, attention_mask, token_type_ids : LongTensor of shape (n_segments, seq_len).
    lower : FloatTensor of shape (n_segments, seq_len, d) or None, cached frozen lower-layer states.
    seg_a, seg_b : ndarray of shape (n_pairs,), int64, segment of each pair's response A / B.
    features : FloatTensor of shape (n_pairs, F), pair features (``SelectorConfig.pair_features``).
    label : FloatTensor of shape (n_pairs,), 1.0 = A better.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    lower: torch.Tensor | None
    seg_a: np.ndarray
    seg_b: np.ndarray
    features: torch.Tensor
    label: torch.Tensor

    @property
    def n_pairs(self) -> int:
        return int(self.seg_a.shape[0])

    def pooled(self, model: PairSelector, segments: np.ndarray) -> torch.Tensor:
        """Segment vectors (len(segments), d) through the model (top layers on the cache, or all layers).

        On the cache the segments run in length-sorted chunks of 64, each cut to its longest segment (segments
        are right-padded and padding is masked, so only float rounding differs from the padded run)."""
        idx = torch.from_numpy(np.asarray(segments, dtype=np.int64))
        dev = model.device
        mask = self.attention_mask[idx]
        if self.lower is None:
            return model.full_pooled(self.input_ids[idx].to(dev), mask.to(dev), self.token_type_ids[idx].to(dev))
        length = mask.sum(1)
        order = torch.argsort(length, stable=True)
        chunks = [order[s:s + 64] for s in range(0, len(order), 64)]
        out = torch.cat([model.top_pooled(self.lower[idx[c], :int(length[c[-1]])].to(dev),
                                          mask[c, :int(length[c[-1]])].to(dev)) for c in chunks])
        return out[torch.argsort(order)]

    def batch(self, model: PairSelector, pairs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(h_a, h_b, features, label) of the pairs, on the model's device; each distinct segment is run once."""
        pairs = np.asarray(pairs, dtype=np.int64)
        segs, inv = np.unique(np.concatenate([self.seg_a[pairs], self.seg_b[pairs]]), return_inverse=True)
        h = self.pooled(model, segs)
        n = len(pairs)
        dev = model.device
        return h[inv[:n]], h[inv[n:]], self.features[pairs].to(dev), self.label[pairs].to(dev)


def build_segment_store(model: PairSelector, prompts: Sequence[str], responses_a: Sequence[str],
                        responses_b: Sequence[str], labels: Sequence[int] | None = None,
                        batch_size: int = 64, show_progress: bool = False,
                        cache_dir: Path | None = None) -> SegmentStore:
    """Encode pairs into a :class:`SegmentStore`; with ``cache_lower_layers`` run the frozen layers once.

    With ``cache_dir`` the lower-layer states are also kept on disk (``segments-<sha256>.pt``, keyed by
    the backbone, the pair encoding, the cached depth and every segment's text; atomic write), so a
    rerun on the same pairs skips the frozen forward. A file there that does not load as a tensor of the
    expected shape (cut short, foreign) is a cache miss: the states are recomputed and replace it.

    Parameters
    ----------
    prompts, responses_a, responses_b : sequences of n_pairs str.
    labels : n_pairs ints in {0, 1}, or None (zeros; for unlabelled pairs).

    Raises
    ------
    InvalidInputError
        Lengths differ.
    """
    n = len(prompts)
    if not (len(responses_a) == len(responses_b) == n):
        raise InvalidInputError(f"{n} prompts, {len(responses_a)} responses_a, {len(responses_b)} responses_b")
    keys: dict[tuple[str, str], int] = {}
    seg_a = np.array([keys.setdefault((p, r), len(keys)) for p, r in zip(prompts, responses_a)], dtype=np.int64)
    seg_b = np.array([keys.setdefault((p, r), len(keys)) for p, r in zip(prompts, responses_b)], dtype=np.int64)
    seg_texts = list(keys)
    enc = model.pair_encoder.encode_segments([p for p, _ in seg_texts], [r for _, r in seg_texts])
    ids, mask, types = (torch.from_numpy(enc[k]) for k in ("input_ids", "attention_mask", "token_type_ids"))
    lower = None
    disk = None
    if model.config.cache_lower_layers and cache_dir is not None:

        h = hashlib.sha256(json.dumps([model.config.backbone, model.config.encoding.to_dict(),
                                       model.first_lora_layer]).encode())
        for p, r in seg_texts:
            h.update(p.encode() + b"\0" + r.encode() + b"\1")
        disk = Path(cache_dir) / f"segments-{h.hexdigest()[:32]}.pt"
        if disk.exists():
            try:
                lower = torch.load(disk)
            except Exception:  # noqa: BLE001 - cut short or foreign (pickle/zip/runtime errors): a cache miss
                lower = None
            expected = (len(seg_texts), ids.shape[1], model.hidden_size)
            if not (isinstance(lower, torch.Tensor) and tuple(lower.shape) == expected):
                lower = None  # recomputed below and written over the file
    if model.config.cache_lower_layers and lower is None:
        chunks = []
        starts = range(0, len(seg_texts), batch_size)
        if show_progress:
            from tqdm.auto import tqdm  # tqdm: optional heavy dependency, imported on use

            starts = tqdm(starts, desc="frozen lower layers", unit="batch")
        for s in starts:
            dev = model.device  # the cache itself stays on the CPU (SegmentStore moves each batch)
            chunks.append(model.lower_hidden(ids[s:s + batch_size].to(dev), mask[s:s + batch_size].to(dev),
                                             types[s:s + batch_size].to(dev)).cpu())
        lower = torch.cat(chunks) if chunks else torch.zeros((0, ids.shape[1], model.hidden_size))
        if disk is not None:

            disk.parent.mkdir(parents=True, exist_ok=True)
            tmp = disk.with_suffix(".tmp")
            torch.save(lower, tmp)
            os.replace(tmp, disk)
    feats = torch.from_numpy(pair_features_many(prompts, responses_a, responses_b, model.config.pair_features))
    lab = torch.zeros(n) if labels is None else torch.as_tensor(np.asarray(labels, dtype=np.float32))
    return SegmentStore(ids, mask, types, lower, seg_a, seg_b, feats, lab)


def save_selector_config(config: SelectorConfig, path: Path) -> None:
    """``selector_config.json`` (atomic)."""

    write_text(path, json.dumps(config.to_dict(), indent=2))


def load_selector_config(path: Path) -> SelectorConfig:
    """Inverse of :func:`save_selector_config`.

    Raises
    ------
    InvalidInputError
        The file is unreadable, not JSON or not a selector config (the message names the file).
    """
    path = Path(path)
    try:
        d = json.loads(path.read_text())
        d["encoding"] = PairEncodingConfig(**d["encoding"])
        d["pair_features"] = tuple(d.get("pair_features", LENGTH_FEATURE_NAMES))  # configs saved before the key: length
        return SelectorConfig(**d)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{path}: {exc}") from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:  # JSON/Unicode errors are ValueErrors; a wrong layout KeyError/TypeError
        raise InvalidInputError(f"{path}: not a selector config written by `fedroute prism train` "
                                f"({type(exc).__name__}: {exc})") from exc
