"""MoR (trainer.rewards): Bradley-Terry loss, z-normalisation, BCE towards the own client, FedAvg of
routers, sparse routing, the membership attack, save/load, and the router's FedAvg on Flower."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from sdk.errors import InvalidInputError, ShapeError
from trainer.rewards.client_router import (
    ClientRouter,
    ClientRouterData,
    FederatedRouterTrainer,
    RouterConfig,
    aggregate_routers,
    initial_router,
    local_router_update,
    own_client_targets,
    router_bce_loss,
    stack_routers,
)
from trainer.rewards.mixture import RoutedReward, load_mixture, save_mixture, softmax
from trainer.rewards.pair_features import PairEncoder
from trainer.rewards.privacy import auc_standard_error, communication_per_round, membership_attack
from trainer.rewards.reward_models import (
    LoRARewardModel,
    MLPRewardModel,
    PreferencePairs,
    RewardModelConfig,
    RewardModelTrainer,
    ScoreNormaliser,
    bradley_terry_loss,
    fit_length_prior,
    pairwise_accuracy,
)

torch.set_num_threads(1)


# ------------------------------------------------------------------ hand-made clients (real texts)


def _pairs(prompts, chosen, rejected):
    return PreferencePairs(tuple(prompts), tuple(chosen), tuple(rejected), tuple(range(len(prompts))))


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return PairEncoder(cache_dir=tmp_path_factory.mktemp("mor-cache"))


@pytest.fixture(scope="module")
def clients():
    """Two clients with different criteria: detailed cooking answers beat curt ones; polite travel
    answers beat rude ones."""
    cook = _pairs([f"How do I cook dish number {i}?" for i in range(30)],
                  [f"Boil water, add ingredient {i}, stir for ten minutes, season and serve warm." for i in range(30)],
                  ["Cook it." for _ in range(30)])
    travel = _pairs([f"Which city should I visit in country {i}?" for i in range(30)],
                    [f"Thank you for asking! I would gladly suggest the capital of country {i}." for i in range(30)],
                    [f"Whatever, go anywhere in {i}, idiot." for i in range(30)])
    return cook, travel


# ------------------------------------------------------------------ Bradley-Terry and normalisation


def test_bradley_terry_loss_on_hand_computed_pairs():
    # -log sigmoid(2 - 1) = log(1 + e^-1) = 0.313262; -log sigmoid(0 - 1) = log(1 + e) = 1.313262
    loss = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert float(loss) == pytest.approx((math.log1p(math.exp(-1)) + math.log1p(math.e)) / 2, abs=1e-6)
    assert float(loss) == pytest.approx(0.813262, abs=1e-6)


def test_pairwise_accuracy_counts_ties_as_half():
    assert pairwise_accuracy(np.array([1.0, 2.0, 3.0, 0.0]), np.array([0.0, 2.0, 4.0, -1.0])) == pytest.approx(2.5 / 4)


def test_z_normalisation_and_clipping_by_hand():
    norm = ScoreNormaliser.fit(np.array([1.0, 2.0, 3.0, 4.0]), eps=0.0)
    assert (norm.mean, norm.std) == (2.5, pytest.approx(math.sqrt(1.25)))
    np.testing.assert_allclose(norm(np.array([2.5, 4.0])), [0.0, 1.5 / math.sqrt(1.25)], rtol=1e-6)
    clipped = ScoreNormaliser(2.5, math.sqrt(1.25), 0.0, clip=1.0)
    np.testing.assert_allclose(clipped(np.array([1.0, 2.5, 10.0])), [-1.0, 0.0, 1.0])
    np.testing.assert_allclose(clipped(np.array([-5.0, 0.3]), normalise=False), [-1.0, 0.3], rtol=1e-6)
    with pytest.raises(InvalidInputError, match="clip"):
        ScoreNormaliser(0.0, 1.0, clip=0.0)


def test_mlp_reward_model_learns_and_normalises_with_its_own_training_scores(clients, encoder):
    cook, _ = clients
    rm = RewardModelTrainer(RewardModelConfig(arch="mlp", epochs=25, early_stopping=False, seed=0), encoder).train(cook)
    assert pairwise_accuracy(rm.score(cook.prompts, cook.chosen), rm.score(cook.prompts, cook.rejected)) == 1.0
    z = rm.score(list(cook.prompts) * 2, list(cook.chosen) + list(cook.rejected))
    assert abs(z.mean()) < 1e-4 and z.std() == pytest.approx(1.0, abs=1e-4)
    raw = rm.raw_scores(cook.prompts, cook.chosen)
    np.testing.assert_allclose(rm.score(cook.prompts, cook.chosen, normalise=False), raw)


def test_length_prior_is_the_local_bradley_terry_length_fit_and_the_initialised_model_equals_it(encoder, tmp_path):
    from sdk.pair_encoding import length_features_many
    from trainer.rewards.pair_features import LENGTH_SCALE, response_lengths

    # hand-made pairs: longer usually wins, once the shorter one does (so the MLE is finite)
    chosen = ["one two three four", "a b c d e f g h", "short", "x y z w v u"]
    rejected = ["one two", "a b c", "a much longer answer here", "x y"]
    lc, lr = response_lengths(chosen), response_lengths(rejected)
    w = fit_length_prior(lc, lr, C=1.0)
    # stationarity of sklearn's objective 0.5 |v|^2 + C sum_rows logloss on rows [d; -d], labels [1; 0]
    # (v = w / LENGTH_SCALE on the unscaled differences d): v = 2 C sum_i d_i sigmoid(-v . d_i)
    d = length_features_many(chosen, rejected).astype(np.float64)
    np.testing.assert_allclose(d, (lc - lr) * LENGTH_SCALE, atol=1e-5)
    v = w / LENGTH_SCALE
    np.testing.assert_allclose(v, 2.0 * (d / (1.0 + np.exp(d @ v))[:, None]).sum(0), atol=1e-4)
    assert v[1] > 0  # more words win on this data
    # the initialised reward model ranks pairs exactly as the length-only fit: P = sigmoid(v . d)
    prompts = [f"question {i}" for i in range(4)]
    rm = MLPRewardModel(encoder, 2 * 384 + 3, hidden=8, dropout=0.0, length_term=True)
    rm.init_length_prior(w)
    margin = rm.raw_scores(prompts, chosen) - rm.raw_scores(prompts, rejected)
    np.testing.assert_allclose(1.0 / (1.0 + np.exp(-margin)), 1.0 / (1.0 + np.exp(-(d @ v))), atol=1e-5)
    assert pairwise_accuracy(rm.raw_scores(prompts, chosen), rm.raw_scores(prompts, rejected)) == 0.75
    # the length term survives save / load
    rm.fit_normaliser(_pairs(prompts, chosen, rejected))
    rm.save(tmp_path / "rm")
    from trainer.rewards.reward_models import load_reward_model

    back = load_reward_model(tmp_path / "rm", encoder.cache_dir)
    np.testing.assert_allclose(back.raw_scores(prompts, chosen), rm.raw_scores(prompts, chosen), atol=1e-6)
    with pytest.raises(InvalidInputError, match="length_features"):
        MLPRewardModel(PairEncoder(length_features=False), 768, length_term=True)
    with pytest.raises(InvalidInputError, match="DP-SGD"):
        RewardModelConfig(length_prior=True, dp_noise_multiplier=1.0)


def test_length_prior_trainer_starts_from_its_own_fit_and_learns_the_residual(clients, encoder):
    from trainer.rewards.pair_features import response_lengths

    cook, travel = clients
    both = _pairs(cook.prompts + travel.prompts, cook.chosen + travel.chosen, cook.rejected + travel.rejected)
    trainer = RewardModelTrainer(RewardModelConfig(arch="mlp", epochs=25, early_stopping=False, length_prior=True, seed=0), encoder)
    rm = trainer.train(both)
    np.testing.assert_allclose(trainer.length_weight_, fit_length_prior(response_lengths(both.chosen), response_lengths(both.rejected)))
    # on travel the polite answer is the longer one; on cook too: length alone already separates both,
    # and the trained residual keeps every pair right
    assert pairwise_accuracy(rm.score(both.prompts, both.chosen), rm.score(both.prompts, both.rejected)) == 1.0


def test_lora_reward_model_trains_adapters_and_leaves_the_base_frozen(clients, tmp_path):
    _, travel = clients
    trainer = RewardModelTrainer(RewardModelConfig(arch="lora", epochs=2, batch_size=8, lr=2e-3, max_tokens=48,
                                                   early_stopping=False))
    reference = LoRARewardModel(max_tokens=48)
    base_before = {k: v.clone() for k, v in reference.module.encoder.named_parameters() if "lora" not in k}
    rm = trainer.train(travel)
    after = dict(rm.module.encoder.named_parameters())
    for k, v in base_before.items():
        assert torch.equal(after[k], v), k  # the pretrained encoder is untouched
    lora_b = [v for k, v in after.items() if "lora_B" in k]
    assert lora_b and all(v.requires_grad for v in lora_b) and max(float(v.detach().abs().max()) for v in lora_b) > 0
    assert trainer.history_[-1]["train_loss"] < trainer.history_[0]["train_loss"]
    acc = pairwise_accuracy(rm.score(travel.prompts, travel.chosen), rm.score(travel.prompts, travel.rejected))
    assert acc >= 0.9
    rm.save(tmp_path / "lora")
    from trainer.rewards.reward_models import load_reward_model

    again = load_reward_model(tmp_path / "lora")
    np.testing.assert_allclose(again.score(travel.prompts[:4], travel.chosen[:4]),
                               rm.score(travel.prompts[:4], travel.chosen[:4]), rtol=1e-5, atol=1e-5)


def test_lora_length_prior_starts_at_the_length_fit_and_survives_save_load(tmp_path):
    from trainer.rewards.pair_features import response_lengths
    from trainer.rewards.reward_models import load_reward_model

    prompts = ["q one", "q two", "q three"]
    chosen, rejected = ["a b c d e", "short", "x y z"], ["a", "a longer answer than that", "x"]
    w = np.array([0.5, 2.0, -1.0])
    rm = LoRARewardModel(max_tokens=32, length_term=True)
    rm.init_length_prior(w)
    margin = rm.raw_scores(prompts, chosen) - rm.raw_scores(prompts, rejected)
    np.testing.assert_allclose(margin, (response_lengths(chosen) - response_lengths(rejected)) @ w, atol=1e-5)
    rm.fit_normaliser(_pairs(prompts, chosen, rejected))
    rm.save(tmp_path / "lora_len")
    back = load_reward_model(tmp_path / "lora_len")
    np.testing.assert_allclose(back.raw_scores(prompts, chosen), rm.raw_scores(prompts, chosen), atol=1e-5)


@pytest.fixture(scope="module")
def saved_lora(tmp_path_factory):
    """A LoRA reward model whose adapter matters (lora_B moved off its zero start), saved; its adapter's tensors."""
    from safetensors.torch import load_file

    rm = LoRARewardModel(max_tokens=32)
    with torch.no_grad():
        for name, p in rm.module.encoder.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p, generator=torch.Generator().manual_seed(0)))
    rm.fit_normaliser(_pairs(["q one", "q two"], ["a b c", "yes"], ["a", "no, not at all"]))
    folder = tmp_path_factory.mktemp("lora_rm") / "rm"
    rm.save(folder)
    return rm, folder, load_file(str(folder / "adapter" / "adapter_model.safetensors"))


