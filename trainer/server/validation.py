"""Validation of an uploaded update (ARCHITECTURE.md §6): every 422 names the first offending field.

MLP uploads (safetensors, :mod:`trainer.federated.mlp_local`) must have the round's parameter names
and shapes, finite values, and ``min_count <= n_samples <= log_size``.

K-means uploads are JSON (``application/json``, parsed with orjson, the standard library taking the
numbers orjson refuses: integers beyond 64 bits, NaN) or MessagePack (``application/msgpack``,
binary arrays; docs/protocol.md §3). Both are checked by the same code, **in this fixed order**,
and the first failure is answered (the detail starts with the field's name):

1. the body is an object / map; unknown keys, then missing keys (first in :data:`UPDATE_FIELDS` order);
2. each field's type, in :data:`UPDATE_FIELDS` order (:func:`parse_kmeans_body`): ``client_id`` str
   of 1-64 chars, ``round_id`` int in [1, 2**31), ``kind`` str, ``centroids_hash`` 64 chars,
   ``models`` list of str, ``log_size`` int in [0, 2**31), the six arrays rectangular and numeric
   (JSON: nested lists of numbers; MessagePack: ``[shape, bin]`` pairs);
3. against the round, in the same order (:func:`validate_update`): ``centroids_hash`` (409 for
   another partition), ``models``, then per array its shape, finite values and range: ``count``
   whole, in [0, 2**31); ``sum_accuracy`` in [0, count] (scores in [0, 1]); ``sum_cost`` in
   [0, count * max cost] (USD); ``centroid_cells`` in [0, n_cells), distinct; ``local_centroids``
   (n_reported, d_emb), norm <= 1 (kept at float32 precision whatever the encoding, so both store
   the same row); ``local_weights`` (n_reported,), whole, <= 2**31 - 1;
4. across fields (:func:`trainer.federated.update_checks.check_kmeans_totals`, shared with Flower):
   an update that reports nothing (every count 0, no cell mean) is refused, then counts summing to
   at most ``log_size``, the privacy threshold ``min_count`` for entries and reported cell means,
   sums 0 where the count is 0.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass

import msgpack
import numpy as np
import orjson

from sdk.cell_statistics import CellStatistics
from sdk.errors import PayloadError, PrivacyError, ShapeError
from sdk.local_update import KMeansUpdate, centroid_threshold
from sdk.protocol import MSGPACK_ARRAYS, UPDATE_FIELDS, unpack_msgpack_array
from trainer.federated.mlp_local import UPLOAD_FIELDS, read_parameters
# The cost bound of one query (USD; sdk.eval_log.MAX_COST_PER_QUERY_USD when the round sets no max_cost_usd:
# rejects absurd sums that would overflow the merge; the device's EvalLog refuses rows above it, so a device
# never logs what it could not upload) is update_checks' cost_limit, shared with the Flower strategy.
from trainer.federated.update_checks import check_kmeans_costs, check_kmeans_totals, check_sample_count, cost_limit
from trainer.server.errors import UploadRejected
from trainer.server.round_kind import ParsedUpload
from trainer.server.store import Round


#: Largest count, weight or sample number accepted (the SQLite/PostgreSQL INTEGER range, and far
#: beyond any device's log).
MAX_COUNT = 2**31 - 1
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
    """Steps 1 and 2 of the module docstring on a decoded body: the fields' types, in order.

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


def _bounds(name: str, arr: np.ndarray, shape: tuple[int, ...]) -> tuple[float, float]:
    """Shape check, then ``(min, max)`` of ``arr`` ((0, 0) when empty): one pass each, which also
    finds NaN (it propagates into both) and infinity (it is the min or the max)."""
    if arr.shape != shape:
        raise _field_error(name, f"must have shape {shape}, got {arr.shape}")
    if arr.size == 0:
        return 0.0, 0.0
    low, high = float(arr.min()), float(arr.max())
    if not (math.isfinite(low) and math.isfinite(high)):
        raise _field_error(name, "holds NaN or infinity")
    return low, high


def _whole(arr: np.ndarray) -> bool:
    """True if every entry of the (finite) float array is a whole number."""
    return not (arr != np.floor(arr)).any()


def _above_tolerance(s_acc: np.ndarray, count: np.ndarray) -> bool:
    """True if a sum of scores exceeds its count by more than the tolerance of
    :class:`sdk.CellStatistics` (in either of the two roundings of the comparison)."""
    tol = 1e-9 * np.maximum(1.0, count)
    return bool((s_acc - count > tol).any() or (s_acc > count + tol).any())


