"""Scores of every method on held-out pairs of validation / test users, per context size C (issue 28).

Accuracy: the share of a user's held-out pairs whose predicted winner (sign of the margin) is the one that
user prefers, averaged over users (every user has the same number of held-out pairs); ``per_type`` averages
over the users of one type. Methods:

- ``fedvpa_gp`` / ``vpl_gaussian`` / ``local_vpl``: ``z`` = the posterior mean of ``q(z | first C context pairs)``
  (under the mixture prior with the natural-parameter encoder: the mean of the mixture posterior) (or, ``z_mode='prototype'``, the mean of the most responsible prototype; ``'responsibility'``, the
  responsibility-weighted prototype mean), then ``r(x, y, z)``.
- ``monolithic_bt``: one FedAvg Bradley-Terry reward for everybody.
- ``oracle_type``: the Bradley-Terry head of the user's true type.
- ``two_stage``: the type with the larger log-likelihood of the user's C context labels under the two type heads
  (plus the log of the training users' type shares), then that head (a generative classifier trained with type labels).
- ``length_per_user``: logistic regression (scikit-learn, no intercept, C = 1) on the length features
  (:func:`sdk.pair_encoding.length_features`) of the user's C context pairs and of their mirror images (features
  negated, label flipped, so both classes are present and the model is antisymmetric).

Collapse: ``kl_mean`` is the mean over test users of ``KL(q(z | C) || p(z))`` under the method's own prior (the
categorical bound with ``c = gamma`` for the mixture); ``type_acc_from_z`` the accuracy of a logistic regression fitted
on the validation users' posterior means at the same C (with their types) and applied to the test users'.
Switching: every test user is paired with a test user of the other type (seeded); on the first user's held-out
pairs, ``flip`` is the share whose predicted winner differs between the two users' ``z`` and ``both_right`` the share
that flips with both predictions right (the two users' labels are opposite on every pair).
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression

from sdk.pair_encoding import length_features_many
from trainer.data.conflicting_users import TYPES
from trainer.vpa.aggregation import Prototypes
from trainer.vpa.model import BTReward, VPAModel, bt_loglik, client_log_weights, component_kl, kl_normal
from trainer.vpa.trainer import VPATrainer


def _context_batch(tr: VPATrainer, ids: np.ndarray, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.as_tensor(np.stack([tr.users.context(u, c) for u in ids]))
    return idx, torch.ones(idx.shape, dtype=torch.float32)


def _heldout(tr: VPATrainer, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.as_tensor(np.stack([tr.users.heldout(u) for u in ids]))
    return idx, tr.user_labels(ids, idx)


def prior_tensors(protos: Prototypes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(proto_mu, proto_logvar, log_pi)`` float32 tensors of the mixture prior."""
    return (torch.tensor(protos.mu, dtype=torch.float32), torch.tensor(protos.logvar, dtype=torch.float32),
            torch.log(torch.tensor(protos.pi, dtype=torch.float32)))


