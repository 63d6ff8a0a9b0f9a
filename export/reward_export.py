"""A client's MoR reward model (MLP or LoRA) and the federated client router -> a signed reward-scorer bundle.

The device then scores its own (prompt, response) pairs locally with :class:`sdk.reward_scorer.RewardScorer`
(MoR, paper 001: client reward models stay on their client). Files (see :mod:`sdk.reward_scorer`):
``tokenizer.json`` and ``embedder.onnx`` (optimum's exporter, as for router bundles), ``reward.onnx``
and ``client_router.onnx`` (``torch.onnx.export``, TorchScript exporter, opset 17: these are our own
small networks, which optimum does not cover), and ``parity.json``.

Design notes: docs/mor.md (Module notes).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from export import kinds
from export.bundle_writer import check_replaceable, check_version, next_bundle_version, write_bundle, write_checked_bundle
from export.embedder_onnx import ExportedEmbedder, export_embedder
from export.errors import ExportError
from export.scratch_folder import scratch_folder
from export.torch_onnx import merged_lora_copy, module_to_onnx
from export.signing import load_signing_key
from sdk import bundle_manifest as fmt
from sdk import kinds as sdk_kinds
from sdk.builtin_kinds import TOKENIZER_FILE
from sdk.reward_scorer import CLIENT_ROUTER_FILE, FAMILY, KIND, LORA_KIND, REWARD_FILE, REWARD_TOKENIZER_FILE
from sdk.errors import InvalidInputError
from trainer.rewards.pair_features import LENGTH_SCALE, check_pair_texts
from sdk.pair_encoding import N_LENGTH_FEATURES as N_LENGTH_COLUMNS
from sdk.reward_scorer import RewardScorer
from trainer.embeddings import resolve_model_path

OPSET = 17
MAX_ABS_DIFF = 1e-3
MIN_CHOICE_AGREEMENT = 0.99


def _to_onnx(module, d_in: int, outputs: list[str], dynamic: dict, metadata: dict) -> bytes:
    """A graph with one ``features (batch, d_in)`` input (:func:`export.torch_onnx.module_to_onnx`)."""
    import torch  # torch: optional heavy dependency, imported on use

    return module_to_onnx(module, (torch.zeros(2, d_in),), ["features"], outputs, {"features": {0: "batch"}, **dynamic},
                          metadata)


def _fitted_normaliser(model, arch: str, exporter: str):
    """``model.normaliser_`` after checking ``model.arch == arch``; ExportError otherwise or when none is fitted."""
    if getattr(model, "arch", None) != arch:
        raise ExportError(f"{exporter} needs a {arch.upper()} reward model, got arch {getattr(model, 'arch', None)!r}")
    if model.normaliser_ is None:
        raise ExportError("the reward model has no normaliser: fit it (fit_normaliser) before export")
    return model.normaliser_


def _normalise_module(norm):
    """The client's z-normalisation ``(raw - mean) / (std + eps)``, clipped when set, as a torch module (MoR Sec. 3)."""
    import torch  # torch: optional heavy dependency, imported on use
    from torch import nn  # torch: optional heavy dependency, imported on use

    class Normalise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mean", torch.tensor(float(norm.mean)))
            self.register_buffer("scale", torch.tensor(float(norm.std) + float(norm.eps)))
            self.clip = None if norm.clip is None else float(norm.clip)

        def forward(self, raw: torch.Tensor) -> torch.Tensor:
            reward = (raw - self.mean) / self.scale
            return reward if self.clip is None else torch.clamp(reward, -self.clip, self.clip)

    return Normalise()


