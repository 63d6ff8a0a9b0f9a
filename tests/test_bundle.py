"""Bundles: golden manifest, round trip through the SDK, tampering, wrong keys, inconsistent parts."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import BUNDLE_MAX_TOKENS, ROOT

from sdk import Router
from sdk.errors import BundleError

ROUTERBENCH_MODELS = [
    "WizardLM/WizardLM-13B-V1.2", "claude-instant-v1", "claude-v1", "claude-v2", "gpt-3.5-turbo-1106",
    "gpt-4-1106-preview", "meta/code-llama-instruct-34b-chat", "meta/llama-2-70b-chat",
    "mistralai/mistral-7b-chat", "mistralai/mixtral-8x7b-chat", "zero-one-ai/Yi-34B-Chat",
]


@pytest.fixture(scope="module")
def kmeans_bundle(make_bundle, tmp_path_factory) -> Path:
    return make_bundle(tmp_path_factory.mktemp("b") / "bundle", kind="kmeans")


@pytest.fixture()
def bundle_copy(kmeans_bundle, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(kmeans_bundle.resolve(), dst)
    return dst


def test_golden_manifest(kmeans_bundle, signing_keys, fitted_routers):
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    manifest = json.loads((kmeans_bundle / "manifest.json").read_text())
    assert sorted(manifest) == ["bundle_version", "created_utc", "embedder", "files", "format_version", "models",
                                "router_kind", "signature"]
    assert manifest["format_version"] == 1 and manifest["bundle_version"] == 1
    assert manifest["router_kind"] == "kmeans"
    assert [m["id"] for m in manifest["models"]] == ROUTERBENCH_MODELS
    assert manifest["embedder"] == {
        "name": "all-MiniLM-L6-v2", "dim": 384, "max_tokens": BUNDLE_MAX_TOKENS, "truncation_side": "left",
        "pooling": "mean", "normalised": True,
        "files": {"fp32": "embedder.onnx", "int8": "embedder.int8.onnx"},
    }
    assert sorted(manifest["files"]) == ["embedder.int8.onnx", "embedder.onnx", "kmeans.npz", "tokenizer.json"]
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((kmeans_bundle / name).read_bytes()).hexdigest() == digest
    # mean cost per model = total logged cost / count in the router's statistics
    stats = fitted_routers["kmeans"].statistics_
    expected = stats.sum_cost.sum(0) / stats.count.sum(0)
    np.testing.assert_allclose([m["mean_cost_usd"] for m in manifest["models"]], expected, rtol=1e-12)
    # The signature is Ed25519 over the canonical JSON of everything but the signature.
    body = {k: v for k, v in manifest.items() if k != "signature"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    key = load_pem_public_key(signing_keys[1].read_bytes())
    key.verify(base64.b64decode(manifest["signature"]["value"]), canonical)  # raises if wrong


def test_round_trip_kmeans_choices_follow_the_cell_table(kmeans_bundle, signing_keys, fitted_routers):
    router = Router.load(kmeans_bundle, signing_keys[1], precision="fp32")
    trained = fitted_routers["kmeans"]
    assert router.model_ids == tuple(ROUTERBENCH_MODELS)
    assert router.router_kind == "kmeans" and router.bundle_version == 1 and router.precision == "fp32"
    test = fitted_routers["test"]
    for query, reference in zip(test.prompts[:20], fitted_routers["test_embeddings"][:20]):
        for lam in (0.0, 50.0, 1e4):
            choice = router.choose(query, lam)
            assert float(choice.embedding @ reference) > 0.999  # ONNX encoder == sentence-transformers
            cell = int(np.argmin(((trained.centroids_ - choice.embedding) ** 2).sum(1)))
            assert choice.cell == cell
            u = trained.accuracy_[cell] - lam * trained.cost_[cell]
            assert choice.index == int(np.nanargmax(u)) and choice.model == ROUTERBENCH_MODELS[choice.index]
            assert choice.utility == pytest.approx(u[choice.index])
            assert [s.accuracy for s in choice.scores] == pytest.approx(list(trained.accuracy_[cell]))
            assert [s.cost_usd for s in choice.scores] == pytest.approx(list(trained.cost_[cell]))


def test_mlp_bundle_predicts_what_the_trainer_predicts(make_bundle, tmp_path, signing_keys, fitted_routers):
    bundle = make_bundle(tmp_path / "mlp", kind="mlp", int8=False)
    router = Router.load(bundle, signing_keys[1])
    assert router.precision == "fp32"  # no int8 file: auto falls back
    emb = fitted_routers["test_embeddings"]
    acc, cost = router.predict_from_embeddings(emb)
    t_acc, t_cost = fitted_routers["mlp"].predict(emb)
    np.testing.assert_allclose(acc, t_acc, atol=2e-5)
    np.testing.assert_allclose(cost, t_cost, rtol=2e-5, atol=1e-9)
    # The last model was never observed: NaN in both (never chosen), every other model finite.
    assert np.isnan(acc[:, -1]).all() and np.isnan(t_acc[:, -1]).all() and np.isnan(cost[:, -1]).all()
    assert np.isfinite(acc[:, :-1]).all() and np.isfinite(cost[:, :-1]).all()
    assert all(c.index != len(ROUTERBENCH_MODELS) - 1 for c in router.choose_batch(["What is 2 + 2?", "Name a prime."], 0.0))


def test_auto_precision_prefers_int8_and_missing_precision_is_refused(kmeans_bundle, make_bundle, tmp_path, signing_keys):
    assert Router.load(kmeans_bundle, signing_keys[1]).precision == "int8"
    fp32_only = make_bundle(tmp_path / "fp32", int8=False)
    with pytest.raises(BundleError, match="no int8 embedder"):
        Router.load(fp32_only, signing_keys[1], precision="int8")


@pytest.mark.parametrize("name, precision", [("kmeans.npz", "auto"), ("embedder.int8.onnx", "auto"),
                                             ("tokenizer.json", "auto"), ("embedder.onnx", "fp32")])
def test_tampered_file_is_rejected(bundle_copy, signing_keys, name, precision):
    # Only the files the chosen precision uses are hashed at load (tests/test_load_path.py).
    path = bundle_copy / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=rf"{name}: sha256"):
        Router.load(bundle_copy, signing_keys[1], precision=precision)


def test_tampered_manifest_is_rejected(bundle_copy, signing_keys):
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    manifest["models"][0]["mean_cost_usd"] = 0.0  # make a model look free
    (bundle_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="signature does not verify"):
        Router.load(bundle_copy, signing_keys[1])


def test_wrong_key_is_rejected(kmeans_bundle, tmp_path):
    from export.signing import generate_keypair

    _, other_pub = generate_keypair(tmp_path / "other")
    with pytest.raises(BundleError, match="signature does not verify"):
        Router.load(kmeans_bundle, other_pub)


@pytest.mark.parametrize("damage", ["missing_file", "manifest_not_json", "no_signature", "not_a_dir", "bad_key_file"])
def test_broken_bundles_raise_bundle_error(bundle_copy, signing_keys, tmp_path, damage):
    key = signing_keys[1]
    if damage == "missing_file":
        (bundle_copy / "kmeans.npz").unlink()
        match = "kmeans.npz: missing"
    elif damage == "manifest_not_json":
        (bundle_copy / "manifest.json").write_text("{not json")
        match = "not valid JSON"
    elif damage == "no_signature":
        manifest = json.loads((bundle_copy / "manifest.json").read_text())
        del manifest["signature"]
        (bundle_copy / "manifest.json").write_text(json.dumps(manifest))
        match = "no Ed25519 signature"
    elif damage == "not_a_dir":
        bundle_copy = tmp_path / "nothing-here"
        match = "not a directory"
    else:
        key = tmp_path / "garbage.pub"
        key.write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
        match = "not a PEM public key"
    with pytest.raises(BundleError, match=match):
        Router.load(bundle_copy, key)


@pytest.mark.parametrize("content", [b"", b"\n  \n", b"not a key"], ids=["empty", "blank", "garbage"])
def test_a_public_key_file_that_holds_no_key_is_named(tmp_path, content):
    """An empty key file gave 'public key is not a PEM public key: ...' without saying which file."""
    from sdk.bundle_manifest import load_public_key

    key = tmp_path / "signing.pub"
    key.write_bytes(content)
    with pytest.raises(BundleError) as info:
        load_public_key(key)
    if content.strip():
        assert str(info.value).startswith(f"public key {key} is not a PEM public key: ")
    else:
        assert str(info.value) == (f"public key {key} is an empty file; expected the PEM signing.pub written by "
                                   "`fedroute keygen`")


def test_signed_but_hostile_file_name_is_rejected(make_bundle, tmp_path, signing_keys):
    """A manifest signed by the right key still may not point outside the bundle."""
    from export.bundle_writer import build_manifest
    from export.signing import load_signing_key

    bundle = make_bundle(tmp_path / "b")
    manifest = json.loads((bundle / "manifest.json").read_text())
    body = {k: manifest[k] for k in ("bundle_version", "router_kind", "models", "embedder")}
    files = {name: (bundle / name).read_bytes() for name in manifest["files"]}
    hostile = build_manifest(files, body, load_signing_key(signing_keys[0]))
    hostile["files"]["../outside.txt"] = hashlib.sha256(b"x").hexdigest()
    from export.signing import sign_manifest

    hostile = sign_manifest(hostile, load_signing_key(signing_keys[0]))
    (bundle / "manifest.json").write_text(json.dumps(hostile))
    with pytest.raises(BundleError, match="not a plain file name"):
        Router.load(bundle, signing_keys[1])


def _priced(models: list[str]) -> list[dict]:
    return [{"id": m, "price_per_1k_input_usd": None, "price_per_1k_output_usd": None, "mean_cost_usd": None}
            for m in models]


def _embedder(name: str, dim: int) -> dict:
    return {"name": name, "dim": dim, "max_tokens": 64, "truncation_side": "left", "pooling": "mean",
            "normalised": True, "files": {"fp32": "embedder.onnx", "int8": "embedder.int8.onnx"}}


@pytest.mark.parametrize("overrides, field", [
    pytest.param(dict(models=_priced(ROUTERBENCH_MODELS + ["gpt-5-imaginary"])), "['gpt-5-imaginary']",
                 id="price-table-model-without-router-head"),
    pytest.param(dict(kind="mlp", int8=False, models=_priced(ROUTERBENCH_MODELS[:-1])), "['zero-one-ai/Yi-34B-Chat']",
                 id="router-head-without-price"),
    pytest.param(dict(embedder=_embedder("all-mpnet-base-v2", 384)), "'all-MiniLM-L6-v2'", id="other-embedder"),
    pytest.param(dict(embedder={**_embedder("all-MiniLM-L6-v2", 768), "files": {"fp32": "embedder.onnx"}}),
                 "768", id="other-dimension"),
    pytest.param(dict(files={"kmeans.npz": b"PK\x03\x04 definitely not an npz"}), "kmeans.npz", id="corrupt-router"),
])
def test_a_signed_bundle_whose_parts_disagree_is_refused(make_bundle, tmp_path, signing_keys, overrides, field):
    with pytest.raises(BundleError, match=re.escape(field)):
        Router.load(make_bundle(tmp_path / "b", **overrides), signing_keys[1])


def test_export_over_an_existing_bundle_replaces_it_whole(make_bundle, tmp_path, signing_keys):
    from export.bundle_writer import next_bundle_version

    out = make_bundle(tmp_path / "b", bundle_version=1)
    first = out.resolve()
    assert out.is_symlink() and next_bundle_version(out) == 2
    make_bundle(out, kind="mlp", int8=False, bundle_version=2)
    router = Router.load(out, signing_keys[1])
    assert router.bundle_version == 2 and router.router_kind == "mlp"
    assert sorted(p.name for p in out.iterdir()) == ["embedder.onnx", "manifest.json", "router.onnx", "tokenizer.json"]
    assert first.exists()  # the previous version stays for readers still loading it
    make_bundle(out, bundle_version=3)
    assert not first.exists()  # two versions back: removed
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["b"]


def test_a_reader_holding_the_old_version_still_loads_it_after_a_new_export(make_bundle, tmp_path, signing_keys):
    out = make_bundle(tmp_path / "b", bundle_version=1)
    old_dir = out.resolve()
    make_bundle(out, bundle_version=2)
    assert Router.load(old_dir, signing_keys[1]).bundle_version == 1
    assert Router.load(out, signing_keys[1]).bundle_version == 2
    with pytest.raises(BundleError, match="older than min_bundle_version 2"):
        Router.load(old_dir, signing_keys[1], min_bundle_version=2)


@pytest.mark.parametrize("spelling", ["relative", "dot-dot"])
def test_a_bundle_path_that_is_relative_or_has_dot_dot_keeps_the_version_in_use(make_bundle, tmp_path, signing_keys,
                                                                                  monkeypatch, spelling):
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    out = Path("../b") if spelling == "dot-dot" else Path("b")
    make_bundle(out, bundle_version=1)
    make_bundle(out, bundle_version=2)
    in_use = out.resolve()
    make_bundle(out, bundle_version=3)  # removes v1 (two back), must keep v2 (now the previous one)
    assert in_use.exists() and Router.load(in_use, signing_keys[1]).bundle_version == 2
    assert Router.load(out, signing_keys[1]).bundle_version == 3


def test_a_crash_before_publishing_leaves_the_old_bundle_and_the_version_count(make_bundle, tmp_path, signing_keys,
                                                                                monkeypatch):
    import os

    from export.bundle_writer import next_bundle_version

    out = make_bundle(tmp_path / "b", bundle_version=4)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        make_bundle(out, bundle_version=5)
    monkeypatch.undo()
    assert Router.load(out, signing_keys[1]).bundle_version == 4
    assert next_bundle_version(out) == 5
    assert len([p for p in tmp_path.iterdir() if ".v" in p.name]) == 1  # the failed version's folder is gone


@pytest.mark.parametrize("content", ["notes", "manifest"])
def test_writer_refuses_to_replace_a_folder_that_is_not_a_bundle(make_bundle, tmp_path, content):
    from export.errors import ExportError

    precious = tmp_path / "webapp"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    if content == "manifest":  # a web app's manifest.json is not a bundle
        (precious / "manifest.json").write_text(json.dumps({"name": "my app", "files": {}, "bundle_version": 3}))
    with pytest.raises(ExportError, match="not a fedroute bundle"):
        make_bundle(precious)
    assert (precious / "notes.txt").read_text() == "keep me"


def test_loading_and_choosing_imports_no_torch(kmeans_bundle, signing_keys):
    code = (
        "import sys\n"
        "from sdk import Router\n"
        f"r = Router.load({str(kmeans_bundle)!r}, {str(signing_keys[1])!r})\n"
        "c = r.choose('What is the capital of France?', 100.0)\n"
        "assert c.model in r.model_ids\n"
        "bad = [m for m in ('torch', 'transformers', 'sentence_transformers', 'optimum', 'trainer', 'export', 'sklearn')"
        " if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("bad", [-1.0, "0.008", [1, 2], True, pytest.param(10**400, id="10**400")])
def test_price_table_values_must_be_non_negative_numbers(make_bundle, tmp_path, signing_keys, bad):
    from sdk.bundle_manifest import MANIFEST_FILE

    bundle = make_bundle(tmp_path / "p")
    manifest = json.loads((bundle / MANIFEST_FILE).read_text())
    manifest["models"][0]["price_per_1k_input_usd"] = bad
    from export.signing import load_signing_key, sign_manifest

    (bundle / MANIFEST_FILE).write_text(json.dumps(sign_manifest(manifest, load_signing_key(signing_keys[0]))))
    with pytest.raises(BundleError, match="price_per_1k_input_usd"):
        Router.load(bundle, signing_keys[1])


def test_deeply_nested_manifest_and_fifo_files_are_bundle_errors(bundle_copy, signing_keys, tmp_path):
    import os

    fifo_bundle = tmp_path / "fifo"
    shutil.copytree(bundle_copy, fifo_bundle)
    (fifo_bundle / "tokenizer.json").unlink()
    (fifo_bundle / "tokenizer.json").symlink_to(bundle_copy / "tokenizer.json")
    with pytest.raises(BundleError, match="tokenizer.json: cannot be opened"):
        Router.load(fifo_bundle, signing_keys[1])
    (fifo_bundle / "tokenizer.json").unlink()
    shutil.copy(bundle_copy / "tokenizer.json", fifo_bundle / "tokenizer.json")
    (fifo_bundle / "kmeans.npz").unlink()
    os.mkfifo(fifo_bundle / "kmeans.npz")
    with pytest.raises(BundleError, match="not a regular file"):
        Router.load(fifo_bundle, signing_keys[1])
    (bundle_copy / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(BundleError, match="not valid JSON"):
        Router.load(bundle_copy, signing_keys[1])


def test_duplicate_keys_and_huge_integers_in_the_manifest_are_bundle_errors(bundle_copy, signing_keys):
    text = (bundle_copy / "manifest.json").read_text()
    (bundle_copy / "manifest.json").write_text(text.replace('"bundle_version": 1,', '"bundle_version": 1, "bundle_version": 9,'))
    with pytest.raises(BundleError, match="not valid JSON"):
        Router.load(bundle_copy, signing_keys[1])
    (bundle_copy / "manifest.json").write_text(text.replace('"bundle_version": 1,', '"bundle_version": 1' + "0" * 5000 + ","))
    with pytest.raises(BundleError, match="not valid JSON"):
        Router.load(bundle_copy, signing_keys[1])


def test_public_key_may_be_given_as_pem_text(kmeans_bundle, signing_keys):
    assert Router.load(kmeans_bundle, signing_keys[1].read_text()).bundle_version == 1
