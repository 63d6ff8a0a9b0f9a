"""Reward-scorer bundles: a client's reward model (MLP, or LoRA-tuned MiniLM with the adapter merged) + the
client router -> ONNX, signed; sdk.RewardScorer.

Real pairs (AlpacaEval model-vs-model, HH-RLHF harmless), the real MiniLM encoder (exported by optimum,
64 tokens as the other bundle tests), reward models and router trained by trainer.rewards.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tokenizers
import torch

from export.errors import ExportError
from export.reward_export import MAX_ABS_DIFF, export_reward_bundle
from sdk.errors import BundleError, InvalidInputError, InvalidQueryError
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
    from trainer.rewards.routing_rule import RoutingRule

    # a validation-chosen rule per mode, as `fedroute mor train` saves it; the manifest must carry it
    mixture = RoutedReward(router, rms, encoder, "sparse", variants={"sparse": RoutingRule("sparse", 1.0, "prompt"),
                                                                     "soft": RoutingRule("soft", 0.5, "response")})
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
    plain = {"fallback": 0.0, "fallback_top": 0, "probabilities": "softmax"}
    assert manifest["routing"] == {"active": {"mode": "sparse", "temperature": 1.0, "route_by": "prompt", **plain},
                                   "variants": {"sparse": {"mode": "sparse", "temperature": 1.0, "route_by": "prompt", **plain},
                                                "soft": {"mode": "soft", "temperature": 0.5, "route_by": "response", **plain}}}
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
    for flag in (None, 0, "no", 1.0):  # None and 0 were taken as False: the raw reward, silently
        with pytest.raises(InvalidInputError, match=rf"^normalised"):
            scorer.score("a question", "an answer", normalised=flag)
        with pytest.raises(InvalidInputError, match="^normalised"):
            scorer.score_batch(["a question"], ["an answer"], normalised=flag)
    assert scorer.score("a question", "an answer", normalised=np.bool_(False)) == pytest.approx(
        scorer.score("a question", "an answer", normalised=False), abs=0)
    # a blank response is scored as the trainer reads it ("(empty)"), not refused
    assert scorer.score("a question", "   ") == pytest.approx(scorer.score("a question", "(empty)"), abs=1e-6)



class _RowsPerRun:
    """onnxruntime's session (not ours) with a record of the rows of each ``run``."""

    def __init__(self, session) -> None:
        self._session, self.rows = session, []

    def run(self, outputs, feeds):
        self.rows.append(len(feeds["input_ids"]))
        return self._session.run(outputs, feeds)

    def __getattr__(self, name):
        return getattr(self._session, name)


def test_a_long_batch_runs_the_encoder_in_bounded_chunks(reward_bundle, signing_keys):
    """score_batch gave the encoder every text of the call in one run: 1,000 pairs peaked at 3.8 GB (250 pairs:
    1.1 GB), so an app scoring 10,000 pairs at once ran out of memory. The encoder now sees at most
    RUN_TOKENS // max_tokens texts per run, and the scores are those of smaller calls."""
    from sdk.embedder import RUN_TOKENS

    scorer = RewardScorer.load(reward_bundle[0], signing_keys[1])
    n = 150
    prompts = [f"Question {i}: how many legs does a spider have?" for i in range(n)]
    responses = [f"Answer {i}: " + "eight " * (i % 7 + 1) for i in range(n)]
    recorder = _RowsPerRun(scorer._embedder._session)
    scorer._embedder._session = recorder
    scores = scorer.score_batch(prompts, responses)
    per_run = RUN_TOKENS // scorer.manifest["embedder"]["max_tokens"]
    assert sum(recorder.rows) == 2 * n and max(recorder.rows) <= per_run, recorder.rows
    assert scores.shape == (n,) and scores.dtype == np.float32
    np.testing.assert_allclose(scores[-3:], scorer.score_batch(prompts[-3:], responses[-3:]), atol=1e-5)


