"""The wire and file formats of fedroute, typed and versioned: one encoder and one decoder per format.

Byte-level specification: ``docs/protocol.md``; golden fixed-bytes tests: ``tests/test_protocol.py``
with ``tests/golden/``. Every party uses these functions: the device (:mod:`sdk.sync`,
:mod:`sdk.device_rounds`), the server (:mod:`trainer.server`), its store and the Flower app.

========================  ===============================  ==============================================
format                    type                             encoder / decoder
========================  ===============================  ==============================================
K-means round (JSON)      :class:`RoundSpec`               :func:`encode_kmeans_round` / :meth:`RoundSpec.from_json`
K-means update, wire      :class:`KMeansUpdate`            :func:`encode_kmeans_update` / :func:`decode_kmeans_update_json`
  (JSON)                                                   (the server checks fields in order,
                                                           :mod:`trainer.server.validation`)
K-means update, wire      :class:`KMeansUpdate`            :func:`encode_kmeans_update_msgpack` / :func:`decode_kmeans_update_msgpack`
  (MessagePack, binary                                     (the device's default; per-field
  little-endian arrays)                                    :func:`unpack_msgpack_array`)
K-means update, arrays    :class:`KMeansUpdate`            :func:`kmeans_update_to_arrays` / :func:`kmeans_update_from_arrays`
  (``.npz``, Flower)                                       (``.npz`` bytes: :func:`encode_kmeans_update_npz` / :func:`decode_kmeans_update_npz`)
K-means update, stored    :class:`KMeansUpdate`            :func:`encode_kmeans_update_record` / :func:`decode_kmeans_update_record`
  (server store record)                                    (MessagePack arrays; also reads v2 and ``.npz`` rows)
receipt (JSON)            :class:`Receipt`                 :meth:`Receipt.to_json` / :meth:`Receipt.from_json`
device sync state (JSON)  :class:`SyncState`               :func:`encode_sync_state` / :func:`decode_sync_state`
  its sent-update record  :class:`KMeansUpdate`            :func:`encode_sent_record` / :func:`decode_sent_record`
bundle manifest           ``dict``                         :mod:`sdk.bundle_manifest` (``encode_manifest_file``, ``verify_manifest``)
MLP parameters / update   ``dict`` of arrays               safetensors, :mod:`trainer.federated.mlp_local` (torch side)
========================  ===============================  ==============================================

Pure functions and dataclasses: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgpack
import numpy as np

from sdk.arrays import is_npz
from sdk.cell_statistics import CellStatistics
from sdk.errors import PayloadError, ShapeError, SyncError
from sdk.real_numbers import finite_float

#: Version of the sync protocol (``/v1``) and of each JSON message below.
PROTOCOL_VERSION = 1
#: Version of the device's sync state file.
SYNC_STATE_VERSION = 1
KMEANS_KIND = "kmeans"


def encode_json(obj: object) -> bytes:
    """Compact JSON bytes of a wire message: no whitespace, keys in the order given, ASCII,
    NaN/inf refused (ValueError). Floats are Python's shortest repr (exact for float64)."""
    return json.dumps(obj, allow_nan=False, separators=(",", ":")).encode("ascii")


def centroids_hash(centroids: np.ndarray) -> str:
    """sha256 (hex) of the centroids as little-endian float32 with their shape: the identity of a
    cell partition. Updates are merged only with updates for the same partition."""
    c = np.ascontiguousarray(centroids, dtype="<f4")
    h = hashlib.sha256(f"{c.shape[0]}x{c.shape[1]}:".encode())
    h.update(c.tobytes())
    return h.hexdigest()