@torch.no_grad()
def components(tr: VPATrainer, model: VPAModel, ids: np.ndarray, c: int, protos: Prototypes
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Component posteriors and log responsibilities (:meth:`VPAModel.components`) of users ``ids`` from c context pairs."""
    idx, mask = _context_batch(tr, ids, c)
    return model.components(*tr.context_tensors(ids, idx, mask), mask, *prior_tensors(protos))


@torch.no_grad()
def posterior(tr: VPATrainer, model: VPAModel, ids: np.ndarray, c: int, protos: Prototypes | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mu, logvar)`` (U, d_z) of ``q(z | first c context pairs)`` of users ``ids`` (under the mixture prior
    ``protos``: the mean and variance of the mixture posterior)."""
    idx, mask = _context_batch(tr, ids, c)
    return model.infer(*tr.context_tensors(ids, idx, mask), mask, None if protos is None else prior_tensors(protos))


@torch.no_grad()
def client_log_pi(tr: VPATrainer, model: VPAModel, protos: Prototypes, ids: np.ndarray) -> torch.Tensor:
    """(U, K) log mixing weights of each user's client: ``pi_ik = (sum_u gamma_uk + pi_k) / (n_i + 1)`` over the
    client's n_i training users, ``gamma_u`` their responsibilities from ``context_max`` of their training pairs
    (the client's own soft-assignment mass, one global ``pi`` as a pseudo-user), so the prior of a user is that of
    the client's users."""
    p_mu, p_lv, log_pi = prior_tensors(protos)
    rows = {}
    for i in np.unique(tr.users.client[ids]):
        train = tr.users.users("train", int(i))
        rows[int(i)] = client_log_weights(tr.client_gamma(model, train, p_mu, p_lv, log_pi), log_pi.exp())
    return torch.stack([rows[int(i)] for i in tr.users.client[ids]])


@torch.no_grad()
def choose_z(tr: VPATrainer, model: VPAModel, ids: np.ndarray, c: int, protos: Prototypes | None, z_mode: str,
             evidence_scale: float = 1.0) -> torch.Tensor:
    """The ``z`` scored with (:data:`trainer.vpa.trainer.Z_MODES`): the posterior mean, the mean of the most
    responsible prototype, the responsibility-weighted prototype mean ``sum_k gamma_k mu_k``, or ``'likelihood'``:
    ``sum_k w_k mu_k`` with ``w_k ~ pi_k prod_i p(s_i | z = mu_k)``, the posterior of the prototype given the
    Bradley-Terry likelihood of the user's C context labels under the reward head at each prototype mean (the
    E-step of a mixture of Bradley-Terry models, the prototypes taken as points; it bypasses the encoder), or
    ``'client'``: the mixture posterior's mean under the user's client's mixing weights (:func:`client_log_pi`),
    the evidence scaled by ``evidence_scale`` (:meth:`VPAModel.components`; the other modes read it unscaled), or
    ``'client_prototype'``: the mean of the prototype most responsible under that posterior."""
    if z_mode == "mean" or protos is None:
        return posterior(tr, model, ids, c, protos)[0]
    if z_mode in ("client", "client_prototype"):
        idx, mask = _context_batch(tr, ids, c)
        p_mu, p_lv, _ = prior_tensors(protos)
        prior = (p_mu, p_lv, client_log_pi(tr, model, protos, ids))
        ctx = tr.context_tensors(ids, idx, mask)
        if z_mode == "client":
            return model.infer(*ctx, mask, prior, evidence_scale)[0]
        return p_mu[model.components(*ctx, mask, *prior, evidence_scale)[2].argmax(1)]
    proto_mu = torch.tensor(protos.mu, dtype=torch.float32)
    if z_mode == "likelihood":
        idx, _ = _context_batch(tr, ids, c)
        lab = tr.user_labels(ids, idx)
        ll = torch.stack([bt_loglik(model.margin(tr.phi[idx, 0], tr.phi[idx, 1], m.expand(len(ids), -1)), lab).sum(1)
                          for m in proto_mu], 1)
        return torch.softmax(ll + torch.log(torch.tensor(protos.pi, dtype=torch.float32)), 1) @ proto_mu
    _, _, logits = components(tr, model, ids, c, protos)
    if z_mode == "prototype":
        return proto_mu[logits.argmax(1)]
    return torch.softmax(logits, 1) @ proto_mu


@torch.no_grad()
def kl_to_prior(tr: VPATrainer, model: VPAModel, ids: np.ndarray, c: int, protos: Prototypes | None) -> np.ndarray:
    """``KL(q || p)`` per user (nats): N(0, I) when ``protos`` is None, else the mixture bound with ``c = gamma``."""
    if protos is None:
        mu, logvar = posterior(tr, model, ids, c)
        return kl_normal(mu, logvar, torch.zeros_like(mu), torch.zeros_like(logvar)).numpy()
    m, lv, logits = components(tr, model, ids, c, protos)
    p_mu, p_lv, log_pi = prior_tensors(protos)
    return component_kl(m, lv, logits, p_mu, p_lv, log_pi, None)[0].numpy()


@torch.no_grad()
def vpa_correct(tr: VPATrainer, model: VPAModel, ids: np.ndarray, z: torch.Tensor) -> np.ndarray:
    """(U, n_heldout) bool: held-out predictions of users ``ids`` scored with latents ``z`` (U, d_z) that are right."""
    idx, lab = _heldout(tr, ids)
    margin = model.margin(tr.phi[idx, 0], tr.phi[idx, 1], z)
    return ((margin > 0).long() == lab).numpy()


@torch.no_grad()
def bt_margins(tr: VPATrainer, model: BTReward, idx: torch.Tensor, head: int) -> torch.Tensor:
    """Margins (same shape as ``idx``) of pairs ``idx`` under head ``head``."""
    flat = idx.reshape(-1)
    h = torch.full(flat.shape, head, dtype=torch.long)
    return model.margin(tr.phi[flat, 0], tr.phi[flat, 1], h).reshape(idx.shape)


@torch.no_grad()
def two_stage_types(tr: VPATrainer, oracle: BTReward, ids: np.ndarray, c: int, log_prior: np.ndarray) -> np.ndarray:
    """The type each user's first c context labels make most likely under the oracle's heads: (U,) int64."""
    idx, _ = _context_batch(tr, ids, c)
    lab = tr.user_labels(ids, idx)
    ll = np.stack([bt_loglik(bt_margins(tr, oracle, idx, t), lab).sum(1).numpy() for t in range(len(TYPES))], 1)
    return np.argmax(ll + log_prior, axis=1)


@torch.no_grad()
def bt_correct(tr: VPATrainer, model: BTReward, ids: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """(U, n_heldout) bool: held-out predictions of users ``ids``, user j scored with head ``heads[j]``."""
    idx, lab = _heldout(tr, ids)
    margins = torch.stack([bt_margins(tr, model, idx, t) for t in range(model.heads.out_features)], 0)
    m = margins[torch.as_tensor(heads), torch.arange(len(ids))]
    return ((m > 0).long() == lab).numpy()


def length_correct(tr: VPATrainer, ids: np.ndarray, c: int) -> np.ndarray:
    """(U, n_heldout) bool: per-user length-only logistic regression fitted on the user's first c context pairs."""
    pairs = tr.users.pairs
    out = []
    for u in ids:
        ctx, held = tr.users.context(u, c), tr.users.heldout(u)
        f = length_features_many(list(pairs["response_a"].iloc[ctx]), list(pairs["response_b"].iloc[ctx]))
        y = tr.users.labels(u, ctx)
        clf = LogisticRegression(fit_intercept=False).fit(np.concatenate([f, -f]), np.concatenate([y, 1 - y]))
        g = length_features_many(list(pairs["response_a"].iloc[held]), list(pairs["response_b"].iloc[held]))
        out.append(clf.predict(g) == tr.users.labels(u, held))
    return np.array(out)


def summarise(correct: np.ndarray, types: np.ndarray) -> dict:
    """``{'acc', 'per_type': {type name: acc}}`` of per-user correctness (U, n_heldout)."""
    per_user = correct.mean(1)
    return {"acc": float(per_user.mean()),
            "per_type": {name: float(per_user[types == t].mean()) for t, name in enumerate(TYPES) if np.any(types == t)}}


def type_probe(z_val: np.ndarray, t_val: np.ndarray, z_test: np.ndarray, t_test: np.ndarray) -> float:
    """Accuracy on test users of a logistic regression from z to type fitted on validation users."""
    if len(np.unique(t_val)) < 2:
        return float("nan")
    clf = LogisticRegression().fit(z_val, t_val)
    return float((clf.predict(z_test) == t_test).mean())


def partners(types: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """For each user, a random user of the other type (index into the same arrays)."""
    out = np.empty(len(types), dtype=np.int64)
    for t in np.unique(types):
        other = np.flatnonzero(types != t)
        out[types == t] = rng.choice(other, size=int((types == t).sum()))
    return out


def switching(correct_own: np.ndarray, correct_partner_z: np.ndarray) -> dict:
    """``{'flip', 'both_right'}`` from correctness of users' held-out pairs under their own z and under the partner's.

    On every pair the two users' labels are opposite, so the prediction flips iff exactly one of the two
    is right for the first user's label; it flips with both right iff own is right and the partner's z is wrong.
    """
    flip = correct_own != correct_partner_z
    return {"flip": float(flip.mean()), "both_right": float((correct_own & ~correct_partner_z).mean())}
