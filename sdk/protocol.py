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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from sdk.arrays import is_npz
from sdk.cell_statistics import CellStatistics
from sdk.errors import PayloadError, ShapeError, SyncError
from sdk.real_numbers import finite_float

#: Version of the sync protocol (``/v1``) and of each JSON message below.
PROTOCOL_VERSION = 1
#: Version of the device's sync state file.
SYNC_STATE_VERSION = 1
KMEANS_KIND = "kmeans"
JSONObject = dict[str, Any]
_Floats = npt.NDArray[np.float64]
_Ints = npt.NDArray[np.int64]


def encode_json(obj: object) -> bytes:
    """Compact JSON bytes of a wire message: no whitespace, keys in the order given, ASCII,
    NaN/inf refused (ValueError). Floats are Python's shortest repr (exact for float64)."""
    return json.dumps(obj, allow_nan=False, separators=(",", ":")).encode("ascii")


def centroids_hash(centroids: npt.ArrayLike) -> str:
    """sha256 (hex) of the centroids as little-endian float32 with their shape: the identity of a
    cell partition. Updates are merged only with updates for the same partition."""
    c = np.ascontiguousarray(centroids, dtype="<f4")
    h = hashlib.sha256(f"{c.shape[0]}x{c.shape[1]}:".encode())
    h.update(c.tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class RoundSpec:
    """The open round as the server announces it (``GET /v1/rounds/current``): ``round_id`` >= 1,
    ``kind``, the global ``centroids`` (n_cells, d_emb) float32 and their :func:`centroids_hash`,
    ``models`` (the statistics' column order), the embedder's name and ``d_emb``, the privacy threshold
    ``min_count`` >= 1, ``deadline_utc`` (ISO-8601) and ``max_cost_usd`` (USD > 0, the bound each logged
    cost is clipped to; None: no bound). Fields: docs/protocol.md."""

    round_id: int
    kind: str
    centroids: npt.NDArray[np.float32]
    centroids_hash: str
    models: tuple[str, ...]
    embedder_name: str
    d_emb: int
    min_count: int
    deadline_utc: str
    max_cost_usd: float | None = None

    @classmethod
    def from_json(cls, data: object) -> RoundSpec:
        """Parse the server's JSON answer; SyncError for a missing field, one of the wrong type or shape
        (``models`` a list of distinct strings), or centroids that do not match their hash."""
        try:
            obj = dict(data) if isinstance(data, Mapping) else {}
            spec = cls(round_id=_field(obj, "round_id", int, 1), kind=_field(obj, "kind", str),
                       centroids=np.asarray(obj["centroids"], dtype=np.float64).astype(np.float32),
                       centroids_hash=_field(obj, "centroids_hash", str), models=tuple(_field(obj, "models", list)),
                       embedder_name=_field(obj, "embedder_name", str), d_emb=_field(obj, "d_emb", int, 1),
                       min_count=_field(obj, "min_count", int, 1), deadline_utc=_field(obj, "deadline_utc", str),
                       max_cost_usd=_positive_or_none(obj.get("max_cost_usd"), "max_cost_usd"))
            c = spec.centroids
            problem = (f"centroids of shape {c.shape} do not fit d_emb={spec.d_emb}"
                       if c.ndim != 2 or c.shape[0] < 1 or c.shape[1] != spec.d_emb or not np.isfinite(c).all()
                       else "centroids do not match their hash" if centroids_hash(c) != spec.centroids_hash
                       else f"models must be distinct and non-empty, got {spec.models}"
                       if not spec.models or len(set(spec.models)) != len(spec.models) else None)
            problem = problem and f"round {spec.round_id}: {problem}"
        except (KeyError, TypeError, ValueError) as exc:
            problem = (f"malformed round description from the server: "
                       f"{repr(exc) if isinstance(data, Mapping) else 'not a JSON object'}")
        if problem:
            raise SyncError(problem)
        return spec


def _positive_or_none(value: object, name: str) -> float | None:
    out = finite_float(value)
    if value is not None and (out is None or out <= 0):
        raise ValueError(f"{name} must be a finite number > 0 or null, got {value!r}")
    return out


_KINDS = {str: "a string", bool: "a boolean", int: "an integer", list: "a list of strings"}


def _field(obj: Mapping[str, Any], key: str, kind: type[Any], minimum: int = 0) -> Any:
    """``obj[key]`` when it is of ``kind`` (an int: not a bool, >= ``minimum``), else TypeError."""
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < minimum)) \
            or (kind is list and not all(isinstance(m, str) for m in value)):
        shown = value if isinstance(value, (int, float)) else type(value).__name__  # no quotes: repr(exc) stays plain
        raise TypeError(f"{key} must be {_KINDS[kind]}{f' >= {minimum}' if kind is int else ''}, got {shown}")
    return value