@dataclass(frozen=True)
class RoundSpec:
    """The open round as the server announces it (``GET /v1/rounds/current``).

    Attributes
    ----------
    round_id : int >= 1.
    kind : str, ``"kmeans"`` (the only kind a device computes without torch).
    centroids : ndarray of shape (n_cells, d_emb), float32, the global centroids.
    centroids_hash : str, :func:`centroids_hash` of ``centroids``.
    models : tuple of str, column order of the statistics.
    embedder_name : str; d_emb : int, the embedder the centroids live in.
    min_count : int >= 1, the privacy threshold of this round.
    deadline_utc : str, ISO-8601 UTC time at which the round closes.
    max_cost_usd : float > 0 or None, USD: the round's bound on one query's cost (``fedroute rounds
        open --max-cost-usd``, for clipping and DP). The device clips each logged cost to it
        (:func:`sdk.local_update.kmeans_update`), since the server refuses any entry whose mean cost
        is above it; None (key absent or null) when the round sets no bound.
    """

    round_id: int
    kind: str
    centroids: np.ndarray
    centroids_hash: str
    models: tuple[str, ...]
    embedder_name: str
    d_emb: int
    min_count: int
    deadline_utc: str
    max_cost_usd: float | None = None

    @classmethod
    def from_json(cls, data: object) -> RoundSpec:
        """Parse the server's JSON answer.

        Raises
        ------
        SyncError
            A field is missing or has the wrong type (strings where strings belong, ``models`` a
            list of strings: a string is not read as its characters) or shape, or the centroids do
            not match their hash (a malformed or tampered answer).
        """
        try:
            if not isinstance(data, Mapping):
                raise TypeError("not a JSON object")
            for key in ("kind", "centroids_hash", "embedder_name", "deadline_utc"):
                if not isinstance(data[key], str):
                    raise TypeError(f"{key} must be a string, got {type(data[key]).__name__}")
            if not isinstance(data["models"], list) or not all(isinstance(m, str) for m in data["models"]):
                raise TypeError(f"models must be a list of strings, got {str(data['models'])[:80]}")
            centroids = np.asarray(data["centroids"], dtype=np.float64)
            spec = cls(
                round_id=_int(data["round_id"], 1),
                kind=str(data["kind"]),
                centroids=centroids.astype(np.float32),
                centroids_hash=str(data["centroids_hash"]),
                models=tuple(str(m) for m in data["models"]),
                embedder_name=str(data["embedder_name"]),
                d_emb=_int(data["d_emb"], 1),
                min_count=_int(data["min_count"], 1),
                deadline_utc=str(data["deadline_utc"]),
                max_cost_usd=_positive_or_none(data.get("max_cost_usd"), "max_cost_usd"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncError(f"malformed round description from the server: {exc!r}") from exc
        c = spec.centroids
        if c.ndim != 2 or c.shape[0] < 1 or c.shape[1] != spec.d_emb or not np.isfinite(c).all():
            raise SyncError(f"round {spec.round_id}: centroids of shape {c.shape} do not fit d_emb={spec.d_emb}")
        if centroids_hash(c) != spec.centroids_hash:
            raise SyncError(f"round {spec.round_id}: centroids do not match their hash")
        if not spec.models or len(set(spec.models)) != len(spec.models):
            raise SyncError(f"round {spec.round_id}: models must be distinct and non-empty, got {spec.models}")
        return spec


def _positive_or_none(value: object, name: str) -> float | None:
    if value is None:
        return None
    out = finite_float(value)
    if out is None or out <= 0:
        raise ValueError(f"{name} must be a finite number > 0 or null, got {value!r}")
    return out


def _int(value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"expected an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class KMeansUpdate:
    """One device's statistics for one round.

    Attributes
    ----------
    statistics : CellStatistics of shape (n_cells, n_models), entries below ``min_count`` zeroed.
    centroid_cells : ndarray of shape (n_reported,), int64, cells whose mean embedding is reported.
    local_centroids : ndarray of shape (n_reported, d_emb), float64, mean embedding per reported cell.
    local_weights : ndarray of shape (n_reported,), float64, queries averaged per reported cell.
    log_size : int, evaluations summarised (logged rows with an embedding and a known model);
        ``statistics.count.sum() <= log_size`` and ``local_weights.sum() <= log_size``.
    local_distinct : ndarray of shape (n_reported,), int64, distinct embeddings averaged per reported
        cell, or None where unknown (an update decoded from the wire). Kept on the device for
        :func:`hold_small_changes`; never sent (:meth:`to_payload` leaves it out).
    """

    statistics: CellStatistics
    centroid_cells: np.ndarray
    local_centroids: np.ndarray
    local_weights: np.ndarray
    log_size: int
    local_distinct: np.ndarray | None = None

    def is_empty(self) -> bool:
        """True if the update reports nothing: every count zero and no cell mean (not worth sending)."""
        return not np.any(self.statistics.count) and self.centroid_cells.size == 0

    def to_payload(self, client_id: str, spec: RoundSpec) -> dict:
        """The JSON body of ``POST /v1/rounds/{round_id}/updates`` (ARCHITECTURE.md §6).

        Holds aggregates only: counts and sums per (cell, model) and mean embeddings of cells with
        at least ``max(min_count, 2)`` distinct queries. Floats are written exactly (JSON repr of
        float64). ``local_distinct`` is not sent.
        """
        return {
            "client_id": client_id,
            "round_id": spec.round_id,
            "kind": KMEANS_KIND,
            "centroids_hash": spec.centroids_hash,
            "models": list(spec.models),
            "log_size": int(self.log_size),
            "count": self.statistics.count.tolist(),
            "sum_accuracy": self.statistics.sum_accuracy.tolist(),
            "sum_cost": self.statistics.sum_cost.tolist(),
            "centroid_cells": self.centroid_cells.tolist(),
            "local_centroids": self.local_centroids.tolist(),
            "local_weights": self.local_weights.tolist(),
        }


def encode_kmeans_update(update: KMeansUpdate, client_id: str, spec: RoundSpec) -> bytes:
    """The JSON body of ``POST /v1/rounds/{round_id}/updates`` for a K-means round
    (:meth:`KMeansUpdate.to_payload`, :func:`encode_json`). Its sha256 names the upload in the
    device's ``Idempotency-Key``, so the same update always gives the same bytes."""
    return encode_json(update.to_payload(client_id, spec))


#: ``Content-Type`` of the two K-means update encodings.
JSON_MEDIA_TYPE = "application/json"
MSGPACK_MEDIA_TYPE = "application/msgpack"
#: Keys of a K-means update on the wire (JSON and MessagePack), in the order written.
UPDATE_FIELDS = ("client_id", "round_id", "kind", "centroids_hash", "models", "log_size", "count", "sum_accuracy",
                 "sum_cost", "centroid_cells", "local_centroids", "local_weights")
#: The array fields of the MessagePack encoding: name -> (numpy dtype of the raw bytes, rank).
#: Statistics and weights travel as float64 (sums of costs and scores stay exact), cell indices as
#: int64, the cell means (the bulk of the body) as float32, the precision of the embeddings they average.
MSGPACK_ARRAYS = {"count": ("<f8", 2), "sum_accuracy": ("<f8", 2), "sum_cost": ("<f8", 2),
                  "centroid_cells": ("<i8", 1), "local_centroids": ("<f4", 2), "local_weights": ("<f8", 1)}


_INT64, _FLOAT64 = np.dtype(np.int64), np.dtype(np.float64)
_WIDE = (_INT64, _FLOAT64)
_DTYPES = {dtype: np.dtype(dtype) for dtype, _ in MSGPACK_ARRAYS.values()}  # parsed once


def pack_msgpack_array(values: np.ndarray, dtype: str) -> list:
    """One array of the MessagePack encoding: ``[shape, data]``, ``shape`` a list of ints and
    ``data`` the C-order bytes of ``values`` cast to ``dtype`` (little-endian)."""
    a = np.ascontiguousarray(values, dtype=dtype)
    return [list(a.shape), a.tobytes()]


def unpack_msgpack_array(value: object, dtype: str, rank: int, widen: bool = True) -> np.ndarray:
    """The ndarray of a ``[shape, data]`` pair of the MessagePack encoding (read-only, ``dtype``
    widened to float64 or int64; ``widen=False``: a view of the bytes in ``dtype`` itself).

    Raises
    ------
    ShapeError
        Not a pair of a list of ``rank`` non-negative ints and bytes of exactly ``prod(shape) *
        itemsize`` bytes.
    """
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], (list, tuple))
            and isinstance(value[1], bytes)):
        raise ShapeError("must be [shape, bytes] (a list of ints and a bin)")
    shape, data = value
    if len(shape) != rank or not all([type(n) is int and 0 <= n < 2**31 for n in shape]):
        raise ShapeError(f"shape must be {rank} non-negative ints, got {list(shape)!r}")
    dt = _DTYPES.get(dtype) or np.dtype(dtype)
    n = math.prod(shape)
    if len(data) != n * dt.itemsize:
        raise ShapeError(f"shape {list(shape)} needs {n * dt.itemsize} bytes of {dtype}, got {len(data)}")
    # A view of the bytes (read-only, like the bytes) where the dtype is already the wide one (no
    # copy), else a widened copy.
    arr = np.ndarray(shape, dt, data)
    return arr if not widen or dt in _WIDE else arr.astype(_INT64 if dt.kind in "iu" else _FLOAT64)


