"""Validation of an uploaded update (ARCHITECTURE.md §6): every check names the field.

MLP uploads (safetensors, :mod:`trainer.federated.mlp_local`) must have the round's parameter names
and shapes, finite values, and ``min_count <= n_samples <= log_size``. K-means uploads:

The body is JSON (``application/json``) or MessagePack (``application/msgpack``) holding the object
written by :meth:`sdk.local_update.KMeansUpdate.to_payload`. Checks, in order: the envelope's types
(pydantic, unknown fields refused), the round's kind, partition and models, shapes and finite values,
then :class:`sdk.CellStatistics` (counts >= 0, sums of scores in ``[0, count]`` i.e. scores in
[0, 1], sums of costs >= 0) and :func:`trainer.federated.update_checks.check_kmeans_update` (whole
counts summing to at most ``log_size``, the privacy threshold ``min_count`` for entries and reported
cell means, mean embeddings of norm <= 1).
"""

from __future__ import annotations

import json
from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sdk.cell_statistics import CellStatistics
from sdk.errors import PayloadError, PrivacyError, ShapeError
from sdk.local_update import KMeansUpdate
from trainer.federated.mlp_local import UPLOAD_FIELDS, read_parameters
from trainer.federated.update_checks import check_kmeans_update
from trainer.server.errors import UploadRejected
from trainer.server.round_kind import ParsedUpload
from trainer.server.store import Round


#: Largest count, weight or sample number accepted (the SQLite/PostgreSQL INTEGER range, and far
#: beyond any device's log).
MAX_COUNT = 2**31 - 1
#: Cost bound of one query (USD) when the round sets no max_cost_usd: rejects absurd sums that
#: would overflow the merge.
MAX_COST_PER_QUERY_USD = 1000.0

Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]


