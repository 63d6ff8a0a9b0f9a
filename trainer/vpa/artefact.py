"""A trained FedVPA-GP model as an artefact: what ``fedroute vpa train`` saves and ``fedroute vpa export`` ships.

:class:`PersonalRewardArtefact` holds the model (:class:`~trainer.vpa.model.VPAModel`), the prototypes of its
mixture prior, the feature path from text (the embedder, :func:`trainer.vpa.features.raw_features`, then
:class:`~trainer.vpa.features.FeatureTransform`: the ``p(y)`` scales and the PCA), and the ``z`` it scores with
(``z_mode``: the posterior mean, or the mean of the most responsible prototype, chosen on validation). Its
:meth:`~PersonalRewardArtefact.latent` and :meth:`~PersonalRewardArtefact.rewards` are the trainer's inference
(:mod:`trainer.vpa.evaluation`), the reference of the device's parity.

Layout of the folder: ``personal_reward.json`` (format, settings, embedder) and ``personal_reward.npz`` (the
model's ``state_dict``, ``proto_mu``, ``proto_logvar``, ``proto_pi``, ``pca_mean``, ``pca_components``,
``scales``), written to a staged folder that replaces the old one in one rename.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from sdk.atomic_write import replace_dir, temporary_path
from sdk.errors import InvalidInputError
from trainer.embedder_kind import EmbedderConfig
from trainer.rewards.pair_features import PairEncoder
from trainer.vpa.aggregation import Prototypes
from trainer.vpa.evaluation import prior_tensors
from trainer.vpa.features import EmbeddingProjection, FeatureTransform, raw_features, select_structure
from trainer.vpa.model import VPAModel

FORMAT_VERSION = 1
META_FILE, ARRAYS_FILE = "personal_reward.json", "personal_reward.npz"
#: Folder of ``fedroute vpa train --out OUT`` that holds seed 0's FedVPA-GP.
ARTEFACT_DIR = "personal_reward"


@dataclass
class PersonalRewardArtefact:
    """A trained FedVPA-GP (or VPL, ``prototypes=None``) model with its feature path (module docstring).

    settings : ``{"d_in", "hidden", "latent_dim", "pooling", "beta"}`` of the model. z_mode : ``'mean'`` or
    ``'prototype'`` (under the global ``pi``). embedder : the frozen sentence encoder of ``e(x)``, ``e(y)``.
    readout : ``{C: (z_mode, evidence_scale)}``, the read-out chosen per context size on validation
    (:func:`trainer.vpa.experiment.choose_readout`): ``('client', alpha)`` where the client's own ``pi`` won.
    """

    model: VPAModel
    prototypes: Prototypes | None
    transform: FeatureTransform
    z_mode: str
    embedder: EmbedderConfig
    settings: dict
    readout: dict[int, tuple[str, float]] = field(default_factory=dict)

    def readout_for(self, n_pairs: int) -> tuple[str, float]:
        """The read-out for a user with ``n_pairs`` context pairs: that of the largest chosen C <= n_pairs (the
        smallest C below them); ``(z_mode, 1.0)`` without a per-C choice."""
        if not self.readout:
            return self.z_mode, 1.0
        cs = sorted(self.readout)
        return self.readout[max([c for c in cs if c <= n_pairs], default=cs[0])]

    @classmethod
    def from_run(cls, run: dict, cfg, scales: np.ndarray, embedder: EmbedderConfig | None = None
                 ) -> PersonalRewardArtefact:
        """From :func:`trainer.vpa.experiment.run_seed`'s ``artefact`` entry, its ``VPAConfig`` and the ``p(y)``
        scales of the pairs (:func:`trainer.vpa.features.pair_feature_scales`); ``embedder`` default: the one
        :func:`trainer.vpa.experiment.load_features` reads with."""
        model = run["model"]
        keeps_p = run["structure"] in ("pair_features", "both")
        settings = {"d_in": model.pair_net[0].in_features, "hidden": cfg.hidden, "latent_dim": cfg.latent_dim,
                    "pooling": cfg.pooling, "beta": run["beta"]}
        return cls(model, run["prototypes"], FeatureTransform(run["structure"], scales if keeps_p else None,
                                                              run["projection"]),
                   run["z_mode"], embedder or EmbedderConfig(), settings, dict(run.get("readout", {})))

    # -- the trainer's inference on text ----------------------------------------------------------------

    def raw(self, prompts: Sequence[str], responses: Sequence[str], cache_dir: Path | None = None) -> np.ndarray:
        """The columns of :func:`~trainer.vpa.features.raw_features` the model reads (``structure``): (n, d_raw)
        float64 of n (prompt, response) texts (``cache_dir``: the embedding cache, default the project's)."""
        return select_structure(raw_features(prompts, responses, PairEncoder(self.embedder, cache_dir)),
                                self.transform.structure)

    def features(self, prompts: Sequence[str], responses: Sequence[str], cache_dir: Path | None = None) -> np.ndarray:
        """``phi`` (n, d_in) float32 of n (prompt, response) texts, as the model was trained on."""
        return self.transform.apply(self.raw(prompts, responses, cache_dir))

    @torch.no_grad()
    def latent(self, phi_w: np.ndarray, phi_l: np.ndarray, client_pi: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """One user's latent from C context pairs (phi_w, phi_l: (C, d_in) float32 of the preferred / dispreferred
        response): ``z`` (d_z,) as :func:`trainer.vpa.evaluation.choose_z`, ``mu``, ``logvar`` (d_z,) of the
        (mixture) posterior, ``responsibilities`` (K,) (``[1.0]`` under the N(0, I) prior). client_pi : (K,) the
        user's client's mixing weights (:func:`trainer.vpa.evaluation.client_log_pi`): used where
        :meth:`readout_for` C is ``'client'``; None or elsewhere the global ``pi`` and ``z_mode``."""
        w, lo = (torch.as_tensor(x, dtype=torch.float32)[None] for x in (phi_w, phi_l))
        mask = torch.ones(1, len(phi_w))
        prior = None if self.prototypes is None else prior_tensors(self.prototypes)
        z_mode, scale = self.readout_for(len(phi_w))
        if prior is None or client_pi is None or z_mode != "client":
            z_mode, scale = self.z_mode, 1.0
        else:
            prior = (prior[0], prior[1], torch.log(torch.as_tensor(client_pi, dtype=torch.float32))[None])
        mu, logvar = self.model.eval().infer(w, lo, mask, prior, scale)
        gamma = torch.ones(1, 1) if prior is None else self.model.components(w, lo, mask, *prior, scale)[2].softmax(-1)
        z = prior[0][gamma.argmax(1)] if z_mode == "prototype" and prior is not None else mu
        return {"z": z[0].numpy(), "mu": mu[0].numpy(), "logvar": logvar[0].numpy(), "responsibilities": gamma[0].numpy()}

    @torch.no_grad()
    def rewards(self, phi: np.ndarray, z: np.ndarray) -> np.ndarray:
        """``r(x, y, z)`` (n,) float32 of responses ``phi`` (n, d_in) under ``z`` (d_z,)."""
        return self.model.eval().reward(torch.as_tensor(phi, dtype=torch.float32)[None],
                                        torch.as_tensor(z, dtype=torch.float32)[None])[0].numpy()

    # -- saving ------------------------------------------------------------------------------------------

    def save(self, directory: Path) -> Path:
        """Write the module docstring's layout to ``directory`` (replaced whole); returns it."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        staged = temporary_path(directory)
        staged.mkdir()
        try:
            arrays = {f"state/{k}": v.detach().numpy() for k, v in self.model.state_dict().items()}
            t, p = self.transform, self.prototypes
            if p is not None:
                arrays |= {"proto_mu": p.mu, "proto_logvar": p.logvar, "proto_pi": p.pi}
            if t.projection is not None:
                arrays |= {"pca_mean": t.projection.mean, "pca_components": t.projection.components}
            if t.scales is not None:
                arrays["scales"] = t.scales
            np.savez(staged / ARRAYS_FILE, **arrays)
            meta = {"format_version": FORMAT_VERSION, "kind": "personal_reward/vpa", "z_mode": self.z_mode,
                    "readout": {str(c): list(r) for c, r in self.readout.items()},
                    "structure": t.structure, "d_emb": t.d_emb, "embedder": asdict(self.embedder), **self.settings}
            (staged / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            replace_dir(staged, directory)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        return directory

    @classmethod
    def load(cls, directory: Path) -> PersonalRewardArtefact:
        """The artefact :meth:`save` wrote. Raises InvalidInputError: no such folder, an unreadable or foreign file."""
        directory = Path(directory)
        try:
            meta = json.loads((directory / META_FILE).read_text())
            with np.load(directory / ARRAYS_FILE, allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
            model = VPAModel(meta["d_in"], meta["hidden"], meta["latent_dim"], 0.0, meta["pooling"])
            model.load_state_dict({k[6:]: torch.as_tensor(v) for k, v in arrays.items() if k.startswith("state/")})
            projection = EmbeddingProjection(arrays["pca_mean"], arrays["pca_components"]) if "pca_mean" in arrays else None
            protos = Prototypes(arrays["proto_mu"], arrays["proto_logvar"], arrays["proto_pi"]) if "proto_mu" in arrays else None
            transform = FeatureTransform(meta["structure"], arrays.get("scales"), projection, meta["d_emb"])
            settings = {k: meta[k] for k in ("d_in", "hidden", "latent_dim", "pooling", "beta")}
            readout = {int(c): (str(m), float(a)) for c, (m, a) in meta.get("readout", {}).items()}
            return cls(model.eval(), protos, transform, meta["z_mode"], EmbedderConfig(**meta["embedder"]), settings,
                       readout)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise InvalidInputError(f"{directory} is not a saved FedVPA-GP model (`fedroute vpa train --out RUN` "
                                    f"writes RUN/{ARTEFACT_DIR}): {exc}") from exc
