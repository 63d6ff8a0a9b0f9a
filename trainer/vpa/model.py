"""The variational preference model of VPL (Poddar et al. 2024) and the mixture prior of FedVPA-GP (paper 003).

Notation (per user u, latent dimension d_z, K prototypes)
---------------------------------------------------------
- Features ``phi(x, y)`` of a response (:mod:`trainer.vpa.features`), shape (d_in,).
- **Context encoder** ``q(z | C) = N(mu, diag(exp(logvar)))``: every context pair (preferred ``y_w``, dispreferred
  ``y_l``) becomes ``psi = g(phi(x, y_w)) - g(phi(x, y_l))`` (``g`` an MLP; the difference makes a pair's
  vector flip sign with its label), the C vectors are **mean-pooled** and, with ``log C``, mapped linearly to
  ``(mu, logvar)`` (VPL's language models pool the same way).
- **Reward** ``r(x, y, z) = <A z + a_0, t(phi(x, y))>``: a trunk ``t`` (MLP) and a head linear in ``z``, so
  users of opposite tastes can sit at opposite ``z`` and get opposite rewards.
- **Bradley-Terry likelihood** of a target pair with label ``s`` (1 = A preferred):
  ``log p(s | z) = s log sigma(m) + (1 - s) log sigma(-m)``, ``m = r(x, y_A, z) - r(x, y_B, z)``.
- **ELBO** (VPL Eq. 4): ``L_u = sum_t log p(s_t | z) - beta KL(q(z | C_u) || p(z))``, ``z ~ q`` by
  reparameterisation; the loss is ``-L_u / n_targets`` averaged over users.
- **VPL prior** ``p(z) = N(0, I)``: ``KL = 1/2 sum(exp(logvar) + mu^2 - 1 - logvar)``.
- **FedVPA-GP prior** ``p(z) = sum_k pi_k N(mu_k, diag(sigma_k^2))`` (paper 003, "Federated Mixture Prior"):
  the user's prototype is a Gumbel-softmax sample ``c ~ GS(l, tau)`` of the logits
  ``l_k = log pi_k + E_q[log N(z; mu_k, sigma_k^2)]`` (their softmax ``gamma`` is the soft assignment);
  ``KL = sum_k c_k KL(q || N(mu_k, sigma_k^2)) + KL(Cat(gamma) || Cat(pi))``, the usual bound of the
  KL to a mixture through a categorical latent.
- **Natural-parameter encoder** (``pooling='natural'``; the product of Gaussian experts of neural processes and
  Bayesian context aggregation, Volpp et al. 2021, Eq. 5-6): every context pair gives an observation ``r_i`` of ``z``
  with precision ``lambda_i = softplus(.) > 0`` (both linear in ``psi_i``); the evidence is ``Lambda = sum_i lambda_i``,
  ``h = sum_i lambda_i r_i``, so more pairs give a tighter posterior. Under a Gaussian prior ``N(m_0, s_0^2)`` the
  posterior is ``N((m_0 / s_0^2 + h) / P, 1 / P)``, ``P = 1 / s_0^2 + Lambda`` (VPL: ``m_0 = 0``, ``s_0 = 1``);
  under the mixture it is the mixture of the K component posteriors with responsibilities
  ``gamma_k ~ pi_k N(h / Lambda; mu_k, sigma_k^2 + 1 / Lambda)`` (the evidence's marginal likelihood under
  prototype k): :func:`mixture_posterior`. With ``pooling='mean'`` ``q`` does not depend on the prior and
  ``gamma`` comes from :func:`assignment_logits`.
- **Orthogonality loss** (paper 003, "Orthogonal Loss") on prototype means ``m_k``, normalised to unit length:
  ``L_orth = sum_{k != l} (m_k . m_l / (|m_k| |m_l|))^2 / (K (K - 1))``; zero iff the means are pairwise
  orthogonal. The trainer applies it to each client's soft prototype means (:mod:`trainer.vpa.trainer`).

The paper gives only its abstract; the Gumbel logits, the categorical bound, the moment-matched prototype
aggregation and where ``L_orth`` applies are our reading of it. Private kernels here do not validate their inputs (the callers build them).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

LOG_2PI = math.log(2 * math.pi)


def bt_loglik(margin: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry log-likelihood ``s log sigma(m) + (1 - s) log sigma(-m)``, elementwise (same shape as ``margin``)."""
    return -F.binary_cross_entropy_with_logits(margin, label.to(margin.dtype), reduction="none")