def reward_mlp_to_onnx(model) -> bytes:
    """``reward.onnx`` for a :class:`trainer.rewards.reward_models.MLPRewardModel` with a normaliser.

    Graph: ``features (batch, d_in) float32`` -> ``raw (batch,)``, ``reward (batch,)`` float32.

    Raises
    ------
    ExportError
        Not an MLP reward model, or no normaliser fitted.
    """
    from torch import nn  # torch: optional heavy dependency, imported on use

    norm = _fitted_normaliser(model, "mlp", "reward_mlp_to_onnx")
    net = model.module

    class Normalised(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.normalise = _normalise_module(norm)

        def forward(self, features):
            raw = self.net(features)
            return raw, self.normalise(raw)

    return _to_onnx(Normalised(), model.d_in, ["raw", "reward"], {"raw": {0: "batch"}, "reward": {0: "batch"}},
                    {"family": FAMILY, "kind": KIND, "arch": "mlp", "d_in": str(model.d_in)})


def reward_lora_to_onnx(model) -> bytes:
    """``reward.onnx`` of kind ``mor_lora`` for a :class:`trainer.rewards.reward_models.LoRARewardModel`
    with a normaliser: the encoder with its LoRA adapter merged (:func:`export.torch_onnx.merged_lora_copy`,
    as the selector export does), masked mean pooling, the linear head, the length term when the model has
    one, and the client's normaliser folded in.

    Graph: ``input_ids``, ``attention_mask``, ``token_type_ids`` (batch, seq) int64 [, ``lengths`` (batch, 3)
    float32 = ``trainer.rewards.pair_features.response_lengths``] -> ``raw``, ``reward`` (batch,) float32.

    Raises
    ------
    ExportError
        Not a LoRA reward model, or no normaliser fitted.
    """
    import torch  # torch: optional heavy dependency, imported on use
    from torch import nn  # torch: optional heavy dependency, imported on use

    norm = _fitted_normaliser(model, "lora", "reward_lora_to_onnx")
    scorer = model.module
    length = scorer.length is not None

    class Merged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = merged_lora_copy(scorer.encoder)
            self.head = copy.deepcopy(scorer.head)
            self.length = copy.deepcopy(scorer.length)
            self.normalise = _normalise_module(norm)

        def forward(self, input_ids, attention_mask, token_type_ids, lengths=None):
            out = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                               token_type_ids=token_type_ids).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(out.dtype)
            raw = self.head((out * mask).sum(1) / mask.sum(1).clamp(min=1.0)).squeeze(-1)
            if self.length is not None:
                raw = raw + self.length(lengths).squeeze(-1)
            return raw, self.normalise(raw)

    enc = model.tokenize(["a prompt", "another prompt"], ["an answer", "a second, longer answer"])
    names = ["input_ids", "attention_mask", "token_type_ids"]
    args: tuple = tuple(enc[n] for n in names)
    if length:
        names.append("lengths")
        args += (torch.zeros(2, N_LENGTH_COLUMNS),)
    dynamic = {n: ({0: "batch"} if n == "lengths" else {0: "batch", 1: "seq"}) for n in names}
    return module_to_onnx(Merged(), args, names, ["raw", "reward"], dynamic | {"raw": {0: "batch"}, "reward": {0: "batch"}},
                          {"family": FAMILY, "kind": LORA_KIND, "arch": "lora", "base_model": model.base_model,
                           "max_tokens": str(model.max_tokens)})


def client_router_to_onnx(router) -> bytes:
    """``client_router.onnx`` for a :class:`trainer.rewards.client_router.ClientRouter`:
    ``features (batch, d_in) float32`` -> ``logits (batch, K) float32``."""
    return _to_onnx(router, router.d_in, ["logits"], {"logits": {0: "batch"}},
                    {"family": FAMILY, "kind": KIND, "clients": json.dumps(list(router.client_names)),
                     "d_in": str(router.d_in)})


@dataclass(frozen=True)
class ClientRewardArtefact:
    """What the ``reward_scorer/mor`` export kind exports: one ``client`` of a trained ``mixture``
    (``trainer.rewards.mixture.RoutedReward``) and the embedder dimension its features use."""

    mixture: object
    client: str
    embedder_dim: int

    @property
    def index(self) -> int:
        return list(self.mixture.client_names).index(self.client)


