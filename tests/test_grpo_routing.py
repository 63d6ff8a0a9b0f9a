"""GRPO (TRL) on a routed reward with online neural Thompson routing, on a tiny random causal LM."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from trainer.alignment.errors import AlignmentConfigError
from trainer.alignment.grpo import RoutedGRPOConfig, RoutedGRPOReward, RoutedGRPOTrainer
from trainer.alignment.thompson_routing import NeuralThompsonRouting, ThompsonConfig

torch.set_num_threads(1)

PROMPTS = [
    "Give three tips for staying healthy.", "What is the capital of France?", "Describe a sunset in one line.",
    "How do I boil an egg?", "Name a famous painter.", "Why is the sky blue?", "Write a haiku about rain.",
    "Explain recursion briefly.", "Suggest a name for a cat.", "What does a compiler do?",
    "How many legs does a spider have?", "Translate 'hello' into Spanish.",
]


def even_code_point_share(responses) -> np.ndarray:
    """The learnable signal: share of characters with an even Unicode code point (about 0.4 at random)."""
    return np.array([np.mean([ord(ch) % 2 == 0 for ch in r]) if r else 0.0 for r in responses], dtype=np.float32)


# Two clients with the same criterion but their own normalisation (mean, std), as MoR's clients return
# z-normalised scores: the routed reward's scale depends on which client is asked.
CLIENTS = [lambda p, r: (even_code_point_share(r) - 0.5) / 0.1,
           lambda p, r: (even_code_point_share(r) - 0.45) / 0.2]


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> Path:
    from trainer.alignment.policy_models import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("policy") / "tiny", train_texts=PROMPTS * 4, vocab_size=300)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """Enc(x, y) = [e(x), e(y)] with the real MiniLM embedder (768 dims), cached in a temp SQLite file."""
    from trainer.embeddings import embed_texts

    cache = tmp_path_factory.mktemp("emb")

    def encode(prompts, responses):
        responses = [r if r.strip() else "(empty)" for r in responses]
        return np.concatenate([embed_texts(list(prompts), cache_dir=cache, show_progress=False),
                               embed_texts(responses, cache_dir=cache, show_progress=False)], axis=1)

    return encode


STEPS = 28  # GRPO steps per run (two runs: online routing on and off)


def run(tiny_policy, encoder, tmp_path, online: bool, steps: int = STEPS):
    torch.manual_seed(0)
    router = nn.Sequential(nn.Linear(768, 32), nn.Tanh(), nn.Linear(32, 2))
    thompson = ThompsonConfig(enabled=online, seed=0)
    reward = RoutedGRPOReward(encoder, CLIENTS, NeuralThompsonRouting(router, thompson))
    config = RoutedGRPOConfig(model=str(tiny_policy), output_dir=tmp_path / ("on" if online else "off"),
                              learning_rate=1e-2, beta=0.04, max_steps=steps, max_completion_length=16,
                              num_generations=4, prompts_per_step=4, thompson=thompson, seed=0)
    return RoutedGRPOTrainer(config, reward, PROMPTS).train(), reward, config


def test_routed_reward_rises_kl_finite_and_online_routing_changes_choices(tiny_policy, encoder, tmp_path):
    on, reward_on, config = run(tiny_policy, encoder, tmp_path, online=True)
    off, reward_off, _ = run(tiny_policy, encoder, tmp_path, online=False)
    print("online on:", on.summary, "\nonline off:", off.summary)
    for result in (on, off):
        assert len(result.history) == STEPS
        kl = np.array([h["kl"] for h in result.history])
        assert np.isfinite(kl).all() and kl.max() > 0  # the KL penalty is live and stays finite
        # the routed reward rises: last quarter vs first quarter, in the clients' normalised units
        assert result.summary["reward_last_quarter"] > result.summary["reward_first_quarter"] + 1.0
    # sparse routing: exactly one client query per (prompt, completion)
    assert reward_on.n_queries_ == STEPS * 16 and reward_off.n_queries_ == STEPS * 16
    # off: the offline router decides every pair and never moves
    assert off.summary["changed_vs_offline_mean"] == 0.0
    assert off.summary["router_drift"] == 0.0 and off.summary["router_argmax_changed"] == 0.0
    # on: Thompson sampling routes a measurable share of pairs elsewhere, and the feedback moves the layer
    assert on.summary["changed_vs_offline_mean"] > 0.1
    assert on.summary["router_drift"] > 0.0 and on.summary["router_argmax_changed"] > 0.0
    assert sum(h["feedback"] is not None for h in on.history) == STEPS - 1  # every step after the first
    assert (config.output_dir / "history.json").exists() and (config.output_dir / "grpo.png").exists()


def test_config_validation_names_the_field():
    with pytest.raises(AlignmentConfigError, match="beta"):
        RoutedGRPOConfig(model="x", beta=0.0)
    with pytest.raises(AlignmentConfigError, match="num_generations"):
        RoutedGRPOConfig(model="x", num_generations=1)
    with pytest.raises(AlignmentConfigError, match="learning_rate"):
        RoutedGRPOConfig(model="x", learning_rate=10**400)  # beyond the float range: was an OverflowError traceback
    with pytest.raises(AlignmentConfigError, match="soft"):
        RoutedGRPOConfig(model="x", routing_mode="soft")  # thompson enabled by default
    RoutedGRPOConfig(model="x", routing_mode="soft", thompson=ThompsonConfig(enabled=False))


def test_soft_routing_mixes_every_client_with_softmax_weights():
    router = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with torch.no_grad():
        router[0].weight.copy_(torch.eye(2))
        router[0].bias.zero_()
        router[1].weight.copy_(torch.eye(2))
        router[1].bias.zero_()
    routing = NeuralThompsonRouting(router, ThompsonConfig(enabled=False))
    contexts = np.array([[np.log(3.0), 0.0]], dtype=np.float32)  # logits (ln 3, 0) -> weights (0.75, 0.25)
    clients = [lambda p, r: np.array([2.0]), lambda p, r: np.array([-2.0])]
    reward = RoutedGRPOReward(lambda p, r: contexts, clients, routing, mode="soft")
    assert reward(["x"], ["y"]) == pytest.approx([0.75 * 2.0 + 0.25 * -2.0])
    assert reward.n_queries_ == 2
    sparse = RoutedGRPOReward(lambda p, r: contexts, clients, NeuralThompsonRouting(router, ThompsonConfig(enabled=False)))
    assert sparse(["x"], ["y"]) == [2.0] and sparse.n_queries_ == 1


def test_rolling_mean_is_the_trailing_window_mean():
    from trainer.alignment.grpo import rolling_mean

    np.testing.assert_allclose(rolling_mean(np.array([1.0, 2.0, 3.0, 4.0]), 2), [1.0, 1.5, 2.5, 3.5])
    np.testing.assert_allclose(rolling_mean(np.array([4.0, 0.0, 2.0]), 10), [4.0, 2.0, 2.0])


def test_a_policy_that_diverges_is_named_not_a_torch_traceback(tiny_policy, encoder, tmp_path):
    """`mor grpo --learning-rate 1e308` (3 steps) ended in torch's 'RuntimeError: probability tensor contains
    either `inf`, `nan` or element < 0' traceback from generate(): the policy's weights were NaN after a step."""
    torch.manual_seed(0)
    router = nn.Sequential(nn.Linear(768, 32), nn.Tanh(), nn.Linear(32, 2))
    thompson = ThompsonConfig(enabled=True, seed=0)
    reward = RoutedGRPOReward(encoder, CLIENTS, NeuralThompsonRouting(router, thompson))
    config = RoutedGRPOConfig(model=str(tiny_policy), output_dir=tmp_path / "run", learning_rate=1e308, beta=0.04,
                              max_steps=3, max_completion_length=8, num_generations=4, prompts_per_step=4,
                              thompson=thompson, seed=0)
    with pytest.raises(AlignmentConfigError, match="--learning-rate"):
        RoutedGRPOTrainer(config, reward, PROMPTS).train()
    assert not (tmp_path / "run" / "history.json").exists()
