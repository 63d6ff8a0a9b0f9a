"""Device round handlers: what a device sends for an open federated round, per router kind.

:class:`sdk.SyncClient` reads the round (``GET /v1/rounds/current``), finds the kind's handler
(:mod:`sdk.kinds`, ``ArtefactKind.round_handler``) and sends what :meth:`DeviceRoundHandler.prepare`
returns. Both handlers first screen the log (:func:`screen_log`, :mod:`sdk.log_checks`).

- :class:`KMeansRoundHandler` (paper 002, federated K-means): :mod:`sdk.local_update`'s statistics and
  local centroids, small changes since the last sent update held back; rows whose embedding is not of
  unit norm (logged by older SDKs; the server refuses means of them) or absent (a cell only) are left out with
  a warning.
- :class:`MlpRoundHandler` (paper 002, federated MLP): fetches the round's parameters, checks their
  hash and hands them to the app's local trainer (torch lives in ``trainer``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from sdk.errors import SyncError
from sdk.eval_log import UNIT_NORM_TOLERANCE, Evaluations
from sdk.log_checks import LogCheck, check_log, warn
from sdk.local_update import centroid_threshold, hold_small_changes, kmeans_update
from sdk.protocol import (
    JSON_MEDIA_TYPE,
    MSGPACK_MEDIA_TYPE,
    RoundSpec,
    decode_sent_record,
    encode_kmeans_update,
    encode_kmeans_update_msgpack,
    encode_sent_record,
)


#: The app's local trainer of torch kinds: ``f(evaluations, round_json, parameters, client_id) -> upload or None``.
LocalTrainer = Callable[[Evaluations, dict[str, Any], bytes, str], bytes | None]


@dataclass(frozen=True)
class DeviceRoundContext:
    """What a handler may use: the device's ``client_id``; ``rows()`` reads the EvalLog; ``sent``, the
    state's record of the last sent update (``PreparedUpload.sent`` of an earlier round);
    ``min_count_floor``, the smallest privacy threshold the device accepts; ``allow_repartition``;
    ``fetch(path, limit_bytes)``, a retried, size-limited GET; ``local_trainer(evaluations, round_json,
    parameters, client_id) -> bytes | None`` (torch kinds); ``upload_format``: ``"msgpack"`` or ``"json"``."""

    client_id: str
    rows: Callable[[], Evaluations]
    sent: dict[str, Any] | None
    min_count_floor: int
    allow_repartition: bool
    fetch: Callable[[str, int], bytes]
    local_trainer: LocalTrainer | None = None
    state_path: str = ""
    upload_format: str = "msgpack"


@dataclass(frozen=True)
class PreparedUpload:
    """A handler's answer: ``round_id``; ``payload`` (bytes) and its ``content_type``, or None with
    ``skipped`` saying why nothing is sent; ``sent``, the record to keep in the state as what the
    server may see from now on (None: keep the previous record)."""

    round_id: int
    payload: bytes | None
    content_type: str
    skipped: str | None = None
    sent: dict[str, Any] | None = None
    warnings: tuple[str, ...] = ()


def screen_log(evaluations: Evaluations) -> tuple[Evaluations, LogCheck]:
    """The log without the rows of models whose scores are degenerate (:mod:`sdk.log_checks`,
    criterion 1), and the check; each warning is logged."""
    models = tuple(sorted(set(evaluations.model)))
    index = {m: j for j, m in enumerate(models)}
    model_index = np.array([index[m] for m in evaluations.model], dtype=np.int64)
    check = check_log(model_index, evaluations.score, models)
    warn(check.warnings, "upload")
    keep = check.uploadable[model_index] if len(evaluations) else np.zeros(0, dtype=bool)
    if keep.all():
        return evaluations, check
    return _take(evaluations, np.flatnonzero(keep)), check


def _take(evaluations: Evaluations, rows: npt.NDArray[np.intp]) -> Evaluations:
    """The ``rows`` of ``evaluations`` (policy and propensity: not recorded; uploads ignore them)."""
    e = evaluations
    return Evaluations(e.id[rows], e.timestamp[rows], tuple(e.model[i] for i in rows), e.score[rows],
                       e.cost_usd[rows], e.latency_ms[rows], e.cell[rows], e.embedding[rows],
                       e.bundle_version[rows], tuple(e.query[i] for i in rows))


def _without_off_norm_embeddings(evaluations: Evaluations) -> tuple[Evaluations, tuple[str, ...]]:
    """The rows whose embedding is absent or of unit norm (within ``UNIT_NORM_TOLERANCE``), and a
    warning for the others (the server refuses cell means of norm above 1) and for the absent ones
    (rows logged with a cell only: the upload places each query by its embedding, so they stay out)."""
    emb = evaluations.embedding.astype(np.float64)
    norm = np.sqrt(np.einsum("ij,ij->i", emb, emb)) if emb.shape[1] else np.full(len(evaluations), np.nan)
    bad, absent = np.isfinite(norm) & (np.abs(norm - 1.0) > UNIT_NORM_TOLERANCE), int((~np.isfinite(norm)).sum())
    messages: tuple[str, ...] = (f"{absent} rows of the log have no embedding (logged with a cell only): left out of "
                                 "this upload (K-means uploads place each query by its embedding); they stay in the log",
                                 ) if absent else ()
    if bad.any():
        messages += (f"{int(bad.sum())} rows of the log have an embedding whose norm is not 1 (e.g. row "
                     f"{int(evaluations.id[bad][0])}: {float(norm[bad][0]):.6g}; logged before EvalLog.record refused "
                     "them): left out of this upload (the server refuses means of them); they stay in the log",)
    warn(messages, "upload")
    return (_take(evaluations, np.flatnonzero(~bad)) if bad.any() else evaluations), messages


class DeviceRoundHandler(Protocol):
    """The device side of a federated round kind."""

    def prepare(self, round_json: dict[str, Any], context: DeviceRoundContext) -> PreparedUpload:
        """The upload for ``round_json`` (``GET /v1/rounds/current``); SyncError for a malformed round or
        a damaged ``context.sent``, ShapeError when the log's embeddings do not fit the round."""
        ...


