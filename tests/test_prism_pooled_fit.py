"""The exact federated fits of the experts' feature path (trainer.experts.length_init.federated_logistic_fit,
pooled_expert_coefs) against scikit-learn on the pooled pairs, and the router's centroid distillation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from trainer.experts.length_init import client_loss_grad, federated_logistic_fit, pooled_expert_coefs
from trainer.experts.prompt_router import PromptRouter, centroid_distillation, kmeans_init

torch.set_num_threads(1)


def _pairs(n, seed, w=(1.5, -2.0, 0.5)):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, len(w)))
    y = (rng.random(n) < 1 / (1 + np.exp(-x @ np.asarray(w)))).astype(np.float64)
    return x, y


def test_client_loss_and_gradient_by_hand():
    x = np.array([[1.0, 0.0], [0.0, 2.0]])
    y = np.array([1.0, 0.0])
    w = np.array([0.5, -1.0])
    z = np.array([0.5, -2.0])
    loss = 2 * (np.log1p(np.exp(-0.5)) + np.log1p(np.exp(-2.0)))  # pairs and swapped copies: twice the sum
    grad = 2 * x.T @ (1 / (1 + np.exp(-z)) - y)
    got_loss, got_grad = client_loss_grad(x, y, w)
    assert got_loss == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(got_grad, grad, rtol=1e-12)
    eps = 1e-6  # and the gradient is the loss's derivative
    num = [(client_loss_grad(x, y, w + eps * e)[0] - client_loss_grad(x, y, w - eps * e)[0]) / (2 * eps) for e in np.eye(2)]
    np.testing.assert_allclose(got_grad, num, rtol=1e-6)


def test_federated_fit_is_the_central_fit_on_the_pooled_pairs_and_swapped_copies():
    parts = [_pairs(n, s) for s, n in enumerate((3, 40, 7, 120))]  # clients of very different sizes
    w, n_eval = federated_logistic_fit(parts, C=5.0)
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    ref = LogisticRegression(C=5.0, fit_intercept=False, tol=1e-10, max_iter=1000).fit(
        np.concatenate([x, -x]), np.concatenate([y, 1 - y]).astype(int))
    np.testing.assert_allclose(w, ref.coef_[0], atol=1e-5)
    assert n_eval >= 2
    # the same model as the plain per-pair fit with C doubled (no intercept: the swapped copy repeats the term)
    plain = LogisticRegression(C=10.0, fit_intercept=False, tol=1e-10, max_iter=1000).fit(x, y.astype(int))
    np.testing.assert_allclose(w, plain.coef_[0], atol=1e-5)
    # a client with no pair contributes nothing
    w2, _ = federated_logistic_fit(parts + [(np.zeros((0, 3)), np.zeros(0))], C=5.0)
    np.testing.assert_allclose(w2, w, atol=1e-8)


def test_pooled_expert_fits_interpolate_between_the_global_and_the_per_expert_fit():
    x, y = _pairs(400, 0)
    x[200:] *= np.array([-1.0, 1.0, 1.0])  # expert 1's pairs follow the opposite first-feature rule
    assign = np.repeat([0, 1], 200)
    clients = [np.arange(i, 400, 4) for i in range(4)]
    glob, _ = federated_logistic_fit([(x[c], y[c]) for c in clients], C=5.0)
    same, _ = pooled_expert_coefs(x, y, assign, clients, 3, C=5.0, pool_C=None)
    np.testing.assert_allclose(same, np.tile(glob, (3, 1)))
    tight, _ = pooled_expert_coefs(x, y, assign, clients, 3, C=5.0, pool_C=1e-6)
    np.testing.assert_allclose(tight, np.tile(glob, (3, 1)), atol=1e-3)  # a tight pull: every expert is the global fit
    loose, _ = pooled_expert_coefs(x, y, assign, clients, 3, C=5.0, pool_C=1e6)
    for k in (0, 1):  # a loose pull: each expert's own unregularised fit (the scikit-learn optimum, C huge)
        s = assign == k
        ref = LogisticRegression(C=1e6, fit_intercept=False, tol=1e-10, max_iter=1000).fit(
            np.concatenate([x[s], -x[s]]), np.concatenate([y[s], 1 - y[s]]).astype(int))
        np.testing.assert_allclose(loose[k], ref.coef_[0], atol=1e-3)
    assert loose[0, 0] > 0.5 and loose[1, 0] < -0.5  # the two rules, which the global fit averages away
    np.testing.assert_allclose(loose[2], glob)  # no pair routed to expert 2: the global fit


def test_centroid_distillation_brings_the_router_to_the_nearest_public_centroid():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 16)) * 3
    public = (centres[rng.integers(0, 3, 12)] + rng.normal(size=(12, 16))).astype(np.float32)
    clients = [(centres[rng.integers(0, 3, 60)] + rng.normal(size=(60, 16))).astype(np.float32) for _ in range(4)]
    router = PromptRouter(16, 3, hidden=8, seed=0)
    kmeans_init(router, public, lr=1e-2, epochs=1, seed=0)  # barely fitted to 12 public prompts
    pool = np.concatenate(clients)
    centroids = centroid_distillation(router, public, clients + [np.zeros((0, 16), np.float32)], rounds=3, lr=3e-2,
                                      epochs=5, seed=0)
    nearest = np.argmin(((pool[:, None, :] - centroids[None]) ** 2).sum(-1), axis=1)
    assert centroids.shape == (3, 16)
    assert (router.route(pool) == nearest).mean() >= 0.95
