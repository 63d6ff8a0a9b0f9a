"""Validation of an uploaded update (ARCHITECTURE.md §6): every 422 names the first offending field.

Design notes: docs/sync-protocol-and-operations.md (Module notes).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import msgpack
import numpy as np
import orjson

from sdk.errors import PayloadError, PrivacyError, ShapeError
from sdk.local_update import KMeansUpdate
from sdk.protocol import MSGPACK_ARRAYS, UPDATE_FIELDS, unpack_msgpack_array
from trainer.federated.mlp_local import UPLOAD_FIELDS, read_parameters
from trainer.federated.update_checks import MAX_COUNT, check_kmeans_update, check_sample_count
from trainer.server.errors import UploadRejected
from trainer.server.round_kind import ParsedUpload
from trainer.server.store import Round


JSON_TYPES = ("application/json",)
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
_NUMBER = frozenset((int, float))
_FIELD_SET = frozenset(UPDATE_FIELDS)


def _field_error(name: str, message: str, status: int = 422) -> UploadRejected:
    return UploadRejected(status, f"{name}: {message}")


@dataclass(frozen=True)
class KMeansBody:
    """A K-means upload whose fields have the right types (step 2), not yet checked against a round.

    arrays : name -> ndarray for ``count``, ``sum_accuracy``, ``sum_cost`` (2-D float64),
        ``centroid_cells`` (1-D int64), ``local_centroids`` (2-D: float32 when ``means_float32``,
        a read-only view of the body's bytes, else float64; (0, 0) when empty in JSON),
        ``local_weights`` (1-D float64).
    means_float32 : True when ``local_centroids`` came as float32 (MessagePack): already at the
        precision the store keeps, so not rounded again.
    wire : name -> the ``[shape, bytes]`` pair of each array as received (MessagePack; None for
        JSON): the arrays above are views of these bytes, which the store's record reuses
        (:func:`sdk.protocol.encode_kmeans_update_record`) once they are checked.
    """

    client_id: str
    round_id: int
    kind: str
    centroids_hash: str
    models: tuple[str, ...]
    log_size: int
    arrays: dict[str, np.ndarray]
    means_float32: bool = False
    wire: dict[str, list] | None = None


#: What msgpack's exceptions that carry no message mean (FormatError, StackError).
_MSGPACK_REASONS = {"FormatError": "a byte that starts no MessagePack value (0xc1?)",
                    "StackError": "nested deeper than MessagePack's decoder allows"}
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
    try:  # the check the Flower router strategy applies too (update_checks.check_sample_count)
        check_sample_count(n_samples, round_.min_count, log_size)
    except (PrivacyError, ShapeError) as exc:
        raise UploadRejected(422, str(exc)) from exc
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
    """Decode a JSON or MessagePack body into Python objects (MessagePack ``bin`` stays bytes).

    Raises
    ------
    UploadRejected
        415 for another content type, 400 for an undecodable body.
    """
    media = media_type(content_type)
    if media in JSON_TYPES:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # integers beyond 64 bits or NaN/Infinity: json takes them, and the field check names them
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise UploadRejected(400, f"body is not valid JSON: {exc}") from exc
    if media in MSGPACK_TYPES:
        try:
            return msgpack.unpackb(raw, raw=False, strict_map_key=True)
        except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated classes on bad input
            # Its message (a truncated body, a map key that is not a string); it said only "ValueError".
            reason = str(exc) or _MSGPACK_REASONS.get(type(exc).__name__, type(exc).__name__)
            raise UploadRejected(400, f"body is not valid MessagePack: {reason[:200]}") from exc
    raise UploadRejected(415, "content type must be application/json or application/msgpack (K-means) or "
                              f"application/x-safetensors (MLP), got {content_type!r}")


def _int_field(obj: dict, name: str, low: int, high: int) -> int:
    value = obj[name]
    if type(value) is not int or not low <= value <= high:
        raise _field_error(name, f"must be an integer in [{low}, {high}], got {str(value)[:40]!r}")
    return value


def _str_field(obj: dict, name: str, min_len: int, max_len: int) -> str:
    value = obj[name]
    if not isinstance(value, str) or not min_len <= len(value) <= max_len:
        raise _field_error(name, f"must be a string of {min_len}-{max_len} characters")
    return value


def _json_array(name: str, value: object, rank: int) -> np.ndarray:
    """A JSON array field (nested lists of numbers, rectangular) as float64 (``rank`` 1 or 2)."""
    rows = value if rank == 2 else [value]
    if not isinstance(value, list) or not all(isinstance(r, list) for r in rows):
        raise _field_error(name, f"must be {'a list of lists' if rank == 2 else 'a list'} of numbers")
    if not set(map(type, itertools.chain.from_iterable(rows))) <= _NUMBER:  # bool, None, str... refused
        raise _field_error(name, "must hold only numbers")
    if rows and len({len(r) for r in rows}) > 1:
        raise _field_error(name, f"rows must have one length, got lengths {sorted({len(r) for r in rows})[:5]}")
    try:
        arr = np.array(value, dtype=np.float64)
    except OverflowError as exc:
        raise _field_error(name, "holds a number outside the float64 range") from exc
    return arr.reshape(0, 0) if rank == 2 and arr.size == 0 else arr


def _json_cells(value: object) -> np.ndarray:
    if not isinstance(value, list) or any(type(x) is not int or not 0 <= x <= MAX_COUNT for x in value):
        raise _field_error("centroid_cells", f"must be a list of integers in [0, {MAX_COUNT}]")
    return np.array(value, dtype=np.int64)


def parse_kmeans_body(obj: object) -> KMeansBody:
    """Steps 1 and 2 of the design notes on a decoded body: the fields' types, in order.

    Raises
    ------
    UploadRejected
        422 naming the first offending field (or the unknown / missing keys).
    """
    if not isinstance(obj, dict):
        raise UploadRejected(422, "body: a K-means update is an object (map) of the fields "
                                  f"{list(UPDATE_FIELDS)}")
    if obj.keys() != _FIELD_SET:  # the keys are the fields (any order), else name the first stray or missing one
        unknown = [k for k in obj if k not in _FIELD_SET]
        if unknown:
            raise UploadRejected(422, f"{str(unknown[0])[:64]}: unknown field (the fields are {list(UPDATE_FIELDS)})")
        missing = [k for k in UPDATE_FIELDS if k not in obj]
        raise _field_error(missing[0], "field required")
    client_id = _str_field(obj, "client_id", 1, 64)
    round_id = _int_field(obj, "round_id", 1, MAX_COUNT)
    kind = _str_field(obj, "kind", 1, 64)
    centroids_hash = _str_field(obj, "centroids_hash", 64, 64)
    models = obj["models"]
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise _field_error("models", "must be a list of strings")
    log_size = _int_field(obj, "log_size", 0, MAX_COUNT)
    arrays, means_float32, wire = {}, False, {}
    for name, (dtype, rank) in MSGPACK_ARRAYS.items():
        value = obj[name]
        if isinstance(value, list) and len(value) == 2 and isinstance(value[1], bytes):  # MessagePack [shape, bin]
            means = name == "local_centroids"
            try:  # the cell means stay float32 (the precision kept), a view of the body: no copy
                arrays[name] = unpack_msgpack_array(value, dtype, rank, widen=not means)
            except ShapeError as exc:
                raise _field_error(name, str(exc)) from exc
            means_float32 = means_float32 or (means and dtype == "<f4")
            wire[name] = value
        elif name == "centroid_cells":
            arrays[name] = _json_cells(value)
        else:
            arrays[name] = _json_array(name, value, rank)
    return KMeansBody(client_id, round_id, kind, centroids_hash, tuple(models), log_size, arrays, means_float32,
                      wire if len(wire) == len(MSGPACK_ARRAYS) else None)


def record_pairs(body: KMeansBody, update: KMeansUpdate) -> dict[str, list]:
    """The ``[shape, bytes]`` pairs of a MessagePack ``body`` that the store's record of its checked
    ``update`` (:func:`validate_update`'s result) can take as they are
    (:func:`sdk.protocol.encode_kmeans_update_record` ``packed``): all of them, but an empty
    ``local_centroids`` whose shape is not the checked array's (sent as ``[0, 0]``, packed again as
    ``[0, d_emb]``); the other arrays were checked to have their wire shapes. The checked arrays are
    views of these bytes in the record's dtypes, so the record's bytes are the same either way;
    empty for a JSON body."""
    if body.wire is None:
        return {}
    means = body.wire["local_centroids"]
    if update.local_centroids.size == 0 and list(means[0]) != list(update.local_centroids.shape):
        return {name: pair for name, pair in body.wire.items() if name != "local_centroids"}
    return body.wire


def validate_update(body: KMeansBody, round_: Round) -> KMeansUpdate:
    """Steps 3 and 4 of the design notes: check ``body`` against ``round_`` and return the update
    it holds (``local_centroids`` at float32 precision, as float64). The rules after the hash and the
    models are :func:`trainer.federated.update_checks.check_kmeans_update`, the one validator the
    Flower strategies call too.

    Raises
    ------
    UploadRejected
        409 for an update computed for another partition (centroids); 422 naming the first
        offending field.
    """
    if body.centroids_hash != round_.centroids_hash:
        raise UploadRejected(409, f"centroids_hash: update was computed for other centroids than round {round_.id}'s; "
                                  "fetch /v1/rounds/current again")
    if body.models != round_.models:
        raise _field_error("models", f"must be the round's {list(round_.models)} in that order")
    arrays = body.arrays
    if not body.means_float32:  # the precision the store keeps, for both encodings (too large: inf, refused)
        with np.errstate(over="ignore"):
            arrays = {**arrays, "local_centroids": arrays["local_centroids"].astype(np.float32)}
    try:
        return check_kmeans_update(arrays, body.log_size, round_.centroids.shape, len(round_.models),
                                   round_.min_count, round_.settings.aggregation.get("max_cost_usd"))
    except (ShapeError, PrivacyError) as exc:
        raise UploadRejected(422, str(exc)) from exc