class MoRRewardExportKind(kinds.ExportKind):
    """``reward_scorer/mor``: ``reward.onnx`` (MLP on the pair features) + ``client_router.onnx``, the kind's
    manifest fields, and the parity gate of the design notes. ``arch`` is the reward-model
    architecture (``ClientRewardModel.arch``) the kind exports: :func:`export_kind_for` picks the kind by it."""

    family = FAMILY
    name = KIND
    arch = "mlp"

    def check(self, artefact: ClientRewardArtefact) -> None:
        """Raises ExportError: unknown client, a reward model of another architecture than the kind's, a
        reward model and router that read different features, or features of another width than the embedder's."""
        mixture, client = artefact.mixture, artefact.client
        names = list(mixture.client_names)
        if client not in names:
            raise ExportError(f"unknown client {client!r}; the mixture has {names}")
        rm = mixture.reward_models[names.index(client)]
        if getattr(rm, "arch", None) != self.arch:
            raise ExportError(f"client {client!r} has a {getattr(rm, 'arch', None)!r} reward model; the kind "
                              f"{self.family}/{self.name} exports {self.arch!r} reward models")
        if getattr(mixture.encoder, "pair_features", None) is not None:
            raise ExportError(f"the mixture's features hold the pair-feature columns {list(mixture.encoder.pair_features)} "
                              "(MoRConfig.pair_features); the device's RewardScorer computes only the 3 length columns")
        d_in = 2 * artefact.embedder_dim + (3 if mixture.encoder.length_features else 0)
        self.check_reward_model(rm, mixture, client, d_in)
        if mixture.router.d_in != d_in:
            raise ExportError(f"features of width {d_in} (embedder dim {artefact.embedder_dim}) but the router "
                              f"reads {mixture.router.d_in}")

    def check_reward_model(self, rm, mixture, client: str, d_in: int) -> None:
        """The MLP reads the router's features: same encoder, width ``d_in``. Raises ExportError."""
        if rm.encoder.identity != mixture.encoder.identity:
            raise ExportError(f"client {client!r}'s reward model reads {rm.encoder.identity}, "
                              f"the router {mixture.encoder.identity}")
        if rm.d_in != d_in:
            raise ExportError(f"features of width {d_in} but client {client!r}'s reward model reads {rm.d_in}")

    def reward_files(self, rm) -> dict[str, bytes]:
        """The reward model's files (``reward.onnx``)."""
        return {REWARD_FILE: reward_mlp_to_onnx(rm)}

    def reward_fields(self, rm) -> dict:
        """The manifest's ``reward`` entry."""
        norm = rm.normaliser_
        return {"arch": self.arch, "normaliser": {"mean": norm.mean, "std": norm.std, "eps": norm.eps, "clip": norm.clip}}

    def torch_raw(self, rm, prompts: Sequence[str], responses: Sequence[str], features: np.ndarray) -> np.ndarray:
        """The trainer's raw rewards (n,) of the pairs, the reference of the parity check (on ``features``)."""
        return rm.raw_scores_from_features(features)

    def files(self, artefact: ClientRewardArtefact) -> dict[str, bytes]:
        self.check(artefact)
        return {**self.reward_files(artefact.mixture.reward_models[artefact.index]),
                CLIENT_ROUTER_FILE: client_router_to_onnx(artefact.mixture.router)}

    def manifest_fields(self, artefact: ClientRewardArtefact) -> dict:

        self.check(artefact)
        mixture = artefact.mixture
        encoder = mixture.encoder
        length = bool(encoder.length_features)
        return {
            sdk_kinds.manifest_key(FAMILY): self.name,
            "client": {"name": artefact.client, "index": artefact.index},
            "clients": list(mixture.client_names),
            "features": {"layout": encoder.identity["layout"], "length_features": length,
                         "length_scale": LENGTH_SCALE, "d_in": 2 * artefact.embedder_dim + (3 if length else 0)},
            "reward": self.reward_fields(mixture.reward_models[artefact.index]),
            # the routing rule saved with the mixture (``fedroute mor train``: chosen on validation); the device's
            # RewardScorer.route is its top-1 client, which a per-response rule's argmax equals at any temperature
            "routing": {"active": mixture.rule.to_dict(), "variants": {m: r.to_dict() for m, r in mixture.variants.items()}},
        }

    def parity(self, bundle_dir, public_key, artefact, reference, test, precisions=("fp32",), progress=print) -> dict:
        """``reference`` = the trainer's features (n, d_in) float32 of ``test`` = (prompts, responses)."""

        scorer = RewardScorer.load(bundle_dir, public_key)
        prompts, responses = test
        return check_parity(scorer, artefact.mixture, artefact.index, prompts, responses, reference, kind=self)