@dataclass(frozen=True)
class KMeansUpdate:
    """One device's statistics for one round: ``statistics`` (n_cells, n_models), the reported cells
    ``centroid_cells`` (n_reported,) int64 with their mean embeddings ``local_centroids`` (n_reported,
    d_emb) float64 and query counts ``local_weights`` (n_reported,), ``log_size`` (rows summarised, at
    least the counts' and the weights' sums) and ``local_distinct`` (n_reported,) int64 distinct
    embeddings per cell (None: unknown; kept on the device, never sent)."""

    statistics: CellStatistics
    centroid_cells: _Ints
    local_centroids: _Floats
    local_weights: _Floats
    log_size: int
    local_distinct: _Ints | None = None

    def is_empty(self) -> bool:
        """True if the update reports nothing: every count zero and no cell mean (not worth sending)."""
        return not np.any(self.statistics.count) and self.centroid_cells.size == 0

    def to_payload(self, client_id: str, spec: RoundSpec) -> JSONObject:
        """The JSON body of ``POST /v1/rounds/{round_id}/updates`` (aggregates only; floats exact)."""
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
    """The JSON body of ``POST /v1/rounds/{round_id}/updates``; deterministic (its sha256 names the upload)."""
    return encode_json(update.to_payload(client_id, spec))


#: ``Content-Type`` of the two K-means update encodings.
JSON_MEDIA_TYPE = "application/json"
MSGPACK_MEDIA_TYPE = "application/msgpack"
#: Keys of a K-means update on the wire (JSON and MessagePack), in the order written.
UPDATE_FIELDS = ("client_id", "round_id", "kind", "centroids_hash", "models", "log_size", "count", "sum_accuracy",
                 "sum_cost", "centroid_cells", "local_centroids", "local_weights")
#: The array fields of the MessagePack encoding: name -> (numpy dtype of the raw bytes, rank); the
#: cell means travel as float32, the precision of the embeddings they average.
MSGPACK_ARRAYS = {"count": ("<f8", 2), "sum_accuracy": ("<f8", 2), "sum_cost": ("<f8", 2),
                  "centroid_cells": ("<i8", 1), "local_centroids": ("<f4", 2), "local_weights": ("<f8", 1)}


_INT64, _FLOAT64 = np.dtype(np.int64), np.dtype(np.float64)
_WIDE = (_INT64, _FLOAT64)
_DTYPES = {dtype: np.dtype(dtype) for dtype, _ in MSGPACK_ARRAYS.values()}  # parsed once


def pack_msgpack_array(values: npt.ArrayLike, dtype: str) -> list[Any]:
    """``[shape, data]``: one array of the MessagePack encoding, C-order bytes cast to ``dtype``."""
    a = np.ascontiguousarray(values, dtype=dtype)
    return [list(a.shape), a.tobytes()]


def unpack_msgpack_array(value: object, dtype: str, rank: int, widen: bool = True) -> npt.NDArray[Any]:
    """The read-only array of a ``[shape, data]`` pair, widened to float64 / int64 (``widen=False``: a
    view in ``dtype``). ShapeError unless ``shape`` is ``rank`` non-negative ints and ``data`` bytes of
    exactly ``prod(shape) * itemsize``."""
    dt = _DTYPES.get(dtype) or np.dtype(dtype)
    shape, data = value if isinstance(value, (list, tuple)) and len(value) == 2 else (None, None)
    if not (isinstance(shape, (list, tuple)) and isinstance(data, bytes)):
        problem = "must be [shape, bytes] (a list of ints and a bin)"
    elif len(shape) != rank or not all([type(n) is int and 0 <= n < 2**31 for n in shape]):
        problem = f"shape must be {rank} non-negative ints, got {list(shape)!r}"
    elif len(data) != math.prod(shape) * dt.itemsize:
        problem = f"shape {list(shape)} needs {math.prod(shape) * dt.itemsize} bytes of {dtype}, got {len(data)}"
    else:
        # A view of the bytes (read-only, like the bytes) where the dtype is already the wide one, else a widened copy.
        arr = np.ndarray(shape, dt, data)
        return arr if not widen or dt in _WIDE else arr.astype(_INT64 if dt.kind in "iu" else _FLOAT64)
    raise ShapeError(problem)


