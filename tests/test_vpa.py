"""FedVPA-GP (issue 28): ELBO terms, Gumbel-softmax assignment, prototype aggregation, orthogonality loss,
what a client uploads, and a small synthetic federation where the personal latent must beat the monolithic model."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from sdk.errors import InvalidInputError, ShapeError
from trainer.data.conflicting_users import UsersConfig, make_users
from trainer.vpa import evaluation as ev
from trainer.vpa.aggregation import ClientUpdate, PrototypeStats, Prototypes, aggregate_prototypes, aggregate_round
from trainer.vpa.model import (VPAModel, bt_loglik, client_log_weights, component_kl, elbo, expected_log_normal,
                               gumbel_softmax, kl_normal, mixture_kl, mixture_moments, mixture_posterior,
                               orthogonality_loss)
from trainer.vpa.prototype_kmeans import federated_kmeans, lloyd_stats, principal_split
from trainer.vpa.trainer import VPAConfig, VPATrainer

torch.set_num_threads(1)


def test_elbo_terms_hand_computed():
    # KL(N([1, 0], diag[1, 4]) || N(0, I)) = 1/2 (1 + 1 - 1 - 0) + 1/2 (4 + 0 - 1 - ln 4)
    kl = kl_normal(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, math.log(4.0)]]), torch.zeros(1, 2), torch.zeros(1, 2))
    assert kl.item() == pytest.approx(0.5 + 0.5 * (3 - math.log(4.0)), abs=1e-6)
    # Bradley-Terry: log sigma(2) for label 1, log sigma(-2) for label 0
    ll = bt_loglik(torch.tensor([[2.0, 2.0]]), torch.tensor([[1, 0]]))
    assert ll[0, 0].item() == pytest.approx(-math.log1p(math.exp(-2.0)), abs=1e-6)
    assert ll[0, 1].item() == pytest.approx(-math.log1p(math.exp(2.0)), abs=1e-6)
    # ELBO = sum_t log p - beta KL
    assert elbo(ll, kl, 0.5).item() == pytest.approx(ll.sum().item() - 0.5 * kl.item(), abs=1e-6)
    # E_q log N(z; 0, 1) for q = N(1, 1): -1/2 (ln 2 pi + 1 + 1)
    e = expected_log_normal(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]))
    assert e.item() == pytest.approx(-0.5 * (math.log(2 * math.pi) + 2.0), abs=1e-6)


def test_mixture_kl_hand_computed():
    mu, logvar = torch.tensor([[1.0]]), torch.tensor([[0.0]])
    # one prototype at N(0, 1) with pi = 1: the bound is the Gaussian KL, 1/2
    kl, gamma = mixture_kl(mu, logvar, torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), None)
    assert kl.item() == pytest.approx(0.5, abs=1e-6) and gamma.item() == pytest.approx(1.0)
    # prototypes at 1 and -1 (unit variance), pi = (1/2, 1/2): logits differ by E log N: -(0 + 1)/2 vs -(4 + 1)/2
    kl, gamma = mixture_kl(mu, logvar, torch.tensor([[1.0], [-1.0]]), torch.zeros(2, 1), torch.log(torch.tensor([0.5, 0.5])), None)
    g = 1 / (1 + math.exp(-2.0))
    assert gamma[0, 0].item() == pytest.approx(g, abs=1e-6)
    expect = g * 0.0 + (1 - g) * 2.0 + g * math.log(g / 0.5) + (1 - g) * math.log((1 - g) / 0.5)
    assert kl.item() == pytest.approx(expect, abs=1e-6)


def test_gumbel_softmax_sums_to_one_and_hardens():
    logits = torch.tensor([[0.3, -0.2, 0.1]]).repeat(2000, 1)
    sharpness = []
    for tau in (5.0, 1.0, 0.2, 0.02):
        y = gumbel_softmax(logits, tau, torch.Generator().manual_seed(0))
        assert torch.allclose(y.sum(-1), torch.ones(2000), atol=1e-5)
        sharpness.append(y.max(-1).values.mean().item())
    assert sharpness == sorted(sharpness) and sharpness[-1] > 0.99 and sharpness[0] < 0.5
    # the same noise: at a low temperature the sample is one-hot at argmax(logits + g)
    gen = torch.Generator().manual_seed(1)
    u = torch.rand(logits.shape, generator=gen).clamp(1e-10, 1 - 1e-10)
    y = gumbel_softmax(logits, 1e-3, torch.Generator().manual_seed(1))
    assert torch.equal(y.argmax(-1), (logits - torch.log(-torch.log(u))).argmax(-1))


def test_prototype_aggregation_is_the_mass_weighted_mean():
    prev = Prototypes(mu=np.full((2, 2), 9.0), logvar=np.full((2, 2), 9.0), pi=np.array([0.5, 0.5]))
    # client a: mass 3 of users at mu = (1, 2), sigma^2 = 1; client b: mass 1 at mu = (5, -2)
    a = PrototypeStats(mass=np.array([3.0, 0.0]), sum_mu=np.array([[3.0, 6.0], [0.0, 0.0]]),
                       sum_sq=np.array([[6.0, 15.0], [0.0, 0.0]]))
    b = PrototypeStats(mass=np.array([1.0, 0.0]), sum_mu=np.array([[5.0, -2.0], [0.0, 0.0]]),
                       sum_sq=np.array([[12.0, 5.0], [0.0, 0.0]]))
    new = aggregate_prototypes([a, b], prev)
    np.testing.assert_allclose(new.mu[0], [(3 * 1 + 5) / 4, (3 * 2 - 2) / 4])  # (2, 1)
    # E[z^2] = (18 / 4, 20 / 4): variance (0.5, 4), the second capped at VAR_CAP = 1
    np.testing.assert_allclose(new.logvar[0], np.log([18 / 4 - 4, 1.0]))
    np.testing.assert_allclose(new.mu[1], [9.0, 9.0])  # no mass anywhere: the previous prototype stays
    np.testing.assert_allclose(new.logvar[1], [9.0, 9.0])
    assert new.pi.sum() == pytest.approx(1.0) and new.pi[1] == pytest.approx(1e-3 / (1 + 1e-3))
    # a tighter cap (the config's proto_var_cap) caps both variances: (0.5, 4) -> (0.3, 0.3)
    np.testing.assert_allclose(aggregate_prototypes([a, b], prev, var_cap=0.3).logvar[0], np.log([0.3, 0.3]))


@pytest.mark.parametrize("bad, error", [
    (PrototypeStats(mass=np.array([1.0]), sum_mu=np.zeros((2, 2)), sum_sq=np.zeros((2, 2))), ShapeError),
    (PrototypeStats(mass=np.array([1.0, np.nan]), sum_mu=np.zeros((2, 2)), sum_sq=np.zeros((2, 2))), ShapeError),
    (PrototypeStats(mass=np.array([1.0, -1.0]), sum_mu=np.zeros((2, 2)), sum_sq=np.zeros((2, 2))), InvalidInputError),
    (None, InvalidInputError),
])
def test_aggregate_round_refuses_bad_statistics(bad, error):
    prev = Prototypes(mu=np.zeros((2, 2)), logvar=np.zeros((2, 2)), pi=np.array([0.5, 0.5]))
    ok = ClientUpdate({"w": np.ones(3)}, 2.0, PrototypeStats(np.ones(2), np.zeros((2, 2)), np.zeros((2, 2))))
    with pytest.raises(error):
        aggregate_round([ok, ClientUpdate({"w": np.ones(3)}, 1.0, bad)], prev)


def test_aggregate_round_fedavg_by_users():
    params, protos = aggregate_round([ClientUpdate({"w": np.array([0.0, 1.0])}, 1.0, None),
                                      ClientUpdate({"w": np.array([4.0, 5.0])}, 3.0, None)], None)
    np.testing.assert_allclose(params["w"], [3.0, 4.0])
    assert protos is None


def test_mixture_posterior_hand_computed():
    # one prototype N(0, 1): the posterior of evidence (h, Lambda) = (3, 2) is N(3 / 3, 1 / 3), as under VPL's prior
    h, lam = torch.tensor([[3.0]]), torch.tensor([[2.0]])
    m, lv, logits = mixture_posterior(h, lam, torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1))
    assert m.item() == pytest.approx(1.0) and lv.item() == pytest.approx(-math.log(3.0))
    # two prototypes N(+-1, 1/2), pi = (1/4, 3/4): gamma_k ~ pi_k N(h / Lambda = 1.5; mu_k, 1/2 + 1/2)
    p_mu, p_lv = torch.tensor([[1.0], [-1.0]]), torch.log(torch.tensor([[0.5], [0.5]]))
    m, lv, logits = mixture_posterior(h, lam, p_mu, p_lv, torch.log(torch.tensor([0.25, 0.75])))
    w = np.array([0.25 * math.exp(-0.5 * 0.25), 0.75 * math.exp(-0.5 * 2.5 ** 2)])
    np.testing.assert_allclose(torch.softmax(logits, -1)[0].numpy(), w / w.sum(), rtol=1e-5)
    # component posteriors: precision 2 + 2 = 4, means (+-1 * 2 + 3) / 4
    np.testing.assert_allclose(m[0, :, 0].numpy(), [5 / 4, 1 / 4], rtol=1e-6)
    np.testing.assert_allclose(lv[0, :, 0].numpy(), [-math.log(4.0)] * 2, rtol=1e-6)
    # mixture moments: mean sum_k g_k m_k, variance sum_k g_k (v_k + m_k^2) - mean^2
    g = torch.tensor([[0.5, 0.5]])
    mean, logvar = mixture_moments(m, lv, g)
    assert mean.item() == pytest.approx(0.75) and logvar.exp().item() == pytest.approx(0.25 + (25 / 16 + 1 / 16) / 2 - 0.5625)
    # component KL with one component equals the Gaussian KL (no categorical term)
    kl, _, _ = component_kl(torch.tensor([[[1.0]]]), torch.zeros(1, 1, 1), torch.zeros(1, 1), torch.zeros(1, 1),
                            torch.zeros(1, 1), torch.zeros(1), None)
    assert kl.item() == pytest.approx(0.5)


def test_natural_parameter_encoder_tightens_with_more_pairs():
    torch.manual_seed(0)
    model = VPAModel(5, hidden=8, latent_dim=3, dropout=0.0, pooling="natural").eval()
    w, lo = torch.randn(1, 1, 5), torch.randn(1, 1, 5)
    var = [model.encode(w.repeat(1, c, 1), lo.repeat(1, c, 1), torch.ones(1, c))[1].exp() for c in (1, 2, 8)]
    assert bool((var[0] > var[1]).all() and (var[1] > var[2]).all())
    # the same pair c times: precision 1 + c lambda, mean c h_1 / (1 + c lambda)
    h1, lam1 = model.evidence(w, lo, torch.ones(1, 1))
    mu8, lv8 = model.encode(w.repeat(1, 8, 1), lo.repeat(1, 8, 1), torch.ones(1, 8))
    torch.testing.assert_close(mu8, 8 * h1 / (1 + 8 * (lam1 - 1e-6) + 1e-6))
    # padding does not count
    mu_pad, _ = model.encode(torch.cat([w.repeat(1, 8, 1), torch.randn(1, 3, 5)], 1),
                             torch.cat([lo.repeat(1, 8, 1), torch.randn(1, 3, 5)], 1),
                             torch.cat([torch.ones(1, 8), torch.zeros(1, 3)], 1))
    torch.testing.assert_close(mu_pad, mu8)


def test_federated_kmeans_finds_the_clusters_from_statistics():
    # principal split of points at (+-2, 0): mean 0, covariance diag(4, 0) -> centres (+-2, 0)
    pts = np.array([[2.0, 0.0], [-2.0, 0.0]])
    np.testing.assert_allclose(np.sort(principal_split([(2.0, pts.sum(0), pts.T @ pts)], 2)[:, 0]), [-2.0, 2.0], atol=1e-12)
    # hard-assignment statistics: counts and sums per centre
    st = lloyd_stats(np.array([[1.0, 1.0], [3.0, 1.0], [-5.0, 0.0]]), np.array([[2.0, 0.0], [-4.0, 0.0]]))
    np.testing.assert_allclose(st.mass, [2.0, 1.0])
    np.testing.assert_allclose(st.sum_mu, [[4.0, 2.0], [-5.0, 0.0]])
    np.testing.assert_allclose(st.sum_sq, [[10.0, 2.0], [25.0, 0.0]])
    # two clusters spread over three clients, one client holding only one of them
    rng = np.random.default_rng(0)
    a, b = rng.normal([3.0, 1.0], 0.1, (30, 2)), rng.normal([-1.0, -2.0], 0.1, (30, 2))
    protos = federated_kmeans([a[:20], np.vstack([a[20:], b[:10]]), b[10:]], 2, 5)
    order = np.argsort(protos.mu[:, 0])
    np.testing.assert_allclose(protos.mu[order], [b.mean(0), a.mean(0)], atol=1e-9)
    np.testing.assert_allclose(protos.pi, [0.5, 0.5])


def test_orthogonality_loss():
    assert orthogonality_loss(torch.eye(3, 5) * torch.tensor([[2.0], [0.5], [3.0]])).item() == pytest.approx(0.0, abs=1e-7)
    assert orthogonality_loss(torch.tensor([[1.0, 1.0], [2.0, 2.0]])).item() == pytest.approx(1.0, abs=1e-6)
    assert orthogonality_loss(torch.tensor([[1.0, 0.0], [1.0, 1.0]])).item() == pytest.approx(0.5, abs=1e-6)


# ------------------------------------------------------------------ a small synthetic federation


def _synthetic(n_pairs: int = 240, d: int = 6, seed: int = 0):
    """Pairs whose HH label is which response has the larger feature 0: harmless users prefer it, helpful users not."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((n_pairs, 2))
    label = (h[:, 0] > h[:, 1]).astype(np.int8)
    pairs = pd.DataFrame({"prompt_id": [f"p{i}" for i in range(n_pairs)], "domain": "hh_harmless",
                          "prompt": [f"prompt {i}" for i in range(n_pairs)],
                          "response_a": ["a " * int(rng.integers(1, 30)) for _ in range(n_pairs)],
                          "response_b": ["b " * int(rng.integers(1, 30)) for _ in range(n_pairs)], "label": label})
    phi = rng.standard_normal((n_pairs, 2, d)).astype(np.float32) * 0.3
    phi[:, :, 0] = h
    return pairs, phi