def encode_kmeans_update_msgpack(update: KMeansUpdate, client_id: str, spec: RoundSpec) -> bytes:
    """The MessagePack body (``application/msgpack``) of ``POST /v1/rounds/{round_id}/updates``:
    a map with the keys of :data:`UPDATE_FIELDS` in that order, scalars and ``models`` as native
    MessagePack values, the six arrays as ``[shape, bin]`` pairs of little-endian values of the
    dtypes in :data:`MSGPACK_ARRAYS` (``local_centroids`` rounded to float32). Deterministic, like
    :func:`encode_kmeans_update` (its sha256 names the upload). Byte-level spec: docs/protocol.md §3."""
    s = update.statistics
    arrays = {"count": s.count, "sum_accuracy": s.sum_accuracy, "sum_cost": s.sum_cost,
              "centroid_cells": update.centroid_cells, "local_centroids": update.local_centroids,
              "local_weights": update.local_weights}
    body = {"client_id": client_id, "round_id": int(spec.round_id), "kind": KMEANS_KIND,
            "centroids_hash": spec.centroids_hash, "models": list(spec.models), "log_size": int(update.log_size)}
    if arrays["local_centroids"].size == 0:  # (0, d_emb) whatever the update's empty shape
        arrays["local_centroids"] = np.zeros((0, int(spec.d_emb)))
    for name, (dtype, _) in MSGPACK_ARRAYS.items():
        body[name] = pack_msgpack_array(arrays[name], dtype)
    return msgpack.packb(body, use_bin_type=True)


