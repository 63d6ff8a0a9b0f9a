"""Trained routers -> the bundle's router file (ARCHITECTURE.md §5).

Design notes: docs/device-and-bundles.md (Module notes).
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import numpy as np

from export.embedder_onnx import quiet_libraries
from export.errors import ExportError

OPSET = 17


def _embedder_identity(router) -> tuple[str, int]:
    emb = getattr(router, "embedder", None)
    if not emb or "name" not in emb:
        raise ExportError("router.json has no 'embedder' entry (name, dim): retrain with this fedroute version")
    if int(emb.get("dim", router.d_emb)) != router.d_emb:
        raise ExportError(f"router.json embedder dim {emb.get('dim')} != router input dim {router.d_emb}")
    return str(emb["name"]), int(router.d_emb)


def mlp_to_onnx(router) -> bytes:
    """``router.onnx`` bytes for a trained :class:`trainer.routers.mlp_router.MLPRouter`.

    Raises
    ------
    ExportError
        The router has no embedder identity.
    """
    import onnx  # export needs onnx (trainer extra), imported on use
    import torch  # trainer extra (torch), imported on use
    from torch import nn  # trainer extra (torch), imported on use

    name, dim = _embedder_identity(router)
    net = router.network.eval()
    n_models = len(router.models)
    scale = np.where(np.isfinite(router.cost_scale_), router.cost_scale_, 0.0)
    mask = np.where(router.available_, 0.0, np.nan)

    class Exported(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk = net.trunk
            self.accuracy = nn.Linear(net.accuracy_head.in_features, n_models)
            self.cost = net.cost_head
            with torch.no_grad():
                self.accuracy.weight.copy_(net.accuracy_head.weight + net.shared_accuracy.weight)
                self.accuracy.bias.copy_(net.accuracy_head.bias)
            self.register_buffer("scale", torch.tensor(scale, dtype=torch.float32))
            self.register_buffer("mask", torch.tensor(mask, dtype=torch.float32))

        def forward(self, embedding: torch.Tensor):
            h = self.trunk(embedding)
            return self.accuracy(h) + self.mask, self.cost(h) * self.scale + self.mask

    module = Exported().eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "router.onnx"
        with torch.no_grad(), quiet_libraries():
            torch.onnx.export(
                module, (torch.zeros(2, dim),), str(path), dynamo=False, opset_version=OPSET,
                input_names=["embedding"], output_names=["accuracy", "cost"],
                dynamic_axes={"embedding": {0: "batch"}, "accuracy": {0: "batch"}, "cost": {0: "batch"}},
            )
        model = onnx.load(str(path))
    for key, value in {"models": json.dumps(list(router.models)), "embedder_name": name,
                       "embedder_dim": str(dim), "router_kind": "mlp"}.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.checker.check_model(model)
    return model.SerializeToString()


def kmeans_to_npz(router) -> bytes:
    """``kmeans.npz`` bytes for a trained :class:`trainer.routers.kmeans_router.KMeansRouter`.

    Raises
    ------
    ExportError
        The router has no embedder identity.
    """
    name, dim = _embedder_identity(router)
    buf = io.BytesIO()
    np.savez(
        buf,
        centroids=np.ascontiguousarray(router.centroids_, dtype=np.float32),
        accuracy=np.asarray(router.accuracy_, dtype=np.float64),
        cost=np.asarray(router.cost_, dtype=np.float64),
        count=np.asarray(router.statistics_.count, dtype=np.float64),
        prior_strength=np.array(router.prior_strength, dtype=np.float64),
        models=np.array(list(router.models), dtype=np.str_),
        embedder_name=np.array(name, dtype=np.str_),
        embedder_dim=np.array(dim, dtype=np.int64),
    )
    return buf.getvalue()