def _foreign(tensors: dict, case: str) -> dict:
    out = dict(tensors)
    first_b = next(k for k in out if "lora_B" in k)
    if case == "a LoRA tensor missing":
        out.pop(first_b)
    elif case == "no tensor":
        out = {}
    elif case == "an extra tensor":
        out[first_b.replace(".query.", ".key.")] = torch.zeros_like(out[first_b])
    elif case == "another backbone (12 layers)":  # layers 6-11 MiniLM-L6 does not have
        out.update({k.replace("layer.0.", f"layer.{i}."): v.clone() for k, v in tensors.items() if "layer.0." in k
                    for i in range(6, 12)})
    elif case == "another width":  # a 768-wide backbone's adapter
        out[first_b] = torch.zeros(768, out[first_b].shape[1])
    return out


@pytest.mark.parametrize("case, message", [
    ("a LoRA tensor missing", r"\(1 tensor\(s\) missing, e\.g\. \['base_model\.model\.encoder\.layer\.0\."
                              r"attention\.self\.query\.lora_B\.weight'\]; 0 unexpected"),
    ("no tensor", r"\(24 tensor\(s\) missing"),
    ("an extra tensor", r"\(0 tensor\(s\) missing, e\.g\. \[\]; 1 unexpected, e\.g\. "
                        r"\['base_model\.model\.encoder\.layer\.0\.attention\.self\.key\.lora_B\.weight'\]\)"),
    ("another backbone (12 layers)", r"\(0 tensor\(s\) missing, e\.g\. \[\]; 24 unexpected"),
    ("another width", r"\(Error\(s\) in loading state_dict for PeftModel: size mismatch for "),
])
def test_a_lora_adapter_of_another_model_or_cut_short_is_refused(saved_lora, tmp_path, case, message):
    """peft loaded an adapter leniently: a LoRA tensor the file lacked kept its random start and one in excess
    was ignored (a warning at most), so a truncated adapter or one saved over another backbone scored as an
    untrained model; another width ended in torch's RuntimeError. Each is now one InvalidInputError naming the
    file (load_mixture passes it on as it is)."""
    import shutil

    from safetensors.torch import save_file

    from trainer.rewards.reward_models import load_reward_model

    rm, folder, tensors = saved_lora
    cut = tmp_path / "rm"
    shutil.copytree(folder, cut)
    adapter_file = cut / "adapter" / "adapter_model.safetensors"
    save_file(_foreign(tensors, case), str(adapter_file))
    with pytest.raises(InvalidInputError, match=f"^{adapter_file}: not the adapter of this reward model {message}"):
        load_reward_model(cut)
    back = load_reward_model(folder)  # the complete adapter loads, as itself
    prompts, responses = ["q one", "q two"], ["a b c", "no, not at all"]
    np.testing.assert_allclose(back.raw_scores(prompts, responses), rm.raw_scores(prompts, responses), atol=1e-5)


# ------------------------------------------------------------------ router: BCE targets and FedAvg


def test_own_client_targets_are_one_hot_on_the_own_index():
    np.testing.assert_array_equal(own_client_targets(2, 1, 3), [[0, 1, 0], [0, 1, 0]])
    with pytest.raises(InvalidInputError, match="client_index=3"):
        own_client_targets(2, 3, 3)


def test_router_bce_loss_by_hand():
    zc = torch.tensor([[0.0, 2.0, -1.0]])
    zr = torch.tensor([[1.0, 0.0, 0.0]])
    sp = lambda x: math.log1p(math.exp(x))  # noqa: E731  BCE(z, 1) = softplus(-z); BCE(z, 0) = softplus(z)
    want_c = (sp(0.0) + sp(-2.0) + sp(-1.0)) / 3
    want_r = (sp(1.0) + sp(-0.0) + sp(0.0)) / 3
    assert float(router_bce_loss(zc, zr, client_index=1)) == pytest.approx(0.5 * (want_c + want_r), abs=1e-6)


