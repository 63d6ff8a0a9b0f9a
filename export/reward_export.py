"""A client's MoR reward model and the federated client router -> a signed reward-scorer bundle.

The device then scores its own (prompt, response) pairs locally with :class:`sdk.reward_scorer.RewardScorer`
(MoR, paper 001: client reward models stay on their client). Files (see :mod:`sdk.reward_scorer`):
``tokenizer.json`` and ``embedder.onnx`` (optimum's exporter, as for router bundles), ``reward.onnx``
and ``client_router.onnx`` (``torch.onnx.export``, TorchScript exporter, opset 17: these are our own
small networks, which optimum does not cover), and ``parity.json``.

``reward.onnx`` folds the client's normaliser into the graph: outputs ``raw = R_k(x, y)`` and
``reward = clip((R_k - mu_k) / (sigma_k + eps))`` (``trainer.rewards.reward_models.ScoreNormaliser``).

Reward models exported: the MLP on frozen pair features (``arch = "mlp"``). The LoRA-tuned encoder
(``arch = "lora"``) reads tokenised pairs, not the shared features, and is refused with a clear error.

Parity (:func:`check_parity`, the gate of :func:`export_reward_bundle`), measured through the SDK on the
staged bundle, on real pairs:

- graphs: on the trainer's own features, ``max |reward_onnx - reward_torch|`` and the same for raw
  rewards and router logits must be <= :data:`MAX_ABS_DIFF` (1e-3, fp32);
- end to end (the device's ONNX embedder and length features vs the trainer's sentence-transformers
  features): reward and logits within the same :data:`MAX_ABS_DIFF`, and the router's client choice
  agreeing on >= :data:`MIN_CHOICE_AGREEMENT` of the pairs.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from export import kinds
from export.bundle_writer import check_replaceable, check_version, next_bundle_version, write_bundle, write_checked_bundle
from export.embedder_onnx import ExportedEmbedder, export_embedder, quiet_libraries
from export.errors import ExportError
from export.signing import load_signing_key
from sdk import bundle_manifest as fmt
from sdk import kinds as sdk_kinds
from sdk.builtin_kinds import TOKENIZER_FILE
from sdk.reward_scorer import CLIENT_ROUTER_FILE, FAMILY, KIND, REWARD_FILE
from trainer.rewards.pair_features import LENGTH_SCALE
from sdk.reward_scorer import RewardScorer
from trainer.embeddings import resolve_model_path

OPSET = 17
MAX_ABS_DIFF = 1e-3
MIN_CHOICE_AGREEMENT = 0.99


def _to_onnx(module, d_in: int, outputs: list[str], dynamic: dict, metadata: dict) -> bytes:
    import onnx  # onnx: optional heavy dependency, imported on use
    import torch  # torch: optional heavy dependency, imported on use

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.onnx"
        with torch.no_grad(), quiet_libraries():
            torch.onnx.export(module.eval(), (torch.zeros(2, d_in),), str(path), dynamo=False, opset_version=OPSET,
                              input_names=["features"], output_names=outputs,
                              dynamic_axes={"features": {0: "batch"}, **dynamic})
        model = onnx.load(str(path))
    for key, value in metadata.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.checker.check_model(model)
    return model.SerializeToString()


def reward_mlp_to_onnx(model) -> bytes:
    """``reward.onnx`` for a :class:`trainer.rewards.reward_models.MLPRewardModel` with a normaliser.

    Graph: ``features (batch, d_in) float32`` -> ``raw (batch,)``, ``reward (batch,)`` float32.

    Raises
    ------
    ExportError
        Not an MLP reward model, or no normaliser fitted.
    """
    import torch  # torch: optional heavy dependency, imported on use
    from torch import nn  # torch: optional heavy dependency, imported on use

    if getattr(model, "arch", None) != "mlp":
        raise ExportError(f"only MLP reward models export to ONNX features graphs, got arch {getattr(model, 'arch', None)!r}")
    norm = model.normaliser_
    if norm is None:
        raise ExportError("the reward model has no normaliser: fit it (fit_normaliser) before export")
    net = model.module

    class Normalised(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.register_buffer("mean", torch.tensor(float(norm.mean)))
            self.register_buffer("scale", torch.tensor(float(norm.std) + float(norm.eps)))
            self.clip = None if norm.clip is None else float(norm.clip)

        def forward(self, features: torch.Tensor):
            raw = self.net(features)
            reward = (raw - self.mean) / self.scale
            if self.clip is not None:
                reward = torch.clamp(reward, -self.clip, self.clip)
            return raw, reward

    return _to_onnx(Normalised(), model.d_in, ["raw", "reward"], {"raw": {0: "batch"}, "reward": {0: "batch"}},
                    {"family": FAMILY, "kind": KIND, "arch": "mlp", "d_in": str(model.d_in)})


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
    """``reward_scorer/mor``: ``reward.onnx`` + ``client_router.onnx``, the kind's manifest fields, and
    the parity gate of the module docstring."""

    family = FAMILY
    name = KIND

    def check(self, artefact: ClientRewardArtefact) -> None:
        """Raises ExportError: unknown client, a reward model that is not the MLP kind, a reward model
        and router that read different features, or features of another width than the embedder's."""
        mixture, client = artefact.mixture, artefact.client
        names = list(mixture.client_names)
        if client not in names:
            raise ExportError(f"unknown client {client!r}; the mixture has {names}")
        rm = mixture.reward_models[names.index(client)]
        if getattr(rm, "arch", None) != "mlp":
            raise ExportError(f"client {client!r} has a {getattr(rm, 'arch', None)!r} reward model; only 'mlp' "
                              "(MLP on frozen pair features) exports to a reward-scorer bundle in this version")
        if rm.encoder.identity != mixture.encoder.identity:
            raise ExportError(f"client {client!r}'s reward model reads {rm.encoder.identity}, "
                              f"the router {mixture.encoder.identity}")
        d_in = 2 * artefact.embedder_dim + (3 if mixture.encoder.length_features else 0)
        if rm.d_in != d_in or mixture.router.d_in != d_in:
            raise ExportError(f"features of width {d_in} (embedder dim {artefact.embedder_dim}) but the reward model "
                              f"reads {rm.d_in} and the router {mixture.router.d_in}")

    def files(self, artefact: ClientRewardArtefact) -> dict[str, bytes]:
        self.check(artefact)
        return {REWARD_FILE: reward_mlp_to_onnx(artefact.mixture.reward_models[artefact.index]),
                CLIENT_ROUTER_FILE: client_router_to_onnx(artefact.mixture.router)}

    def manifest_fields(self, artefact: ClientRewardArtefact) -> dict:

        self.check(artefact)
        mixture = artefact.mixture
        encoder, norm = mixture.encoder, mixture.reward_models[artefact.index].normaliser_
        length = bool(encoder.length_features)
        return {
            sdk_kinds.manifest_key(FAMILY): KIND,
            "client": {"name": artefact.client, "index": artefact.index},
            "clients": list(mixture.client_names),
            "features": {"layout": encoder.identity["layout"], "length_features": length,
                         "length_scale": LENGTH_SCALE, "d_in": 2 * artefact.embedder_dim + (3 if length else 0)},
            "reward": {"arch": "mlp", "normaliser": {"mean": norm.mean, "std": norm.std, "eps": norm.eps,
                                                    "clip": norm.clip}},
        }

    def parity(self, bundle_dir, public_key, artefact, reference, test, precisions=("fp32",), progress=print) -> dict:
        """``reference`` = the trainer's features (n, d_in) float32 of ``test`` = (prompts, responses)."""

        scorer = RewardScorer.load(bundle_dir, public_key)
        prompts, responses = test
        return check_parity(scorer, artefact.mixture, artefact.index, prompts, responses, reference)


