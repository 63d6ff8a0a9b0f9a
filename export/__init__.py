"""Compiles trained routers into signed ONNX bundles for the SDK (ARCHITECTURE.md §5).

Not built yet: it is the subject of the issue "On-device routing: ONNX bundles from `export`".
Its inputs are what ``fedroute simulate`` saves under ``results/routers/{mlp,kmeans}``:
``router.json`` (kind, models, embedder, cost scales) with ``router.safetensors`` (MLP) or
``kmeans.npz`` (centroids and per-(cell, model) statistics).
"""