def test_label_smoothed_targets_and_loss_by_hand():
    # eps 0.3, K 3: off-target 0.3 / 3 = 0.1, own 1 - 0.3 + 0.1 = 0.8
    np.testing.assert_allclose(own_client_targets(1, 0, 3, 0.3), [[0.8, 0.1, 0.1]], atol=1e-7)
    with pytest.raises(InvalidInputError, match="smoothing"):
        own_client_targets(1, 0, 3, 1.0)
    with pytest.raises(InvalidInputError, match="label_smoothing"):
        RouterConfig(label_smoothing=-0.1)
    sp = lambda x: math.log1p(math.exp(x))  # noqa: E731  BCE(z, t) = t softplus(-z) + (1 - t) softplus(z)
    bce = lambda z, t: t * sp(-z) + (1 - t) * sp(z)  # noqa: E731
    zc, zr = torch.tensor([[2.0, -1.0]]), torch.tensor([[0.0, 1.0]])
    # eps 0.2, K 2: targets (0.1, 0.9) for client 1
    want = 0.5 * ((bce(2.0, 0.1) + bce(-1.0, 0.9)) / 2 + (bce(0.0, 0.1) + bce(1.0, 0.9)) / 2)
    assert float(router_bce_loss(zc, zr, client_index=1, smoothing=0.2)) == pytest.approx(want, abs=1e-6)


def test_stacked_routers_give_the_mean_of_the_members_logits():
    members = []
    for seed in range(3):
        torch.manual_seed(seed)
        members.append(ClientRouter(4, 3, 5, 0.5, ["a", "b", "c"]))
    x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    stacked = stack_routers(members)
    assert stacked.hidden == 15 and stacked.client_names == ["a", "b", "c"]
    np.testing.assert_allclose(stacked.logits(x), np.mean([m.logits(x) for m in members], 0), atol=1e-6)
    with pytest.raises(InvalidInputError, match="share"):
        stack_routers([members[0], ClientRouter(4, 3, 5, 0.1, ["a", "b", "c"])])


def test_an_ensemble_config_trains_independent_fedavg_runs_and_stacks_them():
    rng = np.random.default_rng(1)
    data = [ClientRouterData(rng.normal(size=(12, 4)).astype(np.float32), rng.normal(size=(12, 4)).astype(np.float32), k)
            for k in range(2)]
    small = RouterConfig(hidden=3, rounds=2, local_steps=1, batch_size=4, seed=5)
    singles = [FederatedRouterTrainer(RouterConfig(hidden=3, rounds=2, local_steps=1, batch_size=4, seed=s)) for s in (5, 1005)]
    members = [t.train(data) for t in singles]
    ens = FederatedRouterTrainer(RouterConfig(**{**small.__dict__, "ensemble": 2}))
    stacked = ens.train(data)
    x = data[0].features_chosen
    assert stacked.hidden == 6
    np.testing.assert_allclose(stacked.logits(x), (members[0].logits(x) + members[1].logits(x)) / 2, atol=1e-6)
    assert ens.bytes_per_round_ == 2 * singles[0].bytes_per_round_
    with pytest.raises(InvalidInputError, match="ensemble"):
        RouterConfig(ensemble=0)


def test_a_local_step_raises_the_own_clients_logit_for_both_responses():
    rng = np.random.default_rng(0)
    data = ClientRouterData(rng.normal(size=(40, 6)).astype(np.float32), rng.normal(size=(40, 6)).astype(np.float32), 2)
    config = RouterConfig(hidden=8, dropout=0.0, local_steps=30, lr=1e-2)
    router = initial_router(6, 3, config)
    before = softmax(router.logits(data.features_chosen))[:, 2].mean()
    local_router_update(router, data, config, np.random.default_rng(0))
    assert softmax(router.logits(data.features_chosen))[:, 2].mean() > before + 0.2
    assert softmax(router.logits(data.features_rejected))[:, 2].mean() > 0.5


def _updates(rng):
    shapes = {"w": (3, 2), "b": (2,)}
    return [({k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}, n) for n in (10.0, 30.0, 60.0)]


def test_fedavg_of_routers_is_the_weighted_mean():
    updates = _updates(np.random.default_rng(1))
    got = aggregate_routers(updates, "samples")
    eq = aggregate_routers(updates, "equal")
    for k in ("w", "b"):
        stack = np.stack([p[k] for p, _ in updates])
        np.testing.assert_allclose(got[k], np.average(stack, axis=0, weights=[10, 30, 60]), rtol=1e-6)
        np.testing.assert_allclose(eq[k], stack.mean(axis=0), rtol=1e-6)
    assert got["w"].dtype == np.float32


@pytest.mark.parametrize("bad, error, match", [
    ([], InvalidInputError, "at least one"),
    ([({"w": np.ones(2)}, 1.0), ({"w": np.ones(3)}, 1.0)], ShapeError, "shape"),
    ([({"w": np.ones(2)}, 1.0), ({"v": np.ones(2)}, 1.0)], ShapeError, "names"),
    ([({"w": np.array([np.nan, 1.0])}, 1.0)], ShapeError, "NaN"),
    ([({"w": np.ones(2)}, 0.0)], InvalidInputError, "n_examples"),
])
def test_bad_router_updates_are_refused(bad, error, match):
    with pytest.raises(error, match=match):
        aggregate_routers(bad, "samples")


def test_unknown_weighting_lists_the_valid_ones():
    with pytest.raises(InvalidInputError, match="samples"):
        aggregate_routers(_updates(np.random.default_rng(0)), "median")


# ------------------------------------------------------------------ routed reward


@pytest.fixture(scope="module")
def mixture(clients, encoder):
    cook, travel = clients
    rms = [RewardModelTrainer(RewardModelConfig(arch="mlp", epochs=20, early_stopping=False, seed=s), encoder).train(p)
           for s, p in enumerate((cook, travel))]
    data = [ClientRouterData(encoder.encode(p.prompts, p.chosen), encoder.encode(p.prompts, p.rejected), k)
            for k, p in enumerate((cook, travel))]
    router = FederatedRouterTrainer(RouterConfig(rounds=15, hidden=32)).train(data, ["cook", "travel"])
    return router, rms