def encode_kmeans_update_msgpack(update: KMeansUpdate, client_id: str, spec: RoundSpec) -> bytes:
    """The MessagePack body of ``POST /v1/rounds/{round_id}/updates``: the keys of :data:`UPDATE_FIELDS` in
    order, arrays as :data:`MSGPACK_ARRAYS` pairs; deterministic (docs/protocol.md §3)."""
    s = update.statistics
    arrays = {"count": s.count, "sum_accuracy": s.sum_accuracy, "sum_cost": s.sum_cost,
              "centroid_cells": update.centroid_cells, "local_centroids": update.local_centroids,
              "local_weights": update.local_weights}
    body: JSONObject = {"client_id": client_id, "round_id": int(spec.round_id), "kind": KMEANS_KIND,
            "centroids_hash": spec.centroids_hash, "models": list(spec.models), "log_size": int(update.log_size)}
    if arrays["local_centroids"].size == 0:  # (0, d_emb) whatever the update's empty shape
        arrays["local_centroids"] = np.zeros((0, int(spec.d_emb)))
    for name, (dtype, _) in MSGPACK_ARRAYS.items():
        body[name] = pack_msgpack_array(arrays[name], dtype)
    return bytes(msgpack.packb(body, use_bin_type=True))


def _update_of_fields(obj: JSONObject) -> KMeansUpdate:
    return KMeansUpdate(CellStatistics(obj["count"], obj["sum_accuracy"], obj["sum_cost"]),
                        np.asarray(obj["centroid_cells"], dtype=np.int64).reshape(-1),
                        np.asarray(obj["local_centroids"], dtype=np.float64),
                        np.asarray(obj["local_weights"], dtype=np.float64).reshape(-1), int(obj["log_size"]))


_ENVELOPE = ("client_id", "round_id", "kind", "centroids_hash", "models")


def decode_kmeans_update_msgpack(raw: bytes) -> tuple[JSONObject, KMeansUpdate]:
    """(envelope: the :data:`_ENVELOPE` fields, update) of :func:`encode_kmeans_update_msgpack` bytes, not
    checked against a round (the server does, :mod:`trainer.server.validation`). PayloadError: not
    MessagePack or not exactly :data:`UPDATE_FIELDS`; ShapeError naming the array that is malformed
    or that :class:`CellStatistics` refuses."""
    obj = _unpack_map(raw, "K-means update", lambda o: set(o) == set(UPDATE_FIELDS),
                      f"a K-means update is a map with exactly the keys {list(UPDATE_FIELDS)}")
    obj.update(_unpack_arrays(obj, MSGPACK_ARRAYS))
    return {k: obj[k] for k in _ENVELOPE}, _update_of_fields(obj)


def _unpack_map(raw: bytes, what: str, valid: Callable[[JSONObject], bool], expected: str) -> JSONObject:
    """The MessagePack map of ``raw``; PayloadError when it is not one or not ``valid``."""
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        problem = None if isinstance(obj, dict) and valid(obj) else expected
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated classes on bad input
        problem = f"not a MessagePack {what} ({type(exc).__name__})"
    if problem:
        raise PayloadError(problem)
    return obj  # type: ignore[no-any-return]  # msgpack is untyped; checked above


def _unpack_arrays(obj: Mapping[str, object], dtypes: Mapping[str, tuple[str, int]]) -> dict[str, npt.NDArray[Any]]:
    """The ``[shape, bin]`` arrays of ``obj``; ShapeError prefixed with the field's name."""
    name = ""
    try:
        return {(name := n): unpack_msgpack_array(obj.get(n), dtype, rank) for n, (dtype, rank) in dtypes.items()}
    except ShapeError as exc:
        raise ShapeError(f"{name}: {exc}") from exc