def _small_cfg(**over) -> VPAConfig:
    users = UsersConfig(n_clients=4, mix="pure", n_train_users=4, n_val_users=2, n_test_users=4, n_train_pairs=40,
                        context_max=8, n_heldout=16)
    base = dict(users=users, contexts=(2, 8), hidden=16, latent_dim=2, rounds=25, local_steps=5, n_targets=16,
                pca_components=None, structure="markers", lr=1e-2, seeds=1)
    return VPAConfig(**{**base, **over})


@pytest.mark.parametrize("client_prior", [False, True])
def test_client_upload_holds_only_parameters_and_prototype_statistics(client_prior):
    pairs, phi = _synthetic()
    cfg = _small_cfg(client_prior=client_prior)
    users = make_users(pairs, cfg.users, seed=0)
    tr = VPATrainer(users, phi, cfg)
    model, protos = tr.new_vpa(0), tr.init_prototypes(0)
    shapes = None
    for client in (0, 1):
        ids = users.users("train", client)
        up = tr.local_vpa_step(model, protos, ids, 0.1, 1.0, np.random.default_rng(0), torch.Generator().manual_seed(0))
        assert set(vars(up)) == {"params", "n_examples", "prototypes"} and up.n_examples == len(ids)
        assert set(up.params) == set(model.state_dict())
        assert set(vars(up.prototypes)) == {"mass", "sum_mu", "sum_sq"}
        assert up.prototypes.mass.shape == (2,) and up.prototypes.sum_mu.shape == (2, 2)
        now = {k: v.shape for k, v in up.params.items()}
        assert shapes in (None, now)  # the same shapes whatever the client's data
        shapes = now
        # no feature row of the client's pairs appears in the upload
        own = phi[np.concatenate([users.items[u] for u in ids])].reshape(-1, phi.shape[-1])
        for arr in [*up.params.values(), up.prototypes.sum_mu, up.prototypes.sum_sq]:
            flat = np.asarray(arr, dtype=np.float32).reshape(-1)
            for row in own[:50]:
                assert not any(np.allclose(flat[i:i + len(row)], row) for i in range(0, len(flat) - len(row) + 1))


