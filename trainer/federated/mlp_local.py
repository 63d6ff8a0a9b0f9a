"""A client's local step of a federated MLP round over HTTPS, and the MLP wire format.

The on-device SDK has no torch, so it cannot train; clients that can (a desktop app, an edge server,
``pip install 'fedroute[trainer]'``) pass :func:`train_on_log` to :class:`sdk.SyncClient` as its
``mlp_trainer`` (``fedroute sync`` does so when torch is importable). The step is paper 002's:
start from the round's global parameters, one local epoch of AdamW on the observed (query, model)
pairs of the client's log (:func:`trainer.routers.mlp_router.local_train`), upload the parameters
and the sample count; the server averages (:mod:`trainer.federated.mlp_aggregation`).

Wire format: parameters travel as ``safetensors`` bytes (no pickle), name -> float32 array, and an
upload carries its envelope as one JSON string (sorted keys, so the bytes are reproducible) under
the safetensors metadata key ``fedroute``: ``client_id``, ``round_id``, ``kind`` (``"mlp"``),
``parameters_hash`` (sha256 of the round's parameters bytes it trained from), ``n_samples`` and
``log_size``. Training is seeded from (client id, round id), so a rerun on the same
log uploads the same bytes (and the server's idempotency recognises it).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping

import numpy as np

from sdk.errors import PayloadError, ShapeError
from sdk.eval_log import Evaluations
from trainer.data.client_data import ClientData
from trainer.routers.mlp_router import MLPRouterConfig, Party, build_network, local_train

UPLOAD_FIELDS = ("client_id", "round_id", "kind", "parameters_hash", "n_samples", "log_size")


ENVELOPE_KEY = "fedroute"


def parameters_bytes(parameters: Mapping[str, np.ndarray], envelope: Mapping | None = None) -> bytes:
    """safetensors bytes of float32 ``parameters`` with the JSON ``envelope`` in the metadata.
    Deterministic: the same parameters and envelope give the same bytes."""
    from safetensors.numpy import save  # trainer extra (safetensors), imported on use

    arrays = {k: np.ascontiguousarray(parameters[k], dtype=np.float32) for k in sorted(parameters)}
    metadata = None if envelope is None else {ENVELOPE_KEY: json.dumps(dict(envelope), sort_keys=True)}
    return save(arrays, metadata=metadata)


def read_parameters(data: bytes) -> tuple[dict[str, np.ndarray], dict]:
    """(parameters, envelope) of safetensors bytes (envelope ``{}`` if none). Tensors are decoded by
    ``safetensors``; the metadata is read from the format's JSON header (8-byte little-endian
    length, then the header), which ``safetensors`` exposes only for files.

    Raises
    ------
    PayloadError
        Not safetensors, or an envelope that is not a JSON object.
    ShapeError
        A tensor that is not float32.
    """
    from safetensors import SafetensorError  # trainer extra (safetensors), imported on use
    from safetensors.numpy import load  # trainer extra (safetensors), imported on use

    try:
        arrays = load(data)
        (n,) = struct.unpack("<Q", data[:8])
        metadata = json.loads(data[8:8 + n]).get("__metadata__") or {}
        envelope = json.loads(metadata[ENVELOPE_KEY]) if ENVELOPE_KEY in metadata else {}
    except (SafetensorError, ValueError, TypeError, AttributeError, RecursionError, struct.error) as exc:
        raise PayloadError(f"not a valid safetensors body: {exc}") from exc
    for k, v in arrays.items():
        if v.dtype != np.float32:
            raise ShapeError(f"parameter '{k}' must be float32, got {v.dtype}")
    if not isinstance(envelope, dict):
        raise PayloadError(f"safetensors metadata '{ENVELOPE_KEY}' must hold a JSON object")
    return arrays, envelope


def _client_data(evaluations: Evaluations, models: list[str], d_emb: int):
    emb = evaluations.embedding
    n = len(evaluations)
    if n and emb.shape[1] not in (0, d_emb):
        raise ShapeError(f"the log's embeddings have dimension {emb.shape[1]}, the round expects {d_emb}")
    index = {m: i for i, m in enumerate(models)}
    model_idx = np.array([index.get(m, -1) for m in evaluations.model], dtype=np.int64)
    has = np.isfinite(emb).all(axis=1) if emb.shape[1] else np.zeros(n, dtype=bool)
    keep = has & (model_idx >= 0)
    return ClientData(emb[keep].astype(np.float32), model_idx[keep], evaluations.score[keep],
                      evaluations.cost_usd[keep])


def train_on_log(evaluations: Evaluations, round_: Mapping, parameters: bytes, client_id: str) -> bytes | None:
    """The client's upload for an MLP round: its parameters after one local epoch on its log.

    Parameters
    ----------
    evaluations : the client's ``EvalLog.rows()``; embeddings (n, d_emb) float32.
    round_ : the round as ``GET /v1/rounds/current`` describes it (models, d_emb, hidden, dropout,
        cost_scale_usd, min_count, round_id, parameters_hash, local_epochs).
    parameters : safetensors bytes of the round's global parameters.
    client_id : this client's id (from the same answer).

    Returns
    -------
    safetensors bytes to upload (envelope in the metadata), or None when the log holds fewer than
    ``min_count`` usable samples (nothing is uploaded: a tiny update would reveal too much).

    Raises
    ------
    ShapeError
        The parameters do not fit the round's network, or the log's embeddings another dimension.
    """
    import torch  # trainer extra: only devices that train import it

    models = list(round_["models"])
    data = _client_data(evaluations, models, int(round_["d_emb"]))
    if data.n_samples < max(1, int(round_["min_count"])):
        return None
    state, _ = read_parameters(parameters)
    config = MLPRouterConfig(hidden=int(round_["hidden"]), dropout=float(round_["dropout"]),
                             local_epochs=int(round_.get("local_epochs", 1)), val_fraction=0.0)
    net = build_network(int(round_["d_emb"]), len(models), config.hidden, config.dropout)
    try:
        net.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    except RuntimeError as exc:
        raise ShapeError(f"round parameters do not fit the network: {exc}") from exc
    scale = np.array([np.nan if s is None else float(s) for s in round_["cost_scale_usd"]])
    cost_scale = np.where(np.isfinite(scale) & (scale > 0), scale, 1.0)
    seed = int.from_bytes(hashlib.sha256(f"{client_id}/{round_['round_id']}".encode()).digest()[:4], "little")
    torch.manual_seed(seed)
    empty = data.subset(np.zeros(0, dtype=np.int64))
    local_train(net, Party(data, empty), cost_scale, config, torch.Generator().manual_seed(seed))
    new = {k: v.detach().cpu().numpy() for k, v in net.state_dict().items()}
    return parameters_bytes(new, {
        "client_id": client_id, "round_id": int(round_["round_id"]), "kind": "mlp",
        "parameters_hash": str(round_["parameters_hash"]), "n_samples": data.n_samples,
        "log_size": data.n_samples,
    })
