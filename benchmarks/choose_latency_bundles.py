"""The bundles ``benchmarks/choose_latency.py`` measures, built from a clean clone in one command.

Writes under ``--out`` (reused when already there, so a second run starts at once):

- ``keys/signing.key``, ``keys/signing.pub``: a fresh Ed25519 key pair (``export.signing``);
- ``routers/kmeans-minilm32``: a K-means router (the device profile's settings, K = 6 cells) fitted
  centrally on every labelled (query, model) pair of the RouterBench train split, embedded by
  all-MiniLM-L6-v2 (last 32 tokens, left truncation);
- ``bundles/latency``: its bundle with the fp32, int8 and int8-all ONNX encoders, written by
  ``benchmarks/latency_bundle.py`` (``fedroute export``'s steps, parity report stored, not enforced);
- ``routers/kmeans-static``: the same fit on the static embedder's embeddings (model2vec, distilled
  locally from all-MiniLM-L6-v2, whole prompt; ``static:all-MiniLM-L6-v2``);
- ``bundles/static``: its bundle by ``export.pipeline.export_bundle`` (float16 + int8 tables, parity
  gated, as ``fedroute export --int8``).

The routers only need to be real routers of the right kind and size for latency, cold start and RSS
(the time is spent embedding); their routing quality is measured elsewhere (``fedroute simulate``,
``benchmarks/static_embedder_table.py``). CPU time: ~1 min with a warm embedding cache, a few more
on a fresh machine (the ONNX export and, once, model2vec's distillation).

    python benchmarks/choose_latency_bundles.py --data ../shared/data/routerbench --out results/latency-bundles
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Embedder specs of the two routers (trainer ``--embedder`` / ``EmbedderConfig.model``).
ONNX_EMBEDDER = ("all-MiniLM-L6-v2", 32)
STATIC_EMBEDDER = "static:all-MiniLM-L6-v2"


@dataclass(frozen=True)
class LatencyBundles:
    """Paths written by :func:`build`."""

    bundle: Path
    static_bundle: Path
    public_key: Path


def fit_router(data: Path, out: Path, config, cache_dir: Path | None = None) -> Path:
    """Fit a K-means router (default config, seed 0) on the train split's labelled pairs embedded
    with ``config`` (an ``EmbedderConfig``) and save it to ``out``; returns ``out``."""
    from trainer.data.client_data import ClientData
    from trainer.data.routerbench import load_routerbench_dir
    from trainer.embeddings import embed_texts
    from trainer.routers.kmeans_router import KMeansRouterConfig, fit_kmeans_router

    train, _ = load_routerbench_dir(data)
    emb = embed_texts(list(train.prompts), config, cache_dir)
    rows, cols = np.nonzero(train.labelled())
    dense = ClientData(emb[rows], cols.astype(np.int64), train.accuracy[rows, cols], train.cost[rows, cols])
    router = fit_kmeans_router(dense, train.models, KMeansRouterConfig(), seed=0)
    router.embedder = config.router_entry(router.d_emb, cache_dir)
    router.provenance = {"train": str(data / "train.parquet"), "test": str(data / "test.parquet"), "seed": 0}
    router.save(out)
    return out


def build(data: Path, out: Path, cache_dir: Path | None = None) -> LatencyBundles:
    """Build (or reuse) the keys, routers and bundles listed in the module docstring."""
    from export.pipeline import export_bundle
    from export.signing import generate_keypair
    from trainer.embeddings import EmbedderConfig

    import latency_bundle  # benchmarks/ is on sys.path when this runs as a script or from choose_latency

    keys = out / "keys"
    key, pub = keys / "signing.key", keys / "signing.pub"
    if not (key.exists() and pub.exists()):
        key, pub = generate_keypair(keys)
    bundle, static_bundle = out / "bundles" / "latency", out / "bundles" / "static"
    if not (bundle / "manifest.json").exists():
        model, max_tokens = ONNX_EMBEDDER
        router = fit_router(data, out / "routers" / "kmeans-minilm32",
                            EmbedderConfig(model=model, max_tokens=max_tokens, truncation_side="left"), cache_dir)
        latency_bundle.main(["--router", str(router), "--out", str(bundle), "--signing-key", str(key),
                             "--data", str(data)])
    if not (static_bundle / "manifest.json").exists():
        router = fit_router(data, out / "routers" / "kmeans-static", EmbedderConfig(model=STATIC_EMBEDDER), cache_dir)
        export_bundle(router, static_bundle, key, int8=True, data=data, cache_dir=cache_dir)
    return LatencyBundles(bundle, static_bundle, pub)


def main(argv: list[str] | None = None) -> LatencyBundles:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="RouterBench folder (train.parquet, test.parquet)")
    parser.add_argument("--out", type=Path, default=Path("results/latency-bundles"))
    args = parser.parse_args(argv)
    made = build(args.data, args.out)
    print(f"bundle {made.bundle}\nstatic bundle {made.static_bundle}\npublic key {made.public_key}")
    return made


if __name__ == "__main__":
    main()