@pytest.mark.parametrize("over", [{"pooling": "mean"}, {"pooling": "natural", "kmeans_at": (0.3,)},
                                  {"pooling": "natural", "client_prior": False}])
def test_synthetic_federation_personalises_and_the_monolithic_model_cannot(over):
    pairs, phi = _synthetic()
    cfg = _small_cfg(**over)
    users = make_users(pairs, cfg.users, seed=0)
    tr = VPATrainer(users, phi, cfg)
    test_ids, t_test = users.users("test"), users.type[users.users("test")]
    mono = tr.train_bt(per_type=False, seed=0)
    oracle = tr.train_bt(per_type=True, seed=0)
    mono_acc = ev.bt_correct(tr, mono, test_ids, np.zeros(len(test_ids), dtype=np.int64)).mean()
    oracle_acc = ev.bt_correct(tr, oracle, test_ids, t_test).mean()
    model, protos = tr.train_vpa("mixture", 0.03, seed=0)
    mu, logvar = ev.posterior(tr, model, test_ids, 8, protos)
    gp_acc = ev.vpa_correct(tr, model, test_ids, mu).mean()
    assert oracle_acc > 0.85 and abs(mono_acc - 0.5) < 0.1
    assert gp_acc > mono_acc + 0.2, (gp_acc, mono_acc)
    assert protos.pi.sum() == pytest.approx(1.0)
    switch = ev.switching(ev.vpa_correct(tr, model, test_ids, mu),
                          ev.vpa_correct(tr, model, test_ids, mu[ev.partners(t_test, np.random.default_rng(0))]))
    assert switch["flip"] > 0.5 and switch["both_right"] <= switch["flip"]