def elbo(loglik: torch.Tensor, kl: torch.Tensor, beta: float) -> torch.Tensor:
    """``L_u = sum_t log p(s_t | z) - beta KL``: loglik (U, T), kl (U,) -> (U,)."""
    return loglik.sum(1) - beta * kl


def kl_normal(mu_q: torch.Tensor, logvar_q: torch.Tensor, mu_p: torch.Tensor, logvar_p: torch.Tensor) -> torch.Tensor:
    """``KL(N(mu_q, e^logvar_q) || N(mu_p, e^logvar_p))`` of diagonal Gaussians, summed over the last axis (nats)."""
    return 0.5 * (logvar_p - logvar_q + (logvar_q.exp() + (mu_q - mu_p) ** 2) / logvar_p.exp() - 1).sum(-1)


def expected_log_normal(mu_q: torch.Tensor, logvar_q: torch.Tensor, mu_p: torch.Tensor,
                        logvar_p: torch.Tensor) -> torch.Tensor:
    """``E_{z ~ N(mu_q, e^logvar_q)}[log N(z; mu_p, e^logvar_p)]``, summed over the last axis (nats)."""
    return -0.5 * (LOG_2PI + logvar_p + (logvar_q.exp() + (mu_q - mu_p) ** 2) / logvar_p.exp()).sum(-1)


