"""FedPrism on the device: `fedroute export --selector RUN/fedprism_seed0` (prompt router + every expert in one
bundle, export.routed_selector_export) and sdk.Selector routing then scoring as the trainer does.

The run is a real, small FedPrism run (trainer.experts.fedprism.FedPrismTrainer): M = 2 experts (frozen
all-MiniLM-L6-v2 + LoRA in the top layer + pair head reading the presets' pair features,
sdk.pair_features.DEFAULT_FEATURES, which the device computes), K-means-initialised prompt router updated by PGPD,
4 rounds over 4 clients holding real AlpacaEval and HH-RLHF harmless pairs, saved as `prism train` saves it.
It is trained with the generator prior (the presets' exact federated start with the Bradley-Terry feature,
FedPrismConfig.generator_prior), so the bundle carries the strengths table and each expert's weight, and with the
CPU preset's router input (role-tag counts beside the prompt embedding, router_role_scale 0.5), which the device
computes too.
The device's probabilities are compared with FedPrismTrainer.predict_proba on held-out pairs (the trainer's
own routing on its prompt embeddings and its cached-lower-layer scoring), with and without the generators,
and its routes with the trainer's.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from export.errors import ExportError  # noqa: E402
from sdk.errors import BundleError, InvalidInputError  # noqa: E402
from sdk.pair_features import DEFAULT_FEATURES  # noqa: E402
from sdk.selector import Selector  # noqa: E402

pytestmark = pytest.mark.slow
N_TRAIN, N_EVAL, N_PUBLIC = 48, 40, 12  # per source (AlpacaEval, HH harmless), distinct prompts


@pytest.fixture(scope="module")
def frames(shared_data):
    """(train, eval, public) pairs frames, half AlpacaEval model-vs-model, half HH harmless; disjoint prompts."""
    import pandas as pd

    from trainer.data.preferences import load_alpacaeval_pairs, load_hh_harmless_pairs

    parts = []
    for df in (load_alpacaeval_pairs(shared_data, include_reference_pairs=False, max_pairs_per_instruction=1),
               load_hh_harmless_pairs(shared_data, seed=0)):
        df = df.drop_duplicates("prompt_id").sample(N_TRAIN + N_EVAL + N_PUBLIC, random_state=1)
        parts.append((df.iloc[:N_TRAIN], df.iloc[N_TRAIN:N_TRAIN + N_EVAL], df.iloc[N_TRAIN + N_EVAL:]))
    return tuple(pd.concat([p[i] for p in parts], ignore_index=True) for i in range(3))


@pytest.fixture(scope="module")
def run(frames, tmp_path_factory):
    """(trainer, run folder RUN/fedprism_seed0, eval pair indices) of a trained 2-expert FedPrism run."""
    from trainer.embeddings import EmbedderConfig, embed_texts
    from trainer.experts.fedprism import FederatedPairs, FedPrismConfig, FedPrismTrainer
    from sdk.routed_selector import role_counts
    from trainer.experts.selector import PairSelector, SelectorConfig, build_segment_store

    torch.set_num_threads(1)
    import pandas as pd

    train, ev, public = frames
    allp = pd.concat([train, ev], ignore_index=True)
    model = PairSelector(SelectorConfig(pair_features=DEFAULT_FEATURES), seed=0)  # the presets' head features
    store = build_segment_store(model, list(allp.prompt), list(allp.response_a), list(allp.response_b), list(allp.label))
    emb = embed_texts(list(allp.prompt) + list(public.prompt), EmbedderConfig(), show_progress=False)
    n = len(allp)
    half = N_TRAIN // 2
    # four non-IID clients: two hold AlpacaEval pairs, two HH harmless pairs
    clients = [np.arange(0, half), np.arange(half, N_TRAIN), np.arange(N_TRAIN, N_TRAIN + half),
               np.arange(N_TRAIN + half, 2 * N_TRAIN)]
    eval_pairs = np.arange(2 * N_TRAIN, n)
    data = FederatedPairs(store, emb[:n], allp.domain.to_numpy().astype(str), clients, emb[n:], eval_pairs,
                          allp[["domain", "source_a", "source_b"]], role_counts(list(allp.prompt)),
                          role_counts(list(public.prompt)))
    cfg = FedPrismConfig(n_experts=2, rounds=4, warmup_rounds=1, router_every=1, clients_per_round=4, local_pairs=24,
                         batch_size=12, expert_lr=1e-2, router_epochs=3, eval_every=4, seed=0, selector=model.config,
                         length_init="pooled", generator_prior=True, router_role_scale=0.5)
    trainer = FedPrismTrainer(model, data, cfg).train()
    folder = tmp_path_factory.mktemp("run") / "fedprism_seed0"
    trainer.save(folder)
    return trainer, folder, eval_pairs, allp


@pytest.fixture(scope="module")
def bundle(run, signing_keys, tmp_path_factory):
    from export.routed_selector_export import export_routed_selector_bundle

    _, folder, eval_pairs, allp = run
    out = tmp_path_factory.mktemp("bundles") / "fedprism"
    result = export_routed_selector_bundle(folder, out, signing_keys[0], allp.iloc[eval_pairs].reset_index(drop=True),
                                           progress=lambda m: None)
    return out, result


def test_the_device_routes_and_scores_as_the_trainer(run, bundle, signing_keys):
    trainer, _, eval_pairs, allp = run
    out, result = bundle
    g = trainer._generator_g.copy()
    trainer._generator_g[eval_pairs] = 0.0  # the trainer without the generators (g = 0: no prior)
    proba, assign = trainer.predict_proba(eval_pairs)
    trainer._generator_g = g
    with_prior, _ = trainer.predict_proba(eval_pairs)
    assert set(assign.tolist()) == {0, 1}  # both experts serve prompts: the routing is part of what is checked
    ev = allp.iloc[eval_pairs]
    sel = Selector.load(out, signing_keys[1], precision="fp32")
    assert sel.kind == "routed_onnx_pair" and sel.name == "fedprism-routed"
    routes = np.array([sel.route(x) for x in ev.prompt])
    np.testing.assert_array_equal(routes, assign)
    got = sel.prefer_many(list(ev.prompt), list(ev.response_a), list(ev.response_b))
    np.testing.assert_allclose(got, proba, atol=1e-3)
    # with the generators: the trainer's sigmoid(l / 2 + gamma_k (beta_A - beta_B)); HH pairs ("chosen" /
    # "rejected") and generators absent from the training counts get no prior on both sides
    known = np.abs(g[eval_pairs]) > 0
    assert 0.2 < known.mean() < 1.0 and np.abs(with_prior - proba)[known].max() > 0.01  # the prior moves them
    got_g = sel.prefer_many(list(ev.prompt), list(ev.response_a), list(ev.response_b), list(ev.source_a), list(ev.source_b))
    np.testing.assert_allclose(got_g, with_prior, atol=1e-3)
    assert np.mean((got_g > 0.5) == (with_prior > 0.5)) == 1.0
    i = int(np.flatnonzero(known)[0])
    x, a, b, g_a, g_b = ev[["prompt", "response_a", "response_b", "source_a", "source_b"]].iloc[i]
    assert sel.prefer(x, a, b, g_a, g_b) + sel.prefer(x, b, a, g_b, g_a) == pytest.approx(1.0)
    assert sel.prefer(x, a, b, g_a, "no-such-model") == sel.prefer(x, a, b) == pytest.approx(proba[i], abs=1e-3)
    assert result["parity"]["fp32"]["with_generators"]["max_abs_proba_diff"] <= 1e-3
    # the trainer's accuracy on these held-out pairs, reached on the device
    label = ev.label.to_numpy()
    assert np.mean((got > 0.5) == (proba > 0.5)) == 1.0
    from trainer.preference_metrics import pairwise_accuracy

    assert pairwise_accuracy(got_g, label) == pytest.approx(trainer.evaluate(eval_pairs)["accuracy"]["overall"], abs=1e-9)
    report = result["parity"]
    assert report["passed"] and report["n_pairs"] == len(eval_pairs)
    assert report["fp32"]["route_agreement"] == 1.0 and report["fp32"]["max_abs_logit_diff"] <= 1e-3
    assert report["fp32"]["accuracy"] == pytest.approx(report["torch_accuracy"])
    assert report["fp32"]["with_generators"]["accuracy"] == pytest.approx(report["torch_accuracy_with_generators"])
    assert report["share_with_prior"] == pytest.approx(known.mean())


def test_manifest_lists_router_embedder_and_every_expert(run, bundle):
    out, result = bundle
    m = result["manifest"]
    s = m["selector"]
    assert m["selector_kind"] == "routed_onnx_pair"
    assert s["experts"] == [0, 1] and s["n_experts"] == 2 and s["top_k"] is None and s["expert"] is None
    assert s["files"] == {"fp32": ["expert_0.onnx", "expert_1.onnx"]}
    assert s["pair_features"] == list(DEFAULT_FEATURES) and s["n_length_features"] == len(DEFAULT_FEATURES) > 3
    assert s["prompt_embedder"]["dim"] == 384 and s["prompt_embedder"]["max_tokens"] == 256
    assert set(m["files"]) == {"tokenizer.json", "prompt_embedder_tokenizer.json", "prompt_embedder.onnx",
                               "prompt_router.npz", "expert_0.onnx", "expert_1.onnx", "parity.json"}
    saved = json.loads((run[1] / "generator_prior.json").read_text())  # the strengths table travels as trained
    assert s["generator_prior"] == saved and len(saved["weights"]) == 2 and "chosen" not in saved["strengths"]
    with np.load(out / "prompt_router.npz") as z:  # the embedding's 384 columns + 6 role-tag counts
        assert z["w1"].shape == (128, 390) and z["w2"].shape == (2, 128)
    assert s["prompt_router"]["role_scale"] == 0.5 and len(s["prompt_router"]["role_tags"]) == 6


def test_top_k_ships_the_most_used_experts_and_routes_among_them(run, bundle, signing_keys, tmp_path):
    """top-1: the expert the router sends most of the given prompts to; every prompt then goes to it."""
    from export.routed_selector_export import export_routed_selector_bundle

    trainer, folder, eval_pairs, allp = run
    ev = allp.iloc[eval_pairs].reset_index(drop=True)
    _, assign = trainer.predict_proba(eval_pairs)
    top = int(np.bincount(assign, minlength=2).argmax())
    out = tmp_path / "top1"
    result = export_routed_selector_bundle(folder, out, signing_keys[0], ev.iloc[:10], top_k=1,
                                           top_k_prompts=list(ev.prompt), progress=lambda m: None)
    assert result["manifest"]["selector"]["experts"] == [top]
    sel = Selector.load(out, signing_keys[1])
    assert {sel.route(x) for x in ev.prompt[:10]} == {top}
    assert result["parity"]["fp32"]["route_agreement"] == 1.0


def test_tampered_router_or_missing_expert_is_refused(bundle, signing_keys, tmp_path):
    out, _ = bundle
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (bad / "prompt_router.npz").write_bytes(b"PK\x03\x04 not the router")
    with pytest.raises(BundleError, match="sha256|signature"):
        Selector.load(bad, signing_keys[1])
    shutil.rmtree(bad)
    shutil.copytree(out, bad)
    (bad / "expert_1.onnx").unlink()
    with pytest.raises(BundleError):
        Selector.load(bad, signing_keys[1])


def test_route_refuses_an_empty_prompt(bundle, signing_keys):
    out, _ = bundle
    sel = Selector.load(out, signing_keys[1])
    with pytest.raises(InvalidInputError, match="x is empty"):
        sel.route("   ")
    with pytest.raises(InvalidInputError):
        sel.prefer("\u200b", "a", "b")


def test_a_baseline_folder_or_a_domain_prior_run_is_refused(run, signing_keys, tmp_path):
    from export.routed_selector_export import export_routed_selector_bundle

    _, folder, eval_pairs, allp = run
    ev = allp.iloc[eval_pairs[:4]].reset_index(drop=True)
    other = tmp_path / "fedbis_seed0"
    shutil.copytree(folder, other)
    cfg = json.loads((other / "fedprism_config.json").read_text())
    (other / "fedprism_config.json").write_text(json.dumps(cfg | {"routing": "single"}))
    with pytest.raises(ExportError, match="routes by 'single'"):
        export_routed_selector_bundle(other, tmp_path / "b", signing_keys[0], ev, progress=lambda m: None)
    (other / "fedprism_config.json").write_text(json.dumps(cfg))
    (other / "length_prior.json").write_text(json.dumps({"domains": ["alpacaeval"], "coefs": [[1, 0, 0]]}))
    with pytest.raises(ExportError, match="length_prior='domain'"):
        export_routed_selector_bundle(other, tmp_path / "b", signing_keys[0], ev, progress=lambda m: None)
    (other / "length_prior.json").unlink()
    (other / "generator_prior.json").write_text(json.dumps({"strengths": {"gpt4": 1.0}, "weights": [1.0]}))  # M = 2
    with pytest.raises(ExportError, match="generator_prior.json"):
        export_routed_selector_bundle(other, tmp_path / "b", signing_keys[0], ev, progress=lambda m: None)
    assert not (tmp_path / "b").exists()


def test_cli_options_of_a_routed_export_are_checked_first(signing_keys, tmp_path):
    """--top-k needs a run folder; --prior-domain is for one expert; both refused before anything is loaded."""
    from typer.testing import CliRunner

    from trainer.cli import app

    folder = tmp_path / "fedprism_seed0"  # a run folder by its files (nothing is read before the refusals)
    (folder / "expert_0").mkdir(parents=True)
    for name in ("router.safetensors", "fedprism_config.json"):
        (folder / name).write_text("{}")
    base = ["export", "--signing-key", str(signing_keys[0]), "--out", str(tmp_path / "b")]
    r = CliRunner().invoke(app, [*base, "--selector", str(folder / "expert_0"), "--top-k", "1"], env={"COLUMNS": "500"})
    assert r.exit_code == 2 and "--top-k is for a FedPrism run folder" in r.output
    r = CliRunner().invoke(app, [*base, "--selector", str(folder), "--prior-domain", "alpacaeval"], env={"COLUMNS": "500"})
    assert r.exit_code == 2 and "--prior-domain is for one expert" in r.output
    r = CliRunner().invoke(app, [*base, "--router", str(folder), "--top-k", "1"], env={"COLUMNS": "500"})
    assert r.exit_code == 2 and "--top-k is for --selector bundles" in r.output
    assert not (tmp_path / "b").exists()