def decode_kmeans_update_json(raw: bytes) -> tuple[JSONObject, KMeansUpdate]:
    """(envelope, update) of :func:`encode_kmeans_update` bytes (not checked against a round).
    PayloadError: not JSON or not exactly :data:`UPDATE_FIELDS`; ShapeError: ragged or non-numeric
    arrays, statistics :class:`CellStatistics` refuses."""
    try:
        obj = json.loads(raw)
        problem = None if isinstance(obj, dict) and set(obj) == set(UPDATE_FIELDS) else \
            f"a K-means update is an object with exactly the keys {list(UPDATE_FIELDS)}"
    except ValueError as exc:
        problem = f"not a JSON K-means update ({exc})"
    if problem:
        raise PayloadError(problem)
    try:
        arrays = {name: np.asarray(obj[name], dtype=np.float64) for name in MSGPACK_ARRAYS}
    except (TypeError, ValueError) as exc:
        raise ShapeError(f"an array field is ragged or not numeric ({exc})") from exc
    if arrays["local_centroids"].size == 0:
        arrays["local_centroids"] = arrays["local_centroids"].reshape(0, 0)
    return {k: obj[k] for k in _ENVELOPE}, _update_of_fields({**obj, **arrays})


def encode_kmeans_round(round_id: int, status: str, models: Sequence[str], embedder_name: str, d_emb: int,
                        min_count: int, quorum: int, deadline_utc: str, centroids: npt.ArrayLike,
                        max_cost_usd: float | None = None) -> JSONObject:
    """The JSON object of ``GET /v1/rounds/current`` (:meth:`RoundSpec.from_json`): centroids as float64
    lists of their float32 values with their hash; ``max_cost_usd`` last, only when set."""
    c = np.ascontiguousarray(centroids, dtype=np.float32)
    out: JSONObject = {"round_id": int(round_id), "kind": KMEANS_KIND, "status": status, "models": list(models),
           "embedder_name": embedder_name, "d_emb": int(d_emb), "min_count": int(min_count), "quorum": int(quorum),
           "deadline_utc": deadline_utc, "centroids": c.astype(np.float64).tolist(), "centroids_hash": centroids_hash(c)}
    if max_cost_usd is not None:
        out["max_cost_usd"] = float(max_cost_usd)
    return out


#: Names of the arrays of a :class:`KMeansUpdate`, in order (store ``.npz`` and Flower ArrayRecord).
UPDATE_ARRAYS = ("count", "sum_accuracy", "sum_cost", "centroid_cells", "local_centroids", "local_weights", "log_size")
_RANKS = {"count": 2, "sum_accuracy": 2, "sum_cost": 2, "centroid_cells": 1, "local_centroids": 2,
          "local_weights": 1, "log_size": 0}


def kmeans_update_to_arrays(update: KMeansUpdate) -> dict[str, npt.NDArray[Any]]:
    """A :class:`KMeansUpdate` as the arrays of :data:`UPDATE_ARRAYS`, in order: float64 but
    ``centroid_cells`` and ``log_size`` (shape ()) int64; values exact."""
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


def kmeans_update_from_arrays(arrays: Mapping[str, npt.ArrayLike]) -> KMeansUpdate:
    """Inverse of :func:`kmeans_update_to_arrays`; ShapeError for other names, non-numeric dtypes (cells
    and ``log_size``: integers), other ranks, or statistics :class:`CellStatistics` refuses."""
    names = set(arrays)
    out = {name: np.asarray(arrays[name]) for name in UPDATE_ARRAYS if name in names}
    bad = [name for name, arr in out.items() if arr.ndim != _RANKS[name]
           or arr.dtype.kind not in ("iu" if name in ("centroid_cells", "log_size") else "fiu")]
    if names != set(UPDATE_ARRAYS) or bad:
        raise ShapeError(
            f"an update holds exactly the arrays {list(UPDATE_ARRAYS)} (numbers, integers for centroid_cells and "
            f"log_size, of ranks {_RANKS}); missing {sorted(set(UPDATE_ARRAYS) - names)}, unexpected "
            f"{sorted(names - set(UPDATE_ARRAYS))}, wrong dtype or rank "
            f"{[f'{n} {out[n].dtype} {out[n].shape}' for n in bad]}")
    return KMeansUpdate(
        statistics=CellStatistics(out["count"], out["sum_accuracy"], out["sum_cost"]),
        centroid_cells=out["centroid_cells"].astype(np.int64),
        local_centroids=out["local_centroids"].astype(np.float64),
        local_weights=out["local_weights"].astype(np.float64),
        log_size=int(out["log_size"]),
    )