def test_choose_z_modes_read_the_mixture_posterior():
    pairs, phi = _synthetic()
    cfg = _small_cfg(proto_var_cap=0.2)
    users = make_users(pairs, cfg.users, seed=0)
    tr = VPATrainer(users, phi, cfg)
    model, protos = tr.new_vpa(0).eval(), tr.init_prototypes(0)
    np.testing.assert_allclose(protos.logvar, np.log(0.2))  # initial variances are the cap
    ids = users.users("test")
    _, _, logits = ev.components(tr, model, ids, 2, protos)
    gamma = torch.softmax(logits, 1).numpy()
    soft = ev.choose_z(tr, model, ids, 2, protos, "responsibility").numpy()
    np.testing.assert_allclose(soft, gamma @ protos.mu, rtol=1e-5, atol=1e-6)  # sum_k gamma_k mu_k
    hard = ev.choose_z(tr, model, ids, 2, protos, "prototype").numpy()
    np.testing.assert_allclose(hard, protos.mu[gamma.argmax(1)], rtol=1e-6)
    # 'likelihood': w_k ~ pi_k prod_i sigma(+-m_ik), m_ik the margin of context pair i at z = mu_k, sign by the label
    protos = Prototypes(mu=protos.mu, logvar=protos.logvar, pi=np.array([0.3, 0.7]))
    got = ev.choose_z(tr, model, ids, 2, protos, "likelihood").numpy()
    for j, u in enumerate(ids[:3]):
        ctx = users.context(u, 2)
        sign = 2.0 * users.labels(u, ctx) - 1.0
        w = []
        for k in range(2):
            z = torch.tensor(protos.mu[k:k + 1], dtype=torch.float32)
            m = model.margin(tr.phi[ctx, 0][None], tr.phi[ctx, 1][None], z)[0].detach().numpy()
            w.append(protos.pi[k] * np.prod(1.0 / (1.0 + np.exp(-sign * m))))
        np.testing.assert_allclose(got[j], np.array(w) @ protos.mu / sum(w), rtol=1e-4, atol=1e-6)
    # 'client': the client's weights are (sum of its training users' gamma + pi) / (n + 1)
    log_pi = ev.client_log_pi(tr, model, protos, ids).numpy()
    for i in np.unique(users.client[ids]):
        train = users.users("train", int(i))
        _, _, lg = ev.components(tr, model, train, cfg.users.context_max, protos)
        want = (torch.softmax(lg, 1).numpy().sum(0) + protos.pi) / (len(train) + 1)
        np.testing.assert_allclose(np.exp(log_pi[users.client[ids] == i]), np.broadcast_to(want, (int((users.client[ids] == i).sum()), 2)), rtol=1e-5)
    with pytest.raises(InvalidInputError):
        _small_cfg(proto_var_cap=2.0)


