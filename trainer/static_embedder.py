"""The ``static`` embedder kind on the trainer side: model2vec tables distilled from a sentence-transformer.

Design notes: docs/static_embedder.md (Module notes).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from sdk.embedder import MAX_QUERY_CHARS
from sdk.errors import InvalidInputError
from trainer import kinds
from trainer.data.errors import DataUnavailableError
from trainer.embedder_kind import EmbedderConfig, EmbedderTrainerKind
from trainer.embedder_paths import resolve_model_path

#: PCA dimensions of a table distilled here (model2vec's default; d_emb of the routers).
PCA_DIMS = 256


def is_model2vec_folder(path: Path) -> bool:
    """True if ``path`` holds a saved model2vec model (``config.json`` with model_type model2vec)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type") == "model2vec"
    except (OSError, ValueError, AttributeError):
        return False


def distill_static(source: str, out: Path, pca_dims: int = PCA_DIMS) -> Path:
    """Distil the sentence-transformer ``source`` (folder, short name or hub id) into a model2vec
    folder ``out`` (written atomically: a temporary sibling renamed into place).

    Returns
    -------
    Path ``out``.

    Raises
    ------
    DataUnavailableError
        model2vec is not installed or the model cannot be loaded.
    """
    try:
        from model2vec.distill import distill  # trainer extra (model2vec[distill], torch): imported on use
    except ImportError as exc:
        raise DataUnavailableError("static embedders need model2vec[distill] (pip install 'fedroute[trainer]')") from exc
    path = resolve_model_path(source)
    try:
        model = distill(path, pca_dims=pca_dims, device="cpu")
    except (OSError, ValueError, RuntimeError) as exc:
        raise DataUnavailableError(f"cannot distil {source!r} (resolved to {path!r}): {exc}") from exc
    _plain_tokenizer(model)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _plain_tokenizer(model) -> None:
    model.tokenizer.no_padding()
    model.tokenizer.no_truncation()


def load_static_model(path: Path):
    """The ``model2vec.StaticModel`` at ``path`` as the device runs it: tokenizer without padding or
    truncation, ``normalize=True``, table widened from its stored dtype to float32 (the stored
    table is kept as ``model.stored_table`` for :func:`model_digest` and export).

    Raises
    ------
    InvalidInputError
        A model with vocabulary quantisation (token mapping or weights), which the device does not run.
    """
    from model2vec import StaticModel  # trainer extra (model2vec), imported on use

    model = StaticModel.from_pretrained(str(path), normalize=True)
    if model.token_mapping is not None or model.weights is not None:
        raise InvalidInputError(f"{path}: model2vec vocabulary quantisation (token mapping/weights) is not supported")
    _plain_tokenizer(model)
    model.stored_table = np.asarray(model.embedding).astype(np.float16)
    model.embedding = model.stored_table.astype(np.float32)
    return model


def model_digest(model) -> str:
    """sha256 (hex) of the float16 table and the tokenizer JSON the device gets."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(model.stored_table).tobytes())
    h.update(str(model.stored_table.shape).encode())
    h.update(model.tokenizer.to_str().encode())
    return h.hexdigest()


def encode_static(model, texts: list[str], show_progress: bool = False) -> np.ndarray:
    """``StaticModel.encode`` of each text's last MAX_QUERY_CHARS characters, no token cap:
    (n, dim) float32, rows L2-normalised.

    A text made only of unknown tokens (e.g. only emoji), which model2vec encodes as the zero
    vector, gets the ``[UNK]`` row, normalised, as on the device (:mod:`sdk.static_embedder`, step 2).
    A text that gives no token at all stays the zero vector (the device refuses it)."""
    clipped = [t[-MAX_QUERY_CHARS:] for t in texts]
    out = model.encode(clipped, max_length=None, use_multiprocessing=False, show_progress_bar=show_progress)
    out = np.asarray(out, dtype=np.float32).reshape(len(texts), -1)
    unk = model.unk_token_id
    empty = np.flatnonzero(~out.any(axis=1)) if unk is not None else ()
    for i in empty:  # rare: only these few texts are tokenised again
        if model.tokenizer.encode(clipped[i], add_special_tokens=False).ids:  # tokens, every one unknown
            out[i] = model.embedding[unk]
    return out / (np.linalg.norm(out, axis=1, keepdims=True) + np.float32(1e-32))


class StaticEmbedderTrainerKind(EmbedderTrainerKind):
    """``embedder/static``: model2vec table (see the design notes)."""

    name = "static"
    display_name = "static (model2vec)"

    def __init__(self) -> None:
        self._models: dict[str, object] = {}

    def resolve(self, spec: str, cache_dir: Path) -> Path:
        """The model2vec folder of ``spec``: the folder itself, or the distilled copy in
        ``<cache_dir>/static/`` (distilled on first use)."""
        if not spec:
            raise InvalidInputError("--embedder static: needs a model2vec folder or a sentence-transformer, "
                                    "e.g. static:all-MiniLM-L6-v2")
        out = self.resolve_path(spec, cache_dir)
        if not is_model2vec_folder(out):
            source = resolve_model_path(spec)
            print(f"distilling a static embedder from {source} with model2vec (PCA {PCA_DIMS}) into {out}")
            distill_static(spec, out)
        return out

    def resolve_path(self, spec: str, cache_dir: Path) -> Path:
        """Where :meth:`resolve` finds or puts the model2vec folder of ``spec`` (nothing is written)."""
        if is_model2vec_folder(Path(spec)):
            return Path(spec)
        source = resolve_model_path(spec)
        tag = hashlib.sha256(source.encode()).hexdigest()[:12]
        return Path(cache_dir) / "static" / f"{Path(source).name or 'model'}-{tag}-pca{PCA_DIMS}"

    def model(self, spec: str, cache_dir: Path):
        """The loaded StaticModel of ``spec`` (:func:`load_static_model`), kept per resolved folder."""
        folder = str(self.resolve(spec, cache_dir).resolve())
        if folder not in self._models:
            self._models[folder] = load_static_model(Path(folder))
        return self._models[folder]

    def load(self, directory: Path):
        return load_static_model(Path(directory))

    def cache_namespace(self, config: EmbedderConfig, spec: str, cache_dir: Path) -> str:
        return f"static:{model_digest(self.model(spec, cache_dir))[:32]}|last{MAX_QUERY_CHARS}chars|mean|unk|l2"

    def encode(self, config, spec, texts, cache_dir, show_progress):
        return encode_static(self.model(spec, cache_dir), texts, show_progress)

    def reading(self, config) -> str:
        return f"whole text, up to its last {MAX_QUERY_CHARS} characters"

    def router_entry(self, config, spec, dim, cache_dir) -> dict:
        return {"name": config.model, "kind": self.name, "dim": int(dim), "max_tokens": MAX_QUERY_CHARS,
                "truncation_side": "left", "pooling": "mean", "normalised": True,
                "table_sha256": model_digest(self.model(spec, cache_dir))}


kinds.register(StaticEmbedderTrainerKind())
