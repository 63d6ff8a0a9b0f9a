"""Reward-scorer bundles: a client's MLP reward model + the client router -> ONNX, signed; sdk.RewardScorer.

Real pairs (AlpacaEval model-vs-model, HH-RLHF harmless), the real MiniLM encoder (exported by optimum,
64 tokens as the other bundle tests), reward models and router trained by trainer.rewards.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from export.errors import ExportError
from export.reward_export import MAX_ABS_DIFF, export_reward_bundle
from sdk.errors import BundleError, InvalidQueryError
from sdk.reward_scorer import RewardScorer

torch.set_num_threads(1)

N_TRAIN, N_PARITY = 80, 40


@pytest.fixture(scope="module")
def mor_mixture(shared_data, tmp_path_factory):
    """Two clients (helpfulness: AlpacaEval; harmlessness: HH) with MLP reward models, a federated
    router over them, and held-out real pairs of both for parity."""
    from tests.conftest import BUNDLE_MAX_TOKENS
    from trainer.data.preferences import load_alpacaeval_pairs, load_hh_harmless_pairs
    from trainer.embeddings import EmbedderConfig
    from trainer.rewards.client_router import ClientRouterData, FederatedRouterTrainer, RouterConfig
    from trainer.rewards.mixture import RoutedReward
    from trainer.rewards.pair_features import PairEncoder
    from trainer.rewards.reward_models import PreferencePairs, RewardModelConfig, RewardModelTrainer

    encoder = PairEncoder(EmbedderConfig(max_tokens=BUNDLE_MAX_TOKENS), cache_dir=tmp_path_factory.mktemp("emb"))
    frames = [load_alpacaeval_pairs(shared_data).head(N_TRAIN + N_PARITY),
              load_hh_harmless_pairs(shared_data).head(N_TRAIN + N_PARITY)]
    train = [PreferencePairs.from_frame(f.head(N_TRAIN)) for f in frames]
    held = [f.iloc[N_TRAIN:] for f in frames]
    rms = [RewardModelTrainer(RewardModelConfig(arch="mlp", epochs=8, hidden=64, early_stopping=False, seed=k),
                              encoder).train(p) for k, p in enumerate(train)]
    data = [ClientRouterData(encoder.encode(p.prompts, p.chosen), encoder.encode(p.prompts, p.rejected), k)
            for k, p in enumerate(train)]
    router = FederatedRouterTrainer(RouterConfig(rounds=10, hidden=32)).train(data, ["helpful", "harmless"])
    mixture = RoutedReward(router, rms, encoder, "sparse")
    prompts = [p for h in held for p in h["prompt"]]
    responses = [r for h in held for r in h["response_a"]]
    return mixture, prompts, responses


@pytest.fixture(scope="module")
def reward_bundle(mor_mixture, exported_embedder, signing_keys, tmp_path_factory):
    mixture, prompts, responses = mor_mixture
    out = tmp_path_factory.mktemp("reward-bundle") / "bundle"
    result = export_reward_bundle(mixture, "harmless", out, signing_keys[0], prompts, responses,
                                  exported=exported_embedder[0], progress=lambda _: None)
    return out, result


def test_onnx_parity_with_torch(reward_bundle, mor_mixture, signing_keys):
    out, result = reward_bundle
    mixture, prompts, responses = mor_mixture
    report = result.parity
    print("parity:", json.dumps({k: report[k] for k in ("graphs", "end_to_end")}))
    assert report["passed"] and report["n_pairs"] == 2 * N_PARITY
    for name in ("reward_max_abs_diff", "raw_max_abs_diff", "logits_max_abs_diff"):
        assert report["graphs"][name] <= MAX_ABS_DIFF and report["end_to_end"][name] <= MAX_ABS_DIFF
    # the same figures recomputed here through the SDK, end to end (device embedder + length features)
    scorer = RewardScorer.load(out, signing_keys[1])
    device = scorer.score_batch(prompts, responses)
    trainer = mixture.reward_models[1].score(prompts, responses)
    np.testing.assert_allclose(device, trainer, atol=report["end_to_end"]["reward_max_abs_diff"] + 1e-6)
    assert np.max(np.abs(device - trainer)) <= MAX_ABS_DIFF  # ONNX embedder + graphs vs sentence-transformers + torch
    assert scorer.score(prompts[0], responses[0]) == pytest.approx(float(device[0]), abs=1e-6)
    raw = scorer.score_batch(prompts[:5], responses[:5], normalised=False)
    norm = mixture.reward_models[1].normaliser_
    np.testing.assert_allclose(scorer.score_batch(prompts[:5], responses[:5]), (raw - norm.mean) / (norm.std + norm.eps),
                               rtol=1e-5, atol=1e-5)
    choices = scorer.route_batch(prompts, responses)
    expected = mixture.router.logits(mixture.encoder.encode(prompts, responses)).argmax(1)
    assert np.mean([c.index == e for c, e in zip(choices, expected)]) >= 0.99
    assert {c.name for c in choices} <= {"helpful", "harmless"}
    assert all(c.own == (c.index == 1) for c in choices)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["reward_scorer_kind"] == "mor" and manifest["client"] == {"name": "harmless", "index": 1}
    assert "router_kind" not in manifest
    assert json.loads((out / "parity.json").read_text())["passed"]


def test_bad_inputs_raise_sdk_errors(reward_bundle, signing_keys):
    scorer = RewardScorer.load(reward_bundle[0], signing_keys[1])
    with pytest.raises(InvalidQueryError):
        scorer.score("  ", "an answer")
    with pytest.raises(InvalidQueryError):
        scorer.score(3, "an answer")
    with pytest.raises(InvalidQueryError):
        scorer.score("a question", None)
    with pytest.raises(InvalidQueryError):
        scorer.score_batch(["a", "b"], ["x"])
    with pytest.raises(InvalidQueryError):
        scorer.score_batch([], [])
    with pytest.raises(InvalidQueryError):
        scorer.score_batch("a question", "an answer")
    with pytest.raises(InvalidQueryError):
        scorer.score("a question \ud800", "an answer")
    # a blank response is scored as the trainer reads it ("(empty)"), not refused
    assert scorer.score("a question", "   ") == pytest.approx(scorer.score("a question", "(empty)"), abs=1e-6)


def test_tampered_or_foreign_bundles_are_refused(reward_bundle, signing_keys, tmp_path):
    from export.signing import generate_keypair

    out = reward_bundle[0]
    copy = tmp_path / "copy"
    shutil.copytree(out.resolve(), copy)
    data = bytearray((copy / "reward.onnx").read_bytes())
    data[-5] ^= 0xFF
    (copy / "reward.onnx").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="reward.onnx"):
        RewardScorer.load(copy, signing_keys[1])
    _, other_pub = generate_keypair(tmp_path / "other")
    with pytest.raises(BundleError, match="signature"):
        RewardScorer.load(out, other_pub)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["client"]["index"] = 0  # claim to be another client: the signature no longer verifies
    shutil.copytree(out.resolve(), tmp_path / "edited")
    (tmp_path / "edited" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="signature"):
        RewardScorer.load(tmp_path / "edited", signing_keys[1])
    with pytest.raises(BundleError, match="older"):
        RewardScorer.load(out, signing_keys[1], min_bundle_version=2)


def test_a_reward_bundle_is_not_a_router_and_a_router_bundle_is_not_a_reward_scorer(
        reward_bundle, signing_keys, exported_embedder, fitted_routers, tmp_path):
    from export.pipeline import assemble
    from sdk.router import Router

    with pytest.raises(BundleError, match="router"):
        Router.load(reward_bundle[0], signing_keys[1])
    from export.bundle_writer import write_bundle
    from export.signing import load_signing_key

    files, fields = assemble(fitted_routers["mlp"], exported_embedder[0], None, "all-MiniLM-L6-v2", 64, "left", {}, 1)
    write_bundle(tmp_path / "router", files, fields, load_signing_key(signing_keys[0]))
    with pytest.raises(BundleError, match="reward_scorer"):
        RewardScorer.load(tmp_path / "router", signing_keys[1])


def test_export_refuses_unknown_clients_and_non_mlp_models(mor_mixture, exported_embedder, signing_keys, tmp_path):
    mixture, prompts, responses = mor_mixture
    with pytest.raises(ExportError, match="helpful"):
        export_reward_bundle(mixture, "nobody", tmp_path / "b", signing_keys[0], prompts, responses,
                             exported=exported_embedder[0], progress=lambda _: None)
    with pytest.raises(ExportError, match="pairs"):
        export_reward_bundle(mixture, "helpful", tmp_path / "b", signing_keys[0], [], [],
                             exported=exported_embedder[0], progress=lambda _: None)
    assert not (tmp_path / "b").exists()
