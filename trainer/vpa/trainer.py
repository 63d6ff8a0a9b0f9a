"""Federated training of FedVPA-GP, VPL and the Bradley-Terry baselines on simulated clients (issue 28).

One round (:meth:`VPATrainer.train_vpa`): every client copies the global encoder + reward head (and, under the
mixture prior, the global prototypes), runs ``local_steps`` AdamW steps on its own training users, and
returns a :class:`~trainer.vpa.aggregation.ClientUpdate`; the server applies
:func:`~trainer.vpa.aggregation.aggregate_round` (FedAvg weighted by users, prototypes weighted by mass).
A step draws, per user, a context size ``C`` log-uniform in ``[context_min, context_max]``, ``C`` context
pairs and ``n_targets`` other target pairs from the user's pairs, and minimises ``-ELBO / n_targets``
(:mod:`trainer.vpa.model`) plus, under the mixture prior, ``lambda_orth * L_orth`` of the client's soft
prototype means ``m_k = sum_u gamma_uk mu_u / sum_u gamma_uk`` in the step's batch (differentiable through the
encoder: the prototypes themselves are the server's, fixed during the round, and move only by aggregation of the
clients' statistics, :mod:`trainer.vpa.aggregation`). The Gumbel-softmax
temperature falls geometrically from ``tau_start`` to ``tau_end`` over the rounds; ``beta`` rises linearly
from 0 over the first ``warmup`` share of the rounds (KL annealing); a user's KL term is at least ``free_bits``.
The prototype statistics are of the posterior under N(0, I) (:meth:`~trainer.vpa.model.VPAModel.encode`: the
evidence's own location) weighted by the mixture's responsibilities. At the rounds of ``kmeans_at`` the
prototypes are re-fitted by federated K-means of the clients' posterior means
(:mod:`trainer.vpa.prototype_kmeans`) before the round.

The same loop trains a Bradley-Terry reward (:class:`~trainer.vpa.model.BTReward`) by FedAvg: one head
(monolithic) or one head per user type, each user's pairs feeding its type's head (the oracle's models).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from sdk.errors import InvalidInputError
from trainer.data.conflicting_users import ConflictingUsers, UsersConfig
from trainer.vpa.aggregation import VAR_CAP, VAR_FLOOR, ClientUpdate, PrototypeStats, Prototypes, aggregate_round
from trainer.vpa.model import (BTReward, VPAModel, bt_loglik, client_log_weights, component_kl, elbo, kl_normal,
                               mixture_moments, orthogonality_loss)
from trainer.vpa.prototype_kmeans import federated_kmeans

PRIORS = ("gaussian", "mixture")
#: How a user's ``z`` for scoring is read from the posterior (:func:`trainer.vpa.evaluation.choose_z`).
Z_MODES = ("mean", "prototype", "responsibility", "likelihood", "client", "client_prototype")


@dataclass
class VPAConfig:
    """Settings of ``fedroute vpa train`` (CPU defaults; :meth:`quick` is the small preset).

    The defaults of ``structure``, ``pooling``, ``betas``, ``betas_mixture``, ``free_bits`` and ``kmeans_at`` are
    the choices of ``benchmarks/vpa_settings.py`` on validation users (docs/results/vpa_settings.md); its step 4
    kept those of ``n_prototypes``, ``lambda_orth``, ``tau_end``, ``proto_var_cap``, ``proto_scale``, ``learn_pi``
    and ``latent_dim``.

    data_dir, cache_dir : shared data folder; embedding cache folder (None: default).
    seeds : int >= 1, seeds of the whole experiment (split, users, training).
    contexts : context sizes C evaluated (each <= ``users.context_max``).
    users : :class:`~trainer.data.conflicting_users.UsersConfig`.
    structure : which of ``s(y)`` and ``p(y)`` to use (:data:`trainer.vpa.features.STRUCTURES`); None chooses on validation.
    pca_components : principal components kept of ``e(x)`` and of ``e(y)`` each (None: all 384).
    hidden, latent_dim, dropout : model sizes (MLP width, d_z).
    pooling : context encoder, ``'mean'`` or ``'natural'`` (:class:`~trainer.vpa.model.VPAModel`; both priors).
    n_prototypes : K of the mixture prior.
    betas : KL weights tried; the one with the best validation accuracy (mean over ``contexts``) is kept, per prior.
    betas_mixture : KL weights tried for FedVPA-GP (None: ``betas``).
    free_bits : the KL term of a user is ``max(KL, free_bits)`` (Kingma et al. 2016), nats; 0 disables it.
    kmeans_at : shares of the rounds at whose start the prototypes are re-fitted by federated K-means of the
        clients' posterior means (:mod:`trainer.vpa.prototype_kmeans`); kmeans_iters : its Lloyd steps.
    z_modes : ``'mean'`` (score with the posterior mean), ``'prototype'`` (with the mean of the most responsible
        prototype), ``'responsibility'`` (the responsibility-weighted prototype mean ``sum_k gamma_k mu_k``, the
        user's soft type) and/or ``'likelihood'`` (prototypes weighted by the context labels' likelihood under the
        reward head, :func:`trainer.vpa.evaluation.choose_z`); all but the first under the mixture prior only;
        chosen on validation.
    client_scale : FedVPA-GP's read-out under the user's client's mixing weights ``pi_c`` (``z_mode='client'``: the
        prior of a user is ``sum_k pi_ck N(mu_k, sigma_k^2)``, ``pi_c`` its client's users' mean responsibilities,
        computed on the client) with the natural-parameter evidence scaled by ``alpha = client_scale`` at every C
        (``pooling='mean'``: no scale, only ``pi_c`` counts); ``benchmarks/vpa_readout_settings.py`` chose 0.1 on
        validation users. None: the ``z_modes`` choice under the global ``pi``.
    lambda_orth : weight of the orthogonality loss. proto_scale : distance of the initial prototype means from 0.
    proto_var_cap : largest prototype variance per latent dimension (initial variances too; at most
        :data:`~trainer.vpa.aggregation.VAR_CAP`): a tighter ``sigma_k`` lets few pairs pick a prototype.
    client_prior : train FedVPA-GP under each client's own mixing weights (the prior it is read out with): in a
        client's round a user's prior is ``sum_k pi_ck N(mu_k, sigma_k^2)`` with ``pi_c`` the client's other training
        users' mean responsibilities and the global ``pi`` as one pseudo-user (:meth:`VPATrainer.client_gamma`,
        computed on the client at the start of its round, leave-one-out so a user's own labels do not set its
        prior; ``benchmarks/vpa_train_prior_settings.py`` chose it on validation users); False: the global ``pi``
        (the responsibilities and the KL term's categorical part).
    learn_pi : aggregate the mixing weights ``pi_k`` (else they stay uniform). tau_start, tau_end : Gumbel-softmax temperatures.
    warmup : share of the rounds over which beta rises from 0.
    rounds, local_steps, lr, weight_decay : federated optimisation (every client takes part in every round).
    n_targets : target pairs per user per step. context_min : smallest training context.
    """

    data_dir: str = "../shared/data"
    cache_dir: str | None = None
    seeds: int = 3
    contexts: tuple[int, ...] = (2, 4, 8, 16, 32)
    users: UsersConfig = field(default_factory=UsersConfig)
    structure: str | None = "pair_features"
    pca_components: int | None = 32
    hidden: int = 64
    latent_dim: int = 4
    dropout: float = 0.1
    pooling: str = "natural"
    n_prototypes: int = 2
    betas: tuple[float, ...] = (0.01,)
    betas_mixture: tuple[float, ...] | None = None
    free_bits: float = 0.0
    kmeans_at: tuple[float, ...] = ()
    kmeans_iters: int = 10
    z_modes: tuple[str, ...] = ("mean", "prototype")
    client_scale: float | None = 0.1
    client_prior: bool = True
    lambda_orth: float = 1.0
    proto_scale: float = 2.0
    proto_var_cap: float = VAR_CAP
    learn_pi: bool = True
    tau_start: float = 1.0
    tau_end: float = 0.2
    warmup: float = 0.3
    rounds: int = 40
    local_steps: int = 5
    lr: float = 3e-3
    weight_decay: float = 1e-4
    n_targets: int = 16
    context_min: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.users, dict):
            self.users = UsersConfig(**self.users)
        self.contexts, self.betas, self.z_modes = tuple(self.contexts), tuple(self.betas), tuple(self.z_modes)
        self.kmeans_at = tuple(self.kmeans_at)
        if self.betas_mixture is not None:
            self.betas_mixture = tuple(self.betas_mixture)
        if self.seeds < 1 or self.rounds < 1 or self.local_steps < 1 or self.n_prototypes < 2:
            raise InvalidInputError(f"seeds={self.seeds}, rounds={self.rounds}, local_steps={self.local_steps} must be "
                                    f">= 1 and n_prototypes={self.n_prototypes} >= 2")
        if not self.contexts or min(self.contexts) < 1 or max(self.contexts) > self.users.context_max:
            raise InvalidInputError(f"contexts={self.contexts} must lie in [1, users.context_max={self.users.context_max}]")
        if self.context_min + self.n_targets > self.users.n_train_pairs:
            raise InvalidInputError(f"context_min={self.context_min} + n_targets={self.n_targets} exceeds "
                                    f"users.n_train_pairs={self.users.n_train_pairs}")
        if not self.betas or min(self.betas) < 0 or not set(self.z_modes) <= set(Z_MODES) or not self.z_modes:
            raise InvalidInputError(f"betas={self.betas} must be >= 0 and z_modes={self.z_modes} in {'|'.join(Z_MODES)}")
        if not VAR_FLOOR <= self.proto_var_cap <= VAR_CAP:
            raise InvalidInputError(f"proto_var_cap={self.proto_var_cap} must lie in [{VAR_FLOOR}, {VAR_CAP}]")
        if self.pooling not in ("mean", "natural") or self.free_bits < 0 or not all(0 <= a < 1 for a in self.kmeans_at):
            raise InvalidInputError(f"pooling={self.pooling!r} must be mean|natural, free_bits={self.free_bits} >= 0, "
                                    f"kmeans_at={self.kmeans_at} in [0, 1)")
        if self.client_scale is not None and not self.client_scale > 0:
            raise InvalidInputError(f"client_scale={self.client_scale} must be > 0 or None")
        if self.betas_mixture is not None and (not self.betas_mixture or min(self.betas_mixture) < 0):
            raise InvalidInputError(f"betas_mixture={self.betas_mixture} must be >= 0")

    def betas_for(self, prior: str) -> tuple[float, ...]:
        """The KL weights tried for ``prior`` ('gaussian' or 'mixture')."""
        return self.betas_mixture if prior == "mixture" and self.betas_mixture is not None else self.betas

    @classmethod
    def quick(cls, **over) -> VPAConfig:
        """The small preset: one seed, C in {2, 8, 32}, one beta, 30 rounds, 12 clients (<= 5 min CPU)."""
        base = dict(seeds=1, contexts=(2, 8, 32), rounds=30,
                    users=UsersConfig(n_clients=12, n_test_users=6))
        return cls(**{**base, **over})

    def to_json(self) -> dict:
        """The config as JSON-ready data (tuples become lists)."""
        return json.loads(json.dumps(asdict(self)))


def _tau(cfg: VPAConfig, r: int) -> float:
    return cfg.tau_start * (cfg.tau_end / cfg.tau_start) ** (r / max(1, cfg.rounds - 1))


def _beta(cfg: VPAConfig, beta: float, r: int) -> float:
    ramp = cfg.warmup * cfg.rounds
    return beta if ramp < 1 else beta * min(1.0, r / ramp)


def _state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _load(model: torch.nn.Module, params: dict[str, np.ndarray]) -> None:
    model.load_state_dict({k: torch.as_tensor(np.asarray(v), dtype=torch.float32) for k, v in params.items()})


class VPATrainer:
    """Trains and scores the models of one seed on precomputed features.

    users : ConflictingUsers of the seed. phi : ndarray of shape (n_pairs, 2, d_in), float32 (:mod:`trainer.vpa.features`).
    cfg : VPAConfig.
    """

    def __init__(self, users: ConflictingUsers, phi: np.ndarray, cfg: VPAConfig) -> None:
        self.users = users
        self.phi = torch.as_tensor(phi, dtype=torch.float32)
        self.cfg = cfg
        self.label = torch.as_tensor(users.pairs["label"].to_numpy().astype(np.int64))

    # ------------------------------------------------------------------ batches (one client's own users)

    def user_labels(self, user_ids: np.ndarray, idx: torch.Tensor) -> torch.Tensor:
        """Labels (1 = A preferred) of pairs ``idx`` (U, m) as users ``user_ids`` give them."""
        return self.label[idx] ^ torch.as_tensor(self.users.type[user_ids])[:, None]

    def context_tensors(self, user_ids: np.ndarray, idx: torch.Tensor, mask: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(phi_w, phi_l)`` (U, C, d_in) of context pairs ``idx`` (U, C): preferred / dispreferred by each user."""
        a_wins = self.user_labels(user_ids, idx)[..., None].bool()  # 1 = A preferred = side 0
        phi_a, phi_b = self.phi[idx, 0], self.phi[idx, 1]
        m = mask[..., None]
        return torch.where(a_wins, phi_a, phi_b) * m, torch.where(a_wins, phi_b, phi_a) * m

    def _train_batch(self, user_ids: np.ndarray, rng: np.random.Generator):
        cfg = self.cfg
        c_max = min(self.users.context_max, cfg.users.n_train_pairs - cfg.n_targets)
        n_u = len(user_ids)
        ctx = np.zeros((n_u, c_max), dtype=np.int64)
        mask = np.zeros((n_u, c_max), dtype=np.float32)
        tgt = np.zeros((n_u, cfg.n_targets), dtype=np.int64)
        for j, u in enumerate(user_ids):
            c = int(round(math.exp(rng.uniform(math.log(cfg.context_min), math.log(c_max)))))
            order = rng.permutation(self.users.items[u])
            ctx[j, :c], mask[j, :c] = order[:c], 1.0
            tgt[j] = order[c:c + cfg.n_targets]
        return torch.as_tensor(ctx), torch.as_tensor(mask), torch.as_tensor(tgt)

    @torch.no_grad()
    def client_gamma(self, model: VPAModel, user_ids: np.ndarray, p_mu: torch.Tensor, p_lv: torch.Tensor,
                     log_pi: torch.Tensor) -> torch.Tensor:
        """(U, K) responsibilities of users ``user_ids`` (one client's) under the global prior from the first
        ``context_max`` of their pairs (the client's soft-assignment statistics, :func:`trainer.vpa.evaluation.client_log_pi`)."""
        idx = torch.as_tensor(np.stack([self.users.items[u][:self.users.context_max] for u in user_ids]))
        mask = torch.ones(idx.shape, dtype=torch.float32)
        was_training = model.training
        model.eval()
        logits = model.components(*self.context_tensors(user_ids, idx, mask), mask, p_mu, p_lv, log_pi)[2]
        model.train(was_training)
        return torch.softmax(logits, 1)

    # ------------------------------------------------------------------ VPL / FedVPA-GP

    def new_vpa(self, seed: int) -> VPAModel:
        torch.manual_seed(seed)
        return VPAModel(self.phi.shape[-1], self.cfg.hidden, self.cfg.latent_dim, self.cfg.dropout, self.cfg.pooling)

    def init_prototypes(self, seed: int) -> Prototypes:
        """K prototype means ``proto_scale`` apart from 0 along random orthonormal directions (K <= d_z; else
        N(0, proto_scale^2 I) draws), variances ``proto_var_cap``, uniform weights: distinct prototypes from the start, since
        prototypes that start together get equal soft assignments and the aggregation keeps them together."""
        rng = np.random.default_rng(seed)
        k, d = self.cfg.n_prototypes, self.cfg.latent_dim
        if k <= d:
            q, _ = np.linalg.qr(rng.standard_normal((d, k)))
            mu = self.cfg.proto_scale * q.T
        else:
            mu = self.cfg.proto_scale * rng.standard_normal((k, d))
        return Prototypes(mu=mu, logvar=np.full((k, d), math.log(self.cfg.proto_var_cap)), pi=np.full(k, 1.0 / k))

    def local_vpa_step(self, model: VPAModel, protos: Prototypes | None, user_ids: np.ndarray, beta: float,
                       tau: float, rng: np.random.Generator, gen: torch.Generator) -> ClientUpdate:
        """One client's round: ``local_steps`` AdamW steps on its users; returns its upload (parameters, users, stats)."""
        cfg = self.cfg
        model.train()
        params = list(model.parameters())
        if protos is not None:
            p_mu = torch.tensor(protos.mu, dtype=torch.float32)
            p_lv = torch.tensor(protos.logvar, dtype=torch.float32)
            log_pi = torch.log(torch.tensor(protos.pi, dtype=torch.float32))
            prior_pi = log_pi
            if cfg.client_prior:
                prior_pi = client_log_weights(self.client_gamma(model, user_ids, p_mu, p_lv, log_pi), log_pi.exp(), True)
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        for _ in range(cfg.local_steps):
            ctx, mask, tgt = self._train_batch(user_ids, rng)
            ctx_phi = self.context_tensors(user_ids, ctx, mask)
            if protos is None:
                mu, logvar = model.encode(*ctx_phi, mask)
                z = mu + torch.randn(mu.shape, generator=gen) * (0.5 * logvar).exp()
                kl = kl_normal(mu, logvar, torch.zeros_like(mu), torch.zeros_like(logvar))
                extra = 0.0
            else:
                m, lv, logits = model.components(*ctx_phi, mask, p_mu, p_lv, prior_pi)
                kl, gamma, c = component_kl(m, lv, logits, p_mu, p_lv, prior_pi, tau, gen)
                eps = torch.randn((len(user_ids), m.shape[-1]), generator=gen)[:, None]
                z = (c[..., None] * (m + eps * (0.5 * lv).exp())).sum(1)
                mean, _ = mixture_moments(m, lv, gamma)
                local_means = (gamma.T @ mean) / gamma.sum(0)[:, None].clamp_min(1e-6)
                extra = cfg.lambda_orth * orthogonality_loss(local_means)
            margin = model.margin(self.phi[tgt, 0], self.phi[tgt, 1], z)
            loglik = bt_loglik(margin, self.user_labels(user_ids, tgt))
            loss = (-elbo(loglik, kl.clamp_min(cfg.free_bits), beta) / cfg.n_targets).mean() + extra
            opt.zero_grad()
            loss.backward()
            opt.step()
        stats = None
        if protos is not None:
            with torch.no_grad():
                model.eval()
                ctx, mask, _ = self._train_batch(user_ids, rng)
                ctx_phi = self.context_tensors(user_ids, ctx, mask)
                _, _, logits = model.components(*ctx_phi, mask, p_mu, p_lv, log_pi)
                mu, logvar = model.encode(*ctx_phi, mask)
                g = torch.softmax(logits, -1).double()
                stats = PrototypeStats(mass=g.sum(0).numpy(), sum_mu=(g.T @ mu.double()).numpy(),
                                       sum_sq=(g.T @ (mu.double() ** 2 + logvar.double().exp())).numpy())
        return ClientUpdate(params=_state(model), n_examples=float(len(user_ids)), prototypes=stats)

    @torch.no_grad()
    def posterior_means(self, model: VPAModel, user_ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """(U, d_z) posterior means (:meth:`VPAModel.encode`) of users ``user_ids`` from ``context_max`` of their
        training pairs (computed on the client; only :mod:`trainer.vpa.prototype_kmeans` statistics of them leave it)."""
        c = min(self.users.context_max, self.cfg.users.n_train_pairs)
        idx = torch.as_tensor(np.stack([rng.permutation(self.users.items[u])[:c] for u in user_ids]))
        mask = torch.ones(idx.shape, dtype=torch.float32)
        model.eval()
        return model.encode(*self.context_tensors(user_ids, idx, mask), mask)[0].double().numpy()

    def train_vpa(self, prior: str, beta: float, seed: int, clients: list[int] | None = None
                  ) -> tuple[VPAModel, Prototypes | None]:
        """Federated VPL (``prior='gaussian'``) or FedVPA-GP (``'mixture'``) over ``clients`` (default: all).

        A single client in ``clients`` is local-only training (FedAvg of one update is that update).
        """
        cfg = self.cfg
        clients = list(range(cfg.users.n_clients)) if clients is None else clients
        model = self.new_vpa(seed)
        protos = self.init_prototypes(seed) if prior == "mixture" else None
        rng = np.random.default_rng(seed + 1)
        gen = torch.Generator().manual_seed(seed + 2)
        local = copy.deepcopy(model)
        refit = {int(round(a * cfg.rounds)) for a in cfg.kmeans_at} if protos is not None else set()
        fitted = False
        for r in range(cfg.rounds):
            if r in refit:
                means = [self.posterior_means(model, self.users.users("train", i), rng) for i in clients]
                protos = federated_kmeans(means, cfg.n_prototypes, cfg.kmeans_iters, protos if fitted else None)
                fitted = True
            updates = []
            for i in clients:
                local.load_state_dict(model.state_dict())
                updates.append(self.local_vpa_step(local, protos, self.users.users("train", i), _beta(cfg, beta, r),
                                                   _tau(cfg, r), rng, gen))
            params, protos = aggregate_round(updates, protos, cfg.proto_var_cap)
            if protos is not None and not cfg.learn_pi:
                protos = replace(protos, pi=np.full(len(protos.pi), 1.0 / len(protos.pi)))
            _load(model, params)
        model.eval()
        return model, protos

    # ------------------------------------------------------------------ Bradley-Terry baselines

    def train_bt(self, per_type: bool, seed: int) -> BTReward:
        """FedAvg Bradley-Terry reward: one head (monolithic) or one per type (the oracle's models, trained with type labels)."""
        cfg = self.cfg
        torch.manual_seed(seed)
        model = BTReward(self.phi.shape[-1], cfg.hidden, 2 if per_type else 1, cfg.dropout)
        local = copy.deepcopy(model)
        rng = np.random.default_rng(seed + 1)
        data = {}
        for i in range(cfg.users.n_clients):
            ids = self.users.users("train", i)
            idx = torch.as_tensor(np.concatenate([self.users.items[u] for u in ids]))
            owner = np.repeat(ids, [len(self.users.items[u]) for u in ids])
            lab = self.label[idx] ^ torch.as_tensor(self.users.type[owner])
            head = torch.as_tensor(self.users.type[owner] if per_type else np.zeros(len(owner), dtype=np.int64))
            data[i] = (idx, lab, head, len(ids))
        batch = cfg.n_targets * cfg.users.n_train_users
        for _ in range(cfg.rounds):
            updates = []
            for i, (idx, lab, head, n_users) in data.items():
                local.load_state_dict(model.state_dict())
                local.train()
                opt = torch.optim.AdamW(local.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
                for _ in range(cfg.local_steps):
                    b = torch.as_tensor(rng.choice(len(idx), size=min(batch, len(idx)), replace=False))
                    m = local.margin(self.phi[idx[b], 0], self.phi[idx[b], 1], head[b])
                    loss = -bt_loglik(m, lab[b]).mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                updates.append(ClientUpdate(params=_state(local), n_examples=float(n_users), prototypes=None))
            params, _ = aggregate_round(updates, None)
            _load(model, params)
        model.eval()
        return model