def test_a_text_the_embedder_cannot_read_is_named_by_argument_and_index(reward_bundle, signing_keys):
    # The embedder's message counted the de-duplicated prompts + responses ("query at position 3" for the
    # second response of two pairs, "position 1" for the response of one pair).
    scorer = RewardScorer.load(reward_bundle[0], signing_keys[1])
    with pytest.raises(InvalidQueryError, match=r"^responses\[1\]"):
        scorer.score_batch(["a question", "another"], ["an answer", "\x00\x01"])
    with pytest.raises(InvalidQueryError, match=r"^prompts\[0\]"):
        scorer.route("\u200b", "an answer")


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
    said = []  # `mor export --client nobody` exported the embedder to ONNX (a minute) before refusing the name
    with pytest.raises(ExportError, match="unknown client 'nobody'; the mixture has"):
        export_reward_bundle(mixture, "nobody", tmp_path / "b", signing_keys[0], prompts, responses, progress=said.append)
    assert said == [] and not (tmp_path / "b").exists()


# -- a LoRA-tuned encoder reward model (kind mor_lora): adapter merged into the exported encoder ----------------

N_LORA_TRAIN = 24


@pytest.fixture(scope="module")
def lora_mixture(mor_mixture, shared_data):
    """The two-client mixture with the harmlessness client's reward model replaced by a LoRA-tuned MiniLM
    (r = 8 on query/value, 64 tokens, length term from the local length prior), trained on real HH pairs."""
    from trainer.data.preferences import load_hh_harmless_pairs
    from trainer.rewards.mixture import RoutedReward
    from trainer.rewards.reward_models import PreferencePairs, RewardModelConfig, RewardModelTrainer

    mixture, prompts, responses = mor_mixture
    pairs = PreferencePairs.from_frame(load_hh_harmless_pairs(shared_data).head(N_LORA_TRAIN))
    cfg = RewardModelConfig(arch="lora", epochs=2, batch_size=8, lr=2e-2, weight_decay=0.0, max_tokens=64,
                            early_stopping=False, length_prior=True, seed=0)
    lora = RewardModelTrainer(cfg).train(pairs)
    return RoutedReward(mixture.router, [mixture.reward_models[0], lora], mixture.encoder, "sparse"), prompts, responses


@pytest.fixture(scope="module")
def lora_bundle(lora_mixture, exported_embedder, signing_keys, tmp_path_factory):
    mixture, prompts, responses = lora_mixture
    out = tmp_path_factory.mktemp("lora-reward-bundle") / "bundle"
    result = export_reward_bundle(mixture, "harmless", out, signing_keys[0], prompts, responses,
                                  exported=exported_embedder[0], progress=lambda _: None)
    return out, result


def test_pair_tokenisation_matches_transformers_on_real_pairs(lora_mixture):
    """The trainer's pair encoding (sdk.pair_tokenizer, which the device runs too: longest_first, left
    truncation, 64 tokens) gives transformers' token ids, masks and token types on real pairs long enough to
    be truncated; the device's tokenizer, rebuilt from the trainer's tokenizer JSON, gives the same."""
    from sdk.pair_tokenizer import PairTokenizer

    mixture, prompts, responses = lora_mixture
    rm = mixture.reward_models[1]
    sdk_tok = PairTokenizer(tokenizers.Tokenizer.from_str(rm.tokenizer.backend_tokenizer.to_str()), rm.max_tokens, "left")
    for s in range(0, len(prompts), 16):
        p, r = prompts[s : s + 16], responses[s : s + 16]
        want = rm.tokenizer(p, r, truncation=True, max_length=rm.max_tokens, padding=True, return_tensors="np")
        trainer_feeds = rm.tokenize(p, r)
        for name in ("input_ids", "attention_mask", "token_type_ids"):
            np.testing.assert_array_equal(trainer_feeds[name].numpy(), want[name])
            np.testing.assert_array_equal(sdk_tok(p, r)[name], want[name])
    lengths = [int(m.sum()) for m in sdk_tok(prompts, responses)["attention_mask"]]
    assert max(lengths) == rm.max_tokens  # some pairs were truncated to the 64-token budget