#: Largest MLP parameters download (bytes).
MAX_PARAMETERS_BYTES = 64 << 20
JSON_TYPE = JSON_MEDIA_TYPE
#: K-means upload encoders by ``DeviceRoundContext.upload_format``: (encoder, Content-Type).
KMEANS_ENCODINGS = {"msgpack": (encode_kmeans_update_msgpack, MSGPACK_MEDIA_TYPE),
                    "json": (encode_kmeans_update, JSON_MEDIA_TYPE)}
SAFETENSORS_TYPE = "application/x-safetensors"


class KMeansRoundHandler:
    """Federated K-means rounds: see the module docstring and :mod:`sdk.local_update`."""

    def prepare(self, round_json: dict[str, Any], context: DeviceRoundContext) -> PreparedUpload:
        spec = RoundSpec.from_json(round_json)
        spec = dataclasses.replace(spec, min_count=max(spec.min_count, context.min_count_floor))
        record = context.sent
        if (isinstance(record, dict) and record.get("centroids_hash") != spec.centroids_hash
                and not context.allow_repartition):
            return PreparedUpload(spec.round_id, None, JSON_TYPE, (
                "round over other centroids than this device's last upload: uploads for two partitions can be "
                "combined to recover single queries; skipped (allow_repartition=True sends it)"))
        rows, check = screen_log(context.rows())
        rows, off_norm = _without_off_norm_embeddings(rows)
        warnings = (*check.warnings, *off_norm)
        update = kmeans_update(rows, spec)
        update = hold_small_changes(update, decode_sent_record(record, spec, context.state_path), spec.min_count)
        if update.is_empty():
            why = (f"nothing to report: no (cell, model) entry reaches min_count={spec.min_count} and no cell "
                   f"holds {centroid_threshold(spec.min_count)} distinct queries (log size {update.log_size})")
            return PreparedUpload(spec.round_id, None, JSON_TYPE, why, warnings=warnings)
        encode, media_type = KMEANS_ENCODINGS[context.upload_format]
        payload = encode(update, context.client_id, spec)
        return PreparedUpload(spec.round_id, payload, media_type, None, encode_sent_record(update, spec), warnings)


class MlpRoundHandler:
    """Federated MLP rounds: fetch the round's parameters, train on the device (``local_trainer``)."""

    def prepare(self, round_json: dict[str, Any], context: DeviceRoundContext) -> PreparedUpload:
        try:
            round_id = int(round_json["round_id"])
            url, digest = str(round_json["parameters_url"]), str(round_json["parameters_hash"])
            min_count = round_json["min_count"]
            problem = (f"min_count must be an integer, got {min_count!r}" if isinstance(min_count, bool)
                       or not isinstance(min_count, int) else f"unexpected parameters URL {url!r}"
                       if not url.startswith("/v1/rounds/") else None)
        except (KeyError, TypeError, ValueError) as exc:
            problem = repr(exc)
        if problem:
            raise SyncError(f"malformed MLP round description from the server: {problem}")
        if context.local_trainer is None:
            why = "MLP round: this client cannot train (no mlp_trainer; `fedroute sync` with the trainer extra can)"
            return PreparedUpload(round_id, None, SAFETENSORS_TYPE, why)
        if min_count < context.min_count_floor:
            why = (f"MLP round: its min_count={min_count} is below this device's min_count_floor="
                   f"{context.min_count_floor} (an update over so few samples would reveal too much)")
            return PreparedUpload(round_id, None, SAFETENSORS_TYPE, why)
        parameters = context.fetch(url, MAX_PARAMETERS_BYTES)
        if hashlib.sha256(parameters).hexdigest() != digest:
            raise SyncError(f"round {round_id}: parameters do not match their hash")
        rows, check = screen_log(context.rows())
        payload = context.local_trainer(rows, round_json, parameters, context.client_id)
        if payload is None:
            return PreparedUpload(round_id, None, SAFETENSORS_TYPE,
                                  f"MLP round: fewer than min_count={min_count} evaluations to train on",
                                  warnings=check.warnings)
        return PreparedUpload(round_id, payload, SAFETENSORS_TYPE, warnings=check.warnings)
