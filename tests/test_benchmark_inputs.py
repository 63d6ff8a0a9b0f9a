"""Benchmarks that time the ONNX encoder recipes refuse, in one line and before any work, the static-embedder
router and bundle that the README's quick start 0 makes (``results/device/routers/kmeans``, ``bundles/kmeans``):
the docs used to name those as their inputs, and the scripts then failed deep inside (a missing
``tokenizer.json``, an ONNX export of ``static:all-MiniLM-L6-v2`` as a hub id)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from export.signing import generate_keypair
from tiny_kmeans import write_tiny_kmeans

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "routerbench"


@pytest.fixture(scope="module")
def static_artefacts(tmp_path_factory) -> dict[str, Path]:
    """A signed static-embedder bundle, its public key, and a router whose ``router.json`` names the static
    embedder as ``fedroute simulate --embedder static:...`` writes it (``kind`` and the ``static:`` name)."""
    out = tmp_path_factory.mktemp("static")
    key, pub = generate_keypair(out / "keys")
    bundle, router = write_tiny_kmeans(out, key)
    spec = json.loads((router / "router.json").read_text())
    spec["embedder"] |= {"kind": "static", "name": "static:all-MiniLM-L6-v2"}
    (router / "router.json").write_text(json.dumps(spec))
    return {"bundle": bundle, "router": router, "key": key, "pub": pub, "out": out}


def run(script: str, *args: str | Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script, extra", [
    ("max_tokens.py", []),
    ("choose_latency.py", ["--public-key", "PUB"]),
])
def test_encoder_benchmarks_refuse_a_static_bundle(static_artefacts, script, extra):
    extra = [static_artefacts["pub"] if a == "PUB" else a for a in extra]
    out = static_artefacts["out"] / f"results-{script}"
    result = run(script, "--bundle", static_artefacts["bundle"], *extra, "--data", DATA, "--out", out)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: --bundle {static_artefacts['bundle']} is a bundle of the 'static' embedder")
    assert "benchmarks/latency_bundle.py" in last
    assert not out.exists()


def test_latency_bundle_refuses_a_static_router(static_artefacts):
    out = static_artefacts["out"] / "latency"
    result = run("latency_bundle.py", "--router", static_artefacts["router"], "--out", out,
                 "--signing-key", static_artefacts["key"], "--data", DATA)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"latency_bundle.py: error: --router {static_artefacts['router']} was trained on the "
                           "'static' embedder (static:all-MiniLM-L6-v2)")
    assert "fedroute simulate --max-tokens 32" in last
    assert not out.exists()
