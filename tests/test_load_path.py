"""Router.load verifies only the files of the chosen precision, and loads the encoder from the
verified open file (issue 13, item 3); the full check stays in verify_all and the sync install."""

from __future__ import annotations

import hashlib
import os
import shutil
import traceback
from pathlib import Path

import numpy as np
import pytest

from sdk import Router
from sdk import bundle_manifest as fmt
from sdk import kinds
from sdk.errors import BundleError, InvalidInputError
from sdk.verified_file import VerifiedFile, open_regular


@pytest.fixture(scope="module")
def three_precisions(make_bundle, tmp_path_factory) -> Path:
    """A K-means bundle with fp32, int8 and int8-all encoders."""
    return make_bundle(tmp_path_factory.mktemp("lp") / "bundle", int8_all=True)


@pytest.fixture()
def copy(three_precisions, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(three_precisions.resolve(), dst)
    return dst


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_corrupt_unused_precision_does_not_block_the_other_but_verify_all_catches_it(copy, signing_keys):
    reference = Router.load(copy, signing_keys[1], precision="int8").embed(["Is a whale a fish?"])
    flip_a_bit(copy / "embedder.onnx")  # the fp32 encoder, unused by int8
    router = Router.load(copy, signing_keys[1], precision="int8")
    assert router.precision == "int8"
    np.testing.assert_array_equal(router.embed(["Is a whale a fish?"]), reference)
    assert Router.load(copy, signing_keys[1], precision="int8-all").precision == "int8-all"
    with pytest.raises(BundleError, match=r"embedder.onnx: sha256"):
        Router.load(copy, signing_keys[1], precision="fp32")
    with pytest.raises(BundleError, match=r"embedder.onnx: sha256"):
        fmt.verify_all(copy, signing_keys[1])
    # fedroute-sync reads the bundle in use this way before every sync: still the full check.
    with pytest.raises(BundleError, match=r"embedder.onnx: sha256"):
        fmt.read_verified(copy, signing_keys[1], wanted=())


@pytest.mark.parametrize("precision, name", [("int8", "embedder.int8.onnx"), ("int8-all", "embedder.int8-all.onnx"),
                                             ("fp32", "embedder.onnx"), ("int8", "tokenizer.json"),
                                             ("int8", "kmeans.npz")])
def test_a_corrupt_used_file_is_refused(copy, signing_keys, precision, name):
    flip_a_bit(copy / name)
    with pytest.raises(BundleError, match=rf"{name}: sha256"):
        Router.load(copy, signing_keys[1], precision=precision)


@pytest.mark.parametrize("name", ["tokenizer.json", "kmeans.npz"])
def test_files_read_on_the_worker_are_used_only_once_verified(copy, signing_keys, monkeypatch, name):
    """load_bundle reads used files of >= kinds.BACKGROUND_BYTES on a worker thread (here: every file read as
    bytes); a kind gets them only after their sha256 matched, and a tampered one is refused."""
    reference = Router.load(copy, signing_keys[1], precision="int8")
    monkeypatch.setattr(kinds, "BACKGROUND_BYTES", 1)
    before = set(os.listdir("/proc/self/fd"))
    router = Router.load(copy, signing_keys[1], precision="int8")
    np.testing.assert_array_equal(router.embed(["Is a whale a fish?"]), reference.embed(["Is a whale a fish?"]))
    flip_a_bit(copy / name)
    with pytest.raises(BundleError, match=rf"{name}: sha256") as exc:
        Router.load(copy, signing_keys[1], precision="int8")
    assert any("concurrent" in frame.filename for frame in traceback.extract_tb(exc.value.__traceback__))
    assert set(os.listdir("/proc/self/fd")) <= before


def test_an_unused_file_that_is_missing_or_a_fifo_does_not_block_loading(copy, signing_keys):
    (copy / "embedder.onnx").unlink()
    os.mkfifo(copy / "embedder.onnx")
    assert Router.load(copy, signing_keys[1], precision="int8").precision == "int8"
    with pytest.raises(BundleError, match="embedder.onnx: is not a regular file"):
        fmt.verify_all(copy, signing_keys[1])


def test_read_verified_returns_by_path_files_open_and_not_as_bytes(three_precisions, signing_keys):
    with fmt.read_verified(three_precisions, signing_keys[1], wanted=["tokenizer.json", "embedder.int8.onnx"],
                           by_path=["embedder.int8.onnx"], verify_unused=False) as verified:
        assert set(verified.files) == {"tokenizer.json"} and set(verified.opened) == {"embedder.int8.onnx"}
        opened = verified.opened["embedder.int8.onnx"]
        assert opened.size == (three_precisions / "embedder.int8.onnx").stat().st_size
        assert opened.library_path.startswith("/proc/self/fd/")  # Linux: the open descriptor's path
        with open(opened.library_path, "rb") as f:  # reads the verified file
            assert hashlib.sha256(f.read()).hexdigest() == verified.manifest["files"]["embedder.int8.onnx"]
    assert "closed" in repr(opened)
    with pytest.raises(BundleError, match="changed after it was verified"):
        opened.check_unchanged()


def test_a_file_swapped_after_verification_is_not_the_one_onnxruntime_loads(three_precisions, tmp_path):
    import onnxruntime as ort

    src = three_precisions / "embedder.int8.onnx"
    path = tmp_path / "embedder.int8.onnx"
    shutil.copy(src, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with VerifiedFile(path, digest, fmt.MAX_FILE_BYTES) as verified:
        # An attacker renames another file over the bundle path between the check and the load.
        (tmp_path / "evil.onnx").write_bytes(b"not an onnx model")
        os.replace(tmp_path / "evil.onnx", path)
        session = ort.InferenceSession(verified.library_path, providers=["CPUExecutionProvider"])
        # onnxruntime read the verified inode, not the file now at the path...
        assert [o.name for o in session.get_outputs()] == ["token_embeddings", "sentence_embedding"]
        # ...and the load still fails closed: unlinking the verified inode changed its ctime.
        with pytest.raises(BundleError, match="changed after it was verified"):
            verified.check_unchanged()


def test_a_file_written_in_place_after_verification_is_refused(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc" * 1000)
    digest = hashlib.sha256(b"abc" * 1000).hexdigest()
    with pytest.raises(BundleError, match="f.bin: sha256"):
        VerifiedFile(path, hashlib.sha256(b"other").hexdigest(), fmt.MAX_FILE_BYTES)
    with pytest.raises(BundleError, match="over the 100-byte limit"):
        VerifiedFile(path, digest, 100)
    verified = VerifiedFile(path, digest, fmt.MAX_FILE_BYTES)
    verified.check_unchanged()
    with open(path, "ab") as f:  # same inode, new size / mtime / ctime
        f.write(b"x")
    with pytest.raises(BundleError, match="f.bin: changed after it was verified"):
        verified.check_unchanged()
    verified.close()


def test_router_load_leaves_no_descriptor_open(three_precisions, signing_keys):
    before = set(os.listdir("/proc/self/fd"))
    for precision in ("int8", "int8-all", "fp32"):
        Router.load(three_precisions, signing_keys[1], precision=precision)
    broken = three_precisions.parent / "broken"
    shutil.copytree(three_precisions.resolve(), broken)
    flip_a_bit(broken / "kmeans.npz")  # refused after the encoder was opened and verified
    with pytest.raises(BundleError):
        Router.load(broken, signing_keys[1], precision="int8")
    assert set(os.listdir("/proc/self/fd")) <= before


def test_a_bundle_file_that_is_a_symbolic_link_is_named_as_one(tmp_path):
    """A manifest.json linked to a copy outside the bundle was refused as "cannot be opened as a regular file
    (Too many levels of symbolic links)": O_NOFOLLOW's ELOOP, which reads as a link loop for one plain link."""
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").symlink_to(outside)
    with pytest.raises(BundleError, match=r"^manifest.json: .*symbolic link"):
        fmt.read_verified(bundle, b"unused: the manifest is read first")
    with pytest.raises(BundleError, match=r"^manifest.json: .*symbolic link"):
        open_regular(bundle / "manifest.json")
    (bundle / "manifest.json").unlink()
    (bundle / "manifest.json").symlink_to(tmp_path / "missing")  # a dangling link: still a link, not "missing"
    with pytest.raises(BundleError, match=r"^manifest.json: .*symbolic link"):
        open_regular(bundle / "manifest.json")


LOADERS = {"router": lambda *a, **k: Router.load(*a, **k), "selector": lambda *a, **k: _selector().load(*a, **k),
           "reward_scorer": lambda *a, **k: _reward().load(*a, **k)}


def _selector():
    from sdk.selector import Selector

    return Selector


def _reward():
    from sdk.reward_scorer import RewardScorer

    return RewardScorer


BAD_OPTIONS = [("intra_op_threads", 0), ("inter_op_threads", True), ("min_bundle_version", "2"), ("precision", "fp16")]


@pytest.mark.parametrize("family, option, value", [
    (family, option, value) for family in sorted(LOADERS) for option, value in BAD_OPTIONS
    if (family, option) != ("reward_scorer", "precision")])  # RewardScorer.load has no precision (fp32 embedder)
def test_every_loader_refuses_a_bad_option_before_reading_the_bundle(tmp_path, family, option, value):
    """One loader (sdk.kinds.load_bundle) checks the options of every family, naming the option."""
    with pytest.raises(InvalidInputError, match=f"^{option} must be"):
        LOADERS[family](tmp_path / "never-read", b"never read", **{option: value})


@pytest.mark.parametrize("family", ["selector", "reward_scorer"])
def test_a_router_bundle_given_to_another_family_names_its_loader(three_precisions, signing_keys, family):
    with pytest.raises(BundleError, match=rf"^bundle carries no {family} .*sdk.Router.load"):
        LOADERS[family](three_precisions, signing_keys[1])


def test_bundle_manifest_is_the_file_format_only():
    """The format module imports no kind registry (issue 30): the registry imports it, not the other way."""
    import ast

    tree = ast.parse(Path(fmt.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
               {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not imported & {"sdk.kinds", "sdk.builtin_kinds", "sdk.kind_registry", "sdk.artefact_kind"}