def validate_update(body: KMeansBody, round_: Round) -> KMeansUpdate:
    """Steps 3 and 4 of the module docstring: check ``body`` against ``round_``, field by field in
    order, and return the update it holds (``local_centroids`` at float32 precision, as float64).

    A valid update (nearly every upload) is accepted by :func:`_accept_valid`: every rule of steps 3
    and 4 at once, in about a dozen numpy calls (the three statistics in one element-wise test, the
    reported cells and weights as Python numbers). Anything it does not accept goes through
    :func:`_check_fields`, field by field in order, each array with a few whole-array numpy
    operations (min and max for finiteness and range, one pass for whole numbers, one for the norms
    of the cell means), then the rules across fields
    (:func:`trainer.federated.update_checks.check_kmeans_totals`); that names the first offending
    field. In-process, the fast acceptance takes about half the time of the field checks.

    Raises
    ------
    UploadRejected
        409 for an update computed for another partition (centroids); 422 naming the first
        offending field, or ``invalid update: ...`` for the checks across fields.
    """
    if body.centroids_hash != round_.centroids_hash:
        raise UploadRejected(409, f"centroids_hash: update was computed for other centroids than round {round_.id}'s; "
                                  "fetch /v1/rounds/current again")
    if body.models != round_.models:
        raise _field_error("models", f"must be the round's {list(round_.models)} in that order")
    update = _accept_valid(body, round_)
    return _check_fields(body, round_) if update is None else update


#: The norm bound of a cell mean, squared, as :func:`_check_fields` checks it; :func:`_accept_valid`
#: accepts only norms below it by a relative margin far above the rounding of any order of summation.
_MAX_NORM2 = (1.0 + 1e-4) ** 2
_FAST_MAX_NORM2 = _MAX_NORM2 * (1.0 - 1e-12)
#: Row-wise dot products of two (n, d) arrays: numpy 2's ``vecdot`` ufunc (a third of ``einsum``'s
#: time on a 32 x 384 float64 array), ``einsum`` on numpy 1.
_row_dot = getattr(np, "vecdot", None) or (lambda x, y: np.einsum("ij,ij->i", x, y))


def _accept_valid(body: KMeansBody, round_: Round) -> KMeansUpdate | None:
    """The update of ``body`` if it passes every rule of :func:`_check_fields` and
    :func:`trainer.federated.update_checks.check_kmeans_totals`, checked with the fewest numpy calls
    (one combined element-wise test of the three statistics, one reduction each for the totals and
    the norms, the reported cells and weights as Python numbers); None when any test fails or is too
    close to call, and :func:`_check_fields` then finds and names the first offending field (or
    accepts what these tests were stricter about: scores above the count within the tolerance of
    :class:`sdk.CellStatistics`). Accepts nothing :func:`_check_fields` refuses, and returns the same
    update for what both accept (tested)."""
    a = body.arrays
    count, s_acc, s_cost = a["count"], a["sum_accuracy"], a["sum_cost"]
    n_cells, d_emb = round_.centroids.shape
    shape = (n_cells, len(round_.models))
    if count.shape != shape or s_acc.shape != shape or s_cost.shape != shape:
        return None
    min_count = round_.min_count
    c_limit = cost_limit(count, round_.settings.aggregation.get("max_cost_usd"))
    # Every comparison is False for NaN: `ok` is all True only for whole counts in {0} and
    # [min_count, inf], scores in [0, count], costs in [0, c_limit] (so both sums are 0 where
    # the count is 0); the total, at most log_size <= MAX_COUNT, bounds each count (and is infinite
    # for an infinite one).
    ok = count == np.floor(count)
    ok &= (count >= min_count) | (count == 0)
    ok &= s_acc >= 0
    ok &= s_acc <= count
    ok &= s_cost >= 0
    ok &= s_cost <= c_limit
    if np.count_nonzero(ok) != ok.size:
        return None
    total = float(np.add.reduce(count, axis=None))  # whole numbers below 2**53: exact in any order
    if total > body.log_size:
        return None
    cells, weights, means = a["centroid_cells"], a["local_weights"], a["local_centroids"]
    n_rep = cells.shape[0]
    if weights.shape != (n_rep,) or n_rep > n_cells:
        return None
    listed, w = cells.tolist(), weights.tolist()
    threshold = centroid_threshold(min_count)
    if n_rep and (min(listed) < 0 or max(listed) >= n_cells or len(set(listed)) < n_rep
                  or not all(threshold <= x <= MAX_COUNT and x.is_integer() for x in w)
                  or sum(w) > body.log_size):  # whole numbers: exact sums
        return None
    if total == 0 and n_rep == 0:
        return None
    if means.size == 0:
        means = means.reshape(0, d_emb)
    if means.shape != (n_rep, d_emb):
        return None
    # The precision kept: float32 values, as float64 (as _check_fields). The squared norms are summed
    # in float64 from the values the field checks take (the body's float32 values, exactly; a JSON
    # body's float64 values, before rounding): NaN or infinity makes its row's NaN or infinity,
    # refused by the comparison like a norm near or above 1.
    wide = means.astype(np.float64) if body.means_float32 else None
    normed = means if wide is None else wide
    if n_rep and not float(np.maximum.reduce(_row_dot(normed, normed))) <= _FAST_MAX_NORM2:
        return None
    if wide is None:
        wide = means.astype(np.float32).astype(np.float64)
    return KMeansUpdate(CellStatistics.of_checked(count, s_acc, s_cost), cells, wide, weights, int(body.log_size))