def _update_of_fields(obj: dict) -> KMeansUpdate:
    return KMeansUpdate(CellStatistics(obj["count"], obj["sum_accuracy"], obj["sum_cost"]),
                        np.asarray(obj["centroid_cells"], dtype=np.int64).reshape(-1),
                        np.asarray(obj["local_centroids"], dtype=np.float64),
                        np.asarray(obj["local_weights"], dtype=np.float64).reshape(-1), int(obj["log_size"]))


def decode_kmeans_update_msgpack(raw: bytes) -> tuple[dict, KMeansUpdate]:
    """(envelope, update) of :func:`encode_kmeans_update_msgpack` bytes; the envelope holds
    ``client_id``, ``round_id``, ``kind``, ``centroids_hash``, ``models``. Not checked against a
    round (the server does that field by field, :mod:`trainer.server.validation`).

    Raises
    ------
    PayloadError
        Not MessagePack, or not a map with exactly the keys of :data:`UPDATE_FIELDS`.
    ShapeError
        An array that is not a well-formed ``[shape, bin]`` pair (the message names it), or
        statistics :class:`CellStatistics` refuses.
    """
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated classes on bad input
        raise PayloadError(f"not a MessagePack K-means update ({type(exc).__name__})") from exc
    if not isinstance(obj, dict) or set(obj) != set(UPDATE_FIELDS):
        raise PayloadError(f"a K-means update is a map with exactly the keys {list(UPDATE_FIELDS)}")
    for name, (dtype, rank) in MSGPACK_ARRAYS.items():
        try:
            obj[name] = unpack_msgpack_array(obj[name], dtype, rank)
        except ShapeError as exc:
            raise ShapeError(f"{name}: {exc}") from exc
    envelope = {k: obj[k] for k in ("client_id", "round_id", "kind", "centroids_hash", "models")}
    return envelope, _update_of_fields(obj)


def decode_kmeans_update_json(raw: bytes) -> tuple[dict, KMeansUpdate]:
    """(envelope, update) of :func:`encode_kmeans_update` bytes (not checked against a round).

    Raises
    ------
    PayloadError
        Not JSON, or not an object with exactly the keys of :data:`UPDATE_FIELDS`.
    ShapeError
        Ragged or non-numeric arrays, or statistics :class:`CellStatistics` refuses.
    """
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise PayloadError(f"not a JSON K-means update ({exc})") from exc
    if not isinstance(obj, dict) or set(obj) != set(UPDATE_FIELDS):
        raise PayloadError(f"a K-means update is an object with exactly the keys {list(UPDATE_FIELDS)}")
    envelope = {k: obj[k] for k in ("client_id", "round_id", "kind", "centroids_hash", "models")}
    try:
        arrays = {name: np.asarray(obj[name], dtype=np.float64) for name in MSGPACK_ARRAYS}
    except (TypeError, ValueError) as exc:
        raise ShapeError(f"an array field is ragged or not numeric ({exc})") from exc
    if arrays["local_centroids"].size == 0:
        arrays["local_centroids"] = arrays["local_centroids"].reshape(0, 0)
    return envelope, _update_of_fields({**obj, **arrays})


