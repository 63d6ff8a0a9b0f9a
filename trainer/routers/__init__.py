"""Routers: one contract (:class:`trainer.routers.base.Router`) and a flat name -> class registry."""

from __future__ import annotations

from pathlib import Path

from sdk.errors import InvalidInputError
from trainer.routers.base import Router, read_meta
from trainer.routers.kmeans_router import KMeansRouter
from trainer.routers.mlp_router import MLPRouter

ROUTERS: dict[str, type[Router]] = {"mlp": MLPRouter, "kmeans": KMeansRouter}


def router_class(kind: str) -> type[Router]:
    """The router class registered under ``kind``; InvalidInputError lists the valid kinds."""
    try:
        return ROUTERS[kind]
    except KeyError:
        raise InvalidInputError(f"unknown router kind {kind!r}; valid: {sorted(ROUTERS)}") from None


def load_router(directory: str | Path) -> Router:
    """Load a router saved by ``Router.save`` (its kind is read from ``router.json``), with its
    ``embedder`` and ``provenance`` entries."""
    meta = read_meta(Path(directory))
    router = router_class(meta["kind"]).load(Path(directory))
    router.embedder = meta.get("embedder")
    router.provenance = meta.get("provenance")
    return router


__all__ = ["ROUTERS", "Router", "load_router", "router_class"]