def encode_kmeans_update_npz(update: KMeansUpdate) -> bytes:
    """``.npz`` bytes (no pickle) of :func:`kmeans_update_to_arrays` (server store records before v2)."""
    buf = io.BytesIO()
    np.savez(buf, **kmeans_update_to_arrays(update))  # type: ignore[arg-type]  # numpy's stub reads **kwds as allow_pickle
    return buf.getvalue()


def decode_kmeans_update_npz(data: bytes) -> KMeansUpdate:
    """The update of :func:`encode_kmeans_update_npz` bytes; PayloadError: not an ``.npz`` (pickle
    refused), ShapeError: not the update's arrays."""
    arrays, reason = None, "not a zip archive"  # np.load would read a .npy as one array (not an update)
    if is_npz(data):
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            reason = str(exc)
    if arrays is None:
        raise PayloadError(f"not an .npz K-means update ({reason})")
    return kmeans_update_from_arrays(arrays)


#: Version tag of :func:`encode_kmeans_update_record` (first key of the map).
UPDATE_RECORD_FORMAT = "fedroute.kmeans_update.v3"
#: The array dtypes of each store record format read: v3 (written) as the wire, v2 with float64 cell means.
RECORD_ARRAYS = {
    UPDATE_RECORD_FORMAT: MSGPACK_ARRAYS,
    "fedroute.kmeans_update.v2": {**MSGPACK_ARRAYS, "local_centroids": ("<f8", 2)},
}


def encode_kmeans_update_record(update: KMeansUpdate, packed: Mapping[str, list[Any]] | None = None) -> bytes:
    """The server store's record of an accepted update: a MessagePack map of ``format``
    (:data:`UPDATE_RECORD_FORMAT`), the arrays as :data:`MSGPACK_ARRAYS` pairs (cell means float32,
    the precision of the embeddings they average), then ``log_size``; deterministic (docs/protocol.md
    §4). ``packed``: the upload's own wire pairs of these arrays, stored as they are."""
    packed = packed or {}
    arrays = {} if all(name in packed for name in MSGPACK_ARRAYS) else kmeans_update_to_arrays(update)
    record: JSONObject = {"format": UPDATE_RECORD_FORMAT}
    for name, (dtype, _) in MSGPACK_ARRAYS.items():
        record[name] = packed[name] if name in packed else pack_msgpack_array(arrays[name], dtype)
    record["log_size"] = int(update.log_size)
    return bytes(msgpack.packb(record, use_bin_type=True))


def decode_kmeans_update_record(data: bytes) -> KMeansUpdate:
    """The update of a store record (v3, v2 or ``.npz``), arrays as :func:`kmeans_update_from_arrays`
    gives them (float64, cells int64). PayloadError: none of these formats; ShapeError: not the
    update's arrays."""
    if data[:2] == b"PK":
        return decode_kmeans_update_npz(data)
    record = _unpack_map(data, "K-means update record", lambda o: o.get("format") in RECORD_ARRAYS,
                         f"not a K-means update record (formats {list(RECORD_ARRAYS)})")
    arrays = _unpack_arrays(record, RECORD_ARRAYS[record["format"]])
    log_size = record.get("log_size")  # anything but an int is refused as of dtype object
    return kmeans_update_from_arrays({**arrays, "log_size": np.asarray(log_size if type(log_size) is int else None)})


def encode_sent_record(update: KMeansUpdate, spec: RoundSpec) -> JSONObject:
    """The device state's record of an update about to be sent (JSON object; floats exact):
    the wire fields plus ``centroids_hash``, ``models``, ``min_count`` and ``local_distinct``."""
    return {"centroids_hash": spec.centroids_hash, "models": list(spec.models), "min_count": spec.min_count,
            "count": update.statistics.count.tolist(), "sum_accuracy": update.statistics.sum_accuracy.tolist(),
            "sum_cost": update.statistics.sum_cost.tolist(), "centroid_cells": update.centroid_cells.tolist(),
            "local_centroids": update.local_centroids.tolist(), "local_weights": update.local_weights.tolist(),
            "local_distinct": np.asarray(update.local_distinct, dtype=np.int64).tolist()
            if update.local_distinct is not None else update.local_weights.astype(np.int64).tolist(),
            "log_size": int(update.log_size)}


