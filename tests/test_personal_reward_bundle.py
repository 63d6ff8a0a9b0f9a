"""FedVPA-GP on the device (issue 28): a ``personal_reward/vpa`` bundle, exported from a model trained a few rounds
on real HH-RLHF pairs (the real MiniLM encoder, exported by optimum, 64 tokens as the other bundle tests), loaded by
``sdk.PersonalRewardScorer``: the device's ``z`` and rewards from text equal the trainer's, a tampered bundle is
refused, bad input is refused at the edge."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from sdk.errors import BundleError, InvalidQueryError, ShapeError

torch.set_num_threads(1)

N_PAIRS = 150  # training users' pairs; the parity users read the rows after them


@pytest.fixture(scope="module")
def vpa_bundle(shared_data, exported_embedder, signing_keys, tmp_path_factory):
    """(artefact, bundle dir, export result, parity users, phi of the training pairs): FedVPA-GP with both
    ``s(y)`` and ``p(y)``, PCA to 8 components, saved and loaded through the trainer kind, then exported."""
    from export.vpa_export import export_personal_reward_bundle, parity_users
    from tests.conftest import BUNDLE_MAX_TOKENS
    from trainer import kinds
    from trainer.data.conflicting_users import UsersConfig, make_users
    from trainer.data.preferences import load_hh_harmless_pairs
    from trainer.embeddings import EmbedderConfig
    from trainer.rewards.pair_features import PairEncoder
    from trainer.vpa.artefact import PersonalRewardArtefact
    from trainer.vpa.features import fit_projection, pair_feature_scales, pair_features, select_structure
    from trainer.vpa.personal_reward_kind import FAMILY, NAME
    from trainer.vpa.trainer import VPAConfig, VPATrainer

    cache = tmp_path_factory.mktemp("emb")
    embedder = EmbedderConfig(max_tokens=BUNDLE_MAX_TOKENS)
    all_pairs = load_hh_harmless_pairs(shared_data, seed=0)
    pairs = all_pairs.head(N_PAIRS).reset_index(drop=True)
    cfg = VPAConfig(users=UsersConfig(n_clients=2, mix="pure", n_train_users=2, n_val_users=1, n_test_users=1,
                                      n_train_pairs=20, context_max=8, n_heldout=8),
                    contexts=(2, 8), hidden=16, latent_dim=2, rounds=3, local_steps=2, n_targets=8, pca_components=8,
                    structure="both", seeds=1)
    users = make_users(pairs, cfg.users, seed=0)
    phi = pair_features(pairs, PairEncoder(embedder, cache_dir=cache))  # as experiment.run_seed builds it
    projection = fit_projection(phi, np.flatnonzero(users.part == "train"), cfg.pca_components)
    phi = select_structure(projection.apply(phi), cfg.structure)
    model, protos = VPATrainer(users, phi, cfg).train_vpa("mixture", 0.01, seed=0)
    run = {"model": model, "prototypes": protos, "z_mode": "mean", "structure": cfg.structure,
           "projection": projection, "beta": 0.01, "readout": {2: ("client", 0.3), 4: ("mean", 1.0), 8: ("client", 0.1)}}
    saved = PersonalRewardArtefact.from_run(run, cfg, pair_feature_scales(pairs), embedder).save(
        tmp_path_factory.mktemp("run") / "personal_reward")
    artefact = kinds.get(NAME, FAMILY).load(saved)
    parity = parity_users(all_pairs.iloc[N_PAIRS:], 4, 8, 6)
    out = tmp_path_factory.mktemp("vpa-bundle") / "bundle"
    result = export_personal_reward_bundle(artefact, out, signing_keys[0], parity, exported=exported_embedder[0],
                                           cache_dir=cache, progress=lambda _: None)
    return artefact, out, result, parity, pairs, phi, cache


@pytest.fixture(scope="module")
def scorer(vpa_bundle, signing_keys):
    from sdk import PersonalRewardScorer

    return PersonalRewardScorer.load(vpa_bundle[1], signing_keys[1])


def test_the_trainers_features_of_text_are_its_training_features(vpa_bundle):
    artefact, _, _, _, pairs, phi, cache = vpa_bundle
    rows = pairs.iloc[:5]
    again = artefact.features(list(rows["prompt"]), list(rows["response_a"]), cache)
    np.testing.assert_allclose(again, phi[:5, 0], atol=1e-5)  # p(y) scales and PCA as in training


def test_device_z_and_rewards_from_text_equal_the_trainers(vpa_bundle, scorer):
    artefact, out, result, parity, _, _, cache = vpa_bundle
    report = result.parity
    print("parity:", json.dumps(report["max_abs_diff"]))
    assert report["passed"] and report["n_users"] == 4 and report["n_context"] == 8
    assert max(report["max_abs_diff"][k] for k in ("z", "mu", "logvar", "rewards")) <= 1e-3
    assert json.loads((out / "parity.json").read_text())["passed"]
    # recomputed here: a helpful user's (label flipped) context and a target prompt's candidates
    context, targets = parity[1]
    latent = scorer.infer_z(context)
    xs, w, lo = map(list, zip(*context))
    phi = artefact.features(xs + xs, w + lo, cache)
    trainer = artefact.latent(phi[:8], phi[8:])
    for name in ("z", "mu", "logvar", "responsibilities"):
        np.testing.assert_allclose(getattr(latent, name), trainer[name], atol=1e-3)
    assert latent.z.shape == (2,) and latent.responsibilities.shape == (2,)
    assert latent.responsibilities.sum() == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(latent.z, latent.mu)  # z_mode 'mean'
    x, a, b = targets[0]
    device = scorer.rewards(x, [a, b, "   "], latent)
    expect = artefact.rewards(artefact.features([x] * 3, [a, b, "   "], cache), trainer["z"])
    np.testing.assert_allclose(device, expect, atol=1e-3)
    # the client's own pi: the read-out listed for the largest C <= the pairs (8: client pi, evidence x 0.1)
    for n, weights in ((8, [0.3, 0.7]), (5, [0.9, 0.1]), (3, [0.9, 0.1])):
        mine = scorer.infer_z(context[:n], weights)
        want = artefact.latent(phi[:n], phi[8:8 + n], np.array(weights))
        for name in ("z", "mu", "logvar", "responsibilities"):
            np.testing.assert_allclose(getattr(mine, name), want[name], atol=1e-3)
        same = np.allclose(mine.mu, artefact.latent(phi[:n], phi[8:8 + n])["mu"], atol=1e-6)
        assert same == (n == 5)  # C = 4's read-out is the global pi
    assert report["max_abs_diff"]["z"] > 0 and manifest_readout(out) == {"2": ["client", 0.3], "4": ["mean", 1.0],
                                                                         "8": ["client", 0.1]}
    margins = scorer.margins([x], [a], [b], latent.z)
    assert margins[0] == pytest.approx(device[0] - device[1], abs=1e-5)
    # the manifest says what the device computes; the prototypes are in the graph, not in the manifest
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["personal_reward_kind"] == "vpa" and manifest["latent"]["n_prototypes"] == 2
    assert manifest["features"]["d_in"] == scorer.d_in == 2 * 384 + 3 + 9 + len(manifest["features"]["pair_features"])


def manifest_readout(out):
    return json.loads((out / "manifest.json").read_text())["latent"]["readout"]


def test_the_parity_gate_fails_on_a_difference_above_1e_3(vpa_bundle, scorer):
    from export.vpa_export import check_parity, trainer_reference

    artefact, _, _, parity, _, _, cache = vpa_bundle
    (ref,) = trainer_reference(artefact, parity[:1], cache)  # passed in the export (the fixture)
    report = check_parity(scorer, parity[:1], [{**ref, "rewards": ref["rewards"] + 2e-3}])
    assert not report["passed"] and report["failures"][0].startswith("rewards")
    shifted = {**ref["latent_client"], "mu": ref["latent_client"]["mu"] + 2e-3}  # the client-pi latent is gated too
    report = check_parity(scorer, parity[:1], [{**ref, "latent_client": shifted}])
    assert not report["passed"] and report["failures"][0].startswith("mu")


def test_tampered_or_foreign_bundles_are_refused(vpa_bundle, signing_keys, tmp_path):
    from sdk import PersonalRewardScorer, RewardScorer

    out = vpa_bundle[1]
    copy = tmp_path / "copy"
    shutil.copytree(out.resolve(), copy)
    data = bytearray((copy / "vpa_encoder.onnx").read_bytes())
    data[-5] ^= 0xFF
    (copy / "vpa_encoder.onnx").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="vpa_encoder.onnx"):
        PersonalRewardScorer.load(copy, signing_keys[1])
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["latent"]["n_prototypes"] = 3
    shutil.copytree(out.resolve(), tmp_path / "edited")
    (tmp_path / "edited" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="signature"):
        PersonalRewardScorer.load(tmp_path / "edited", signing_keys[1])
    with pytest.raises(BundleError, match="personal_reward"):
        RewardScorer.load(out, signing_keys[1])


def test_bad_input_is_refused_at_the_edge(scorer):
    pair = ("a question", "a yes", "a no")
    for context in ([], "a question", [("a question", "a yes")], [pair, ("q", 3, "no")], [("  ", "a", "b")], None):
        with pytest.raises(InvalidQueryError):
            scorer.infer_z(context)
    for weights in ([0.5, 0.6], [1.0, 0.0], [1.0], "pi"):
        with pytest.raises((InvalidQueryError, ShapeError)):
            scorer.infer_z([pair], weights)
    z = scorer.infer_z([pair])
    with pytest.raises(InvalidQueryError):
        scorer.rewards("a question", "an answer", z)
    with pytest.raises(InvalidQueryError):
        scorer.rewards("", ["an answer"], z)
    with pytest.raises(InvalidQueryError):
        scorer.margins(["q1", "q2"], ["a"], ["b"], z)
    for bad in ([0.1, 0.2, 0.3], [np.nan, 0.0], "z", [[0.1, 0.2]]):
        with pytest.raises(ShapeError):
            scorer.rewards("a question", ["an answer"], bad)


def test_export_cli_refuses_a_run_without_a_saved_model(signing_keys, tmp_path):
    from typer.testing import CliRunner

    from trainer.cli import app

    res = CliRunner().invoke(app, ["vpa", "export", "--run", str(tmp_path), "--out", str(tmp_path / "bundle"),
                                   "--signing-key", str(signing_keys[0])])
    assert res.exit_code != 0 and "personal_reward" in str(res.output) + str(res.exception)