def test_sparse_routing_queries_exactly_one_client_per_pair(mixture, clients, encoder):
    router, rms = mixture
    cook, travel = clients
    prompts = list(cook.prompts[:6]) + list(travel.prompts[:4])
    responses = list(cook.chosen[:6]) + list(travel.rejected[:4])
    feats = encoder.encode(prompts, responses)
    logits = router.logits(feats)
    sparse = RoutedReward(router, rms, encoder, "sparse")
    got = sparse(prompts, responses)
    choice = logits.argmax(1)
    np.testing.assert_array_equal(choice, [0] * 6 + [1] * 4)  # the router learnt who judges what
    np.testing.assert_array_equal(sparse.queries_, np.bincount(choice, minlength=2))
    assert sparse.queries_.sum() == len(prompts)
    each = np.stack([rm.score(prompts, responses) for rm in rms], axis=1)
    np.testing.assert_allclose(got, each[np.arange(len(prompts)), choice], rtol=1e-5, atol=1e-6)
    soft = RoutedReward(router, rms, encoder, "soft")
    np.testing.assert_allclose(soft(prompts, responses), (softmax(logits) * each).sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(soft.queries_, [len(prompts)] * 2)


def test_keep_start_lets_early_stopping_keep_the_untrained_start():
    """Training pulls p towards 1 while the validation loss p^2 is lowest at the start p = 0: with keep_start
    the start (epoch -1) wins the validation selection; without it the best trained epoch does."""
    from trainer.rewards.reward_models import RewardModelConfig, RewardModelTrainer

    def run(keep: bool):
        module = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            module.weight.zero_()
        trainer = RewardModelTrainer(RewardModelConfig(epochs=3, batch_size=4, lr=0.1, weight_decay=0.0, patience=5,
                                                       keep_start=keep))
        trainer._loop(module, 4, lambda idx: (module.weight.sum() - 1.0) ** 2, lambda: module.weight.sum() ** 2,
                      np.random.default_rng(0))
        return float(module.weight.detach().sum()), trainer.history_

    kept, hist = run(True)
    assert kept == 0.0 and hist[0] == {"epoch": -1, "val_loss": 0.0} and len(hist) == 4
    trained, hist = run(False)
    # AdamW's first step moves p by lr = 0.1; epoch 0 is then the best of the trained epochs
    assert trained == pytest.approx(0.1, abs=1e-6) and hist[0]["epoch"] == 0
    assert hist[0]["val_loss"] == pytest.approx(0.01, abs=1e-6)


def test_routing_by_prompt_and_temperature_by_hand(mixture, clients, encoder, tmp_path):
    """route_by="prompt": the responses of one prompt share the mean of their routing probabilities; the
    temperature divides the logits. Hand-made logits, checked against hand-computed weights."""
    from trainer.rewards.evaluation import routing_weights

    router, rms = mixture
    cook, _ = clients
    prompts = ["p", "q", "p", "q", "r"]
    responses = list(cook.chosen[:5])
    z = np.array([[2.0, 0.0], [0.0, 1.0], [0.0, 0.5], [1.0, 0.0], [0.0, 3.0]])
    p = softmax(z)
    mix = RoutedReward(router, rms, encoder, "sparse", route_by="prompt")
    w = mix.weights(prompts, z)
    np.testing.assert_allclose(w[0], (p[0] + p[2]) / 2)
    np.testing.assert_allclose(w[2], w[0])
    np.testing.assert_allclose(w[1], (p[1] + p[3]) / 2)
    np.testing.assert_allclose(w[4], p[4])
    # p: sigmoid(2) + sigmoid(-0.5) = 0.881 + 0.378 -> client 0 for both responses of "p", although
    # response 2 alone would go to client 1
    got = mix(prompts, responses, logits=z)
    each = np.stack([rm.score(prompts, responses) for rm in rms], axis=1)
    np.testing.assert_array_equal(mix.last_choice_, [0, 0, 0, 0, 1])
    np.testing.assert_allclose(got, each[np.arange(5), [0, 0, 0, 0, 1]], rtol=1e-5, atol=1e-6)
    hot = RoutedReward(router, rms, encoder, "soft", temperature=0.5)
    np.testing.assert_allclose(hot(prompts, responses, logits=z), (softmax(2 * z) * each).sum(1), rtol=1e-5, atol=1e-5)
    save_mixture(hot, tmp_path / "hot")
    again = load_mixture(tmp_path / "hot", cache_dir=encoder.cache_dir)
    assert again.temperature == 0.5 and again.route_by == "response"
    with pytest.raises(InvalidInputError):
        RoutedReward(router, rms, encoder, "soft", temperature=0.0)
    with pytest.raises(InvalidInputError):
        RoutedReward(router, rms, encoder, "soft", route_by="client")
    # the evaluation's version on (chosen, rejected) x pairs: pairs 0 and 1 share a prompt
    zz = np.stack([z[:3], z[[2, 3, 4]]])  # (2, 3, K)
    ww = routing_weights(zz, 1.0, "prompt", np.array([7, 7, 9]))
    pp = softmax(zz.reshape(-1, 2)).reshape(zz.shape)
    np.testing.assert_allclose(ww[0, 0], (pp[0, 0] + pp[1, 0] + pp[0, 1] + pp[1, 1]) / 4)
    np.testing.assert_allclose(ww[1, 1], ww[0, 0])
    np.testing.assert_allclose(ww[1, 2], (pp[0, 2] + pp[1, 2]) / 2)
    np.testing.assert_allclose(routing_weights(zz, 2.0), softmax(zz.reshape(-1, 2) / 2).reshape(zz.shape))


def test_mixture_saves_and_loads_to_the_same_rewards(mixture, clients, encoder, tmp_path):
    router, rms = mixture
    cook, travel = clients
    mix = RoutedReward(router, rms, encoder, "soft")
    save_mixture(mix, tmp_path / "mix")
    again = load_mixture(tmp_path / "mix", cache_dir=encoder.cache_dir)
    assert again.mode == "soft" and again.client_names == ["cook", "travel"]
    p, r = list(travel.prompts[:5]), list(travel.chosen[:5])
    np.testing.assert_allclose(again(p, r), mix(p, r), rtol=1e-6)
    with pytest.raises(InvalidInputError, match="mixture.json"):
        load_mixture(tmp_path)


def test_a_save_killed_midway_leaves_the_earlier_mixture_whole(mixture, encoder, tmp_path, monkeypatch):
    """`mor train --out DIR` killed while saving into DIR's earlier mixture: router/ was already overwritten in
    place beside the old mixture.json, a mix that loaded without complaint. The parts are staged and swapped."""
    import copy

    import safetensors.torch

    router, rms = mixture
    save_mixture(RoutedReward(router, rms, encoder, "soft"), tmp_path / "mix")
    files = sorted(p for p in (tmp_path / "mix").rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in files}
    other = copy.deepcopy(router)  # the new run's router: different weights
    other.set_parameters({k: v + 1.0 for k, v in router.get_parameters().items()})

    def killed(*args, **kwargs):  # the third-party writer of the reward models' weights
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", killed)
        with pytest.raises(KeyboardInterrupt):
            save_mixture(RoutedReward(other, rms, encoder, "sparse"), tmp_path / "mix")
    assert {p: p.read_bytes() for p in files} == before
    assert sorted(p for p in (tmp_path / "mix").rglob("*") if p.is_file() and ".mixture.partial" not in str(p)) == files
    save_mixture(RoutedReward(other, rms, encoder, "sparse"), tmp_path / "mix")  # the rerun completes
    again = load_mixture(tmp_path / "mix", cache_dir=encoder.cache_dir)
    assert again.mode == "sparse" and not (tmp_path / "mix" / ".mixture.partial").exists()
    for name, value in other.get_parameters().items():
        np.testing.assert_array_equal(again.router.get_parameters()[name], value)


# ------------------------------------------------------------------ membership attack


def test_attack_auc_is_half_on_random_scores_and_one_on_a_leaking_oracle():
    rng = np.random.default_rng(0)
    rand = membership_attack(rng.normal(size=4000), rng.normal(size=4000))
    assert abs(rand.auc - 0.5) < 0.03 and rand.tpr_at_fpr[0.10] < 0.15
    leak = membership_attack(rng.normal(5.0, 0.5, size=500), rng.normal(0.0, 0.5, size=800))
    assert leak.auc > 0.999 and leak.tpr_at_fpr[0.01] > 0.95
    assert leak.n_members == leak.n_non_members == 500  # 1 : 1
    assert leak.auc_se == pytest.approx(auc_standard_error(leak.auc, 500, 500))


def test_auc_standard_error_by_hand():
    """Hanley & McNeil (1982) Eq. 2. At A = 0.5: Q1 = Q2 = 1/3, so with 500 + 500
    var = (1/4 + 2 * 499 * (1/3 - 1/4)) / 500^2 = 83.41667 / 250000 and SE = 0.0182666."""
    assert auc_standard_error(0.5, 500, 500) == pytest.approx(math.sqrt((0.25 + 2 * 499 / 12) / 250000), rel=1e-12)
    assert auc_standard_error(0.5, 500, 500) == pytest.approx(0.0182666, abs=1e-6)
    assert auc_standard_error(1.0, 50, 50) == 0.0  # a perfect separation has no spread
    assert auc_standard_error(0.5, 120, 120) > 0.035  # the ~120-member audits of before: SE ~0.037
    with pytest.raises(InvalidInputError):
        auc_standard_error(0.5, 0, 10)


def test_communication_counts_bytes():
    c = communication_per_round(100, 3, ["ab", "é"], ["c", "d"])
    assert c == {"router_update_bytes": 2400, "reward_query_bytes": 6, "reward_answer_bytes": 8, "n_queries": 2}


# ------------------------------------------------------------------ Flower


def test_flower_router_fedavg_equals_the_simulated_federated_trainer(monkeypatch):
    pytest.importorskip("ray")
    from flwr.simulation import run_simulation

    from trainer.rewards.flower_router import RouterFedAvg, make_router_client_app, make_router_server_app

    for name in ("flwr.supercore.telemetry", "flwr.common.telemetry"):
        if hasattr(sys.modules.get(name), "FLWR_TELEMETRY_ENABLED"):
            monkeypatch.setattr(sys.modules[name], "FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    rng = np.random.default_rng(3)
    data = {k: ClientRouterData((rng.normal(size=(n, 5)) + k).astype(np.float32),
                                (rng.normal(size=(n, 5)) + k).astype(np.float32), k) for k, n in enumerate((12, 30))}
    config = RouterConfig(hidden=6, dropout=0.0, rounds=2, lr=5e-2, batch_size=8, weighting="samples")
    want = FederatedRouterTrainer(config).train([data[0], data[1]])
    strategy = RouterFedAvg("samples", fraction_evaluate=0.0, min_train_nodes=2, min_available_nodes=2)
    result: dict = {}
    # Ray on one CPU: one actor (a Python process importing the client app) runs the nodes in turn
    run_simulation(make_router_server_app(strategy, initial_router(5, 2, config), config.rounds, result),
                   make_router_client_app(data, config, 5, 2), num_supernodes=2,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 1, "include_dashboard": False}})
    assert sorted(n for _, n in strategy.last_updates_) == [12.0, 30.0]
    for k, v in want.get_parameters().items():
        np.testing.assert_allclose(result["parameters"][k], v, rtol=1e-5, atol=1e-6)