def test_length_per_user_and_summary():
    pairs, phi = _synthetic()
    cfg = _small_cfg()
    users = make_users(pairs, cfg.users, seed=0)
    tr = VPATrainer(users, phi, cfg)
    ids = users.users("test")
    ok = ev.length_correct(tr, ids, 8)
    assert ok.shape == (len(ids), cfg.users.n_heldout)
    s = ev.summarise(np.array([[True, False], [True, True]]), np.array([0, 1]))
    assert s == {"acc": 0.75, "per_type": {"harmless": 0.5, "helpful": 1.0}}


def test_users_split_by_prompt_and_labels_mirror():
    pairs, _ = _synthetic(n_pairs=300)
    users = make_users(pairs, UsersConfig(n_clients=4, n_train_pairs=20, context_max=8, n_heldout=8), seed=1)
    for u in range(len(users.items)):
        parts = set(users.part[users.items[u]])
        assert parts == {users.user_part[u]}  # a user's pairs all come from its part's prompts
        assert len(set(pairs["prompt_id"].iloc[users.items[u]])) == len(users.items[u])
        expect = pairs["label"].to_numpy()[users.items[u]] ^ users.type[u]
        np.testing.assert_array_equal(users.labels(u, users.items[u]), expect)
    train_prompts = set(pairs["prompt_id"][users.part == "train"])
    assert not train_prompts & set(pairs["prompt_id"][users.part == "test"])