class MoRLoRARewardExportKind(MoRRewardExportKind):
    """``reward_scorer/mor_lora``: a LoRA-tuned encoder reward model, adapter merged
    (:func:`reward_lora_to_onnx`), its tokenizer as ``reward_tokenizer.json``, + ``client_router.onnx``;
    the same parity gate, the torch reference being the unmerged peft model on the texts."""

    name = LORA_KIND
    arch = "lora"

    def check_reward_model(self, rm, mixture, client: str, d_in: int) -> None:
        """The LoRA model reads the texts, not the router's features: nothing to match."""

    def reward_files(self, rm) -> dict[str, bytes]:
        return {REWARD_FILE: reward_lora_to_onnx(rm),
                REWARD_TOKENIZER_FILE: rm.tokenizer.backend_tokenizer.to_str().encode("utf-8")}

    def reward_fields(self, rm) -> dict:
        return super().reward_fields(rm) | {"encoder": {
            "base_model": rm.base_model, "max_tokens": int(rm.max_tokens), "truncation_side": rm.tokenizer.truncation_side,
            "length_term": bool(rm.length_term), "pooling": "mean",
            "lora": {"r": rm.lora_r, "alpha": rm.lora_alpha, "target_modules": ["query", "value"], "merged": True}}}

    def torch_raw(self, rm, prompts, responses, features) -> np.ndarray:
        return rm.raw_scores(list(prompts), [r if r.strip() else "(empty)" for r in responses])


for _kind in (MoRRewardExportKind(), MoRLoRARewardExportKind()):
    if _kind.name not in kinds.REGISTRY.names(FAMILY):
        kinds.register(_kind)


def export_kind_for(rm) -> MoRRewardExportKind:
    """The registered ``reward_scorer`` export kind whose ``arch`` is the reward model's.

    Raises
    ------
    ExportError
        No kind exports that architecture (lists the ones that do).
    """
    found = {getattr(k, "arch", None): k for k in kinds.REGISTRY.kinds(FAMILY)}
    arch = getattr(rm, "arch", None)
    if arch not in found:
        raise ExportError(f"no reward_scorer export kind for a {arch!r} reward model (kinds export "
                          f"{sorted(a for a in found if a)})")
    return found[arch]


def assemble(mixture, client: str, exported: ExportedEmbedder, bundle_version: int) -> tuple[dict[str, bytes], dict]:
    """Files and manifest fields (before signing) of the reward-scorer bundle of ``client``: the
    embedder's files and fields, then the ``reward_scorer/mor`` kind's (:class:`MoRRewardExportKind`).

    Raises
    ------
    ExportError
        A bundle_version < 1, or the kind's checks (:meth:`MoRRewardExportKind.check`).
    """
    if bundle_version < 1:
        raise ExportError(f"bundle_version must be >= 1, got {bundle_version}")
    artefact = ClientRewardArtefact(mixture, client, exported.dim)
    if client not in list(mixture.client_names):
        raise ExportError(f"unknown client {client!r}; the mixture has {list(mixture.client_names)}")
    kind = export_kind_for(mixture.reward_models[artefact.index])
    emb = mixture.encoder.embedder
    files = {TOKENIZER_FILE: exported.tokenizer.read_bytes(),
             fmt.EMBEDDER_FILES["fp32"]: exported.model.read_bytes(), **kind.files(artefact)}
    fields = {
        "bundle_version": int(bundle_version),
        **kind.manifest_fields(artefact),
        "embedder": {"name": emb.model, "dim": exported.dim, "max_tokens": int(emb.max_tokens),
                     "truncation_side": emb.truncation_side, "pooling": "mean", "normalised": True,
                     "files": {"fp32": fmt.EMBEDDER_FILES["fp32"]}},
    }
    return files, fields