def test_dp_sgd_reward_model_reports_epsilon_and_more_noise_means_smaller_epsilon(clients, encoder):
    cook, _ = clients
    eps = []
    for noise in (0.8, 2.0):
        trainer = RewardModelTrainer(RewardModelConfig(arch="mlp", epochs=4, batch_size=8, dp_noise_multiplier=noise,
                                                       weight_decay=0.0, dropout=0.0), encoder)
        rm = trainer.train(cook)
        assert np.isfinite(rm.score(cook.prompts[:3], cook.chosen[:3])).all()
        assert trainer.delta_ == pytest.approx(1 / cook.n_pairs)
        eps.append(trainer.epsilon_)
    assert 0 < eps[1] < eps[0] < math.inf
    with pytest.raises(InvalidInputError, match="DP-SGD"):
        RewardModelConfig(arch="lora", dp_noise_multiplier=1.0)


def test_a_dp_reward_model_carries_its_guarantee_through_save_and_load(clients, encoder, tmp_path):
    cook, _ = clients
    trainer = RewardModelTrainer(RewardModelConfig(arch="mlp", epochs=3, batch_size=8, dp_noise_multiplier=1.0,
                                                   weight_decay=0.0, dropout=0.0), encoder)
    rm = trainer.train(cook)
    assert rm.privacy_ == {"epsilon": trainer.epsilon_, "delta": 1 / cook.n_pairs, "noise_multiplier": 1.0,
                           "max_grad_norm": 1.0, "epochs": 3, "batch_size": 8, "n_pairs": cook.n_pairs, "accountant": "rdp"}
    rm.save(tmp_path / "rm")
    back = MLPRewardModel.load(tmp_path / "rm", encoder.cache_dir)
    assert back.privacy_ == rm.privacy_
    plain = RewardModelTrainer(RewardModelConfig(arch="mlp", epochs=2, batch_size=8), encoder).train(cook)
    assert plain.privacy_ is None


def test_dp_config_makes_every_client_a_dp_mlp_and_audit_pools_hold_the_members(shared_data):
    """MoRConfig.dp_rm: the clients' reward models are trained with it (all MLP, no length prior);
    with_members(500) grows every pool so that a seed's split has >= 500 train and >= 500 val + test pairs."""
    from dataclasses import replace

    from trainer.rewards.mor_trainer import DP_RM, MoRConfig, MoRTrainer

    with pytest.raises(InvalidInputError, match="dp_noise_multiplier"):
        MoRConfig(dp_rm=RewardModelConfig(arch="mlp"))
    cfg = MoRConfig(data_dir=str(shared_data)).with_members(500)
    assert len(set(cfg.pool_pairs)) == 1 and cfg.pool_pairs[0] == cfg.max_eval_pairs >= 1375  # 1.1 * 500 / 0.4
    assert cfg.pairs_per_prompt == 4  # AlpacaEval without koala has too few instructions at 2 pairs each
    trainer = MoRTrainer(cfg, show_progress=False)
    for c in trainer.prepare(0).clients:
        assert len(c.train) >= 500 and len(c.val) + len(c.test) >= 500, c.name
    dp_rm = replace(DP_RM, epochs=2)  # which model is trained, not how well: 2 of DP_RM's 30 epochs
    dp = MoRTrainer(MoRConfig.quick(data_dir=str(shared_data), client_archs=("mlp", "lora", "mlp"), dp_rm=dp_rm),
                    show_progress=False)
    c = dp.prepare(0).clients[1]  # harmlessness: a LoRA client without DP
    rm, _ = dp.train_reward_model(c, "lora", 0)
    assert rm.arch == "mlp" and rm.privacy_["noise_multiplier"] == 1.0 and not rm.length_term
    assert rm.privacy_["n_pairs"] == len(c.train) and rm.privacy_["delta"] == pytest.approx(1 / len(c.train))


def test_the_full_preset_keeps_every_pair_of_each_domain_and_caps_no_split(shared_data):
    """MoRConfig.full (issue 29, item 2): each client's pool is every pair of its domain (AlpacaEval without
    koala), all koala pairs are held out, and a seed's train / val / test hold the whole pool (no eval cap)."""
    from trainer.data.preferences import load_preference_pairs
    from trainer.rewards.mor_trainer import MoRConfig, MoRTrainer

    cfg = MoRConfig.full(data_dir=str(shared_data))
    assert cfg.client_archs == ("mlp", "mlp", "mlp") and cfg.seeds == 3 and cfg.embedder.model == "static:all-MiniLM-L6-v2"
    df = load_preference_pairs(shared_data, cfg.client_domains, seed=cfg.pool_seed)
    alpaca = df[df["domain"] == "alpacaeval"]
    expected = {"helpfulness": int((alpaca["subset"] != "koala").sum()), "heldout": int((alpaca["subset"] == "koala").sum()),
                "harmlessness": int((df["domain"] == "hh_harmless").sum()), "correctness": int((df["domain"] == "routerbench").sum())}
    assert expected["heldout"] > 1000 and expected["correctness"] > 5000  # not a subsample of the sources
    trainer = MoRTrainer(cfg, show_progress=False)
    pool = trainer.load_pool()
    assert pool["client"].value_counts().to_dict() == expected
    assert set(pool["pair_id"]) == set(df["pair_id"])
    split = trainer.prepare(1)
    for c in split.clients:
        assert len(c.train) + len(c.val) + len(c.test) == expected[c.name], c.name
        assert len(c.test) > 0.15 * expected[c.name], c.name
    assert len(split.heldout) == expected["heldout"]
    with pytest.raises(InvalidInputError, match="pool_pairs"):
        MoRConfig.full(pool_pairs=(5, 5, 5))


# ------------------------------------------------------------------ one routing rule, saved with the mixture