def test_config_refuses_contexts_beyond_the_users():
    with pytest.raises(InvalidInputError):
        VPAConfig(contexts=(2, 64))


def test_flower_strategy_aggregates_as_the_pure_function_and_drops_a_bad_reply():
    from flwr.app import Message, MessageType, RecordDict

    from trainer.vpa.flower_strategy import FedVPAStrategy, pack_update, unpack_global

    prev = Prototypes(mu=np.zeros((2, 3)), logvar=np.zeros((2, 3)), pi=np.array([0.5, 0.5]))
    rng = np.random.default_rng(0)

    def update(n: float) -> ClientUpdate:
        return ClientUpdate({"w": rng.standard_normal((2, 2)), "b": rng.standard_normal(2)}, n,
                            PrototypeStats(rng.uniform(0, 2, 2), rng.standard_normal((2, 3)), rng.standard_normal((2, 3))))

    ups = [update(1.0), update(3.0)]
    bad = ClientUpdate({"w": np.ones((3, 3)), "b": np.ones(2)}, 1.0, ups[0].prototypes)
    strategy = FedVPAStrategy({"w": np.zeros((2, 2)), "b": np.zeros(2)}, prev)

    def reply(node, u):
        return Message(pack_update(u), reply_to=Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN))

    record, _ = strategy.aggregate_train(1, [reply(1, ups[0]), reply(2, bad), reply(3, ups[1])])
    params, protos = unpack_global(record)
    want_params, want_protos = aggregate_round(ups, prev)
    for k in want_params:
        np.testing.assert_allclose(params[k], want_params[k], rtol=1e-6)
    np.testing.assert_allclose(protos.mu, want_protos.mu)
    np.testing.assert_allclose(protos.pi, want_protos.pi)
    assert [r.client_id for r in strategy.rejected_] == ["2"]


def test_cli_refuses_another_commands_results_folder(tmp_path):
    from typer.testing import CliRunner

    from trainer.cli import app

    (tmp_path / "results.json").write_text('{"command": "mor eval"}')
    res = CliRunner().invoke(app, ["vpa", "train", "--quick", "--out", str(tmp_path), "--data", str(tmp_path)])
    assert res.exit_code != 0 and "mor eval" in str(res.output) + str(res.exception)
    assert VPAConfig.quick().seeds == 1 and VPAConfig.quick().to_json()["users"]["n_clients"] == 12