def encode_kmeans_round(round_id: int, status: str, models, embedder_name: str, d_emb: int, min_count: int,
                        quorum: int, deadline_utc: str, centroids: np.ndarray, max_cost_usd: float | None = None) -> dict:
    """The JSON object of ``GET /v1/rounds/current`` for a K-means round (decoded by
    :meth:`RoundSpec.from_json`); ``centroids`` of shape (n_cells, d_emb) are sent as float64
    lists of their float32 values, with their :func:`centroids_hash`; ``max_cost_usd`` (USD per
    query) is sent, last, only when the round sets it."""
    c = np.ascontiguousarray(centroids, dtype=np.float32)
    out = {"round_id": int(round_id), "kind": KMEANS_KIND, "status": status, "models": list(models),
           "embedder_name": embedder_name, "d_emb": int(d_emb), "min_count": int(min_count), "quorum": int(quorum),
           "deadline_utc": deadline_utc, "centroids": c.astype(np.float64).tolist(), "centroids_hash": centroids_hash(c)}
    if max_cost_usd is not None:
        out["max_cost_usd"] = float(max_cost_usd)
    return out


#: Names of the arrays of a :class:`KMeansUpdate`, in order (store ``.npz`` and Flower ArrayRecord).
UPDATE_ARRAYS = ("count", "sum_accuracy", "sum_cost", "centroid_cells", "local_centroids", "local_weights", "log_size")
_RANKS = {"count": 2, "sum_accuracy": 2, "sum_cost": 2, "centroid_cells": 1, "local_centroids": 2,
          "local_weights": 1, "log_size": 0}


def kmeans_update_to_arrays(update: KMeansUpdate) -> dict[str, np.ndarray]:
    """A :class:`KMeansUpdate` as named numpy arrays (the keys of :data:`UPDATE_ARRAYS`, in order).

    Returns
    -------
    dict with ``count``, ``sum_accuracy``, ``sum_cost`` : ndarrays of shape (n_cells, n_models),
    float64 (sum_cost in USD); ``centroid_cells`` : (n_reported,) int64; ``local_centroids`` :
    (n_reported, d_emb) float64; ``local_weights`` : (n_reported,) float64; ``log_size`` : shape (),
    int64. Values are copied exactly (no rounding).
    """
    s = update.statistics
    return {
        "count": np.asarray(s.count, dtype=np.float64),
        "sum_accuracy": np.asarray(s.sum_accuracy, dtype=np.float64),
        "sum_cost": np.asarray(s.sum_cost, dtype=np.float64),
        "centroid_cells": np.asarray(update.centroid_cells, dtype=np.int64),
        "local_centroids": np.asarray(update.local_centroids, dtype=np.float64),
        "local_weights": np.asarray(update.local_weights, dtype=np.float64),
        "log_size": np.asarray(update.log_size, dtype=np.int64),
    }


def kmeans_update_from_arrays(arrays: Mapping[str, np.ndarray]) -> KMeansUpdate:
    """Inverse of :func:`kmeans_update_to_arrays`; checks names, dtypes and ranks (not the round).

    Raises
    ------
    ShapeError
        A name of :data:`UPDATE_ARRAYS` is missing or another one is present, an array has a
        non-numeric dtype or the wrong rank, or the statistics are invalid (negative or non-finite
        counts, ``sum_accuracy`` outside ``[0, count]``, negative costs).
    """
    names = set(arrays)
    if names != set(UPDATE_ARRAYS):
        raise ShapeError(
            f"an update holds exactly the arrays {list(UPDATE_ARRAYS)}; missing {sorted(set(UPDATE_ARRAYS) - names)}, "
            f"unexpected {sorted(names - set(UPDATE_ARRAYS))}"
        )
    out: dict[str, np.ndarray] = {}
    for name in UPDATE_ARRAYS:
        arr = np.asarray(arrays[name])
        integral = name in ("centroid_cells", "log_size")
        if arr.dtype.kind not in ("iu" if integral else "fiu"):
            what = "integers" if integral else "numbers"
            raise ShapeError(f"update array {name!r} must hold {what}, got dtype {arr.dtype}")
        if arr.ndim != _RANKS[name]:
            raise ShapeError(f"update array {name!r} must be {_RANKS[name]}-D, got shape {arr.shape}")
        out[name] = arr
    return KMeansUpdate(
        statistics=CellStatistics(out["count"], out["sum_accuracy"], out["sum_cost"]),
        centroid_cells=out["centroid_cells"].astype(np.int64),
        local_centroids=out["local_centroids"].astype(np.float64),
        local_weights=out["local_weights"].astype(np.float64),
        log_size=int(out["log_size"]),
    )


