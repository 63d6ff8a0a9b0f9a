"""``fedroute export`` on a router folder whose ``router.json`` names an embedder it cannot rebuild.

A hand-edited or copied ``router.json`` (a non-numeric ``max_tokens``, an embedder that is not a
model, not cached offline or not a valid hub id) is an :class:`ExportError` naming the value, so the
command prints one line, not a numpy / transformers / huggingface_hub traceback; nothing is written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from export.errors import ExportError
from trainer.data.client_data import ClientData
from trainer.routers.kmeans_router import KMeansRouterConfig, fit_kmeans_router

MODELS = ("claude-instant-v1", "gpt-4-1106-preview")  # RouterBench models: the parity set has their labels


def _router_dir(tmp_path: Path, embedder: dict) -> Path:
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(40, 8)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    data = ClientData(emb, np.arange(40, dtype=np.int64) % 2, rng.uniform(size=40), np.full(40, 0.001))
    router = fit_kmeans_router(data, MODELS, KMeansRouterConfig(n_clusters=2), seed=0)
    router.embedder = embedder
    router.save(tmp_path / "router")
    return tmp_path / "router"


def _export(router_dir: Path, out: Path, signing_keys, routerbench_dir: Path):
    from export.pipeline import export_bundle

    return export_bundle(router_dir, out, signing_keys[0], data=routerbench_dir, progress=lambda _: None)


@pytest.mark.parametrize("field, value", [("max_tokens", "lots"), ("max_tokens", [256]), ("truncation_side", 7),
                                          ("name", 5), ("name", "")])
def test_a_router_json_embedder_field_of_the_wrong_type_is_an_export_error(tmp_path, signing_keys, routerbench_dir,
                                                                           field, value):
    router_dir = _router_dir(tmp_path, {"name": "all-MiniLM-L6-v2", "dim": 8})
    meta = json.loads((router_dir / "router.json").read_text())
    meta["embedder"][field] = value
    (router_dir / "router.json").write_text(json.dumps(meta))
    with pytest.raises(ExportError, match=f"embedder.{field}.*{value!r}"):
        _export(router_dir, tmp_path / "out", signing_keys, routerbench_dir)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["weird:x", "not-a-model-folder"])
def test_an_embedder_that_cannot_be_loaded_is_an_export_error_naming_it(tmp_path, signing_keys, routerbench_dir, name):
    if name == "not-a-model-folder":  # a folder, but no sentence-transformer in it
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("not a model")
        name = str(tmp_path / name)
    router_dir = _router_dir(tmp_path, {"name": name, "dim": 8, "max_tokens": 64, "truncation_side": "left"})
    with pytest.raises(ExportError, match=re.escape(f"cannot export the embedder {name!r} named in {router_dir}")):
        _export(router_dir, tmp_path / "out", signing_keys, routerbench_dir)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.__setitem__((1, 3), np.nan), r"centroids: cell 1 holds NaN or inf"),
    (lambda c: c.__setitem__((0, 0), np.inf), r"centroids: cell 0 holds NaN or inf"),
])
def test_a_kmeans_npz_with_a_nan_centroid_is_refused_when_the_router_loads(tmp_path, signing_keys, routerbench_dir,
                                                                           edit, message):
    """It loaded, and the export failed in its parity step with 'ShapeError: embeddings and centroids
    must be finite', naming neither the router folder nor the array."""
    router_dir = _router_dir(tmp_path, {"name": "all-MiniLM-L6-v2", "dim": 8})
    with np.load(router_dir / "kmeans.npz") as z:
        arrays = {k: z[k].copy() for k in z.files}
    edit(arrays["centroids"])
    np.savez(router_dir / "kmeans.npz", **arrays)
    with pytest.raises(ExportError, match=f"cannot load the router at {re.escape(str(router_dir))}: {message}"):
        _export(router_dir, tmp_path / "out", signing_keys, routerbench_dir)
    assert not (tmp_path / "out").exists()
