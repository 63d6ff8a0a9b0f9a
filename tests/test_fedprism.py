"""FedPrism (trainer.experts): per-component aggregation, PGPD pseudo-labels, the router schedule and
sparse retrieval on real preference pairs with the real MiniLM selector; the Flower strategy."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from sdk.errors import InvalidInputError, ShapeError
from trainer.data.preferences import load_preference_pairs
from trainer.embeddings import embed_texts
from trainer.experts.aggregation import aggregate_components, validate_component_update
from trainer.experts.fedprism import FederatedPairs, FedPrismConfig, FedPrismTrainer, method_config, state_bytes
from trainer.experts.prompt_router import PromptRouter, fit_router, pgpd_pseudo_labels
from trainer.experts.selector import PairSelector, SelectorConfig, build_segment_store

torch.set_num_threads(1)


# ------------------------------------------------------------------ pure pieces


def test_component_aggregation_equals_the_hand_computed_weighted_mean():
    cur = [{"w": np.zeros((2,), np.float32)}, {"w": np.ones((2,), np.float32)}, {"w": np.full((2,), 5.0, np.float32)}]
    updates = [
        {0: ({"w": np.array([1.0, 2.0])}, 1.0), 1: ({"w": np.array([3.0, 3.0])}, 3.0)},
        {0: ({"w": np.array([4.0, 8.0])}, 2.0)},
    ]
    out = aggregate_components(cur, updates)
    np.testing.assert_allclose(out[0]["w"], [(1 * 1 + 2 * 4) / 3, (1 * 2 + 2 * 8) / 3], rtol=1e-6)  # [3, 6]
    np.testing.assert_allclose(out[1]["w"], [3.0, 3.0])  # one client updated it: its value
    np.testing.assert_array_equal(out[2]["w"], cur[2]["w"])  # nobody updated it: unchanged
    np.testing.assert_allclose(out[0]["w"], np.average([[1.0, 2.0], [4.0, 8.0]], axis=0, weights=[1, 2]), rtol=1e-6)
    with pytest.raises(InvalidInputError, match="outside"):
        validate_component_update(cur, {3: ({"w": np.zeros(2)}, 1.0)})
    with pytest.raises(ShapeError):
        validate_component_update(cur, {0: ({"w": np.zeros(3)}, 1.0)})
    # a zero-count update has weight 0 (no 0/0): the expert keeps its parameters; a negative count is refused
    np.testing.assert_array_equal(aggregate_components(cur, [{0: ({"w": np.full(2, 9.0)}, 0.0)}])[0]["w"], cur[0]["w"])
    with pytest.raises(InvalidInputError, match="finite and >= 0"):
        validate_component_update(cur, {0: ({"w": np.zeros(2)}, -1.0)})


def test_pgpd_pseudo_label_is_the_argmin_ce_among_retrieved_experts():
    ce = np.array([[0.7, 0.2, 0.9], [0.1, 0.5, 0.3], [0.4, 0.4, 0.6]])
    np.testing.assert_array_equal(pgpd_pseudo_labels(ce, np.array([0, 2, 4])), [2, 0, 0])  # tie -> first
    with pytest.raises(ShapeError):
        pgpd_pseudo_labels(ce, np.array([0, 1]))
    # the distillation step moves the router towards those labels (KL to one-hot = CE)
    router = PromptRouter(4, 3, hidden=8, seed=0)
    emb = np.eye(4, dtype=np.float32)[:3]
    loss = fit_router(router, emb, np.array([2, 0, 1]), lr=0.05, epochs=200)
    assert loss < 0.05 and router.route(emb).tolist() == [2, 0, 1]


def test_building_a_router_leaves_the_global_torch_rng_alone():
    # PGPD builds a router copy per client; a reseed there used to restart the experts' dropout
    # stream for every later client (the same masks client after client).
    import torch

    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    a = PromptRouter(4, 3, hidden=8, seed=7)
    np.testing.assert_array_equal(torch.rand(5).numpy(), expected.numpy())
    b, c = PromptRouter(4, 3, hidden=8, seed=7), PromptRouter(4, 3, hidden=8, seed=8)
    for name, value in a.state().items():  # the seed alone fixes the weights
        np.testing.assert_array_equal(value, b.state()[name])
    assert not np.array_equal(a.state()["net.0.weight"], c.state()["net.0.weight"])


def test_router_schedule_frozen_in_warmup_then_every_f_rounds():
    cfg = FedPrismConfig(rounds=9, warmup_rounds=3, router_every=2)
    assert [t for t in range(1, 10) if cfg.pgpd_round(t)] == [5, 7, 9]
    assert not any(replace(cfg, pgpd=False).pgpd_round(t) for t in range(1, 10))
    assert [t for t in range(1, 10) if method_config("no_warmup", cfg).pgpd_round(t)] == [2, 4, 6, 8]
    with pytest.raises(InvalidInputError, match="unknown method"):
        method_config("fedavg", cfg)
    with pytest.raises(InvalidInputError, match="warmup_rounds"):
        FedPrismConfig(rounds=2, warmup_rounds=3)


def test_length_start_local_fit_and_fedavg_by_hand():
    from scipy.optimize import brentq

    from trainer.experts.length_init import client_length_coefs, fedavg_length_coefs, upload_bytes

    # one pair f = (1, 0, 0), label 1, and its swapped copy: the L2-penalised (C = 1) no-intercept fit
    # minimises w^2 / 2 + 2 log(1 + exp(-w)) in the first coefficient, i.e. w = 2 sigmoid(-w); 0 elsewhere
    w_hand = brentq(lambda w: w - 2.0 / (1.0 + np.exp(w)), 0.0, 2.0)
    got = client_length_coefs(np.array([[1.0, 0.0, 0.0]]), np.array([1]), np.array([2]), n_experts=3)
    assert set(got) == {2} and got[2][1] == 1.0
    np.testing.assert_allclose(got[2][0], [w_hand, 0.0, 0.0], atol=1e-4)
    # FedAvg per expert weighted by counts; an expert nobody sent stays 0
    sent = [{0: (np.array([1.0, 2.0, 3.0]), 1.0), 1: (np.array([4.0, 0.0, 0.0]), 2.0)},
            {0: (np.array([4.0, -1.0, 0.0]), 2.0)}]
    np.testing.assert_allclose(fedavg_length_coefs(sent, 3), [[3.0, 0.0, 1.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert upload_bytes(sent) == 3 * 16
    with pytest.raises(InvalidInputError, match="outside"):
        fedavg_length_coefs([{3: (np.zeros(3), 1.0)}], 3)
    with pytest.raises(ShapeError):
        client_length_coefs(np.zeros((2, 3)), np.array([0, 1]), np.array([0]), 2)


def test_saved_length_prior_reads_one_domain(tmp_path):
    import json

    from trainer.experts.length_init import saved_length_prior

    assert saved_length_prior(tmp_path, "alpacaeval") is None  # a run without the per-domain prior
    (tmp_path / "length_prior.json").write_text(json.dumps({"domains": ["alpacaeval", "hh_harmless"],
                                                            "coefs": [[1.0, 2.0, 3.0], [-1.0, 0.5, 0.0]]}))
    np.testing.assert_array_equal(saved_length_prior(tmp_path, "hh_harmless"), np.float32([-1.0, 0.5, 0.0]))
    with pytest.raises(InvalidInputError, match="routerbench"):
        saved_length_prior(tmp_path, "routerbench")


# ------------------------------------------------------------------ the loop on real pairs


@pytest.fixture(scope="module")
def small(shared_data: Path, tmp_path_factory):
    df = load_preference_pairs(shared_data).groupby("domain").sample(20, random_state=3).reset_index(drop=True)
    model = PairSelector(SelectorConfig(), seed=0)
    store = build_segment_store(model, list(df.prompt), list(df.response_a), list(df.response_b), list(df.label))
    cache = tmp_path_factory.mktemp("emb")
    emb = embed_texts(list(df.prompt), cache_dir=cache, show_progress=False)
    order = np.random.default_rng(0).permutation(len(df))
    clients = [np.sort(order[i::3][:14]) for i in range(3)]
    data = FederatedPairs(store, emb, df.domain.to_numpy().astype(str), clients, emb[order[:12]], order[:18],
                          df[["domain", "source_a", "source_b"]])
    return model, data


def test_sparse_retrieval_asks_only_for_the_routed_experts(small):
    model, data = small
    cfg = FedPrismConfig(n_experts=3, rounds=1, warmup_rounds=0, router_every=1, clients_per_round=2,
                         local_pairs=8, batch_size=8, init_epochs=2, pgpd=False)
    trainer = FedPrismTrainer(model, data, cfg).setup()
    with torch.no_grad():  # a router that sends every prompt to expert 1
        trainer.router_.net[2].bias.copy_(torch.tensor([0.0, 100.0, 0.0]))
    before = [dict(e) for e in trainer.experts_]
    entry = trainer.run_round(1)
    assert [r for _, r in trainer.retrievals_] == [[1], [1]]
    assert all(v == [1] for v in entry["retrieved"].values())
    assert entry["downlink_bytes"] == 2 * (state_bytes(trainer.router_.state()) + state_bytes(before[1]))
    for k in (0, 2):
        for n in before[k]:
            np.testing.assert_array_equal(trainer.experts_[k][n], before[k][n])
    assert any(np.abs(trainer.experts_[1][n] - before[1][n]).max() > 0 for n in before[1])


def test_initialised_experts_reproduce_the_fedavged_length_regressions(small):
    from sklearn.linear_model import LogisticRegression

    model, data = small
    cfg = FedPrismConfig(n_experts=2, rounds=1, warmup_rounds=0, init_epochs=5, length_init="fedavg_lr")
    trainer = FedPrismTrainer(model, data, cfg).setup()
    feats, labels = data.store.features.numpy().astype(np.float64), data.store.label.numpy()
    num, den = np.zeros((2, 3)), np.zeros(2)
    for own in data.clients:  # by hand: each client's fit per routed expert on pairs + swapped copies
        assign = trainer.router_.route(data.prompt_emb[own])
        for k in np.unique(assign):
            x, y = feats[own][assign == k], labels[own][assign == k]
            lr = LogisticRegression(C=1.0, fit_intercept=False).fit(np.concatenate([x, -x]),
                                                                    np.concatenate([y, 1 - y]).astype(int))
            num[k] += len(x) * lr.coef_[0]
            den[k] += len(x)
    w = num / np.maximum(den, 1)[:, None]
    np.testing.assert_allclose(trainer.length_coefs_, w, rtol=1e-6, atol=1e-8)
    assert trainer.length_init_upload_bytes_ == 16 * sum(len(np.unique(trainer.router_.route(data.prompt_emb[c])))
                                                         for c in data.clients)
    pairs = data.eval_pairs
    for k in range(2):  # the initialised expert predicts exactly sigmoid(w_k . f)
        p = trainer._per_sample(trainer.experts_[k], pairs, "proba", k)
        np.testing.assert_allclose(p, 1 / (1 + np.exp(-feats[pairs] @ w[k])), atol=1e-5)
    zero = FedPrismTrainer(model, data, replace(cfg, length_init="zero")).setup()
    assert zero.length_coefs_ is None and not np.any(zero.experts_[0]["length_skip.weight"])
    with pytest.raises(InvalidInputError, match="length_init"):
        FedPrismConfig(length_init="global")


def test_pooled_start_is_the_exact_federated_fit_per_routed_expert(small):
    from trainer.experts.length_init import pooled_expert_coefs

    model, data = small
    cfg = FedPrismConfig(n_experts=2, rounds=1, warmup_rounds=0, init_epochs=5, length_init="pooled", length_C=5.0,
                         length_pool_C=2.0, router_init_rounds=1)
    trainer = FedPrismTrainer(model, data, cfg).setup()
    feats, labels = data.store.features.numpy().astype(np.float64), data.store.label.numpy().astype(np.float64)
    assign = trainer.router_.route(data.prompt_emb)  # the router after its centroid distillation
    w, n_eval = pooled_expert_coefs(feats, labels, assign, data.clients, 2, C=5.0, pool_C=2.0)
    np.testing.assert_allclose(trainer.length_coefs_, w, rtol=1e-5, atol=1e-6)
    assert trainer.length_init_upload_bytes_ == 4 * 4 * n_eval * len(data.clients)
    pairs = data.eval_pairs
    for k in range(2):  # the initialised expert predicts exactly sigmoid(v_k . f)
        p = trainer._per_sample(trainer.experts_[k], pairs, "proba", k)
        np.testing.assert_allclose(p, 1 / (1 + np.exp(-feats[pairs] @ w[k])), atol=1e-5)
    bis = FedPrismTrainer(model, data, method_config("fedbis", cfg)).setup()  # FedBis: the global fit
    glob, _ = pooled_expert_coefs(feats, labels, np.zeros(len(labels), np.int64), data.clients, 1, C=5.0, pool_C=None)
    np.testing.assert_allclose(bis.length_coefs_, glob, rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidInputError, match="length_pool_C"):
        FedPrismConfig(length_pool_C=0.0)


def test_generator_prior_is_a_cross_fitted_feature_of_the_exact_start(small, tmp_path):
    from collections import Counter

    from trainer.experts.length_init import pooled_expert_coefs
    from trainer.generator_prior import client_win_counts, fit_bradley_terry, generator_logit

    model, data = small
    cfg = FedPrismConfig(n_experts=2, rounds=1, warmup_rounds=1, clients_per_round=3, local_pairs=8, batch_size=4,
                         init_epochs=5, length_init="pooled", length_C=5.0, length_pool_C=2.0, length_lr_scale=0.0,
                         generator_prior=True)
    trainer = FedPrismTrainer(model, data, cfg).setup()
    feats, labels = data.store.features.numpy().astype(np.float64), data.store.label.numpy().astype(np.float64)
    frame = data.generators.assign(label=labels.astype(int))
    # by hand: the server sums the clients' counts; a client's pairs get the strengths of the others' counts
    ups = [client_win_counts(frame.iloc[c]) for c in data.clients]
    total = sum(ups, Counter())
    assert trainer.generator_strengths_ == pytest.approx(fit_bradley_terry(total))
    assert trainer.generator_upload_bytes_ == 12 * sum(len(u) for u in ups)
    g = generator_logit(frame, fit_bradley_terry(total))
    for c, u in zip(data.clients, ups):
        g[c] = generator_logit(frame.iloc[c], fit_bradley_terry(total - u))
    assert np.all(g[data.domain == "hh_harmless"] == 0) and np.abs(g).max() > 0.1
    w, _ = pooled_expert_coefs(np.c_[feats, g], labels, trainer.router_.route(data.prompt_emb), data.clients, 2,
                               C=5.0, pool_C=2.0)
    np.testing.assert_allclose(trainer.length_coefs_, w[:, :-1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trainer.generator_weights_, w[:, -1], rtol=1e-5, atol=1e-6)
    assert np.all(trainer.generator_weights_ > 0)  # the stronger generator's answer is preferred
    pairs = data.eval_pairs
    for k in range(2):  # the initialised expert predicts exactly sigmoid(v_k . f + gamma_k g)
        p = trainer._per_sample(trainer.experts_[k], pairs, "proba", k)
        np.testing.assert_allclose(p, 1 / (1 + np.exp(-(np.c_[feats, g][pairs] @ w[k]))), atol=1e-5)
    trainer.run_round(1)
    trainer.save(tmp_path)
    saved = json.loads((tmp_path / "generator_prior.json").read_text())
    assert saved["weights"] == pytest.approx(w[:, -1].tolist(), rel=1e-5) and saved["strengths"] == trainer.generator_strengths_
    assert method_config("fedprism_generator_prior", replace(cfg, generator_prior=False)).generator_prior
    with pytest.raises(InvalidInputError, match="length_init='pooled'"):
        FedPrismConfig(generator_prior=True)
    with pytest.raises(InvalidInputError, match="generators"):
        FedPrismTrainer(model, replace(data, generators=None), cfg)


def test_router_role_tags_are_appended_to_the_router_input(small):
    from sdk.routed_selector import role_counts

    model, data = small
    np.testing.assert_allclose(role_counts(["\n\nHuman: hi\n\nAssistant: hello\n\nHuman: bye", "Write a poem."]),
                               [[np.log(3), np.log(2), 0, 0, 0, 0], [0] * 6], rtol=1e-6)
    roles = np.zeros((len(data.domain), 6), np.float32)
    roles[data.domain == "hh_harmless", 0] = 3.0  # an HH-like count on the HH prompts only
    cfg = FedPrismConfig(n_experts=2, rounds=1, warmup_rounds=1, init_epochs=5, router_role_scale=0.5)
    trainer = FedPrismTrainer(model, replace(data, prompt_roles=roles, public_roles=roles[:12]), cfg).setup()
    x = np.c_[data.prompt_emb, 0.5 * roles]
    assert trainer.router_.net[0].in_features == 390
    np.testing.assert_array_equal(trainer._route(np.arange(len(x))), trainer.router_.route(x))
    with pytest.raises(InvalidInputError, match="prompt_roles"):
        FedPrismTrainer(model, data, cfg)
    with pytest.raises(InvalidInputError, match="router_role_scale"):
        FedPrismConfig(router_role_scale=-1.0)


def test_router_changes_only_in_pgpd_rounds_and_experts_learn(small):
    model, data = small
    cfg = FedPrismConfig(n_experts=2, rounds=4, warmup_rounds=1, router_every=2, clients_per_round=2,
                         local_pairs=8, batch_size=8, init_epochs=5, router_epochs=3, router_lr=0.05, eval_every=4)
    trainer = FedPrismTrainer(model, data, cfg).setup()
    changed = []
    for t in range(1, 5):
        r0 = trainer.router_.state()
        entry = trainer.run_round(t)
        r1 = trainer.router_.state()
        changed.append(any(np.abs(r1[k] - r0[k]).max() > 0 for k in r0))
        assert entry["router_updated"] == changed[-1]
    assert changed == [False, False, True, False]
    assert set(trainer.history_[-1]["accuracy"]) >= {"overall", "alpacaeval", "hh_harmless", "routerbench"}
    assert abs(sum(trainer.history_[-1]["utilisation"]) - 1.0) < 1e-9


def test_residual_head_keeps_the_length_prior_and_trains_the_rest(small):
    model, data = small
    # batches of 2: the first step moves only the zero-initialised output layer w2 (LoRA's gradient flows
    # through it), the later ones move LoRA too
    cfg = FedPrismConfig(n_experts=2, rounds=1, warmup_rounds=1, clients_per_round=2, local_pairs=8, batch_size=2,
                         init_epochs=5, length_lr_scale=0.0)
    trainer = FedPrismTrainer(model, data, cfg).setup()
    before = [dict(e) for e in trainer.experts_]
    entry = trainer.run_round(1)
    updated = sorted({k for ks in entry["retrieved"].values() for k in ks})
    assert updated
    for k in updated:  # the length path is the federated prior, untouched; LoRA and the content head moved
        np.testing.assert_array_equal(trainer.experts_[k]["length_skip.weight"], before[k]["length_skip.weight"])
        np.testing.assert_array_equal(trainer.experts_[k]["length_skip.weight"][0], trainer.length_coefs_[k].astype(np.float32))
        assert np.abs(trainer.experts_[k]["head.2.weight"]).max() > 0 and not np.any(before[k]["head.2.weight"])
    assert any(np.abs(trainer.experts_[k][n] - before[k][n]).max() > 0 for k in updated for n in before[k] if "lora_B" in n)
    with pytest.raises(InvalidInputError, match="length_lr_scale"):
        FedPrismConfig(length_lr_scale=-1.0)


def test_domain_prior_is_the_fedavged_per_domain_regression_plus_a_residual(small):
    from sklearn.linear_model import LogisticRegression

    model, data = small
    cfg = FedPrismConfig(n_experts=2, rounds=1, warmup_rounds=1, clients_per_round=2, local_pairs=8, batch_size=2,
                         init_epochs=5, length_lr_scale=0.0, expert_lr=1e-2, length_prior="domain")
    trainer = FedPrismTrainer(model, data, cfg).setup()
    feats, labels = data.store.features.numpy().astype(np.float64), data.store.label.numpy()
    doms = sorted(set(data.domain))
    num, den = np.zeros((3, 3)), np.zeros(3)
    for own in data.clients:  # by hand: each client's fit per domain on pairs + swapped copies, count-weighted mean
        for j, dname in enumerate(doms):
            sel = own[data.domain[own] == dname]
            if len(sel) == 0:
                continue
            x, y = feats[sel], labels[sel]
            lr = LogisticRegression(C=1.0, fit_intercept=False).fit(np.concatenate([x, -x]),
                                                                    np.concatenate([y, 1 - y]).astype(int))
            num[j] += len(x) * lr.coef_[0]
            den[j] += len(x)
    w = num / den[:, None]
    np.testing.assert_allclose(trainer.domain_length_coefs_, w, rtol=1e-6, atol=1e-8)
    pairs = data.eval_pairs
    prior = 1 / (1 + np.exp(-(feats[pairs] * w[np.searchsorted(doms, data.domain[pairs])]).sum(1)))
    for k in range(2):  # before training every expert is exactly the per-domain length-only regression
        assert not np.any(trainer.experts_[k]["length_skip.weight"])
        np.testing.assert_allclose(trainer._per_sample(trainer.experts_[k], pairs, "proba", k), prior, atol=1e-5)
    trainer.run_round(1)
    moved = [k for k in range(2) if np.abs(trainer.experts_[k]["head.2.weight"]).max() > 0]
    assert moved and all(not np.any(trainer.experts_[k]["length_skip.weight"]) for k in range(2))
    p1 = trainer._per_sample(trainer.experts_[moved[0]], pairs, "proba", moved[0])
    assert np.abs(p1 - prior).max() > 1e-4  # the residual changed the prediction
    trainer.args = replace(cfg, residual_scale=0.0)  # a zero residual scale serves the prior alone
    np.testing.assert_allclose(trainer._per_sample(trainer.served_experts[moved[0]], pairs, "proba", moved[0]), prior, atol=1e-5)
    with pytest.raises(InvalidInputError, match="length_prior"):
        FedPrismConfig(length_prior="subset")
    with pytest.raises(InvalidInputError, match="length_init"):
        FedPrismConfig(length_prior="domain", length_init="zero")
    with pytest.raises(InvalidInputError, match="residual_scale"):
        FedPrismConfig(residual_scale=-0.5)


def test_client_validation_split_and_per_expert_early_stopping(small):
    model, data = small
    cfg = FedPrismConfig(n_experts=2, rounds=1, warmup_rounds=1, clients_per_round=3, local_pairs=8, batch_size=8,
                         init_epochs=5, client_val_fraction=0.3)
    trainer = FedPrismTrainer(model, data, cfg).setup()
    for own, tr, va in zip(data.clients, trainer._train_parts, trainer._val_parts):  # 14 pairs -> 4 kept out
        assert len(va) == 4 and not set(tr) & set(va) and sorted(set(tr) | set(va)) == sorted(own)
    init = list(trainer.experts_)
    assert all(a is b for a, b in zip(trainer.served_experts, init)) and trainer.val_upload_bytes_ > 0
    # every client sends (loss sum, count) per expert its validation pairs route to: 8 bytes each
    assert trainer.val_upload_bytes_ == 8 * sum(len(ks) for ks in trainer._val_experts)
    # a state whose output bias is +50 puts a BCE of ~25 on every pair (one of each pair's two copies has
    # label 0): it is rejected; offered against that state as the best copy, the prior is accepted; a
    # sharper prior (v * 1.5) is kept exactly when its mean CE on the validation pairs is lower
    for k in range(2):
        if not (trainer._val_assign == k).any():
            continue
        bad = dict(init[k], **{"head.2.bias": np.full_like(init[k]["head.2.bias"], 50.0)})
        assert trainer._val_ce(bad, k).mean() > 20.0
        trainer.experts_[k] = bad
        trainer._select_on_client_val({k}, rerouted=False)
        assert trainer.served_experts[k] is init[k] and trainer.best_round_[k] == 0
        trainer.best_experts_[k], trainer._best_ce[k] = bad, trainer._val_ce(bad, k)
        trainer.experts_[k], trainer._round = init[k], 3
        trainer._select_on_client_val({k}, rerouted=False)
        assert trainer.served_experts[k] is init[k] and trainer.best_round_[k] == 3
        sharper = dict(init[k], **{"length_skip.weight": 1.5 * init[k]["length_skip.weight"]})
        better = trainer._val_ce(sharper, k).mean() < trainer._val_ce(init[k], k).mean()
        trainer.experts_[k] = sharper
        trainer._select_on_client_val({k}, rerouted=False)
        assert trainer.served_experts[k] is (sharper if better else init[k])
    # a round trains only on the clients' train parts (a spy that calls the real local training)
    seen, train_expert = [], trainer._train_expert
    trainer._train_expert = lambda state, pairs, k: seen.append(pairs) or train_expert(state, pairs, k)
    trainer.run_round(1)
    assert seen and not set(np.concatenate(seen)) & set(np.concatenate(trainer._val_parts))
    with pytest.raises(InvalidInputError, match="client_val_fraction"):
        FedPrismConfig(client_val_fraction=0.5)


# ------------------------------------------------------------------ Flower


def _local_step(experts, router, pgpd, pid):
    """Deterministic node work: expert k -> params + (pid + 1) * (k + 1); n = 2 + pid samples; node 0
    routes to expert 0 only, node 1 to experts 1 and 2; a PGPD round returns router + pid."""
    updates = {k: ({n: v + (pid + 1) * (k + 1) for n, v in p.items()}, float(2 + pid)) for k, p in experts.items()
               if (pid == 0 and k == 0) or (pid == 1 and k in (1, 2))}
    new_router = {n: v + pid for n, v in router.items()} if pgpd else None
    return updates, new_router, float(2 + pid), ([0] if pid == 0 else [1, 2])


def test_flower_simulation_aggregates_per_component_with_sparse_retrieval(monkeypatch):
    pytest.importorskip("ray")
    from flwr.simulation import run_simulation

    from trainer.experts.flower_strategy import FedPrismStrategy, make_client_app, make_server_app

    for name in ("flwr.supercore.telemetry", "flwr.common.telemetry"):
        if hasattr(sys.modules.get(name), "FLWR_TELEMETRY_ENABLED"):
            monkeypatch.setattr(sys.modules[name], "FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    experts = [{"w": np.full((2,), float(k), np.float32)} for k in range(3)]
    router = {"b": np.zeros((3,), np.float32)}
    # min_count=2: the nodes train each expert on 2 and 3 samples (the default, 5, would drop them all).
    strategy = FedPrismStrategy(experts, router, pgpd_rounds={2}, min_nodes=2, rng=np.random.default_rng(0),
                                min_count=2)
    # Ray on one CPU: one actor (a Python process importing the client app) runs the nodes in turn
    run_simulation(make_server_app(strategy, num_rounds=2, timeout=900.0), make_client_app(_local_step),
                   num_supernodes=2, backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                                     "init_args": {"num_cpus": 1, "include_dashboard": False}})
    sent = {(r, tuple(e)) for r, _, e in strategy.sent_}
    assert {e for r, e in sent if r == 1} == {(0, 1, 2)}  # round 1: nobody asked yet -> all
    assert {e for r, e in sent if r == 2} == {(0,), (1, 2)}  # round 2: only what each node routes to
    # each round: expert 0 <- node 0 only (+1), experts 1, 2 <- node 1 only (+2(k+1)); two rounds
    np.testing.assert_allclose(strategy.experts_[0]["w"], [0 + 2 * 1] * 2)
    np.testing.assert_allclose(strategy.experts_[1]["w"], [1 + 2 * 4] * 2)
    np.testing.assert_allclose(strategy.experts_[2]["w"], [2 + 2 * 6] * 2)
    # PGPD in round 2 only: router = (2 * (0 + 0) + 3 * (0 + 1)) / 5
    np.testing.assert_allclose(strategy.router_["b"], [3 / 5] * 3, rtol=1e-6)



def test_a_rerun_into_the_same_out_replaces_the_saved_experts_whole(tmp_path: Path):
    """`prism train --out DIR` again with fewer experts kept the earlier run's expert_5/ in fedprism_seed0/
    (written in place), and a run killed after saving seed 0 left new experts beside the old results.json.
    The seed-0 folders are staged in .<m>_seed0.partial/ and swapped in after the results. Short synthetic
    pairs and random unit prompt embeddings keep it fast (the layout, not the accuracy, is under test)."""
    import pandas as pd

    from trainer.data.preferences import DOMAINS
    from sdk.pair_encoding import PairEncodingConfig
    from trainer.experts.experiment import DataPreset, PreparedData, run_experiment

    out = tmp_path / "run"
    (out / "fedprism_seed0" / "expert_5").mkdir(parents=True)  # an earlier M = 6 run
    (out / ".fedprism_seed0.partial" / "expert_3").mkdir(parents=True)  # left by a killed run
    n = 48  # two pairs per prompt; 36 train, 12 test
    dom = [DOMAINS[(i // 2) % 3] for i in range(n)]
    pairs = pd.DataFrame({"pair_id": [f"q{i}" for i in range(n)], "prompt_id": [f"p{i // 2}" for i in range(n)],
                          "domain": dom, "subset": dom, "prompt": [f"question {i // 2}" for i in range(n)],
                          "response_a": ["yes " * (1 + i % 5) for i in range(n)], "response_b": ["no"] * n,
                          "label": [i % 2 for i in range(n)], "source_a": "a", "source_b": "b"})
    model = PairSelector(SelectorConfig(encoding=PairEncodingConfig(prompt_tokens=4, response_tokens=6)), seed=0)
    store = build_segment_store(model, list(pairs.prompt), list(pairs.response_a), list(pairs.response_b),
                                list(pairs.label))
    emb = np.random.default_rng(0).normal(size=(n + 6, 384)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    train, test = pairs.iloc[:36].reset_index(drop=True), pairs.iloc[36:].reset_index(drop=True)
    splits = {"train": sorted(train.prompt_id.unique()), "public": [], "val": [], "test": sorted(test.prompt_id.unique())}
    prep = PreparedData(train, pairs.iloc[:0], test, [f"public {i}" for i in range(6)], splits, store, emb[:n], emb[n:])
    preset = DataPreset(n_train=36, n_val=0, n_test=12, n_public=6, n_clients=3)
    base = FedPrismConfig(n_experts=2, rounds=1, warmup_rounds=0, router_every=1, clients_per_round=2,
                          local_pairs=4, batch_size=4, init_epochs=1, router_epochs=1, eval_every=1)
    run_experiment(prep, model, preset, base, [0], out, methods=("fedprism",), progress=False)
    assert sorted(p.name for p in (out / "fedprism_seed0").glob("expert_*")) == ["expert_0", "expert_1"]
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
    assert (out / "fedprism_seed0" / "router.safetensors").is_file()
    assert json.loads((out / "results.json").read_text())["command"] == "prism train"  # trainer.results_owner


def test_the_gpu_preset_trains_on_the_cpu_with_a_tiny_causal_lm(shared_data: Path, tmp_path):
    """The paper-scale preset (`prism train --preset gpu`: a causal LM, LoRA on every layer's q/v, last-token
    pooling, no cached lower layers, 128 + 256 tokens, the selector on `device`) has not run on CUDA here: this
    runs its code path on the CPU with a 2-layer Llama from a config, shrunk to three rounds. The warm-up round
    leaves the router alone, the next two update it (PGPD every round after the warm-up), and the experts'
    LoRA weights move."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_selector import tiny_backbone

    from trainer.experts.selector import selector_for_backbone

    llama = str(tiny_backbone(tmp_path / "llama", "llama"))
    gpu = FedPrismConfig.gpu_preset(llama)
    cfg = replace(gpu, device="cpu", rounds=3, warmup_rounds=1, router_every=1, n_experts=2, clients_per_round=2,
                  local_pairs=4, batch_size=4, eval_every=3, selector=selector_for_backbone(gpu.selector, llama))
    assert (cfg.selector.lora_layers, cfg.selector.pooling, cfg.selector.cache_lower_layers) == (None, "last", False)
    df = load_preference_pairs(shared_data).groupby("domain").sample(6, random_state=5).reset_index(drop=True)
    model = PairSelector(cfg.selector, seed=0)
    store = build_segment_store(model, list(df.prompt), list(df.response_a), list(df.response_b), list(df.label))
    assert store.lower is None and store.input_ids.shape[1] == 128 + 256 + 2
    emb = embed_texts(list(df.prompt), cache_dir=tmp_path / "emb", show_progress=False)
    order = np.random.default_rng(0).permutation(len(df))
    clients = [np.sort(order[i::3][:5]) for i in range(3)]
    trainer = FedPrismTrainer(model, FederatedPairs(store, emb, df.domain.to_numpy().astype(str), clients,
                                                    emb[order[:6]], order[:9]), cfg).setup()
    before = [dict(e) for e in trainer.experts_]
    updated = [trainer.run_round(t)["router_updated"] for t in (1, 2, 3)]
    assert updated == [False, True, True]
    lora = [n for n in before[0] if "lora_B" in n]
    assert len(lora) == 2 * 2  # q_proj and v_proj of both layers
    assert any(np.abs(trainer.experts_[k][n] - before[k][n]).max() > 0 for k in range(2) for n in lora)