def encode_kmeans_update_npz(update: KMeansUpdate) -> bytes:
    """``.npz`` bytes (uncompressed zip of ``.npy`` files, no pickle) of :func:`kmeans_update_to_arrays`:
    the server store's record of an accepted K-means update."""
    buf = io.BytesIO()
    np.savez(buf, **kmeans_update_to_arrays(update))
    return buf.getvalue()


def decode_kmeans_update_npz(data: bytes) -> KMeansUpdate:
    """The update of :func:`encode_kmeans_update_npz` bytes.

    Raises
    ------
    PayloadError
        Not an ``.npz`` (pickle refused).
    ShapeError
        Not the update's arrays (see :func:`kmeans_update_from_arrays`).
    """
    if not is_npz(data):  # np.load would read a .npy as one array (not an update)
        raise PayloadError("not an .npz K-means update (not a zip archive)")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise PayloadError(f"not an .npz K-means update ({exc})") from exc
    return kmeans_update_from_arrays(arrays)


#: Version tag of :func:`encode_kmeans_update_record` (first key of the map).
UPDATE_RECORD_FORMAT = "fedroute.kmeans_update.v3"
#: The array dtypes of each store record format still read (:func:`decode_kmeans_update_record`):
#: v3 (written now) keeps the cell means as float32, the dtypes of the MessagePack wire encoding
#: (:data:`MSGPACK_ARRAYS`); v2 (rows written before it) held them as float64.
RECORD_ARRAYS = {
    UPDATE_RECORD_FORMAT: MSGPACK_ARRAYS,
    "fedroute.kmeans_update.v2": {**MSGPACK_ARRAYS, "local_centroids": ("<f8", 2)},
}


def encode_kmeans_update_record(update: KMeansUpdate, packed: Mapping[str, list] | None = None) -> bytes:
    """The server store's record of an accepted K-means update: a MessagePack map, keys in order
    ``format`` (:data:`UPDATE_RECORD_FORMAT`), then the arrays of :func:`kmeans_update_to_arrays`
    (``count``, ``sum_accuracy``, ``sum_cost``, ``centroid_cells``, ``local_centroids``,
    ``local_weights``) as ``[shape, bin]`` pairs of little-endian values of the dtypes of the
    MessagePack wire encoding (:data:`MSGPACK_ARRAYS`: float64, ``centroid_cells`` int64,
    ``local_centroids`` float32), then ``log_size`` (int). Deterministic; exact but for the cell
    means, rounded to float32: the precision of the embeddings they average, at which the server
    keeps them whatever the wire encoding (so storing them as float32 loses nothing; about half
    the bytes of the float64 v2 record for 32 cells of 384 dimensions). Docs: docs/protocol.md §4.

    ``packed``: name -> ``[shape, bytes]`` pairs already in the record's form (the MessagePack wire
    pairs of an upload, :func:`pack_msgpack_array`'s output for the same arrays), used as they are
    instead of packing ``update``'s arrays again (the server's upload path: the bytes it received and
    checked are the bytes it stores); the caller guarantees they hold ``update``'s values and shapes."""
    packed = packed or {}
    arrays = None if all(name in packed for name in MSGPACK_ARRAYS) else kmeans_update_to_arrays(update)
    record: dict = {"format": UPDATE_RECORD_FORMAT}
    for name, (dtype, _) in MSGPACK_ARRAYS.items():
        record[name] = packed[name] if name in packed else pack_msgpack_array(arrays[name], dtype)
    record["log_size"] = int(update.log_size)
    return msgpack.packb(record, use_bin_type=True)