def test_train_saves_the_validation_chosen_router_and_variants_and_load_uses_them(mixture, clients, encoder, tmp_path):
    """`fedroute mor train` saves the routing the evaluation chose on validation (choose_routing's dict), not the
    config's defaults: the chosen weighting's router, and per mode its variant; load_mixture(mode=...) uses it."""
    import copy

    from trainer.rewards.mor_trainer import MoRConfig, MoRModels, MoRTrainer

    router, rms = mixture
    cook, travel = clients
    other = copy.deepcopy(router)
    with torch.no_grad():
        other.head.bias.add_(torch.tensor([5.0, -5.0]))  # a different "samples" router: sends everything to cook
    trainer = MoRTrainer(MoRConfig(client_names=("cook", "travel"), client_domains=("alpacaeval", "hh_harmless"),
                                   client_archs=("mlp", "mlp"), pool_pairs=(30, 30), length_prior=False), show_progress=False)
    trainer.encoder = encoder
    models = MoRModels(rms, {"samples": other, "equal": router}, fedavg_rm=None, length_baseline=None)
    choice = {"weighting": "samples", "sparse": "sparse|prompt", "soft": "soft|prompt|T=2", "val": {"samples/sparse|prompt": 0.7}}
    trainer.save(models, tmp_path / "mix", routing=choice, mode="sparse")
    meta = __import__("json").loads((tmp_path / "mix" / "mixture.json").read_text())
    # the run's config is written with the mixture, before mixture.json (no older run's config beside it)
    assert __import__("json").loads((tmp_path / "mix" / "mor_config.json").read_text()) == trainer.args.to_json()
    plain = {"fallback": 0.0, "fallback_top": 0, "probabilities": "softmax"}
    assert meta["variants"] == {"sparse": {"mode": "sparse", "temperature": 1.0, "route_by": "prompt", **plain},
                                "soft": {"mode": "soft", "temperature": 2.0, "route_by": "prompt", **plain}}
    assert meta["selection"]["chosen_on"] == "validation" and meta["selection"]["weighting"] == "samples"
    sparse = load_mixture(tmp_path / "mix", cache_dir=encoder.cache_dir)
    assert (sparse.mode, sparse.route_by, sparse.temperature) == ("sparse", "prompt", 1.0)
    p, r = list(travel.prompts[:3]) * 2, list(travel.chosen[:3]) + list(travel.rejected[:3])
    np.testing.assert_allclose(sparse.route(p, r), other.logits(encoder.encode(p, r)), rtol=1e-6)  # the chosen router
    soft = load_mixture(tmp_path / "mix", cache_dir=encoder.cache_dir, mode="soft")
    assert (soft.mode, soft.route_by, soft.temperature) == ("soft", "prompt", 2.0)
    # by hand: softmax(z / 2), then the two responses of each prompt share the mean weights
    z = other.logits(encoder.encode(p, r)).astype(np.float64)
    w = softmax(z / 2.0)
    w = (w[:3] + w[3:]) / 2
    each = np.stack([rm.score(p, r) for rm in rms], axis=1)
    np.testing.assert_allclose(soft(p, r), (np.concatenate([w, w]) * each).sum(1), rtol=1e-5, atol=1e-5)
    assert sparse.with_mode("soft").rule == soft.rule
    with pytest.raises(InvalidInputError):
        trainer.save(models, tmp_path / "bad", routing=choice | {"soft": "soft|prompt"})


def test_grpo_reward_evaluation_and_mixture_compute_one_routed_reward(mixture, clients, encoder):
    """The GRPO reward function (online routing off), RoutedReward and the evaluation's ranking path give the
    same routed reward for every rule, including temperature and per-prompt routing (one code path)."""
    from trainer.alignment.grpo import from_mixture
    from trainer.alignment.thompson_routing import ThompsonConfig
    from trainer.rewards.evaluation import routed_reward
    from trainer.rewards.routing_rule import RoutingRule

    router, rms = mixture
    cook, travel = clients
    n = 4
    prompts = list(cook.prompts[:2]) + list(travel.prompts[:2])
    chosen = list(cook.chosen[:2]) + list(travel.chosen[:2])
    rejected = list(travel.rejected[:2]) + list(cook.rejected[:2])  # cross-criterion responses: routing matters
    p, r = prompts + prompts, chosen + rejected
    feats = encoder.encode(p, r)
    z = router.logits(feats).astype(np.float64)
    each = np.stack([rm.score(p, r) for rm in rms], axis=1).astype(np.float64)
    seen = set()
    for rule in (RoutingRule("sparse"), RoutingRule("sparse", 1.0, "prompt"), RoutingRule("soft", 0.5),
                 RoutingRule("soft", 2.0, "prompt"), RoutingRule("sparse", 1.0, "prompt", 0.99),
                 RoutingRule("sparse", 1.0, "prompt", 0.99, 2), RoutingRule("soft", 1.0, "prompt", probabilities="ovr")):
        mix = RoutedReward(router, rms, encoder, rule.mode, variants={rule.mode: rule})
        want = mix(p, r)
        grpo = from_mixture(mix, ThompsonConfig(enabled=False))
        assert grpo.rule == rule
        np.testing.assert_allclose(grpo(p, r), want, rtol=1e-5, atol=1e-5)
        ev = routed_reward(each.reshape(2, n, 2), z.reshape(2, n, 2), rule)  # pairs: each prompt once here
        np.testing.assert_allclose(ev.reshape(-1), want, rtol=1e-5, atol=1e-5)
        seen.add(tuple(np.round(want, 4)))
    assert len(seen) >= 3  # the rules really give different rewards on these pairs
    # online routing on with no exploration (nu = 0): the sample is the router's own score -> the same reward
    online = from_mixture(RoutedReward(router, rms, encoder, "sparse", route_by="prompt"), ThompsonConfig(enabled=True, nu=0.0))
    np.testing.assert_allclose(online(p, r), RoutedReward(router, rms, encoder, "sparse", route_by="prompt")(p, r),
                               rtol=1e-5, atol=1e-5)


def test_routing_rule_variants_and_bad_input():
    from trainer.rewards.routing_rule import RoutingRule

    for key in ("sparse|response", "sparse|prompt", "soft|response|T=0.5", "soft|prompt|T=2", "sparse<0.8|prompt"):
        assert RoutingRule.from_variant(key).variant == key
    assert RoutingRule.from_variant("sparse<0.8|prompt") == RoutingRule("sparse", 1.0, "prompt", 0.8)
    for bad in ("sparse", "soft|prompt", "soft|prompt|T=x", "hard|response", "sparse<1|prompt", "sparse<x|prompt"):
        with pytest.raises(InvalidInputError):
            RoutingRule.from_variant(bad)
    for bad in (dict(mode="soft", temperature=float("nan")), dict(mode="soft", fallback=0.5),
                dict(mode="sparse", fallback=-0.1), dict(mode="sparse", fallback=True)):
        with pytest.raises(InvalidInputError):
            RoutingRule(**bad)
    with pytest.raises(ShapeError):
        RoutingRule("soft").weights(np.zeros((0, 2)))
    # by hand: logits (ln 3, 0) -> (0.75, 0.25); T = 2 -> (sqrt 3, 1) / (sqrt 3 + 1)
    w = RoutingRule("soft", 2.0).weights(np.array([[np.log(3.0), 0.0]]))
    np.testing.assert_allclose(w, [[np.sqrt(3) / (np.sqrt(3) + 1), 1 / (np.sqrt(3) + 1)]])
    asked = []
    rewards, choice = RoutingRule("sparse").combine(np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]]),
                                                    lambda k, rows: asked.append((k, rows.tolist())) or np.full(len(rows), 10.0 * (k + 1)))
    assert asked == [(0, [0, 2]), (1, [1])] and rewards.tolist() == [10.0, 20.0, 10.0] and choice.tolist() == [0, 1, 0]
    # fallback 0.7: row 2's largest weight 0.6 < 0.7 -> soft, every client asked: 0.6 * 10 + 0.4 * 20 = 14
    asked = []
    rewards, choice = RoutingRule("sparse", 1.0, "response", 0.7).combine(
        np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]]),
        lambda k, rows: asked.append((k, rows.tolist())) or np.full(len(rows), 10.0 * (k + 1)))
    assert asked == [(0, [0, 2]), (1, [1, 2])] and choice.tolist() == [0, 1, 0]
    np.testing.assert_allclose(rewards, [10.0, 20.0, 14.0])