@pytest.mark.parametrize("pooling,z_mode", [("mean", "prototype"), ("natural", "mean")])
def test_device_z_and_rewards_equal_the_trainers_after_onnx_export(pooling, z_mode):
    from export.vpa_export import vpa_to_onnx
    from sdk.personal_reward import PersonalReward

    pairs, phi = _synthetic()
    cfg = _small_cfg(rounds=3, pooling=pooling, kmeans_at=(0.5,))
    users = make_users(pairs, cfg.users, seed=0)
    tr = VPATrainer(users, phi, cfg)
    model, protos = tr.train_vpa("mixture", 0.03, seed=0)
    device = PersonalReward(*vpa_to_onnx(model, protos, z_mode=z_mode), phi.shape[-1], prior_inputs=True)
    u = users.users("test")[0]
    idx = torch.as_tensor(users.context(u, 8))[None]
    w, lo = tr.context_tensors(np.array([u]), idx, torch.ones(1, 8))
    latent = device.latent(w[0].numpy(), lo[0].numpy(), np.log(protos.pi).astype(np.float32), 1.0)
    # the device's z from the user's own context is the trainer's (posterior mean or nearest prototype)
    mu_t, logvar_t = ev.posterior(tr, model, np.array([u]), 8, protos)
    z_t = ev.choose_z(tr, model, np.array([u]), 8, protos, z_mode)
    np.testing.assert_allclose(latent.mu, mu_t[0].numpy(), atol=1e-5)
    np.testing.assert_allclose(latent.logvar, logvar_t[0].numpy(), atol=1e-4)
    np.testing.assert_allclose(latent.z, z_t[0].numpy(), atol=1e-5)
    held = users.heldout(u)
    with torch.no_grad():
        r_t = model.reward(torch.as_tensor(phi[held, 0])[None], z_t)[0].numpy()
    np.testing.assert_allclose(device.rewards(phi[held, 0], latent.z), r_t, atol=1e-4)
    # under the client's own pi, evidence scaled (natural parameters only): the trainer's 'client' read-out
    if pooling == "natural":
        log_pi = ev.client_log_pi(tr, model, protos, np.array([u]))[0].numpy()
        client = device.latent(w[0].numpy(), lo[0].numpy(), log_pi, 0.1)
        want = ev.choose_z(tr, model, np.array([u]), 8, protos, "client", 0.1)[0].numpy()
        np.testing.assert_allclose(client.mu, want, atol=1e-5)
        assert np.abs(client.mu - latent.mu).max() > 1e-3  # the client's prior and the scale change it


@torch.no_grad()
def test_client_prior_and_evidence_scale_hand_computed():
    # natural-parameter evidence (h, Lambda) scaled by alpha: gamma_k ~ pi_ck N(h / Lambda; mu_k, s_k^2 + 1 / (alpha
    # Lambda)), the component posterior N((mu_k / s_k^2 + alpha h) / P_k, 1 / P_k), P_k = 1 / s_k^2 + alpha Lambda
    torch.manual_seed(0)
    model = VPAModel(3, hidden=8, latent_dim=1, dropout=0.0, pooling="natural").eval()
    w, lo, mask = torch.randn(2, 4, 3), torch.randn(2, 4, 3), torch.ones(2, 4)
    h, lam = (t.double().numpy()[:, 0] for t in model.evidence(w, lo, mask))
    p_mu, p_lv = torch.tensor([[1.0], [-1.0]]), torch.log(torch.tensor([[0.1], [0.1]]))
    log_pi = torch.log(torch.tensor([[0.9, 0.1], [0.2, 0.8]]))  # one prior per user (its client's pi)
    for alpha in (1.0, 0.1):
        m, lv, logits = model.components(w, lo, mask, p_mu, p_lv, log_pi, alpha)
        for u in range(2):
            var = 0.1 + 1.0 / (alpha * lam[u])
            g = np.exp(log_pi[u].double().numpy()) * np.exp(-0.5 * (h[u] / lam[u] - np.array([1.0, -1.0])) ** 2 / var)
            np.testing.assert_allclose(torch.softmax(logits[u], -1).numpy(), g / g.sum(), rtol=1e-4)
            prec = 10.0 + alpha * lam[u]
            np.testing.assert_allclose(m[u, :, 0].numpy(), (np.array([10.0, -10.0]) + alpha * h[u]) / prec, rtol=1e-5)
            np.testing.assert_allclose(lv[u, :, 0].numpy(), [-np.log(prec)] * 2, rtol=1e-5)
    # with vanishing evidence the responsibilities are the client's weights
    _, _, logits = model.components(w, lo, mask, p_mu, p_lv, log_pi, 1e-6)
    np.testing.assert_allclose(torch.softmax(logits, -1).numpy(), log_pi.exp().numpy(), atol=1e-4)