def decode_kmeans_update_record(data: bytes) -> KMeansUpdate:
    """The update of a store record: :func:`encode_kmeans_update_record` bytes (v3), a v2 record
    (float64 cell means), or ``.npz`` bytes (:func:`encode_kmeans_update_npz`, rows written before
    v2). Arrays come back as :func:`kmeans_update_from_arrays` gives them (float64, cell indices
    int64), so sums over records (the aggregation) run in float64 whatever the stored dtype.

    Raises
    ------
    PayloadError
        None of these formats.
    ShapeError
        Not the update's arrays (see :func:`kmeans_update_from_arrays`).
    """
    if data[:2] == b"PK":
        return decode_kmeans_update_npz(data)
    try:
        record = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated classes on bad input
        raise PayloadError(f"not a K-means update record ({type(exc).__name__})") from exc
    dtypes = RECORD_ARRAYS.get(record.get("format")) if isinstance(record, dict) else None
    if dtypes is None:
        raise PayloadError(f"not a K-means update record (formats {list(RECORD_ARRAYS)})")
    arrays = {}
    for name, (dtype, rank) in dtypes.items():
        try:
            arrays[name] = unpack_msgpack_array(record.get(name), dtype, rank)
        except ShapeError as exc:
            raise ShapeError(f"{name}: {exc}") from exc
    log_size = record.get("log_size")
    if type(log_size) is not int:
        raise ShapeError(f"log_size must be an integer, got {log_size!r}")
    arrays["log_size"] = np.asarray(log_size, dtype=np.int64)
    return kmeans_update_from_arrays(arrays)


def encode_sent_record(update: KMeansUpdate, spec: RoundSpec) -> dict:
    """The device state's record of an update about to be sent (JSON object; floats exact):
    the wire fields plus ``centroids_hash``, ``models``, ``min_count`` and ``local_distinct``."""
    return {"centroids_hash": spec.centroids_hash, "models": list(spec.models), "min_count": spec.min_count,
            "count": update.statistics.count.tolist(), "sum_accuracy": update.statistics.sum_accuracy.tolist(),
            "sum_cost": update.statistics.sum_cost.tolist(), "centroid_cells": update.centroid_cells.tolist(),
            "local_centroids": update.local_centroids.tolist(), "local_weights": update.local_weights.tolist(),
            "local_distinct": np.asarray(update.local_distinct, dtype=np.int64).tolist()
            if update.local_distinct is not None else update.local_weights.astype(np.int64).tolist(),
            "log_size": int(update.log_size)}


def decode_sent_record(record: dict | None, spec: RoundSpec, state_path: str = "") -> KMeansUpdate | None:
    """The update last sent for ``spec``'s centroids (the state's ``record``), its columns in
    ``spec.models`` order (a model it did not have counts as never sent), or None if none was sent
    for them.

    Raises
    ------
    SyncError
        The record is damaged (rather than dropping the privacy guarantee it carries).
    """
    if not isinstance(record, dict) or record.get("centroids_hash") != spec.centroids_hash:
        return None
    try:
        models = [str(m) for m in record["models"]]
        n_cells = spec.centroids.shape[0]
        stats = {k: np.asarray(record[k], dtype=np.float64).reshape(n_cells, len(models))
                 for k in ("count", "sum_accuracy", "sum_cost")}
        column = {m: j for j, m in enumerate(models)}
        aligned = {k: np.zeros((n_cells, len(spec.models))) for k in stats}
        for i, m in enumerate(spec.models):
            if m in column:
                for k in stats:
                    aligned[k][:, i] = stats[k][:, column[m]]
        cells = np.asarray(record["centroid_cells"], dtype=np.int64).reshape(-1)
        if cells.size and (cells.min() < 0 or cells.max() >= n_cells or np.unique(cells).size != cells.size):
            raise ValueError(f"centroid_cells must be distinct and lie in [0, {n_cells}), got {cells.tolist()}")
        return KMeansUpdate(
            CellStatistics(aligned["count"], aligned["sum_accuracy"], aligned["sum_cost"]), cells,
            np.asarray(record["local_centroids"], dtype=np.float64).reshape(cells.size, spec.d_emb),
            np.asarray(record["local_weights"], dtype=np.float64).reshape(cells.size),
            int(record["log_size"]),
            np.asarray(record["local_distinct"], dtype=np.int64).reshape(cells.size))
    except (KeyError, TypeError, ValueError) as exc:  # ShapeError is a ValueError
        raise SyncError(f"sync state {state_path}: the record of the last sent update is damaged "
                        f"({exc!r}); {STATE_LOSS_ADVICE}") from exc