def check_parity(scorer, mixture, client_index: int, prompts: Sequence[str], responses: Sequence[str],
                 trainer_features: np.ndarray, kind: MoRRewardExportKind | None = None) -> dict:
    """Parity report of a loaded :class:`sdk.reward_scorer.RewardScorer` against the trainer (design notes).

    Parameters
    ----------
    scorer : the RewardScorer loaded from the staged bundle.
    mixture : the trainer's RoutedReward that was exported.
    client_index : the exported client.
    prompts, responses : n real pairs.
    trainer_features : (n, d_in) float32, the trainer's features of the pairs.
    kind : the export kind (default: :func:`export_kind_for` the client's reward model); gives the torch
        reference (:meth:`MoRRewardExportKind.torch_raw`: the MLP on ``trainer_features``, the unmerged
        LoRA model on the texts).

    Returns
    -------
    dict with ``graphs`` and ``end_to_end`` (each ``reward_max_abs_diff``, ``raw_max_abs_diff``,
    ``logits_max_abs_diff``, ``choice_agreement``), ``thresholds``, ``passed``, ``failures``.
    """
    rm = mixture.reward_models[client_index]
    kind = kind or export_kind_for(rm)
    torch_raw = kind.torch_raw(rm, prompts, responses, trainer_features).astype(np.float64)
    torch_reward = rm.normaliser_(torch_raw).astype(np.float64)
    torch_logits = mixture.router.logits(trainer_features).astype(np.float64)

    def compare(out: dict) -> dict:
        return {"reward_max_abs_diff": float(np.max(np.abs(out["reward"] - torch_reward))),
                "raw_max_abs_diff": float(np.max(np.abs(out["raw"] - torch_raw))),
                "logits_max_abs_diff": float(np.max(np.abs(out["logits"] - torch_logits))),
                "choice_agreement": float(np.mean(out["logits"].argmax(1) == torch_logits.argmax(1)))}

    graphs = compare(scorer.scores_from_features(trainer_features, list(prompts), list(responses)))
    device_features = scorer.features(list(prompts), list(responses))
    end_to_end = compare(scorer.scores_from_features(device_features, list(prompts), list(responses)))
    end_to_end["features_max_abs_diff"] = float(np.max(np.abs(device_features - trainer_features)))
    failures = [f"graphs: {name} {graphs[name]:.3g} > {MAX_ABS_DIFF}"
                for name in ("reward_max_abs_diff", "raw_max_abs_diff", "logits_max_abs_diff")
                if not graphs[name] <= MAX_ABS_DIFF]
    failures += [f"end to end: {name} {end_to_end[name]:.3g} > {MAX_ABS_DIFF}"
                 for name in ("reward_max_abs_diff", "logits_max_abs_diff") if not end_to_end[name] <= MAX_ABS_DIFF]
    if not end_to_end["choice_agreement"] >= MIN_CHOICE_AGREEMENT:
        failures.append(f"end to end: the router's client choice agrees on {end_to_end['choice_agreement']:.4f} "
                        f"< {MIN_CHOICE_AGREEMENT} of the pairs")
    return {"n_pairs": len(prompts), "graphs": graphs, "end_to_end": end_to_end,
            "thresholds": {"max_abs_diff": MAX_ABS_DIFF, "min_choice_agreement": MIN_CHOICE_AGREEMENT},
            "failures": failures, "passed": not failures}