def gumbel_softmax(logits: torch.Tensor, tau: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Relaxed one-hot sample ``softmax((logits + g) / tau)``, ``g ~ Gumbel(0, 1)`` i.i.d. (Jang et al. 2017, Eq. 1).

    logits : (..., K). Returns (..., K), rows sum to 1; as ``tau -> 0`` a row tends to one-hot at ``argmax(logits + g)``.
    """
    u = torch.rand(logits.shape, generator=generator, dtype=logits.dtype).clamp(1e-10, 1 - 1e-10)
    return F.softmax((logits - torch.log(-torch.log(u))) / tau, dim=-1)


def assignment_logits(mu: torch.Tensor, logvar: torch.Tensor, proto_mu: torch.Tensor, proto_logvar: torch.Tensor,
                      log_pi: torch.Tensor) -> torch.Tensor:
    """``l_k = log pi_k + E_q[log N(z; mu_k, sigma_k^2)]``: mu, logvar (U, d_z); prototypes (K, d_z); log_pi (K,) -> (U, K)."""
    return log_pi + expected_log_normal(mu[:, None], logvar[:, None], proto_mu[None], proto_logvar[None])


def mixture_kl(mu: torch.Tensor, logvar: torch.Tensor, proto_mu: torch.Tensor, proto_logvar: torch.Tensor,
               log_pi: torch.Tensor, tau: float | None, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """KL bound of ``q(z | C)`` to the mixture prior (module docstring) and the soft assignment ``gamma``.

    mu, logvar : (U, d_z); proto_mu, proto_logvar : (K, d_z); log_pi : (K,); tau : Gumbel-softmax
    temperature, or None for the expectation (``c = gamma``, used at evaluation). Returns (kl (U,), gamma (U, K)).
    """
    logits = assignment_logits(mu, logvar, proto_mu, proto_logvar, log_pi)
    kl, gamma, _ = component_kl(mu[:, None], logvar[:, None], logits, proto_mu, proto_logvar, log_pi, tau, generator)
    return kl, gamma


def component_kl(m: torch.Tensor, lv: torch.Tensor, logits: torch.Tensor, proto_mu: torch.Tensor,
                 proto_logvar: torch.Tensor, log_pi: torch.Tensor, tau: float | None,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sum_k c_k KL(q_k || N(mu_k, sigma_k^2)) + KL(Cat(gamma) || Cat(pi))`` with ``gamma = softmax(logits)``.

    m, lv : (U, K, d_z) or (U, 1, d_z) component posteriors ``q_k``; logits : (U, K); prototypes (K, d_z); log_pi (K,);
    tau : Gumbel-softmax temperature of ``c`` or None (``c = gamma``). Returns (kl (U,), gamma (U, K), c (U, K)).
    """
    gamma = F.softmax(logits, dim=-1)
    c = gamma if tau is None else gumbel_softmax(logits, tau, generator)
    kl_k = kl_normal(m, lv, proto_mu[None], proto_logvar[None])
    kl_cat = (gamma * (torch.log(gamma.clamp_min(1e-12)) - log_pi)).sum(-1)
    return (c * kl_k).sum(-1) + kl_cat, gamma, c


def mixture_posterior(h: torch.Tensor, lam: torch.Tensor, proto_mu: torch.Tensor, proto_logvar: torch.Tensor,
                      log_pi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Posterior of ``z`` under the mixture prior from natural-parameter evidence (module docstring).

    h, lam : (U, d_z) evidence ``sum_i lambda_i r_i`` and ``sum_i lambda_i`` (> 0); prototypes (K, d_z); log_pi (K,).
    Returns (m (U, K, d_z), lv (U, K, d_z), logits (U, K)): component posteriors and the log responsibilities
    (up to a constant per user).
    """
    p_prec = torch.exp(-proto_logvar)
    prec = p_prec[None] + lam[:, None]
    m = (proto_mu * p_prec)[None] + h[:, None]
    m = m / prec
    # log N(h / lam; mu_k, s_k^2 + 1 / lam) without dividing by a small lam: the squared distance is
    # (h - lam mu_k)^2 / (lam (lam s_k^2 + 1)) and the log variance log(lam s_k^2 + 1) - log lam (the last is the same for every k)
    s2 = proto_logvar.exp()[None]
    lam_k = lam[:, None]
    quad = (h[:, None] - lam_k * proto_mu[None]) ** 2 / (lam_k * (lam_k * s2 + 1.0))
    logits = log_pi - 0.5 * (torch.log(lam_k * s2 + 1.0) + quad).sum(-1)
    return m, -torch.log(prec), logits


def mixture_moments(m: torch.Tensor, lv: torch.Tensor, gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and log variance (U, d_z) of the mixture ``sum_k gamma_k N(m_k, e^lv_k)``: m, lv (U, K, d_z), gamma (U, K)."""
    g = gamma[..., None]
    mean = (g * m).sum(1)
    var = (g * (lv.exp() + m ** 2)).sum(1) - mean ** 2
    return mean, torch.log(var.clamp_min(1e-8))


def client_log_weights(gamma: torch.Tensor, pi: torch.Tensor, leave_one_out: bool = False) -> torch.Tensor:
    """Log mixing weights of a client from its U users' responsibilities ``gamma`` (U, K) and the global ``pi`` (K,)
    as one pseudo-user: ``log((sum_u gamma_u + pi) / (U + 1))`` (K,), or with ``leave_one_out`` per user
    ``log((sum_{v != u} gamma_v + pi) / U)`` (U, K), the prior of a user set by the client's other users."""
    if leave_one_out:
        return torch.log((gamma.sum(0) - gamma + pi) / len(gamma))
    return torch.log((gamma.sum(0) + pi) / (len(gamma) + 1))


def orthogonality_loss(proto_mu: torch.Tensor) -> torch.Tensor:
    """Mean squared cosine between distinct prototype means: proto_mu (K, d_z), K >= 2 -> scalar."""
    m = F.normalize(proto_mu, dim=-1)
    k = m.shape[0]
    gram = m @ m.T
    return ((gram - torch.eye(k, dtype=m.dtype)) ** 2).sum() / (k * (k - 1))


def _mlp(d_in: int, hidden: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.GELU())


class VPAModel(nn.Module):
    """Context encoder ``q(z | C)`` and reward head ``r(x, y, z)`` (module docstring).

    Parameters
    ----------
    d_in : int, features per response. hidden : int, MLP width. latent_dim : int, d_z. dropout : float in [0, 1).
    pooling : ``'mean'`` (mean-pooled pairs and ``log C`` map to ``(mu, logvar)``) or ``'natural'`` (per-pair
        natural parameters that add up, :meth:`evidence`).
    """

    def __init__(self, d_in: int, hidden: int = 64, latent_dim: int = 4, dropout: float = 0.1,
                 pooling: str = "mean") -> None:
        super().__init__()
        self.pooling = pooling
        self.pair_net = _mlp(d_in, hidden, dropout)
        self.posterior = nn.Linear(hidden + (pooling == "mean"), 2 * latent_dim)
        self.trunk = _mlp(d_in, hidden, dropout)
        self.head = nn.Linear(latent_dim, hidden)

    def evidence(self, phi_w: torch.Tensor, phi_l: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, Lambda)`` (U, d_z) of the context pairs (``pooling='natural'``; inputs as :meth:`encode`)."""
        psi = self.pair_net(phi_w) - self.pair_net(phi_l)
        r, rho = self.posterior(psi).chunk(2, -1)
        lam_i = F.softplus(rho) * mask[..., None]
        return (lam_i * r).sum(1), lam_i.sum(1) + 1e-6

    def encode(self, phi_w: torch.Tensor, phi_l: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, logvar)`` of ``q(z | C)`` (under ``pooling='natural'``: the posterior under the N(0, I) prior).

        phi_w, phi_l : (U, C, d_in) float32, features of the preferred / dispreferred response of each context
        pair (by the user's own labels); mask : (U, C) float32, 1 for a real pair, 0 for padding (>= 1 per row).
        Returns two (U, d_z) tensors.
        """
        if self.pooling == "natural":
            h, lam = self.evidence(phi_w, phi_l, mask)
            prec = 1.0 + lam
            return h / prec, -torch.log(prec)
        psi = self.pair_net(phi_w) - self.pair_net(phi_l)
        n = mask.sum(1, keepdim=True)
        pooled = (psi * mask[..., None]).sum(1) / n
        mu, logvar = self.posterior(torch.cat([pooled, torch.log(n) / math.log(32.0)], -1)).chunk(2, -1)
        return mu, logvar.clamp(-8.0, 4.0)

    def components(self, phi_w: torch.Tensor, phi_l: torch.Tensor, mask: torch.Tensor, proto_mu: torch.Tensor,
                   proto_logvar: torch.Tensor, log_pi: torch.Tensor, evidence_scale: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Component posteriors and log responsibilities under the mixture prior: (m, lv (U, K or 1, d_z), logits (U, K)).

        log_pi : (K,) or, a prior per user (a client's own mixing weights), (U, K). evidence_scale : ``alpha`` > 0,
        the evidence ``(alpha h, alpha Lambda)`` (``pooling='natural'`` only: a tempered likelihood, so that the
        prior weighs in against few pairs)."""
        if self.pooling == "natural":
            h, lam = self.evidence(phi_w, phi_l, mask)
            return mixture_posterior(evidence_scale * h, evidence_scale * lam, proto_mu, proto_logvar, log_pi)
        mu, logvar = self.encode(phi_w, phi_l, mask)
        return mu[:, None], logvar[:, None], assignment_logits(mu, logvar, proto_mu, proto_logvar, log_pi)

    def infer(self, phi_w: torch.Tensor, phi_l: torch.Tensor, mask: torch.Tensor,
              prior: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, evidence_scale: float = 1.0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior mean and log variance (U, d_z) of ``z``: :meth:`encode` without ``prior``, else of the mixture
        posterior under ``prior = (proto_mu (K, d_z), proto_logvar (K, d_z), log_pi (K,) or (U, K))`` with the
        evidence scaled by ``evidence_scale`` (:meth:`components`, :func:`mixture_moments`)."""
        if prior is None:
            return self.encode(phi_w, phi_l, mask)
        m, lv, logits = self.components(phi_w, phi_l, mask, *prior, evidence_scale)
        return mixture_moments(m, lv, F.softmax(logits, dim=-1))

    def reward(self, phi: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``r(x, y, z)``: phi (U, T, d_in), z (U, d_z) -> (U, T)."""
        return (self.trunk(phi) * self.head(z)[:, None, :]).sum(-1)

    def margin(self, phi_a: torch.Tensor, phi_b: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``r(x, y_A, z) - r(x, y_B, z)``: phi_a, phi_b (U, T, d_in), z (U, d_z) -> (U, T)."""
        return self.reward(phi_a, z) - self.reward(phi_b, z)


class BTReward(nn.Module):
    """Bradley-Terry reward ``r_h(x, y) = <a_h, t(phi(x, y))>`` with one head per user type (the oracle) or one (monolithic)."""

    def __init__(self, d_in: int, hidden: int = 64, n_heads: int = 1, dropout: float = 0.1) -> None:
        super().__init__()
        self.trunk = _mlp(d_in, hidden, dropout)
        self.heads = nn.Linear(hidden, n_heads, bias=False)

    def margin(self, phi_a: torch.Tensor, phi_b: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """phi_a, phi_b (n, d_in); head (n,) int64 -> (n,) margins ``r_h(A) - r_h(B)``."""
        diff = self.heads(self.trunk(phi_a)) - self.heads(self.trunk(phi_b))
        return diff.gather(1, head[:, None])[:, 0]