def test_prompt_only_router_keeps_response_columns_at_zero(clients, encoder):
    """RouterConfig.input_columns: the router reads only e(x); the weights of the other columns stay exactly zero
    through local AdamW steps and FedAvg, so both responses of a prompt get the same logits."""
    cook, travel = clients
    data = [ClientRouterData(encoder.encode(q.prompts, q.chosen), encoder.encode(q.prompts, q.rejected), k)
            for k, q in enumerate((cook, travel))]
    d_emb = (data[0].features_chosen.shape[1] - 3) // 2
    router = FederatedRouterTrainer(RouterConfig(rounds=3, hidden=16, input_columns=d_emb)).train(data, ["cook", "travel"])
    w = router.trunk[0].weight.detach().numpy()
    assert np.all(w[:, d_emb:] == 0.0) and np.abs(w[:, :d_emb]).sum() > 0
    np.testing.assert_array_equal(router.logits(data[0].features_chosen), router.logits(data[0].features_rejected))
    with pytest.raises(InvalidInputError):
        FederatedRouterTrainer(RouterConfig(rounds=1, input_columns=10_000)).train(data)
    with pytest.raises(InvalidInputError):
        RouterConfig(input_columns=0)


def test_choose_routing_keeps_the_defaults_unless_validation_beats_them_by_the_margin():
    """Hand-made validation accuracies: 2 clients x 50 pairs; default equal / sparse|response (0.70) and
    soft|prompt|T=0.5 (0.70). One standard error of 0.70 on 100 pairs is sqrt(0.21 / 100) = 0.0458."""
    from trainer.rewards.evaluation import choose_routing, routing_variants

    def val(overrides: dict) -> dict:
        acc = {w: {r.variant: 0.70 for r in routing_variants()} for w in ("samples", "equal")}
        for (w, v), a in overrides.items():
            acc[w][v] = a
        return {n: {"n": 50, "routing": {"": acc}} for n in ("a", "b")}

    defaults = ("equal", "sparse|response", "soft|prompt|T=0.5")
    small = val({("samples", "sparse|prompt"): 0.74, ("equal", "soft|response|T=2"): 0.74})  # +0.04 < 1 SE
    got = choose_routing(small, ["a", "b"], *defaults, margin_se=1.0)
    assert (got["weighting"], got["sparse"], got["soft"]) == defaults
    got = choose_routing(small, ["a", "b"], *defaults, margin_se=0.0)  # plain argmax
    assert (got["weighting"], got["sparse"], got["soft"]) == ("samples", "sparse|prompt", "soft|prompt|T=0.5")
    big = val({("samples", "sparse|prompt"): 0.75, ("samples", "soft|response|T=2"): 0.76})  # +0.05, +0.06 > 1 SE
    got = choose_routing(big, ["a", "b"], *defaults, margin_se=1.0)
    assert (got["weighting"], got["sparse"], got["soft"]) == ("samples", "sparse|prompt", "soft|response|T=2")
    assert got["val"]["samples/sparse|prompt"] == 0.75


def test_routing_errors_split_routing_from_reward_model_errors_by_hand():
    """Two pairs, two clients, own client 0. Pair 0: both responses routed home, own RM right. Pair 1: the chosen
    response goes to client 1 (score -1 < the rejected's 0.5 at home): routed wrong, own RM right. Per response:
    half the pairs away, costing 1 pair of 2 (0.5); per prompt (each pair its own group), pair 1's weights average
    to (0.5, 0.5), argmax client 0: nothing away."""
    from trainer.rewards.evaluation import EvalSet, routing_errors

    norm = np.array([[[1.0, 0.0], [1.0, -1.0]], [[0.0, 0.0], [0.5, 3.0]]])  # (2 sides, 2 pairs, 2 clients)
    z = np.array([[[2.0, 0.0], [0.0, 2.0]], [[2.0, 0.0], [2.0, 0.0]]])
    e = EvalSet("t", 0, norm, norm, {"equal": z}, np.zeros((2, 2)), np.full(2, 0.5), np.array([0, 1]))
    got = routing_errors(e, z)
    zero = {"share": 0.0, "cost": 0.0}
    assert got["sparse|response"]["buckets"] == {"home_sure": {"share": 0.5, "cost": 0.0}, "home_mixed": zero,
                                                 "away_sure": {"share": 0.5, "cost": 0.5}, "away_mixed": zero}
    del got["sparse|response"]["buckets"], got["sparse|prompt"]["buckets"]
    assert got["sparse|response"] == {"pairs_away": 0.5, "routing_cost": 0.5, "acc_home": 1.0, "acc_away_routed": 0.0,
                                      "acc_away_own": 1.0}
    assert got["sparse|prompt"] == {"pairs_away": 0.0, "routing_cost": 0.0, "acc_home": 1.0, "acc_away_routed": None,
                                    "acc_away_own": None}
    # fallback 0.8 per prompt: pair 0's weights (0.881, 0.119) stay sparse; pair 1's (0.5, 0.5) get the mixture,
    # chosen 0.5 * 1 + 0.5 * (-1) = 0 < rejected 0.5 * 0.5 + 0.5 * 3 = 1.75: wrong where the own RM is right. Nothing is
    # routed away (routing_cost 0), yet the mixing costs 1 pair of 2: the home_mixed bucket.
    got = routing_errors(e, z)["sparse<0.8|prompt"]
    assert (got["pairs_away"], got["routing_cost"], got["acc_home"]) == (0.0, 0.0, 0.5)
    assert got["buckets"] == {"home_sure": {"share": 0.5, "cost": 0.0}, "home_mixed": {"share": 0.5, "cost": 0.5},
                              "away_sure": zero, "away_mixed": zero}


def test_fallback_top_and_one_vs_rest_probabilities_by_hand():
    """RoutingRule.fallback_top: an unsure row mixes only its k largest weights, renormalised, and only those clients
    are asked; probabilities="ovr": normalised sigmoids of the logits."""
    from trainer.rewards.routing_rule import RoutingRule

    w = np.array([[0.05, 0.9, 0.05], [0.5, 0.3, 0.2]])  # row 0 sure (0.9 >= 0.7), row 1 unsure (0.5 < 0.7)
    ask = lambda log: lambda k, rows: log.append((k, rows.tolist())) or np.full(len(rows), 10.0 * (k + 1))  # noqa: E731
    asked = []
    rewards, choice = RoutingRule("sparse", 1.0, "response", 0.7, 2).combine(w, ask(asked))
    assert asked == [(0, [1]), (1, [0, 1])] and choice.tolist() == [1, 0]  # client 2 is never asked
    np.testing.assert_allclose(rewards, [20.0, (0.5 * 10 + 0.3 * 20) / 0.8])  # 13.75
    asked = []
    rewards, _ = RoutingRule("sparse", 1.0, "response", 0.7).combine(w, ask(asked))  # every client: 5 + 6 + 6 = 17
    assert asked == [(0, [1]), (1, [0, 1]), (2, [1])]
    np.testing.assert_allclose(rewards, [20.0, 17.0])
    # logits (0, ln 3): sigmoids (1/2, 3/4) -> (0.4, 0.6); softmax would give (0.25, 0.75)
    z = np.array([[0.0, np.log(3.0)]])
    np.testing.assert_allclose(RoutingRule("soft", probabilities="ovr").weights(z), [[0.4, 0.6]])
    np.testing.assert_allclose(RoutingRule("soft").weights(z), [[0.25, 0.75]])
    for key in ("sparse<0.8,top2|prompt", "soft|prompt|T=1|ovr", "sparse|response|ovr", "sparse<0.6,top3|response|ovr"):
        assert RoutingRule.from_variant(key).variant == key
    assert RoutingRule.from_variant("sparse<0.8,top2|prompt") == RoutingRule("sparse", 1.0, "prompt", 0.8, 2)
    assert RoutingRule.from_variant("soft|prompt|T=1|ovr") == RoutingRule("soft", 1.0, "prompt", probabilities="ovr")
    for bad in ("sparse<0.8,top1|prompt", "sparse<0.8,topx|prompt", "soft|prompt|T=1|sigmoid"):
        with pytest.raises(InvalidInputError):
            RoutingRule.from_variant(bad)
    for bad in (dict(fallback=0.8, fallback_top=1), dict(fallback_top=2), dict(mode="soft", fallback_top=2),
                dict(fallback=0.8, fallback_top=True), dict(probabilities="sigmoid")):
        with pytest.raises(InvalidInputError):
            RoutingRule(**bad)