class UpdateBody(BaseModel):
    """Envelope of ``POST /v1/rounds/{round_id}/updates``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    client_id: str = Field(min_length=1, max_length=64)
    round_id: int = Field(ge=1)
    kind: str
    centroids_hash: str = Field(min_length=64, max_length=64)
    models: list[str]
    log_size: Count
    count: list[list[float | int]]
    sum_accuracy: list[list[float | int]]
    sum_cost: list[list[float | int]]
    centroid_cells: list[Count]
    local_centroids: list[list[float | int]]
    local_weights: list[float | int]


SAFETENSORS_TYPES = ("application/x-safetensors", "application/vnd.safetensors")


def parse_mlp_upload(raw: bytes) -> ParsedUpload:
    """Decode an MLP upload (safetensors with the ``fedroute`` metadata envelope); its ``content``
    is ``(parameters, metadata)``.

    Raises
    ------
    UploadRejected
        400 undecodable, 422 a malformed envelope.
    """
    try:
        parameters, metadata = read_parameters(raw)
    except (PayloadError, ShapeError) as exc:
        raise UploadRejected(400, str(exc)) from exc
    missing = [f for f in UPLOAD_FIELDS if f not in metadata]
    if missing:
        raise UploadRejected(422, f"the upload's envelope (safetensors metadata 'fedroute') lacks {missing}")
    round_id = metadata["round_id"]
    if not isinstance(round_id, int) or isinstance(round_id, bool) or not 1 <= round_id <= MAX_COUNT:
        raise UploadRejected(422, f"round_id {round_id!r} is not an integer")
    return ParsedUpload(str(metadata["client_id"]), round_id, str(metadata["kind"]), (parameters, metadata), raw)


def validate_mlp_update(parameters: dict, metadata: dict, round_: Round) -> int:
    """Check MLP parameters against the round's; return the upload's log size.

    Raises
    ------
    UploadRejected
        409 trained from other parameters than the round's; 422 other names, shapes, NaN/inf,
        ``n_samples`` below ``min_count`` or above ``log_size``.
    """
    if str(metadata["parameters_hash"]) != round_.base_hash:
        raise UploadRejected(409, f"update was trained from other parameters than round {round_.id}'s")
    try:
        n_samples, log_size = metadata["n_samples"], metadata["log_size"]
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT
                   for v in (n_samples, log_size)):
            raise ValueError("not integers")
    except ValueError as exc:
        raise UploadRejected(422, f"n_samples and log_size must be integers in [0, {MAX_COUNT}]") from exc
    if not round_.min_count <= n_samples <= log_size:
        raise UploadRejected(422, f"need min_count={round_.min_count} <= n_samples={n_samples} <= log_size={log_size}")
    base, _ = read_parameters(round_.parameters)
    if set(parameters) != set(base):
        raise UploadRejected(422, f"parameter names differ from the round's: {sorted(set(parameters) ^ set(base))[:5]}")
    for name, value in parameters.items():
        if value.shape != base[name].shape:
            raise UploadRejected(422, f"'{name}' has shape {value.shape}, the round's has {base[name].shape}")
        if not np.isfinite(value).all():
            raise UploadRejected(422, f"'{name}' holds NaN or infinity")
    return log_size


def media_type(content_type: str | None) -> str:
    """The media type of a ``Content-Type`` header, lower case, without parameters."""
    return (content_type or "").split(";")[0].strip().lower()


def decode_body(raw: bytes, content_type: str) -> object:
    """Decode a JSON or MessagePack body.

    Raises
    ------
    UploadRejected
        415 for another content type, 400 for an undecodable body.
    """
    media = media_type(content_type)
    try:
        if media == "application/json":
            return json.loads(raw)
        if media in ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack"):
            import msgpack  # server extra (msgpack), only for MessagePack bodies

            return msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - json and msgpack raise several unrelated classes on bad input
        raise UploadRejected(400, f"body is not valid {media}: {type(exc).__name__}") from exc
    raise UploadRejected(415, "content type must be application/json or application/msgpack (K-means) or "
                              f"application/x-safetensors (MLP), got {content_type!r}")


def parse_envelope(obj: object) -> UpdateBody:
    """The typed envelope, or 422 naming the first bad fields."""
    try:
        return UpdateBody.model_validate(obj)
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc'][:2])) or 'body'}: {e['msg']}" for e in exc.errors()[:5])
        raise UploadRejected(422, f"invalid update: {errors}") from exc


def _matrix(name: str, rows: list, shape: tuple[int, int]) -> np.ndarray:
    if len(rows) != shape[0] or any(len(r) != shape[1] for r in rows):
        got = (len(rows), sorted({len(r) for r in rows}))
        raise UploadRejected(422, f"{name} must have shape {shape}, got {got[0]} rows of lengths {got[1]}")
    try:
        arr = np.array(rows, dtype=np.float64).reshape(shape)
    except OverflowError as exc:
        raise UploadRejected(422, f"{name} holds a number outside the float64 range") from exc
    if not np.isfinite(arr).all():
        raise UploadRejected(422, f"{name} holds NaN or infinity")
    return arr


def validate_update(body: UpdateBody, round_: Round) -> KMeansUpdate:
    """Check ``body`` against ``round_`` and return the update it holds.

    Raises
    ------
    UploadRejected
        409 for an update computed for another partition (centroids) or of another kind; 422 for
        everything else listed in the module docstring (the checks of
        :func:`trainer.federated.update_checks.check_kmeans_update`, shared with Flower).
    """
    if body.centroids_hash != round_.centroids_hash:
        raise UploadRejected(409, f"update was computed for other centroids than round {round_.id}'s; "
                                  "fetch /v1/rounds/current again")
    if tuple(body.models) != round_.models:
        raise UploadRejected(422, f"models must be the round's {list(round_.models)} in that order")
    shape = (round_.centroids.shape[0], len(round_.models))
    count = _matrix("count", body.count, shape)
    s_acc = _matrix("sum_accuracy", body.sum_accuracy, shape)
    s_cost = _matrix("sum_cost", body.sum_cost, shape)
    if (count > MAX_COUNT).any():
        raise UploadRejected(422, f"count must be <= {MAX_COUNT}")
    c_max = round_.settings.aggregation.get("max_cost_usd") or MAX_COST_PER_QUERY_USD
    if (s_cost > count * c_max).any():
        raise UploadRejected(422, f"sum_cost is above {c_max:g} USD per query")
    n_rep = len(body.centroid_cells)
    means = _matrix("local_centroids", body.local_centroids, (n_rep, round_.centroids.shape[1]))
    weights = _matrix("local_weights", [body.local_weights], (1, len(body.local_weights)))[0]
    if (weights > MAX_COUNT).any():
        raise UploadRejected(422, f"local_weights must be <= {MAX_COUNT}")
    if count.sum() == 0 and n_rep == 0:
        raise UploadRejected(422, "the update reports nothing (no evaluation above min_count): do not upload it")
    try:
        update = KMeansUpdate(CellStatistics(count, s_acc, s_cost), np.array(body.centroid_cells, dtype=np.int64),
                              means, weights, int(body.log_size))
        check_kmeans_update(update, round_.centroids, len(round_.models), round_.min_count)
    except (ShapeError, PrivacyError) as exc:
        raise UploadRejected(422, f"invalid update: {exc}") from exc
    return update
