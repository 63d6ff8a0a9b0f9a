"""Router heads on the device: embedding -> predicted accuracy and cost (USD) per model.

- :class:`MlpScorer` runs ``router.onnx`` (paper 002, MLP router: trunk + per-model accuracy and
  cost heads; the export folds the cost scale in, so ``cost`` is USD per query).
- :class:`KMeansScorer` looks up the Voronoi cell of the embedding in ``kmeans.npz`` and returns that
  cell's per-model accuracy and cost (paper 002, K-means router).

Both check, at construction, that the router file names the same models in the same order as the
manifest's price table and was trained on the bundle's embedder; any mismatch is a BundleError.
NaN in a prediction means "no estimate for this model"; such a model is never chosen.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from sdk.arrays import is_npz
from sdk.embedder import FLOAT, inference_session, run_session
from sdk.errors import BundleError
from sdk.voronoi import CentroidTable


def _check_models(router_models: Sequence[str], manifest_models: Sequence[str], where: str) -> None:
    router_models, manifest_models = list(router_models), list(manifest_models)
    no_head = [m for m in manifest_models if m not in router_models]
    no_price = [m for m in router_models if m not in manifest_models]
    if router_models != manifest_models:
        raise BundleError(f"price table and {where} disagree: models without a router head {no_head}, router heads "
                          f"without a price-table entry {no_price}" if no_head or no_price
                          else f"{where} orders models {router_models}, the price table {manifest_models}")


def _check_embedder(name: str, dim: int, embedder: dict[str, Any], where: str) -> None:
    if name != embedder["name"] or dim != embedder["dim"]:
        raise BundleError(
            f"{where} was trained on embedder {name!r} (dim {dim}) but the bundle ships "
            f"{embedder['name']!r} (dim {embedder['dim']})"
        )


class MlpScorer:
    """``router.onnx``: input ``embedding (batch, d_emb) float32``, outputs ``accuracy`` and
    ``cost`` ``(batch, n_models) float32`` (cost in USD per query; NaN for models never observed).

    Raises
    ------
    BundleError
        Unloadable graph, wrong input/output names, types, ranks or dimensions, missing or
        malformed metadata, or models / embedder that differ from the manifest.
    """

    cells = False

    def __init__(self, model: bytes, models: Sequence[str], embedder: dict[str, Any], options: Any) -> None:
        self._session = inference_session(model, options, "router.onnx")
        meta = self._session.get_modelmeta().custom_metadata_map
        try:
            router_models = json.loads(meta["models"])
            emb_name, emb_dim = meta["embedder_name"], int(meta["embedder_dim"])
        except (KeyError, ValueError) as exc:
            raise BundleError(f"router.onnx lacks models/embedder metadata ({exc})") from exc
        if not isinstance(router_models, list) or not all(isinstance(m, str) for m in router_models):
            raise BundleError(f"router.onnx metadata 'models' must be a JSON list of model ids, got {meta['models']!r:.80}")
        _check_models(router_models, models, "router.onnx")
        _check_embedder(emb_name, emb_dim, embedder, "router.onnx")
        inputs = self._session.get_inputs()
        outputs = {o.name: o.shape for o in self._session.get_outputs()}
        if len(inputs) != 1 or inputs[0].type != FLOAT or not inputs[0].shape or inputs[0].shape[-1] != embedder["dim"] \
                or any(len(outputs.get(n) or ()) != 2 or outputs[n][-1] != len(models) for n in ("accuracy", "cost")):
            raise BundleError(f"router.onnx must have one {FLOAT} input (batch, {embedder['dim']}) and outputs "
                              f"'accuracy', 'cost' of shape (batch, {len(models)}), got inputs "
                              f"{[(i.name, i.type, i.shape) for i in inputs]} and outputs {outputs}")
        self._input = inputs[0].name
        self._n_models = len(models)

    def predict(self, embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
        """(accuracy, cost USD) of shape (n, n_models) float64, and no cell ids.

        Raises
        ------
        BundleError
            onnxruntime fails to run the graph, or it returns another shape or an infinite value
            (NaN stays: no estimate).
        """
        acc, cost = run_session(self._session, ["accuracy", "cost"], {self._input: embeddings}, "router.onnx")
        acc, cost = np.asarray(acc, dtype=np.float64), np.asarray(cost, dtype=np.float64)
        expected = (embeddings.shape[0], self._n_models)
        if acc.shape != expected or cost.shape != expected or np.isinf(acc).any() or np.isinf(cost).any():
            raise BundleError(f"router.onnx predicted an infinite accuracy or cost, or accuracy {acc.shape} and cost "
                              f"{cost.shape} instead of {expected} (a corrupt router graph)")
        return acc, cost, None


#: Array of ``kmeans.npz`` -> (accepted ``dtype.kind`` codes, ndim, description for errors).
_KMEANS_ARRAYS = {
    "centroids": ("fiu", 2, "a 2-D array of real numbers"),
    "accuracy": ("fiu", 2, "a 2-D array of real numbers"),
    "cost": ("fiu", 2, "a 2-D array of real numbers"),
    "count": ("fiu", 2, "a 2-D array of real numbers"),
    "models": ("U", 1, "a 1-D array of strings"),
    "embedder_name": ("U", 0, "a string"),
    "embedder_dim": ("iu", 0, "an integer"),
}
#: ``prior_strength`` of a ``kmeans.npz`` exported before the file carried it: the trainer's default
#: shrinkage (``trainer.routers.kmeans_router.KMeansRouterConfig.prior_strength``).
DEFAULT_PRIOR_STRENGTH = 16.0


class KMeansScorer:
    """``kmeans.npz``: ``centroids (K, d_emb) float32``, ``accuracy``, ``cost`` ``(K, n_models)``
    (shrunk cell means, cost in USD; NaN where no estimate), ``count (K, n_models)``, ``models``,
    ``embedder_name``, ``embedder_dim``, and ``prior_strength`` (scalar >= 0, the pseudo-observations
    the means were shrunk with; :data:`DEFAULT_PRIOR_STRENGTH` when absent, a bundle exported before
    the file carried it).

    Raises
    ------
    BundleError
        Unreadable archive (or not an ``.npz``), missing arrays, arrays of the wrong dtype (e.g.
        strings where numbers belong, an embedder dimension that is not an integer), wrong shapes,
        non-finite centroids, accuracy outside [0, 1], negative costs, or models / embedder that
        differ from the manifest.
    """

    cells = True

    def __init__(self, data: bytes, models: Sequence[str], embedder: dict[str, Any]) -> None:
        if not is_npz(data):  # np.load would read a .npy as one array, anything else as a pickle
            raise BundleError("kmeans.npz cannot be read (not a zip archive, so not an .npz)")
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                arrays = {k: z[k] for k in ("centroids", "accuracy", "cost", "count", "models", "embedder_name", "embedder_dim")}
                strength = z["prior_strength"] if "prior_strength" in z.files else np.array(DEFAULT_PRIOR_STRENGTH)
        except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise BundleError(f"kmeans.npz cannot be read ({exc})") from exc
        for name, (kinds, ndim, what) in _KMEANS_ARRAYS.items():
            a = arrays[name]
            if a.dtype.kind not in kinds or a.ndim != ndim:
                raise BundleError(f"kmeans.npz {name} must be {what}, got a {a.ndim}-D {a.dtype} array")
        _check_models([str(m) for m in arrays["models"]], models, "kmeans.npz")
        _check_embedder(str(arrays["embedder_name"]), int(arrays["embedder_dim"]), embedder, "kmeans.npz")
        centroids = np.ascontiguousarray(arrays["centroids"], dtype=np.float32)
        k, m = centroids.shape[0], len(models)
        acc, cost = arrays["accuracy"].astype(np.float64), arrays["cost"].astype(np.float64)
        shapes = {"centroids": (max(k, 1), embedder["dim"]), "accuracy": (k, m), "cost": (k, m), "count": (k, m)}
        rules = [(name, arrays[name].shape == shape, f"of shape {shape} (K >= 1, embedder dim, models), got "
                  f"{arrays[name].shape}") for name, shape in shapes.items()] + [
            ("centroids", np.isfinite(centroids).all(), "finite (no NaN/inf)"),
            ("accuracy", bool(np.all((acc >= 0) & (acc <= 1) | np.isnan(acc))), "in [0, 1] (NaN = no estimate)"),
            ("cost", bool(np.all((cost >= 0) & (cost < np.inf) | np.isnan(cost))), "finite and >= 0 USD (NaN = no estimate)"),
            ("prior_strength", strength.dtype.kind in "fiu" and strength.ndim == 0 and 0 <= float(strength) < np.inf,
             f"a finite real number >= 0, got {strength!r:.80}")]
        for name, accepted, what in rules:
            if not accepted:
                raise BundleError(f"kmeans.npz {name} must be {what}")
        self.centroids = centroids
        self._cells = CentroidTable(centroids)
        self.accuracy, self.cost = acc, cost
        self.count = arrays["count"]
        self.prior_strength = float(strength)

    def predict(self, embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(accuracy, cost USD) of shape (n, n_models) float64, and the cell id per query (n,) int64."""
        cells = self._cells.nearest(embeddings)
        return self.accuracy[cells], self.cost[cells], cells
