"""A FedVPA-GP model (``fedroute vpa train``) -> a signed ``personal_reward/vpa`` bundle, with a parity gate (issue 28).

Files (layouts: :mod:`sdk.personal_reward`): ``tokenizer.json`` and ``embedder.onnx`` (optimum's exporter, as for
reward-scorer bundles), ``vpa_encoder.onnx`` and ``vpa_reward.onnx`` (``torch.onnx.export``, TorchScript
exporter, opset 17, user / context / target axes dynamic: :func:`vpa_to_onnx`), ``parity.json``. The graphs read
the raw features a device computes from text; the trainer's scaling of ``p(y)`` and its PCA of ``e(x)``,
``e(y)`` (:class:`trainer.vpa.features.FeatureTransform`) and the prototypes of the mixture prior are constants
in them, so nothing else fitted ships.

Parity (:func:`check_parity`): on real pairs, users of both types with C context pairs and held-out target pairs,
the staged bundle loaded by :class:`sdk.personal_reward.PersonalRewardScorer` (text in, as an app uses it) against
the trainer (:class:`trainer.vpa.artefact.PersonalRewardArtefact`): ``z``, ``mu``, ``logvar`` and the rewards of the
target responses must agree within :data:`PARITY_FP32` (fp32), else :class:`export.errors.ParityError` and
nothing is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

from export import kinds
from export.bundle_writer import check_replaceable, check_version, next_bundle_version, write_bundle, write_checked_bundle
from export.embedder_onnx import ExportedEmbedder, export_embedder
from export.errors import ExportError
from export.scratch_folder import scratch_folder
from export.signing import load_signing_key
from export.torch_onnx import module_to_onnx
from sdk import bundle_manifest as fmt
from sdk import kinds as sdk_kinds
from sdk.builtin_kinds import TOKENIZER_FILE
from sdk.personal_reward import ENCODER_FILE, FAMILY, KIND, REWARD_FILE, PersonalRewardScorer
from trainer.embeddings import resolve_model_path
from trainer.rewards.pair_features import LENGTH_SCALE
from trainer.vpa.artefact import PersonalRewardArtefact
from trainer.vpa.evaluation import prior_tensors
from trainer.vpa.features import PAIR_FEATURE_NAMES, STRUCTURE_PATTERNS, STRUCTURE_SCALE, FeatureTransform
from trainer.vpa.model import mixture_moments

#: Largest absolute difference between device and trainer (z, mu, logvar, rewards), fp32.
PARITY_FP32 = 1e-3

#: One user of the parity check: C context pairs ``(prompt, preferred, dispreferred)`` and target pairs
#: ``(prompt, response_a, response_b)``.
ParityUser = tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]


class _Features(nn.Module):
    """:class:`FeatureTransform` as graph constants: raw columns -> ``phi`` (identity for ``transform=None``)."""

    def __init__(self, transform: FeatureTransform | None, d_raw: int) -> None:
        super().__init__()
        div = np.ones(d_raw, dtype=np.float32)
        if transform is not None and transform.scales is not None:
            div[-len(transform.scales):] = transform.scales
        self.register_buffer("div", torch.as_tensor(div))
        proj = None if transform is None else transform.projection
        self.d = 0 if proj is None else proj.mean.shape[1]
        if proj is not None:
            self.register_buffer("mean", torch.as_tensor(proj.mean, dtype=torch.float32))
            self.register_buffer("components", torch.as_tensor(proj.components, dtype=torch.float32))

    def forward(self, raw: torch.Tensor) -> torch.Tensor:
        x, d = raw / self.div, self.d
        if not d:
            return x
        blocks = [x[..., i * d:(i + 1) * d] @ self.components[i].T - self.mean[i] @ self.components[i].T for i in (0, 1)]
        return torch.cat(blocks + [x[..., 2 * d:]], -1)


def vpa_to_onnx(model, protos=None, transform: FeatureTransform | None = None, z_mode: str = "mean",
                d_raw: int | None = None) -> tuple[bytes, bytes]:
    """``(vpa_encoder.onnx, vpa_reward.onnx)`` bytes of a :class:`trainer.vpa.model.VPAModel` (put in eval mode).

    protos : the FedVPA-GP prior (:class:`trainer.vpa.aggregation.Prototypes`) or None (VPL's N(0, I)); with it the
    encoder outputs the moments of the mixture posterior (:meth:`~trainer.vpa.model.VPAModel.infer`), the prototypes
    being graph constants. transform : what turns the graphs' raw inputs (width ``d_raw``) into the model's ``phi``
    (None: the inputs are ``phi``). z_mode : ``'mean'`` or ``'prototype'`` (the most responsible prototype's mean).
    Under the mixture prior the encoder also reads ``log_pi`` (U, K) float32, the mixing weights of each user's
    prior (the global ``log pi`` or its client's), and ``evidence_scale`` (U, 1) float32, the ``alpha`` of
    :meth:`~trainer.vpa.model.VPAModel.components`.
    """
    model = model.eval()
    prior = None if protos is None else prior_tensors(protos)
    d_in = model.pair_net[0].in_features
    features = _Features(transform, d_raw or d_in)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.features = model, features

        def forward(self, phi_w, phi_l, mask, log_pi=None, evidence_scale=None):
            w, lo = self.features(phi_w), self.features(phi_l)
            if prior is None:
                mu, logvar = self.model.encode(w, lo, mask)
                return mu, mu, logvar, torch.ones_like(mu[:, :1])
            m, lv, logits = self.model.components(w, lo, mask, prior[0], prior[1], log_pi, evidence_scale)
            gamma = torch.softmax(logits, -1)
            mu, logvar = mixture_moments(m, lv, gamma)
            return (prior[0][gamma.argmax(-1)] if z_mode == "prototype" else mu), mu, logvar, gamma

    class Reward(Encoder):
        def forward(self, phi, z):
            return self.model.reward(self.features(phi), z)

    d, users = d_raw or d_in, {0: "users"}
    ctx = {0: "users", 1: "context"}
    args, names, axes = (torch.zeros(2, 3, d), torch.zeros(2, 3, d), torch.ones(2, 3)), ["phi_w", "phi_l", "mask"], {}
    if prior is not None:
        args += (prior[2].expand(2, -1).clone(), torch.ones(2, 1))
        names += ["log_pi", "evidence_scale"]
        axes = {"log_pi": users, "evidence_scale": users}
    enc = module_to_onnx(Encoder(), args, names, ["z", "mu", "logvar", "responsibilities"],
                         {"phi_w": ctx, "phi_l": ctx, "mask": ctx, "z": users, "mu": users, "logvar": users,
                          "responsibilities": users, **axes}, {"family": FAMILY, "kind": KIND})
    rew = module_to_onnx(Reward(), (torch.zeros(2, 3, d), torch.zeros(2, model.head.in_features)), ["phi", "z"],
                         ["reward"], {"phi": {0: "users", 1: "targets"}, "z": users, "reward": {0: "users", 1: "targets"}},
                         {"family": FAMILY, "kind": KIND})
    return enc, rew


def feature_fields(artefact: PersonalRewardArtefact) -> dict:
    """The manifest's ``features``: which raw columns the device computes (:mod:`sdk.personal_reward`)."""
    structure = artefact.transform.structure
    markers = list(STRUCTURE_PATTERNS.values()) if structure in ("markers", "both") else []
    names = list(PAIR_FEATURE_NAMES) if structure in ("pair_features", "both") else []
    d = artefact.transform.d_emb
    return {"layout": "[e(x), e(y), log1p([chars, words, lines](y)) / length_scale, log1p(count(marker, y)) / "
                      "marker_scale, response_features(x, y, pair_features)]",
            "structure": structure, "length_scale": LENGTH_SCALE, "markers": markers, "marker_scale": STRUCTURE_SCALE,
            "pair_features": names, "d_in": 2 * d + 3 + len(markers) + len(names)}


class VPAPersonalRewardExportKind(kinds.ExportKind):
    """``personal_reward/vpa``: the two graphs of :func:`vpa_to_onnx`, the manifest's ``features`` and ``latent``,
    and the parity gate of :func:`check_parity`."""

    family = FAMILY
    name = KIND

    def files(self, artefact: PersonalRewardArtefact) -> dict[str, bytes]:
        enc, rew = vpa_to_onnx(artefact.model, artefact.prototypes, artefact.transform, artefact.z_mode,
                               feature_fields(artefact)["d_in"])
        return {ENCODER_FILE: enc, REWARD_FILE: rew}

    def manifest_fields(self, artefact: PersonalRewardArtefact) -> dict:
        protos = artefact.prototypes
        return {sdk_kinds.manifest_key(FAMILY): self.name, "features": feature_fields(artefact),
                "latent": {"dim": int(artefact.settings["latent_dim"]), "prior": "gaussian" if protos is None else "mixture",
                           "n_prototypes": 1 if protos is None else len(protos.pi), "z_mode": artefact.z_mode,
                           "pooling": artefact.settings["pooling"], "beta": artefact.settings["beta"],
                           **({} if protos is None else {"pi": [float(p) for p in protos.pi],
                                                          "readout": {str(c): [m, float(a)] for c, (m, a)
                                                                      in sorted(artefact.readout.items())}})}}

    def parity(self, bundle_dir, public_key, artefact, reference, test, precisions=("fp32",), progress=print) -> dict:
        """``reference``: :func:`trainer_reference` of the users ``test``."""
        return check_parity(PersonalRewardScorer.load(bundle_dir, public_key), test, reference)


if KIND not in kinds.REGISTRY.names(FAMILY):
    kinds.register(VPAPersonalRewardExportKind())


def parity_users(pairs: pd.DataFrame, n_users: int, context: int, n_targets: int) -> list[ParityUser]:
    """``n_users`` users over consecutive rows of ``pairs`` (``label`` 1 = A preferred): even users keep the label
    (harmless), odd users flip it (helpful, as :mod:`trainer.data.conflicting_users` builds them); C = ``context``
    context pairs and ``n_targets`` target pairs each. Raises ExportError when there are too few pairs."""
    per = context + n_targets
    if n_users < 1 or context < 1 or n_targets < 1 or len(pairs) < n_users * per:
        raise ExportError(f"parity needs {n_users} x ({context} + {n_targets}) >= 1 pairs, the data has {len(pairs)}")
    rows = list(pairs[["prompt", "response_a", "response_b", "label"]].itertuples(index=False))
    users = []
    for u in range(n_users):
        mine = rows[u * per:(u + 1) * per]
        ctx = [(x, a, b) if bool(lab) != bool(u % 2) else (x, b, a) for x, a, b, lab in mine[:context]]
        users.append((ctx, [(x, a, b) for x, a, b, _ in mine[context:]]))
    return users


def client_weights(n_prototypes: int, user: int) -> np.ndarray:
    """The client mixing weights the parity check gives user ``user`` (K,): 0.8 on prototype ``user mod K``, the
    rest spread evenly (a client of mostly one type)."""
    w = np.full(n_prototypes, 0.2 / (n_prototypes - 1))
    w[user % n_prototypes] = 0.8
    return w


def trainer_reference(artefact: PersonalRewardArtefact, users: Sequence[ParityUser], cache_dir: Path | None = None
                      ) -> list[dict]:
    """Per user the trainer's raw features of its context and targets, its latent
    (:meth:`~trainer.vpa.artefact.PersonalRewardArtefact.latent`) and the rewards of the target responses (A then B);
    under the mixture prior also ``latent_client``, the latent under :func:`client_weights`."""
    out = []
    for u, (ctx, targets) in enumerate(users):
        (xs, w, lo), (tx, a, b) = zip(*ctx), zip(*targets)
        raw_c, raw_t = artefact.raw(xs + xs, w + lo, cache_dir), artefact.raw(tx + tx, a + b, cache_dir)
        phi_c = artefact.transform.apply(raw_c)
        latent = artefact.latent(phi_c[:len(xs)], phi_c[len(xs):])
        out.append({"raw": np.concatenate([raw_c, raw_t]), "latent": latent,
                    "rewards": artefact.rewards(artefact.transform.apply(raw_t), latent["z"])})
        if artefact.prototypes is not None:
            out[-1]["latent_client"] = artefact.latent(phi_c[:len(xs)], phi_c[len(xs):],
                                                       client_weights(len(artefact.prototypes.pi), u))
    return out


def check_parity(scorer: PersonalRewardScorer, users: Sequence[ParityUser], reference: Sequence[dict]) -> dict:
    """The device (``scorer``, from text) against the trainer's ``reference`` (:func:`trainer_reference`) on ``users``.

    Returns ``{"n_users", "n_context", "n_targets", "max_abs_diff": {features, z, mu, logvar, responsibilities,
    rewards}, "threshold", "failures", "passed"}``; the gate covers ``z``, ``mu``, ``logvar`` and ``rewards`` (the
    latent also under :func:`client_weights` where the reference has it).
    """
    diff = dict.fromkeys(("features", "z", "mu", "logvar", "responsibilities", "rewards"), 0.0)
    for u, ((ctx, targets), ref) in enumerate(zip(users, reference)):
        if "latent_client" in ref:
            mine = scorer.infer_z(ctx, client_weights(scorer.n_prototypes, u))
            for name in ("z", "mu", "logvar", "responsibilities"):
                diff[name] = max(diff[name], float(np.abs(getattr(mine, name) - ref["latent_client"][name]).max()))
        (xs, w, lo), (tx, a, b) = (list(map(list, zip(*ctx))), list(map(list, zip(*targets))))
        latent = scorer.infer_z(ctx)
        device = {"features": np.concatenate([scorer.features(xs + xs, w + lo), scorer.features(tx + tx, a + b)]),
                  "rewards": np.concatenate([scorer.rewards(x, [ya, yb], latent) for x, ya, yb in targets])}
        trainer = {"features": ref["raw"], "rewards": np.stack([ref["rewards"][:len(tx)], ref["rewards"][len(tx):]], 1).ravel()}
        for name in diff:
            d, t = (device[name], trainer[name]) if name in device else (getattr(latent, name), ref["latent"][name])
            diff[name] = max(diff[name], float(np.abs(np.asarray(d, dtype=np.float64) - t).max()))
    failures = [f"{name} max|diff| {diff[name]:.3g} > {PARITY_FP32}" for name in ("z", "mu", "logvar", "rewards")
                if not diff[name] <= PARITY_FP32]
    return {"n_users": len(users), "n_context": len(users[0][0]), "n_targets": len(users[0][1]), "max_abs_diff": diff,
            "threshold": PARITY_FP32, "failures": failures, "passed": not failures}


@dataclass(frozen=True)
class VPAExportResult:
    """What :func:`export_personal_reward_bundle` wrote: the signed ``manifest`` and the ``parity`` report."""

    out: Path
    manifest: dict
    parity: dict


def export_personal_reward_bundle(artefact: PersonalRewardArtefact, out: Path, signing_key: Path,
                                  users: Sequence[ParityUser], *, bundle_version: int | None = None,
                                  exported: ExportedEmbedder | None = None, cache_dir: Path | None = None,
                                  progress: Callable[[str], None] = print) -> VPAExportResult:
    """Export ``artefact`` as a signed, parity-checked ``personal_reward/vpa`` bundle at ``out``.

    Parameters
    ----------
    artefact : a saved FedVPA-GP (``kinds.get('vpa', 'personal_reward').load(RUN/personal_reward)``).
    out : bundle directory to create or replace (atomically; only a bundle of this family or an empty folder).
    signing_key : ``signing.key`` of ``fedroute keygen``.
    users : real pairs for the parity check (:func:`parity_users`), at least one user.
    bundle_version : default 1 + the version at ``out``.
    exported : an already exported embedder of ``artefact.embedder`` (tests reuse one); default: export it now.
    cache_dir : embedding cache of the trainer's features (default the project's).
    progress : callable receiving one-line progress messages.

    Raises
    ------
    ExportError
        Bad key, no parity user, an ``out`` or version that cannot be written, an embedder of another width.
    ParityError
        The gate failed; nothing is written at ``out``.
    """
    if not users:
        raise ExportError("parity needs at least one user of real pairs")
    key = load_signing_key(signing_key)
    out = Path(out)
    check_replaceable(out, FAMILY)
    version = bundle_version if bundle_version is not None else next_bundle_version(out)
    check_version(out, version)
    emb, kind = artefact.embedder, kinds.get(KIND, FAMILY)
    with scratch_folder(out) as tmp:
        if exported is None:
            progress(f"exporting embedder {emb.model} to ONNX with optimum")
            exported = export_embedder(resolve_model_path(emb.model), tmp / "embedder", emb.max_tokens, emb.truncation_side)
        if exported.dim != artefact.transform.d_emb:
            raise ExportError(f"the embedder has dim {exported.dim}, the model was trained on {artefact.transform.d_emb}")
        progress("exporting the context encoder and the reward head")
        files = {TOKENIZER_FILE: exported.tokenizer.read_bytes(), fmt.EMBEDDER_FILES["fp32"]: exported.model.read_bytes(),
                 **kind.files(artefact)}
        fields = {"bundle_version": int(version), **kind.manifest_fields(artefact),
                  "embedder": {"name": emb.model, "dim": exported.dim, "max_tokens": int(emb.max_tokens),
                               "truncation_side": emb.truncation_side, "pooling": "mean", "normalised": True,
                               "files": {"fp32": fmt.EMBEDDER_FILES["fp32"]}}}
        staged = tmp / "staged"
        write_bundle(staged, files, fields, key)
        progress(f"checking parity of the staged bundle on {len(users)} users of real pairs")
        report = kind.parity(staged, key.public_key(), artefact, trainer_reference(artefact, users, cache_dir), users)
        d = report["max_abs_diff"]
        progress(f"  max|diff| z {d['z']:.2e}, mu {d['mu']:.2e}, logvar {d['logvar']:.2e}, rewards {d['rewards']:.2e}, "
                 f"features {d['features']:.2e}")
        manifest = write_checked_bundle(out, files, fields, key, report)
    progress(f"wrote personal-reward bundle v{manifest['bundle_version']} to {out}")
    return VPAExportResult(out, manifest, report)