def test_client_log_weights_hand_computed():
    gamma, pi = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]]), torch.tensor([0.5, 0.5])
    # (sum_u gamma_u + pi) / (U + 1) = ((1.7 + 0.5) / 4, (1.3 + 0.5) / 4)
    np.testing.assert_allclose(client_log_weights(gamma, pi).exp().numpy(), [0.55, 0.45], rtol=1e-6)
    # leave-one-out, user u: (sum_{v != u} gamma_v + pi) / U; user 0: ((0.8 + 0.5) / 3, (1.2 + 0.5) / 3)
    loo = client_log_weights(gamma, pi, leave_one_out=True).exp().numpy()
    np.testing.assert_allclose(loo, [[1.3 / 3, 1.7 / 3], [2.0 / 3, 1.0 / 3], [1.6 / 3, 1.4 / 3]], rtol=1e-6)
    # the training prior under client_prior: a user's weights are set by the client's other users only
    pairs, phi = _synthetic()
    cfg = _small_cfg()
    assert cfg.client_prior
    tr = VPATrainer(make_users(pairs, cfg.users, seed=0), phi, cfg)
    model, protos = tr.new_vpa(0).eval(), tr.init_prototypes(0)
    p_mu, p_lv, log_pi = ev.prior_tensors(protos)
    ids = tr.users.users("train", 0)
    g = tr.client_gamma(model, ids, p_mu, p_lv, log_pi)
    np.testing.assert_allclose(g.sum(1).numpy(), 1.0, rtol=1e-6)
    changed = tr.client_gamma(model, ids[1:], p_mu, p_lv, log_pi)  # user 0's own pairs do not enter its weights
    np.testing.assert_allclose(client_log_weights(g, log_pi.exp(), True)[0].numpy(),
                               torch.log((changed.sum(0) + log_pi.exp()) / len(ids)).numpy(), rtol=1e-5)


def test_readout_is_chosen_per_context_on_validation_and_read_back_by_context_size():
    from trainer.vpa.artefact import PersonalRewardArtefact
    from trainer.vpa.experiment import choose_readout

    pairs, phi = _synthetic()
    cfg = _small_cfg()
    users = make_users(pairs, cfg.users, seed=0)
    tr = VPATrainer(users, phi, cfg)
    model, protos = tr.new_vpa(0).eval(), tr.init_prototypes(0)
    choices = {"fedvpa_gp": {}}
    readout = choose_readout(tr, model, protos, "mean", [("client", 1.0), ("client", 0.1)], choices)
    ids = users.users("val")
    for c in cfg.contexts:
        scores = choices["fedvpa_gp_readout_val_acc"][str(c)]
        assert list(scores) == ["mean@1.0", "client@1.0", "client@0.1"]
        best = max(scores.values())
        assert scores[f"{readout[c][0]}@{readout[c][1]}"] == best
        assert readout[c] == ("mean", 1.0) or scores["mean@1.0"] < best  # ties keep the global pi
        z = ev.choose_z(tr, model, ids, c, protos, "client", 0.1)
        assert scores["client@0.1"] == pytest.approx(ev.vpa_correct(tr, model, ids, z).mean())
        # 'client_prototype': the mean of the prototype most responsible under the same posterior
        _, _, logits = model.components(*tr.context_tensors(ids, torch.as_tensor(np.stack([users.context(u, c) for u in ids])),
                                                            torch.ones(len(ids), c)), torch.ones(len(ids), c),
                                        *ev.prior_tensors(protos)[:2], ev.client_log_pi(tr, model, protos, ids), 0.1)
        np.testing.assert_allclose(ev.choose_z(tr, model, ids, c, protos, "client_prototype", 0.1).numpy(),
                                   protos.mu[logits.argmax(1).numpy()], rtol=1e-6)
    assert choices["fedvpa_gp"]["readout"] == {str(c): list(r) for c, r in readout.items()}
    art = PersonalRewardArtefact(model, protos, None, "mean", None, {}, {2: ("client", 0.1), 8: ("mean", 1.0)})
    assert [art.readout_for(n) for n in (1, 2, 7, 8, 40)] == [("client", 0.1)] * 3 + [("mean", 1.0)] * 2
    with pytest.raises(InvalidInputError):
        _small_cfg(client_scale=0.0)
    assert _small_cfg(client_scale=None).client_scale is None