def _check_fields(body: KMeansBody, round_: Round) -> KMeansUpdate:
    """:func:`validate_update` field by field in the module docstring's order (after the hash and
    the models): the first offending field raises; else the update."""
    a = body.arrays
    n_cells, d_emb = round_.centroids.shape
    shape = (n_cells, len(round_.models))
    count = a["count"]
    low, count_max = _bounds("count", count, shape)
    if low < 0 or count_max > MAX_COUNT or not _whole(count):
        raise _field_error("count", f"entries must be whole numbers in [0, {MAX_COUNT}]")
    s_acc = a["sum_accuracy"]
    low, high = _bounds("sum_accuracy", s_acc, shape)
    # Scores in [0, 1], with sdk.CellStatistics' tolerance: sums of float scores round. The tolerant
    # comparison runs only where a plain one fails.
    if (low < 0 and (s_acc < -1e-9 * np.maximum(1.0, count)).any()) or (
            high > 0 and (s_acc > count).any() and _above_tolerance(s_acc, count)):
        raise _field_error("sum_accuracy", "entries must lie in [0, count] (scores in [0, 1])")
    s_cost = a["sum_cost"]
    low, high = _bounds("sum_cost", s_cost, shape)
    if low < 0:
        raise _field_error("sum_cost", "entries must be >= 0 (USD)")
    if high > 0:
        try:  # the rule the Flower strategy applies too (trainer.federated.update_checks)
            check_kmeans_costs(count, s_cost, round_.settings.aggregation.get("max_cost_usd"))
        except ShapeError as exc:
            raise UploadRejected(422, str(exc)) from exc
    cells = a["centroid_cells"]
    n_rep = cells.shape[0]
    if n_rep:  # at most n_cells of them: a few Python ints
        listed = cells.tolist() if n_rep <= n_cells else []
        if not listed or min(listed) < 0 or max(listed) >= n_cells or len(set(listed)) < n_rep:
            raise _field_error("centroid_cells", f"must be distinct cells in [0, {n_cells}), got {cells[:10].tolist()}")
    means = a["local_centroids"]
    if means.size == 0:
        means = means.reshape(0, d_emb)
    if means.shape != (n_rep, d_emb):
        raise _field_error("local_centroids", f"must have shape {(n_rep, d_emb)}, got {means.shape}")
    if n_rep:
        # Squared norms (summed in float64 whatever the wire's dtype): NaN or infinity anywhere makes
        # its row's NaN or infinity, so one max finds them and the largest norm (a square that
        # overflows belongs to a norm far above 1).
        top = float(np.einsum("ij,ij->i", means, means, dtype=np.float64).max())
        if not math.isfinite(top) and not np.isfinite(means).all():
            raise _field_error("local_centroids", "holds NaN or infinity")
        if not top <= _MAX_NORM2:
            raise _field_error("local_centroids", "must be means of unit-norm embeddings (norm <= 1)")
    # The precision of the embeddings, for both encodings (MessagePack sends float32 values: widened
    # once, from the body's bytes).
    means = means.astype(np.float64) if body.means_float32 else means.astype(np.float32).astype(np.float64)
    weights = a["local_weights"]
    low, high = _bounds("local_weights", weights, (n_rep,))
    if low < 0 or high > MAX_COUNT or not _whole(weights):
        raise _field_error("local_weights", f"must be whole numbers in [0, {MAX_COUNT}]")
    try:
        # Every rule of CellStatistics' constructor was checked above, field by field.
        update = KMeansUpdate(CellStatistics.of_checked(count, s_acc, s_cost), cells, means, weights,
                              int(body.log_size))
        check_kmeans_totals(update, round_.min_count)
    except (ShapeError, PrivacyError) as exc:
        raise UploadRejected(422, f"invalid update: {exc}") from exc
    return update
