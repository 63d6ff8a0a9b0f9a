"""Validation of an uploaded K-means update (ARCHITECTURE.md §6): every check names the field.

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

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sdk.cell_statistics import CellStatistics
from sdk.errors import ShapeError
from sdk.local_update import KMeansUpdate
from trainer.federated.update_checks import check_kmeans_update
from trainer.server.store import Round


class UploadRejected(Exception):
    """An upload the server refuses; ``status`` is the HTTP status, ``detail`` the reason."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class UpdateBody(BaseModel):
    """Envelope of ``POST /v1/rounds/{round_id}/updates``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    client_id: str = Field(min_length=1, max_length=64)
    round_id: int = Field(ge=1)
    kind: str
    centroids_hash: str = Field(min_length=64, max_length=64)
    models: list[str]
    log_size: int = Field(ge=0)
    count: list[list[float | int]]
    sum_accuracy: list[list[float | int]]
    sum_cost: list[list[float | int]]
    centroid_cells: list[int]
    local_centroids: list[list[float | int]]
    local_weights: list[float | int]


def decode_body(raw: bytes, content_type: str) -> object:
    """Decode a JSON or MessagePack body.

    Raises
    ------
    UploadRejected
        415 for another content type, 400 for an undecodable body.
    """
    media = (content_type or "").split(";")[0].strip().lower()
    try:
        if media == "application/json":
            return json.loads(raw)
        if media in ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack"):
            import msgpack

            return msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, RecursionError) as exc:
        raise UploadRejected(400, f"body is not valid {media}: {type(exc).__name__}") from exc
    except Exception as exc:
        raise UploadRejected(400, f"body is not valid {media}: {type(exc).__name__}") from exc
    raise UploadRejected(415, f"content type must be application/json or application/msgpack, got {content_type!r}")


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
    arr = np.array(rows, dtype=np.float64).reshape(shape)
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
    if body.kind != round_.kind:
        raise UploadRejected(409, f"round {round_.id} is a {round_.kind!r} round, got a {body.kind!r} update")
    if body.centroids_hash != round_.centroids_hash:
        raise UploadRejected(409, f"update was computed for other centroids than round {round_.id}'s; "
                                  "fetch /v1/rounds/current again")
    if tuple(body.models) != round_.models:
        raise UploadRejected(422, f"models must be the round's {list(round_.models)} in that order")
    shape = (round_.centroids.shape[0], len(round_.models))
    count = _matrix("count", body.count, shape)
    s_acc = _matrix("sum_accuracy", body.sum_accuracy, shape)
    s_cost = _matrix("sum_cost", body.sum_cost, shape)
    n_rep = len(body.centroid_cells)
    means = _matrix("local_centroids", body.local_centroids, (n_rep, round_.centroids.shape[1]))
    weights = np.array(body.local_weights, dtype=np.float64)
    try:
        update = KMeansUpdate(CellStatistics(count, s_acc, s_cost), np.array(body.centroid_cells, dtype=np.int64),
                              means, weights, int(body.log_size))
        check_kmeans_update(update, round_.centroids, len(round_.models), round_.min_count)
    except ShapeError as exc:
        raise UploadRejected(422, f"invalid update: {exc}") from exc
    return update