if KIND not in kinds.REGISTRY.names(FAMILY):
    kinds.register(MoRRewardExportKind())


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
    kind = kinds.REGISTRY.get(FAMILY, KIND)
    artefact = ClientRewardArtefact(mixture, client, exported.dim)
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
                 trainer_features: np.ndarray) -> dict:
    """Parity report of a loaded :class:`sdk.reward_scorer.RewardScorer` against the trainer (module docstring).

    Parameters
    ----------
    scorer : the RewardScorer loaded from the staged bundle.
    mixture : the trainer's RoutedReward that was exported.
    client_index : the exported client.
    prompts, responses : n real pairs.
    trainer_features : (n, d_in) float32, the trainer's features of the pairs.

    Returns
    -------
    dict with ``graphs`` and ``end_to_end`` (each ``reward_max_abs_diff``, ``raw_max_abs_diff``,
    ``logits_max_abs_diff``, ``choice_agreement``), ``thresholds``, ``passed``, ``failures``.
    """
    rm = mixture.reward_models[client_index]
    torch_raw = rm.raw_scores_from_features(trainer_features).astype(np.float64)
    torch_reward = rm.normaliser_(torch_raw).astype(np.float64)
    torch_logits = mixture.router.logits(trainer_features).astype(np.float64)

    def compare(out: dict) -> dict:
        return {"reward_max_abs_diff": float(np.max(np.abs(out["reward"] - torch_reward))),
                "raw_max_abs_diff": float(np.max(np.abs(out["raw"] - torch_raw))),
                "logits_max_abs_diff": float(np.max(np.abs(out["logits"] - torch_logits))),
                "choice_agreement": float(np.mean(out["logits"].argmax(1) == torch_logits.argmax(1)))}

    graphs = compare(scorer.scores_from_features(trainer_features))
    device_features = scorer.features(list(prompts), list(responses))
    end_to_end = compare(scorer.scores_from_features(device_features))
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
        Bad key, unknown client, a reward model that does not export, no parity pairs.
    ParityError
        A parity gate failed; nothing is written at ``out``.
    """

    if len(prompts) == 0 or len(prompts) != len(responses):
        raise ExportError(f"parity needs n >= 1 real pairs, got {len(prompts)} prompts and {len(responses)} responses")
    key = load_signing_key(signing_key)
    out = Path(out)
    check_replaceable(out)
    version = bundle_version if bundle_version is not None else next_bundle_version(out)
    check_version(out, version)
    emb = mixture.encoder.embedder
    with tempfile.TemporaryDirectory(prefix="fedroute-reward-export-") as tmp:
        tmp = Path(tmp)
        if exported is None:
            progress(f"exporting embedder {emb.model} to ONNX with optimum (opset {OPSET})")
            exported = export_embedder(resolve_model_path(emb.model), tmp / "embedder", emb.max_tokens, emb.truncation_side)
        progress(f"exporting client {client!r}'s reward model and the client router")
        files, fields = assemble(mixture, client, exported, version)
        staged = tmp / "staged"
        write_bundle(staged, files, fields, key)
        progress(f"checking parity of the staged bundle on {len(prompts)} real pairs")
        features = mixture.encoder.encode(list(prompts), list(responses))
        kind = kinds.REGISTRY.get(FAMILY, KIND)
        report = kind.parity(staged, key.public_key(), ClientRewardArtefact(mixture, client, exported.dim), features,
                             (list(prompts), list(responses)))
        g, e = report["graphs"], report["end_to_end"]
        progress(f"  graphs: reward max|diff| {g['reward_max_abs_diff']:.2e}, logits {g['logits_max_abs_diff']:.2e}; "
                 f"end to end: reward {e['reward_max_abs_diff']:.2e}, client choice agrees {e['choice_agreement']:.4f}")
        manifest = write_checked_bundle(out, files, fields, key, report)
    progress(f"wrote reward-scorer bundle v{manifest['bundle_version']} for client {client!r} to {out}")
    return RewardExportResult(out, manifest, report)