@dataclass(frozen=True)
class Receipt:
    """The server's answer to an accepted upload (``201``, or ``200`` for a retry with the same key).

    Attributes
    ----------
    update_id : int, the server's id of the stored update.
    client_id : str. round_id : int, the round it was sent for.
    late : bool, True if it arrived after the round closed (counted in the next round).
    counted_in_round : int or None, the round it counts in (None while waiting for the next round).
    log_size : int, evaluations the update summarises.
    """

    update_id: int
    client_id: str
    round_id: int
    late: bool
    counted_in_round: int | None
    log_size: int

    def to_json(self) -> dict:
        """The receipt's JSON object (keys in the order of the attributes)."""
        return {"update_id": self.update_id, "client_id": self.client_id, "round_id": self.round_id,
                "late": self.late, "counted_in_round": self.counted_in_round, "log_size": self.log_size}

    @classmethod
    def from_json(cls, data: object) -> Receipt:
        """Parse a receipt.

        Raises
        ------
        SyncError
            Not an object, a missing field or one of the wrong type.
        """
        try:
            if not isinstance(data, Mapping):
                raise TypeError("not a JSON object")
            counted = data["counted_in_round"]
            receipt = cls(_int(data["update_id"], 1), str(data["client_id"]), _int(data["round_id"], 1),
                          data["late"], None if counted is None else _int(counted, 1), _int(data["log_size"], 0))
            if not isinstance(receipt.late, bool):
                raise TypeError(f"late must be a boolean, got {receipt.late!r}")
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncError(f"malformed receipt from the server: {exc!r}") from exc
        return receipt


#: What a damaged or unreadable sync state's error advises. Not "delete it": the state holds the record
#: of the last update sent, and the server compares each upload with the client's previous one for the
#: same centroids (``trainer.federated.update_checks.check_difference``), so a device without it sends
#: changes the server refuses.
#: Words of the server's 422 for an upload that moved an entry by fewer than min_count since the client's
#: previous one (``trainer.federated.update_checks.check_difference`` puts them in its message); the device
#: reads them to explain that refusal when it has lost its record of what it sent.
DIFFERENCE_REFUSAL_PHRASE = "since your last upload"

STATE_LOSS_ADVICE = (
    "restore it from a backup if there is one. Only if not, move it aside: without its record of the last "
    "update sent, the server refuses (422) each upload that differs from that update by fewer than min_count "
    "samples in some entry, until every changed entry has moved by at least min_count (new evaluations "
    "logged meanwhile) or a round over other centroids opens")


@dataclass
class SyncState:
    """The device's sync state file (JSON, written atomically by :class:`sdk.SyncClient`).

    Attributes
    ----------
    last_upload : dict or None, the last acknowledged upload: ``round_id``, ``key`` (its
        Idempotency-Key), ``update_id``, ``late``, ``log_size``.
    sent : dict or None, the record of the last update *sent* (:func:`encode_sent_record`), what the
        server may hold; written before the upload.
    bundle_etag : str or None, ETag of the manifest last fetched. bundle_version : int or None, the
        bundle version in use when it was fetched.
    version : int, :data:`SYNC_STATE_VERSION`.
    """

    last_upload: dict | None = None
    sent: dict | None = None
    bundle_etag: str | None = None
    bundle_version: int | None = None
    version: int = field(default=SYNC_STATE_VERSION)


def encode_sync_state(state: SyncState) -> bytes:
    """The state file's bytes: JSON with sorted keys, no whitespace beyond ``", "``/``": "``;
    fields that are None are left out."""
    obj = {"version": state.version}
    for name in ("last_upload", "sent", "bundle_etag", "bundle_version"):
        value = getattr(state, name)
        if value is not None:
            obj[name] = value
    return json.dumps(obj, sort_keys=True, allow_nan=False).encode("ascii")


def decode_sync_state(raw: bytes, path: str = "") -> SyncState:
    """Parse a state file (unknown keys ignored).

    Raises
    ------
    SyncError
        Not JSON, not an object, another version, or fields of the wrong type.
    """
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise SyncError(f"sync state {path} is unreadable ({exc}); {STATE_LOSS_ADVICE}") from exc
    if (not isinstance(obj, dict) or obj.get("version") != SYNC_STATE_VERSION
            or not isinstance(obj.get("last_upload") or {}, dict) or not isinstance(obj.get("sent") or {}, dict)):
        raise SyncError(f"sync state {path} has an unknown format; {STATE_LOSS_ADVICE}")
    return SyncState(obj.get("last_upload"), obj.get("sent"), obj.get("bundle_etag"), obj.get("bundle_version"))