@dataclass(frozen=True)
class RewardExportResult:
    """What :func:`export_reward_bundle` wrote: the signed ``manifest`` and the ``parity`` report."""

    out: Path
    manifest: dict
    parity: dict


def export_reward_bundle(mixture, client: str, out: Path, signing_key: Path, prompts: Sequence[str],
                         responses: Sequence[str], *, bundle_version: int | None = None,
                         exported: ExportedEmbedder | None = None,
                         progress: Callable[[str], None] = print) -> RewardExportResult:
    """Export ``client``'s reward model and the mixture's router as a signed, parity-checked bundle at ``out``.

    Parameters
    ----------
    mixture : trainer.rewards.mixture.RoutedReward (e.g. ``load_mixture(DIR)``).
    client : the client whose reward model ships (one of ``mixture.client_names``).
    out : bundle directory to create or replace (atomically; only a bundle or an empty folder is replaced).
    signing_key : path of ``signing.key`` (``fedroute keygen``).
    prompts, responses : real pairs for the parity check (e.g. held-out pairs of the client), n >= 1.
    bundle_version : default 1 + the version at ``out``.
    exported : an already exported embedder (tests reuse one); default: export the mixture's embedder now.
    progress : callable receiving one-line progress messages.

    Raises
    ------
    ExportError
        Bad key, unknown client, a reward model that does not export, no parity pairs or a parity text
        that is not a str (checked before any export work).
    ParityError
        A parity gate failed; nothing is written at ``out``.
    """

    if len(prompts) == 0 or len(prompts) != len(responses):
        raise ExportError(f"parity needs n >= 1 real pairs, got {len(prompts)} prompts and {len(responses)} responses")
    try:  # a None or NaN (a missing cell) was refused by the trainer's encoder after the embedder's ONNX export
        check_pair_texts(list(prompts), list(responses))
    except InvalidInputError as exc:
        raise ExportError(f"parity pairs: {exc}") from exc
    if client not in list(mixture.client_names):  # before the embedder's ONNX export (a minute on a busy CPU)
        raise ExportError(f"unknown client {client!r}; the mixture has {list(mixture.client_names)}")
    key = load_signing_key(signing_key)
    out = Path(out)
    check_replaceable(out, FAMILY)  # a router bundle at out is not replaced by this one
    version = bundle_version if bundle_version is not None else next_bundle_version(out)
    check_version(out, version)
    emb = mixture.encoder.embedder
    with scratch_folder(out) as tmp:  # beside out; a killed export's is removed by the next (export.scratch_folder)
        if exported is None:
            progress(f"exporting embedder {emb.model} to ONNX with optimum (opset {OPSET})")
            exported = export_embedder(resolve_model_path(emb.model), tmp / "embedder", emb.max_tokens, emb.truncation_side)
        progress(f"exporting client {client!r}'s reward model and the client router")
        files, fields = assemble(mixture, client, exported, version)
        staged = tmp / "staged"
        write_bundle(staged, files, fields, key)
        progress(f"checking parity of the staged bundle on {len(prompts)} real pairs")
        features = mixture.encoder.encode(list(prompts), list(responses))
        kind = export_kind_for(mixture.reward_models[list(mixture.client_names).index(client)])
        report = kind.parity(staged, key.public_key(), ClientRewardArtefact(mixture, client, exported.dim), features,
                             (list(prompts), list(responses)))
        g, e = report["graphs"], report["end_to_end"]
        progress(f"  graphs: reward max|diff| {g['reward_max_abs_diff']:.2e}, logits {g['logits_max_abs_diff']:.2e}; "
                 f"end to end: reward {e['reward_max_abs_diff']:.2e}, client choice agrees {e['choice_agreement']:.4f}")
        manifest = write_checked_bundle(out, files, fields, key, report)
    progress(f"wrote reward-scorer bundle v{manifest['bundle_version']} for client {client!r} to {out}")
    return RewardExportResult(out, manifest, report)