def test_lora_reward_model_onnx_parity_with_torch(lora_bundle, lora_mixture, signing_keys):
    out, result = lora_bundle
    mixture, prompts, responses = lora_mixture
    rm = mixture.reward_models[1]
    report = result.parity
    print("lora parity:", json.dumps({k: report[k] for k in ("graphs", "end_to_end")}))
    assert report["passed"] and report["n_pairs"] == 2 * N_PARITY
    for name in ("reward_max_abs_diff", "raw_max_abs_diff", "logits_max_abs_diff"):
        assert report["graphs"][name] <= MAX_ABS_DIFF and report["end_to_end"][name] <= MAX_ABS_DIFF
    scorer = RewardScorer.load(out, signing_keys[1])
    device = scorer.score_batch(prompts, responses)
    torch_scores = rm.score(prompts, responses)  # the peft model, adapter NOT merged
    assert np.max(np.abs(device - torch_scores)) <= MAX_ABS_DIFF
    raw = scorer.score_batch(prompts[:6], responses[:6], normalised=False)
    np.testing.assert_allclose(raw, rm.raw_scores(prompts[:6], responses[:6]), atol=MAX_ABS_DIFF)
    norm = rm.normaliser_
    np.testing.assert_allclose(scorer.score_batch(prompts[:6], responses[:6]), (raw - norm.mean) / (norm.std + norm.eps),
                               rtol=1e-5, atol=1e-5)
    # the adapter matters: without it (base MiniLM + the same head and length term) the scores move by far more
    # than the parity tolerance, so the bundle's agreement shows the adapter was merged, not dropped
    with rm.module.encoder.disable_adapter():
        base = rm.raw_scores(prompts, responses)
    assert np.max(np.abs(base - rm.raw_scores(prompts, responses))) > 20 * MAX_ABS_DIFF
    # routing runs on the pair features, as in the MLP bundle
    choices = scorer.route_batch(prompts, responses)
    expected = mixture.router.logits(mixture.encoder.encode(prompts, responses)).argmax(1)
    assert np.mean([c.index == e for c, e in zip(choices, expected)]) >= 0.99
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["reward_scorer_kind"] == "mor_lora" and manifest["reward"]["arch"] == "lora"
    assert manifest["reward"]["encoder"]["lora"]["merged"] and manifest["reward"]["encoder"]["max_tokens"] == 64
    assert "reward_tokenizer.json" in manifest["files"] and "lora" in repr(scorer)
    # the graph holds no LoRA branch: merged into the base weights
    import onnx

    graph = onnx.load_from_string((out / "reward.onnx").read_bytes()).graph
    assert not [i.name for i in graph.initializer if "lora" in i.name.lower()]
    assert {i.name for i in graph.input} == {"input_ids", "attention_mask", "token_type_ids", "lengths"}


def test_lora_scores_need_the_texts(lora_bundle, lora_mixture, signing_keys):
    mixture, prompts, responses = lora_mixture
    scorer = RewardScorer.load(lora_bundle[0], signing_keys[1])
    feats = scorer.features(prompts[:3], responses[:3])
    with pytest.raises(InvalidQueryError, match="texts"):
        scorer.scores_from_features(feats)
    with pytest.raises(InvalidQueryError):
        scorer.scores_from_features(feats, prompts[:2], responses[:2])
    out = scorer.scores_from_features(feats, prompts[:3], responses[:3])
    assert out["reward"].shape == (3,) and out["logits"].shape == (3, 2)
    # a blank response is read as the trainer reads it
    assert scorer.score("a question", "  ") == pytest.approx(scorer.score("a question", "(empty)"), abs=1e-6)


def test_an_mlp_kind_refuses_a_lora_model_and_an_unknown_arch_is_refused(lora_mixture, exported_embedder):
    from export.reward_export import ClientRewardArtefact, MoRRewardExportKind, export_kind_for

    mixture = lora_mixture[0]
    with pytest.raises(ExportError, match="exports 'mlp'"):
        MoRRewardExportKind().check(ClientRewardArtefact(mixture, "harmless", exported_embedder[0].dim))

    class Other:
        arch = "tree"

    with pytest.raises(ExportError, match="no reward_scorer export kind"):
        export_kind_for(Other())
