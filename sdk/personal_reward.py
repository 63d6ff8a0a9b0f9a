"""A personal reward on the device: the user's latent ``z`` from their own labelled pairs, then ``r(x, y, z)``
(VPL, Poddar et al. 2024; FedVPA-GP, paper 003; docs/vpa.md).

This module declares the family ``personal_reward`` (runtime :class:`PersonalRewardGraphs`; bundles written by
:mod:`export.vpa_export` from ``fedroute vpa train``'s model) and its kind ``vpa``. Files: ``tokenizer.json`` +
``embedder.onnx`` (the frozen sentence encoder ``e(.)``), and two graphs on the raw features
``[e(x), e(y), l(y), s(y), p(y)]`` of a response (columns: the manifest's ``features``; the graphs hold the
trainer's scaling of ``p(y)`` and its PCA of ``e(x)``, ``e(y)`` as constants):

- ``vpa_encoder.onnx``: ``phi_w``, ``phi_l`` (U, C, d_in) float32 (the preferred and dispreferred response of each
  context pair), ``mask`` (U, C) float32, under FedVPA-GP's prior also ``log_pi`` (U, K) and (natural-parameter
  encoders) ``evidence_scale`` (U, 1) float32 -> ``z``, ``mu``, ``logvar`` (U, d_z) and ``responsibilities`` (U, K): the posterior ``q(z | C)``
  (under FedVPA-GP's prior ``sum_k pi_k N(mu_k, sigma_k^2)``: the mixture of the component posteriors, prototypes
  as graph constants, ``pi`` the manifest's ``latent.pi`` or the client's own), the ``z`` the trainer scores with
  (posterior mean or most responsible prototype's mean);
- ``vpa_reward.onnx``: ``phi`` (U, T, d_in), ``z`` (U, d_z) -> ``reward`` (U, T).

The user's context pairs are an input of :meth:`PersonalRewardScorer.infer_z` only: nothing here sends them.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from sdk import bundle_manifest as fmt
from sdk import kinds
from sdk.artefact_kind import ArtefactKind, LoadContext
from sdk.arrays import finite_rows
from sdk.bundle_manifest import need
from sdk.embedder import FLOAT, SessionThreads, check_graph_inputs, check_text, inference_session, run_session
from sdk.errors import BundleError, InvalidInputError, InvalidQueryError
from sdk.pair_encoding import length_features_many
from sdk.pair_features import FEATURE_NAMES, response_features_many
from sdk.real_numbers import finite_float

FAMILY = "personal_reward"
KIND = "vpa"
ENCODER_FILE = "vpa_encoder.onnx"
REWARD_FILE = "vpa_reward.onnx"
EMPTY_RESPONSE = "(empty)"
LATENT_OUTPUTS = ("z", "mu", "logvar", "responsibilities")
PRIOR_INPUTS = ("log_pi", "evidence_scale")

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class PersonalLatent:
    """A user's latent from their context pairs: ``z`` (d_z,) float32, what rewards are scored with; ``mu``,
    ``logvar`` (d_z,) float32, mean and log variance of the posterior ``q(z | C)``; ``responsibilities`` (K,)
    float32, the posterior's weight on each prototype of the mixture prior (``[1.0]`` under VPL's N(0, I))."""

    z: F32
    mu: F32
    logvar: F32
    responsibilities: F32


def check_personal_reward_manifest(manifest: dict[str, Any]) -> None:
    """The ``personal_reward/vpa`` fields ``features`` and ``latent`` and the two graph files. Raises BundleError
    naming the first field that violates its rule."""
    f: Any = manifest.get("features")
    need(isinstance(f, dict) and isinstance(f.get("markers"), list) and all(isinstance(m, str) for m in f["markers"])
         and isinstance(f.get("pair_features"), list) and all(n in FEATURE_NAMES for n in f["pair_features"])
         and all((finite_float(f.get(s)) or 0) > 0 for s in ("length_scale", "marker_scale")),
         "features must hold markers (list of str), pair_features (names of sdk.pair_features.FEATURE_NAMES), "
         "length_scale and marker_scale (> 0)")
    d_in = 2 * manifest["embedder"]["dim"] + 3 + len(f["markers"]) + len(f["pair_features"])
    need(f.get("d_in") == d_in, f"features.d_in {f.get('d_in')!r} != 2 * embedder.dim + 3 + markers + pair_features = {d_in}")
    try:
        [re.compile(m, re.IGNORECASE) for m in f["markers"]]
    except re.error as exc:
        raise BundleError(f"manifest: features.markers: {exc}") from exc
    latent: Any = manifest.get("latent")
    need(isinstance(latent, dict) and all(type(latent.get(k)) is int and latent[k] >= 1 for k in ("dim", "n_prototypes")),
         "latent must hold dim and n_prototypes (int >= 1)")
    pi, readout = latent.get("pi"), latent.get("readout", {})
    need(pi is None or (isinstance(pi, list) and len(pi) == latent["n_prototypes"]
                        and all((finite_float(p) or 0) > 0 for p in pi)),
         "latent.pi must be n_prototypes floats > 0")
    need(isinstance(readout, dict) and all(c.isdigit() and isinstance(r, list) and len(r) == 2 and isinstance(r[0], str)
                                           and (finite_float(r[1]) or 0) > 0 for c, r in readout.items())
         and (pi is not None or not readout), "latent.readout must map context sizes to [z mode, evidence scale > 0], "
                                              "with latent.pi")
    for name in (ENCODER_FILE, REWARD_FILE):
        need(name in manifest["files"], f"{name} is not listed in files")


@runtime_checkable
class PersonalRewardGraphs(Protocol):
    """Runtime of a ``personal_reward`` kind, on validated raw features (module docstring).

    ``latent(phi_w, phi_l, log_pi, evidence_scale)``: one user's C context pairs, each (C, d_in) float32, the log
    mixing weights (K,) float32 of its prior (None under N(0, I)) and the evidence's scale -> :class:`PersonalLatent`.
    ``rewards(phi, z)``: (n, d_in) float32 responses, ``z`` (d_z,) float32 -> ``r(x, y, z)`` (n,) float32.
    """

    def latent(self, phi_w: F32, phi_l: F32, log_pi: F32 | None, evidence_scale: float) -> PersonalLatent: ...

    def rewards(self, phi: F32, z: F32) -> F32: ...


class PersonalReward:
    """The kind ``vpa``'s two graphs (:class:`PersonalRewardGraphs`); raises BundleError on load when a graph's
    inputs or outputs are not the module docstring's (``prior_inputs``: the encoder reads ``log_pi`` and, unless
    it mean-pools, ``evidence_scale``), or its feature width is not ``d_in``."""

    def __init__(self, encoder: bytes, reward: bytes, d_in: int, options: SessionThreads | None = None,
                 prior_inputs: bool = False) -> None:
        self._encoder = inference_session(encoder, options, ENCODER_FILE)
        self._reward = inference_session(reward, options, REWARD_FILE)
        enc_inputs = ("phi_w", "phi_l", "mask") + (("log_pi",) if prior_inputs else ())
        for session, what, inputs, outputs in ((self._encoder, ENCODER_FILE, enc_inputs, LATENT_OUTPUTS),
                                               (self._reward, REWARD_FILE, ("phi", "z"), ("reward",))):
            optional = {"evidence_scale": FLOAT} if prior_inputs and session is self._encoder else {}
            check_graph_inputs(session, dict.fromkeys(inputs, FLOAT), optional, what)
            width = (session.get_inputs()[0].shape or [None])[-1]
            if width != d_in or not set(outputs) <= {o.name for o in session.get_outputs()}:
                raise BundleError(f"{what}: needs outputs {list(outputs)} and features of width {d_in} (the manifest's "
                                  f"features.d_in), has {[o.name for o in session.get_outputs()]} and width {width}")
        self._scaled = "evidence_scale" in {i.name for i in self._encoder.get_inputs()}

    def latent(self, phi_w: F32, phi_l: F32, log_pi: F32 | None, evidence_scale: float) -> PersonalLatent:
        feeds = {"phi_w": phi_w[None], "phi_l": phi_l[None], "mask": np.ones((1, len(phi_w)), dtype=np.float32)}
        if log_pi is not None:
            feeds["log_pi"] = log_pi[None].astype(np.float32)
        if self._scaled:  # a mean-pooling encoder has no evidence to scale
            feeds["evidence_scale"] = np.full((1, 1), evidence_scale, np.float32)
        out = run_session(self._encoder, list(LATENT_OUTPUTS), feeds, ENCODER_FILE)
        return PersonalLatent(*(np.asarray(v[0], dtype=np.float32) for v in out))

    def rewards(self, phi: F32, z: F32) -> F32:
        (reward,) = run_session(self._reward, ["reward"], {"phi": phi[None], "z": z[None]}, REWARD_FILE)
        return np.asarray(reward[0], dtype=np.float32)


class VPAPersonalRewardKind(ArtefactKind):
    """``personal_reward/vpa``: FedVPA-GP's (or VPL's) context encoder and reward head on the raw pair features."""

    family = FAMILY
    name = KIND

    def files(self, manifest: dict[str, Any], precision: str) -> tuple[str, ...]:
        return (ENCODER_FILE, REWARD_FILE)

    def check_manifest(self, manifest: dict[str, Any]) -> None:
        check_personal_reward_manifest(manifest)

    def load(self, context: LoadContext) -> PersonalReward:
        return PersonalReward(context.files[ENCODER_FILE], context.files[REWARD_FILE],
                              context.manifest["features"]["d_in"], context.options, "pi" in context.manifest["latent"])


kinds.register_family(FAMILY, PersonalRewardGraphs, loader="sdk.PersonalRewardScorer.load")
if KIND not in kinds.names(FAMILY):
    kinds.register(VPAPersonalRewardKind())


def _texts(**lists: object) -> list[list[str]]:
    """Each of ``lists`` as a list of str, all as long as the first (n >= 1); InvalidQueryError naming one otherwise."""
    out: list[list[str]] = []
    for name, v in lists.items():
        if isinstance(v, str) or not isinstance(v, Sequence) or not all(isinstance(t, str) for t in v) or \
                len(v) != len(out[0] if out else v) or len(v) == 0:
            raise InvalidQueryError(f"{name} must be a non-empty list of str{' as long as ' + next(iter(lists)) if out else ''}, "
                                    f"got {v!r:.80}")
        out.append(list(v))
    return out


class PersonalRewardScorer:
    """A personal reward model from a verified bundle (use :meth:`load`): :meth:`infer_z` from the user's own
    labelled pairs, then :meth:`rewards` or :meth:`margins` under that ``z``; text in, as the trainer reads it
    (``trainer.vpa.artefact.PersonalRewardArtefact``). Thread-safe.

    Attributes: ``bundle_version``, ``latent_dim`` (d_z), ``n_prototypes`` (K), ``d_in`` (raw feature width).
    """

    def __init__(self, manifest: dict[str, Any], embedder: kinds.Embedder, graphs: PersonalRewardGraphs) -> None:
        self._manifest = copy.deepcopy(manifest)
        self._embedder, self._graphs = embedder, graphs
        f = manifest["features"]
        self.bundle_version = int(manifest["bundle_version"])
        self.latent_dim, self.n_prototypes = int(manifest["latent"]["dim"]), int(manifest["latent"]["n_prototypes"])
        self.d_in = int(f["d_in"])
        self._markers = [re.compile(m, re.IGNORECASE) for m in f["markers"]]
        self._names = tuple(f["pair_features"])
        self._length_scale, self._marker_scale = float(f["length_scale"]), float(f["marker_scale"])
        latent = manifest["latent"]
        self._log_pi = None if "pi" not in latent else np.log(np.asarray(latent["pi"], dtype=np.float32))
        self._readout = sorted((int(c), str(m), float(a)) for c, (m, a) in latent.get("readout", {}).items())

    @property
    def manifest(self) -> dict[str, Any]:
        """A copy of the bundle's verified manifest."""
        return copy.deepcopy(self._manifest)

    @classmethod
    def load(cls, bundle_dir: str | os.PathLike[str], public_key: fmt.PublicKey, *, intra_op_threads: int = 1,
             inter_op_threads: int = 1, min_bundle_version: int = 1) -> PersonalRewardScorer:
        """Verify and load the personal-reward bundle at ``bundle_dir`` (``fedroute vpa export``); arguments and
        errors as :meth:`sdk.RewardScorer.load` (BundleError also when the bundle is not a personal reward)."""
        loaded = kinds.load_bundle(bundle_dir, public_key, FAMILY, intra_op_threads=intra_op_threads,
                                   inter_op_threads=inter_op_threads, min_bundle_version=min_bundle_version)
        return cls(loaded.manifest, loaded.runtimes[kinds.EMBEDDER_FAMILY], loaded.runtimes[FAMILY])

    def features(self, prompts: Sequence[str], responses: Sequence[str]) -> F32:
        """Raw features ``[e(x), e(y), l(y), s(y), p(y)]`` (n, d_in) float32 of n (prompt, response) (a blank
        response is embedded and measured as ``"(empty)"``, as the trainer does). Raises InvalidQueryError unless
        two lists of str of one length n >= 1 with no blank prompt, or a text has no token the embedder reads."""
        return self._features(*_texts(prompts=prompts, responses=responses))

    def _features(self, prompts: list[str], responses: list[str]) -> F32:
        shown = [r if r.strip() else EMPTY_RESPONSE for r in responses]
        texts = list(dict.fromkeys([check_text(p, "a prompt", InvalidQueryError) for p in prompts] + shown))
        try:
            vecs = self._embedder.embed(texts)
        except InvalidQueryError as exc:  # its position counts the de-duplicated texts
            raise InvalidQueryError(f"a prompt or response has no token the embedder can read ({exc})") from exc
        row = {t: i for i, t in enumerate(texts)}
        counts = np.array([[len(m.findall(r)) for m in self._markers] for r in responses], dtype=np.float64)
        parts: list[npt.NDArray[Any]] = [vecs[[row[p] for p in prompts]], vecs[[row[r] for r in shown]],
                 length_features_many(shown, [""] * len(shown)) / self._length_scale,
                 np.log1p(counts.reshape(len(responses), -1)) / self._marker_scale,
                 response_features_many(prompts, responses, self._names) if self._names else np.zeros((len(prompts), 0))]
        return np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.float32)

    def infer_z(self, context: Sequence[tuple[str, str, str]], client_weights: npt.ArrayLike | None = None
                ) -> PersonalLatent:
        """The user's latent from their own C >= 1 labelled pairs ``(prompt, preferred, dispreferred)``; they stay
        on the device. ``client_weights``: (K,) mixing weights ``pi_c`` of the user's client (its users' mean
        responsibilities, ``sum = 1``, each > 0): under the bundle's read-out for C pairs (``latent.readout``, the
        largest listed C <= the pairs) the prior becomes ``sum_k pi_ck N(mu_k, sigma_k^2)`` with the evidence scaled
        as listed and ``z`` its posterior mean; None: the global ``pi``. Raises InvalidQueryError for a context that
        is not a non-empty list of three str each, a blank prompt, or weights given to a bundle without ``latent.pi``."""
        if isinstance(context, str) or not isinstance(context, Sequence) or not context or \
                any(isinstance(c, str) or not isinstance(c, Sequence) or len(c) != 3 for c in context):
            raise InvalidQueryError(f"context must be a non-empty list of (prompt, preferred, dispreferred) triples "
                                    f"of str, got {context!r:.80}")
        log_pi, scale, client = self._prior(len(context), client_weights)
        prompts, preferred, dispreferred = _texts(**dict(zip(("prompts", "preferred", "dispreferred"), zip(*context))))
        phi = self._features(prompts + prompts, preferred + dispreferred)
        latent = self._graphs.latent(phi[:len(prompts)], phi[len(prompts):], log_pi, scale)
        return PersonalLatent(latent.mu, latent.mu, latent.logvar, latent.responsibilities) if client else latent

    def _prior(self, n_pairs: int, client_weights: npt.ArrayLike | None) -> tuple[F32 | None, float, bool]:
        """``(log_pi, evidence_scale, client read-out?)`` for a user with ``n_pairs`` context pairs."""
        if client_weights is None or self._log_pi is None:
            if client_weights is not None:
                raise InvalidQueryError("client_weights need a bundle whose prior is a mixture with latent.pi")
            return self._log_pi, 1.0, False
        w = finite_rows([client_weights], self.n_prototypes, "client_weights", rows="1")[0]
        if not (np.all(w > 0) and abs(float(w.sum()) - 1.0) <= 1e-3):
            raise InvalidQueryError(f"client_weights must be > 0 and sum to 1, got {w.tolist()}")
        listed = [r for r in self._readout if r[0] <= n_pairs] or self._readout[:1]  # sorted by C
        if not listed or listed[-1][1] != "client":
            return self._log_pi, 1.0, False
        return np.log(w).astype(np.float32), listed[-1][2], True

    def _z(self, z: PersonalLatent | npt.ArrayLike) -> F32:
        row: F32 = finite_rows([z.z if isinstance(z, PersonalLatent) else z], self.latent_dim, "z", rows="1")[0]
        return row

    def rewards(self, prompt: str, responses: Sequence[str], z: PersonalLatent | npt.ArrayLike) -> F32:
        """``r(x, y, z)`` of each candidate response to ``prompt``: (n,) float32, higher = more to this user's
        taste. ``z``: a :class:`PersonalLatent` or (d_z,) floats. Raises InvalidQueryError (texts), ShapeError (z)."""
        zz, x = self._z(z), check_text(prompt, "prompt", InvalidQueryError)
        (ys,) = _texts(responses=responses)
        return self._graphs.rewards(self._features([x] * len(ys), ys), zz)

    def margins(self, prompts: Sequence[str], responses_a: Sequence[str], responses_b: Sequence[str],
                z: PersonalLatent | npt.ArrayLike) -> F32:
        """``r(x, y_A, z) - r(x, y_B, z)`` of n pairs: (n,) float32, > 0 when this user would prefer A (Bradley-Terry:
        ``P(A) = sigmoid(margin)``). Raises InvalidQueryError (texts), ShapeError (z)."""
        zz = self._z(z)
        xs, a, b = _texts(prompts=prompts, responses_a=responses_a, responses_b=responses_b)
        r = self._graphs.rewards(self._features(xs + xs, a + b), zz)
        return r[:len(xs)] - r[len(xs):]

    def __repr__(self) -> str:
        return (f"PersonalRewardScorer(latent_dim={self.latent_dim}, n_prototypes={self.n_prototypes}, "
                f"bundle_version={self.bundle_version})")