def test_pair_feature_prior_starts_at_the_structure_fit_and_survives_save_load(clients, encoder, tmp_path):
    from dataclasses import replace

    from sdk.pair_features import response_features_many
    from trainer.rewards.reward_models import load_reward_model

    names = ("dlog_chars", "dlog_words", "dlog_lines", "refusal", "emphasis")
    enc = replace(encoder, pair_features=names)
    cook, travel = clients
    both = _pairs(cook.prompts + travel.prompts, cook.chosen + travel.chosen, cook.rejected + travel.rejected)
    assert enc.encode(both.prompts[:2], both.chosen[:2]).shape[1] == encoder.encode(both.prompts[:2], both.chosen[:2]).shape[1] + 2
    trainer = RewardModelTrainer(RewardModelConfig(arch="mlp", epochs=1, early_stopping=False, length_prior=True, seed=0), enc)
    trainer.train(both)
    phi = lambda ys: response_features_many(both.prompts, ys, names) / 8  # noqa: E731  (the encoder's columns)
    w = fit_length_prior(phi(both.chosen), phi(both.rejected))
    np.testing.assert_allclose(trainer.length_weight_, w, rtol=1e-5)  # the encoder rounds its columns to float32
    # the start: the margin is exactly the client's own fit on its pair features
    rm = MLPRewardModel(enc, enc.encode(both.prompts[:1], both.chosen[:1]).shape[1], length_term=True)
    rm.init_length_prior(w)
    margin = rm.raw_scores(both.prompts, both.chosen) - rm.raw_scores(both.prompts, both.rejected)
    np.testing.assert_allclose(margin, (phi(both.chosen) - phi(both.rejected)) @ w, atol=1e-4)
    rm.fit_normaliser(both)
    rm.save(tmp_path / "pf")
    back = load_reward_model(tmp_path / "pf", cache_dir=enc.cache_dir)
    assert back.encoder.pair_features == names
    np.testing.assert_allclose(back.raw_scores(both.prompts, both.chosen), rm.raw_scores(both.prompts, both.chosen), atol=1e-5)


def test_generator_prior_beside_the_routed_reward_by_hand():
    """prior_correct: chosen's routed reward + lam * (beta_g(chosen) - beta_g(rejected)) against the rejected's;
    choose_prior_weight: the PRIOR_WEIGHTS entry with the best validation accuracy, ties to the smaller weight."""
    from trainer.rewards.evaluation import EvalSet, choose_prior_weight, prior_correct

    s = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.5]])  # routed-reward differences +1, -1, -0.5
    norm = np.stack([s, s], -1)  # both clients score alike: any routing gives s
    z = np.zeros((2, 3, 2))
    routing = {"weighting": "equal", "sparse": "sparse|response", "soft": "soft|response|T=1"}
    e = EvalSet("t", 0, norm, norm, {"equal": z}, np.zeros((2, 3)), np.full(3, 0.5), prior=np.array([0.0, 1.5, 0.25]))
    for lam, want in ((0.0, [1, 0, 0]), (0.5, [1, 0, 0]), (1.0, [1, 1, 0]), (2.0, [1, 1, 0.5]), (4.0, [1, 1, 1])):
        got = prior_correct(e, routing, lam)
        assert set(got) == {"router_rm_sparse_generator_prior", "router_rm_soft_generator_prior"}
        for v in got.values():
            np.testing.assert_array_equal(v, want)
    assert choose_prior_weight([e], routing) == 4.0
    tie = EvalSet("t", 0, norm, norm, {"equal": z}, np.zeros((2, 3)), np.full(3, 0.5), prior=np.array([0.0, 1.5, 0.0]))
    assert choose_prior_weight([tie], routing) == 1.0  # 2/3 at lam = 1, 2 and 4
    none = EvalSet("t", 0, norm, norm, {"equal": z}, np.zeros((2, 3)), np.full(3, 0.5))
    np.testing.assert_array_equal(prior_correct(none, routing, 4.0)["router_rm_sparse_generator_prior"], [1, 0, 0])
    assert choose_prior_weight([none], routing) == 0.0


def test_generator_strengths_come_from_the_clients_summed_win_counts():
    """MoR's generator prior: each client's win/loss counts of its train pairs, summed (the server's view), fitted by
    Bradley-Terry; HH-RLHF's 'chosen' / 'rejected' are no generators, so an HH-only federation has no prior."""
    from collections import Counter

    import pandas as pd

    from trainer.generator_prior import fit_bradley_terry
    from trainer.rewards.mor_trainer import ClientSplit, MoRSplit, generator_strengths

    def frame(domain, rows):
        return pd.DataFrame([{"domain": domain, "source_a": a, "source_b": b, "label": lab} for a, b, lab in rows])

    empty = frame("alpacaeval", [])
    help_ = frame("alpacaeval", [("A", "B", 1), ("B", "A", 0), ("B", "C", 1)])  # A beats B twice, B beats C
    code = frame("routerbench", [("C", "A", 0), ("A", "C", 1)])  # A beats C twice
    hh = frame("hh_harmless", [("chosen", "rejected", 1)])
    split = MoRSplit(0, [ClientSplit("h", "alpacaeval", help_, empty, empty), ClientSplit("c", "routerbench", code, empty, empty),
                         ClientSplit("hh", "hh_harmless", hh, empty, empty)], None)
    beta = generator_strengths(split)
    assert beta == fit_bradley_terry(Counter({("A", "B"): 2, ("B", "C"): 1, ("A", "C"): 2}))
    assert beta["A"] > beta["B"] > beta["C"]
    assert generator_strengths(MoRSplit(0, [ClientSplit("hh", "hh_harmless", hh, empty, empty)], None)) is None


def test_mor_cli_full_preset_and_quick_are_exclusive(shared_data, tmp_path):
    """`fedroute mor eval|train --full` builds MoRConfig.full (the validation choice FULL_CHOICE included); with
    --quick it is refused before anything trains."""
    from typer.testing import CliRunner

    from trainer.cli import app
    from trainer.rewards.cli import _config
    from trainer.rewards.mor_trainer import FULL_CHOICE, MoRConfig

    cfg = _config(False, shared_data, 3, None, full=True)
    assert cfg == MoRConfig.full(data_dir=str(shared_data), cache_dir=None, seeds=3)
    assert cfg.pool_pairs == (10 ** 9,) * 3 and all(getattr(cfg, k) == v for k, v in FULL_CHOICE.items())
    for command in ("eval", "train"):
        r = CliRunner().invoke(app, ["mor", command, "--quick", "--full", "--out", str(tmp_path / command),
                                     "--data", str(shared_data)])
        assert r.exit_code != 0 and "--quick and --full are two presets" in r.output