def decode_sent_record(record: JSONObject | None, spec: RoundSpec, state_path: str = "") -> KMeansUpdate | None:
    """The update last sent for ``spec``'s centroids (the state's ``record``) in ``spec.models`` column
    order (a model it lacked counts as never sent), or None; SyncError when the record is damaged."""
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
    """The server's answer to an accepted upload: the stored ``update_id``, ``client_id``, the
    ``round_id`` it was sent for, ``late`` (arrived after the round closed), ``counted_in_round``
    (None while waiting for the next round) and the ``log_size`` it summarises."""

    update_id: int
    client_id: str
    round_id: int
    late: bool
    counted_in_round: int | None
    log_size: int

    def to_json(self) -> JSONObject:
        """The receipt's JSON object (keys in the order of the attributes)."""
        return {"update_id": self.update_id, "client_id": self.client_id, "round_id": self.round_id,
                "late": self.late, "counted_in_round": self.counted_in_round, "log_size": self.log_size}

    @classmethod
    def from_json(cls, data: object) -> Receipt:
        """Parse a receipt; SyncError for a non-object, a missing field or one of the wrong type."""
        try:
            obj = dict(data) if isinstance(data, Mapping) else {}
            counted = obj["counted_in_round"] is not None and _field(obj, "counted_in_round", int, 1)
            return cls(_field(obj, "update_id", int, 1), str(obj["client_id"]), _field(obj, "round_id", int, 1),
                       _field(obj, "late", bool), counted or None, _field(obj, "log_size", int))
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncError(f"malformed receipt from the server: "
                            f"{repr(exc) if isinstance(data, Mapping) else 'not a JSON object'}") from exc


#: Words of the server's 422 for an upload that moved an entry by fewer than min_count since the client's
#: previous one (``check_difference``); the device reads them to explain it after losing its state.
DIFFERENCE_REFUSAL_PHRASE = "since your last upload"
#: What a damaged sync state's error advises: not "delete it", since the server compares each upload
#: with the client's previous one and refuses small changes.

STATE_LOSS_ADVICE = (
    "restore it from a backup if there is one. Only if not, move it aside: without its record of the last "
    "update sent, the server refuses (422) each upload that differs from that update by fewer than min_count "
    "samples in some entry, until every changed entry has moved by at least min_count (new evaluations "
    "logged meanwhile) or a round over other centroids opens")


@dataclass
class SyncState:
    """The device's sync state file (JSON, written atomically by :class:`sdk.SyncClient`): the last
    acknowledged upload (``round_id``, ``key``, ``update_id``, ``late``, ``log_size``), the record of the
    last update *sent* (:func:`encode_sent_record`, written before the upload), the manifest's ETag and
    the bundle version in use, and the file's ``version``."""

    last_upload: JSONObject | None = None
    sent: JSONObject | None = None
    bundle_etag: str | None = None
    bundle_version: int | None = None
    version: int = field(default=SYNC_STATE_VERSION)


def encode_sync_state(state: SyncState) -> bytes:
    """The state file's bytes: JSON with sorted keys; fields that are None are left out."""
    obj: JSONObject = {"version": state.version}
    for name in ("last_upload", "sent", "bundle_etag", "bundle_version"):
        value = getattr(state, name)
        if value is not None:
            obj[name] = value
    return json.dumps(obj, sort_keys=True, allow_nan=False).encode("ascii")


def decode_sync_state(raw: bytes, path: str = "") -> SyncState:
    """Parse a state file (unknown keys ignored); SyncError when it is not JSON, not an object, of
    another version, or with fields of the wrong type."""
    try:
        obj = json.loads(raw)
        version = obj.get("bundle_version") if isinstance(obj, dict) else None
        problem = None if (isinstance(obj, dict) and obj.get("version") == SYNC_STATE_VERSION and isinstance(
            obj.get("last_upload") or {}, dict) and isinstance(obj.get("sent") or {}, dict)
            and isinstance(obj.get("bundle_etag") or "", str) and (version is None or (
                isinstance(version, int) and not isinstance(version, bool)))) else "has an unknown format"
    except ValueError as exc:
        problem = f"is unreadable ({exc})"
    if problem:
        raise SyncError(f"sync state {path} {problem}; {STATE_LOSS_ADVICE}")
    return SyncState(obj.get("last_upload"), obj.get("sent"), obj.get("bundle_etag"), obj.get("bundle_version"))
