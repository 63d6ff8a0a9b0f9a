"""A tiny signed K-means bundle for operator and device tests: no sentence-transformers, no ONNX.

A 2-cell K-means router on 3-d static embeddings of a 4-token vocabulary (float16 and int8
tables), its statistics counted from 16 points and assembled and signed by the exporter's own code
(no parity step). About a second to build, so CLI tests of ``fedroute rounds`` / ``publish`` /
``fedroute-sync`` need neither the exported MiniLM encoder nor RouterBench embeddings, and the
proxy-only install's tests (no scikit-learn, no torch) build it too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB = {"[UNK]": 0, "a": 1, "b": 2, "c": 3}
#: Static embedding of each token of VOCAB, (4, 3) float32.
TABLE = np.array([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.6, 0.8, 0.0]], dtype=np.float32)
MODELS = ("model-x", "model-y")


def write_tiny_kmeans(out: Path, signing_key: Path, embedder_name: str = "tiny-static",
                      version: int = 1, config=None, n_copies: int = 1) -> tuple[Path, Path]:
    """Write ``out/bundle`` (signed with ``signing_key``) and ``out/router`` (the trainer router it
    was exported from, for ``--prior-router``); returns (bundle, router) paths. ``embedder_name``
    names the static embedder in the manifest (another name: a bundle of "another" embedder);
    ``version`` is its ``bundle_version``; ``config`` a ``KMeansRouterConfig`` (default: 2 cells,
    the trainer's shrinkage); ``n_copies`` how many times the 16 evaluations are logged.

    Queries near "a" ([1, 0, 0]) were answered right by model-x, near "b" ([0, 1, 0]) by model-y,
    at the same cost (0.001 USD)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from export.bundle_writer import write_bundle
    from export.embedder_export import BundleEmbedder
    from export.pipeline import assemble_bundle
    from export.signing import load_signing_key
    from sdk.static_embedder import STATIC_TABLE_FILES, encode_table
    from trainer.data.client_data import ClientData
    from trainer.routers.kmeans_router import KMeansRouter, KMeansRouterConfig, client_statistics

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    files = {"tokenizer.json": tok.to_str().encode()}
    files.update({STATIC_TABLE_FILES[p]: encode_table(TABLE, p) for p in ("fp32", "int8")})
    entry = {"name": embedder_name, "dim": 3, "max_tokens": 65_536, "truncation_side": "left", "pooling": "mean",
             "normalised": True, "files": {p: STATIC_TABLE_FILES[p] for p in ("fp32", "int8")}}
    emb = np.array([[1, 0, 0]] * 4 + [[0, 1, 0]] * 4, dtype=np.float32)
    data = ClientData(np.tile(np.repeat(emb, 2, axis=0), (n_copies, 1)), np.tile([0, 1], 8 * n_copies).astype(np.int64),
                      np.tile(np.array([1, 0] * 4 + [0, 1] * 4, dtype=np.float64), n_copies), np.full(16 * n_copies, 0.001))
    config = config or KMeansRouterConfig(n_clusters=2)
    # The points sit on 2 distinct embeddings: the centroids Lloyd's K-means finds with >= 2 cells.
    centroids = np.unique(emb, axis=0)
    router = KMeansRouter(centroids, client_statistics(data, centroids, len(MODELS)), list(MODELS),
                          config.prior_strength, config.model_prior_strength, config.prior)
    router.embedder = {k: v for k, v in entry.items() if k != "files"}
    out = Path(out)
    router.save(out / "router")
    bundle_files, fields = assemble_bundle(router, BundleEmbedder(files, entry, "static"), {}, version)
    write_bundle(out / "bundle", bundle_files, fields, load_signing_key(signing_key))
    return out / "bundle", out / "router"
