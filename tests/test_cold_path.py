"""The device's cold path imports only what it uses (issue 13: static cold start <= 0.25 s).

Each check runs in a fresh interpreter, so ``sys.modules`` holds exactly what that process imported:

- ``import sdk`` imports ``sdk.errors`` only (PEP 562 lazy names), and every public name still resolves;
- ``Router.load`` of a static-embedder K-means bundle, then ``choose``, imports neither onnxruntime
  (no ONNX graph runs) nor httpx / sqlite3 / msgpack (sync only), nor the selector, reward-scorer,
  eval-log or device-round modules; those still load when asked for;
- the signature check imports cryptography's Ed25519 module and its PEM loader, not the
  ``serialization`` package (SSH, RSA, EC, DSA, cipher modules), and the loader it uses is the one
  ``serialization.load_pem_public_key`` names.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Imported by neither ``import sdk`` nor a static K-means load + choose.
NOT_ON_THE_STATIC_PATH = ("onnxruntime", "httpx", "sqlite3", "msgpack", "sdk.sync", "sdk.selector",
                          "sdk.reward_scorer", "sdk.eval_log", "sdk.device_rounds", "sdk.budget", "torch",
                          "cryptography.hazmat.primitives.serialization",
                          "cryptography.hazmat.primitives.asymmetric.rsa")


def run_child(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def static_kmeans_bundle(signing_keys, tmp_path_factory) -> Path:
    """A signed bundle: a 2-cell K-means router on 3-d static embeddings of a 4-token vocabulary
    (float16 and int8 tables), assembled and signed by the exporter's own code (no parity step)."""
    from tiny_kmeans import write_tiny_kmeans

    return write_tiny_kmeans(tmp_path_factory.mktemp("static-bundle"), signing_keys[0])[0]


def test_import_sdk_imports_only_the_errors_and_every_public_name_resolves():
    got = run_child(
        "import json, sys\n"
        "import sdk\n"
        "loaded = sorted(m for m in sys.modules if m == 'sdk' or m.startswith('sdk.'))\n"
        "numpy = 'numpy' in sys.modules\n"
        "missing = [n for n in sdk.__all__ if getattr(sdk, n, None) is None]\n"
        "from sdk import Router, SyncClient, nearest_cell\n"
        "print(json.dumps({'loaded': loaded, 'numpy': numpy, 'missing': missing, 'dir': set(sdk.__all__) <= set(dir(sdk)),"
        " 'router': Router.__module__, 'sync': SyncClient.__module__, 'kinds': sdk.kinds.__name__}))\n")
    assert got == {"loaded": ["sdk", "sdk.errors"], "numpy": False, "missing": [], "dir": True,
                   "router": "sdk.router", "sync": "sdk.sync", "kinds": "sdk.kinds"}


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_static_kmeans_load_and_choose_import_no_onnxruntime_nor_sync_modules(static_kmeans_bundle, signing_keys,
                                                                              precision):
    got = run_child(
        "import json, sys\n"
        "import sdk\n"
        f"router = sdk.Router.load({str(static_kmeans_bundle)!r}, {str(signing_keys[1])!r}, precision={precision!r})\n"
        "picks = [router.choose(q, 0.0).model for q in ('a a', 'b b b', 'c a a')]\n"
        f"present = [m for m in {NOT_ON_THE_STATIC_PATH!r} if m in sys.modules]\n"
        "handler = type(sdk.kinds.get('router', 'kmeans').round_handler).__name__\n"  # the sync side still loads
        "after = [m for m in ('sdk.device_rounds', 'msgpack', 'sqlite3') if m in sys.modules]\n"
        "sdk.SyncClient\n"
        "print(json.dumps({'picks': picks, 'present': present, 'handler': handler, 'after': after,"
        " 'httpx': 'httpx' in sys.modules}))\n")
    # 'a a' -> [1, 0, 0] (model-x's cell); 'b b b' -> [0, 1, 0] (model-y's); 'c a a' -> mean of
    # [0.6, 0.8, 0] and 2 x [1, 0, 0] = [0.87, 0.27, 0] / norm, nearer [1, 0, 0]: model-x
    assert got["picks"] == ["model-x", "model-y", "model-x"]
    assert got["present"] == []
    assert got["handler"] == "KMeansRoundHandler" and got["after"] == ["sdk.device_rounds", "msgpack", "sqlite3"]
    assert got["httpx"] is True


def test_a_selector_manifest_still_finds_its_family_without_importing_sdk_selector():
    """The selector family registers when its module is imported; the registry imports it when a
    manifest names it (a sync client installing a selector bundle has not imported it)."""
    got = run_child(
        "import json, sys\n"
        "from sdk import kinds\n"
        "before = 'sdk.selector' in sys.modules\n"
        "found = kinds.manifest_kinds({'selector_kind': 'onnx_pair'})\n"
        "print(json.dumps({'before': before, 'found': found, 'after': 'sdk.selector' in sys.modules,"
        " 'needs_embedder': kinds.needs_embedder({'selector_kind': 'onnx_pair'})}))\n")
    assert got == {"before": False, "found": {"selector": "onnx_pair"}, "after": True, "needs_embedder": False}


def test_the_pem_loader_is_cryptographys_public_one_and_refuses_other_keys(tmp_path):
    """``sdk.bundle_manifest`` reaches cryptography's PEM loader without its ``serialization``
    package; that loader must be the very object the public API names (a cryptography release that
    changes it fails here), and it still refuses what is not an Ed25519 PEM public key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    from sdk import bundle_manifest as fmt
    from sdk.errors import BundleError

    assert fmt._load_pem_public_key is serialization.load_pem_public_key
    private = ed25519.Ed25519PrivateKey.generate()
    pem = private.public_key().public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "signing.pub").write_bytes(pem)
    for given in (tmp_path / "signing.pub", str(tmp_path / "signing.pub"), pem, pem.decode()):
        key = fmt.load_public_key(given)
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        assert key.public_bytes_raw() == raw
        assert fmt.public_key_id(key) == hashlib.sha256(raw).hexdigest()
    other = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with pytest.raises(BundleError, match="ECPublicKey"):
        fmt.load_public_key(other)
    with pytest.raises(BundleError, match="not a PEM public key"):
        fmt.load_public_key(pem.replace(b"MCow", b"MCox"))


def test_sdk_utility_is_the_module_whatever_was_imported_first():
    # `utility` was also a lazy public name for the function: `sdk.utility` was the function until something
    # imported the submodule (every Router load does), the module afterwards, so `from sdk import utility;
    # utility(a, c, lam)` failed with "'module' object is not callable" in an app that had loaded a router.
    got = run_child(
        "import json, sdk\n"
        "first = sdk.utility\n"
        "from sdk import Router\n"
        "from sdk import utility\n"
        "print(json.dumps({'first': type(first).__name__, 'after': type(utility).__name__, 'same': first is utility,"
        " 'u': utility.utility([[0.5, 0.9]], [[0.001, 0.01]], 50.0).tolist()}))\n")
    assert got == {"first": "module", "after": "module", "same": True, "u": [[0.45, 0.4]]}
