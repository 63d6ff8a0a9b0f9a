"""The device side of the federated sync (ARCHITECTURE.md §6): upload statistics, fetch the bundle.

:meth:`SyncClient.run_once` is one sync (``fedroute-sync``, for cron or a systemd timer):

1. ``GET /v1/rounds/current``; for an open round, the kind's device handler (:mod:`sdk.device_rounds`)
   computes the update from the :class:`sdk.EvalLog` (aggregates only, small changes since the last
   *sent* update held back); the record of what is sent goes to the state first, then the ``POST``
   with an ``Idempotency-Key`` from the round and the body (a retry is counted once).
2. ``GET /v1/bundles/latest`` (``If-None-Match``); a newer bundle is verified (signature, every
   sha256; unchanged files copied from the bundle in use), loaded, probed, and swapped in atomically
   (:mod:`sdk.bundle_install`). This step also runs when the upload step was refused (4xx) or the log
   does not fit the round: the newer bundle may be the fix.

Connection errors and 5xx are retried with exponential backoff and jitter; 4xx raise
:class:`sdk.errors.SyncRejectedError`, other statuses :class:`sdk.errors.SyncError`. Answers are read
with a size limit. The state is a small JSON file written atomically. httpx, no torch.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import random
import shutil
import ssl
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np

from sdk import bundle_install, kinds
from sdk import bundle_manifest as fmt
from sdk.atomic_write import write_atomic
from sdk.errors import (
    BundleError,
    EvalLogError,
    FedrouteError,
    InvalidInputError,
    InvalidQueryError,
    ShapeError,
    SyncError,
    SyncRejectedError,
)
from sdk.device_rounds import DeviceRoundContext, LocalTrainer
from sdk.eval_log import EvalLog
from sdk.protocol import (DIFFERENCE_REFUSAL_PHRASE, STATE_LOSS_ADVICE, Receipt, SyncState, decode_sync_state,
                          encode_sync_state)
from sdk.real_numbers import finite_float
from sdk.router import Router

#: Largest round description (``GET /v1/rounds/current``: the centroids) and MLP parameters read.
MAX_ANSWER_BYTES = 64 << 20
#: Largest receipt (``POST .../updates``) read.
MAX_RECEIPT_BYTES = 1 << 20
#: Bytes of an error answer read for its detail.
MAX_ERROR_BYTES = 64 << 10
_T = TypeVar("_T")
#: Query a downloaded bundle must give an estimate for (some model with a finite accuracy); a bundle
#: whose embedder knows no token of it (a static vocabulary of another language) is probed with a
#: unit embedding instead.
PROBE_QUERY = "hello"


@dataclass(frozen=True)
class SyncResult:
    """What one :meth:`SyncClient.run_once` did: the open ``round_id`` (None: none open), whether an
    update was ``uploaded`` and acknowledged in this run, ``late`` (counted in the next round), the
    server's ``update_id`` and the ``log_size`` it summarises, the ``bundle_version`` in use after the
    run and whether it was ``bundle_updated``, why nothing was uploaded (``skipped``), and the
    degenerate-log ``warnings`` of the upload step (:mod:`sdk.log_checks`)."""

    round_id: int | None
    uploaded: bool
    late: bool
    update_id: int | None
    log_size: int | None
    bundle_version: int | None
    bundle_updated: bool
    skipped: str | None = None
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def upload_key(round_id: int, deadline_utc: object, payload: bytes) -> str:
    """The ``Idempotency-Key`` of an upload: ``r{round_id}-{sha256 hex of deadline + NUL + body}``; the
    deadline tells round 1 of a new server database from an old round 1."""
    prefix = ("" if deadline_utc is None else str(deadline_utc)).encode() + b"\0"
    return f"r{int(round_id)}-{hashlib.sha256(prefix + payload).hexdigest()}"


class SyncClient:
    """Periodic sync of one device with the aggregation server.

    Parameters
    ----------
    server_url : ``https://host:port`` (plain http is refused: the token would leak).
    token : the device's bearer token (``fedroute clients add``), printable ASCII.
    eval_log : the device's :class:`sdk.EvalLog` (only read).
    bundle_dir : path of the bundle in use (replaced atomically by newer published bundles).
    public_key : key that must have signed any bundle installed (path, PEM or key object).
    ca_cert : PEM file of the CA that signed the server certificate (default: system CAs).
    state_path : JSON state file; default ``.<bundle name>.sync.json`` beside ``bundle_dir``.
    timeout_s : seconds per HTTP request (> 0); retries : retries after a connection error or 5xx (>= 0);
        backoff_s, max_backoff_s : the first backoff and its cap, seconds (>= 0; doubling, with jitter).
    transport : an ``httpx.BaseTransport``; sleep : the function that waits between retries.
    mlp_trainer : ``f(evaluations, round_json, parameters_bytes, client_id) -> bytes | None`` for MLP
        rounds (``trainer.federated.mlp_local.train_on_log``); without it they are skipped.
    min_count_floor : int >= 1, the smallest privacy threshold this device accepts (MLP rounds below it
        are skipped); upload_format : ``"msgpack"`` or ``"json"`` (docs/protocol.md §3).
    allow_repartition : False skips a K-means round over other centroids than the last upload (two
        uploads over two partitions can be subtracted).

    Raises InvalidInputError naming the argument that is out of range or of the wrong type.
    """

    def __init__(self, server_url: str, token: str, eval_log: EvalLog, bundle_dir: str | os.PathLike[str],
                 public_key: Any, *, ca_cert: str | os.PathLike[str] | None = None,
                 state_path: str | os.PathLike[str] | None = None, timeout_s: float = 30.0, retries: int = 5,
                 backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 transport: httpx.BaseTransport | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 mlp_trainer: LocalTrainer | None = None,
                 min_count_floor: int = 5, allow_repartition: bool = False,
                 upload_format: str = "msgpack") -> None:
        try:
            url, not_a_url = httpx.URL(str(server_url)), ""
        except httpx.InvalidURL as exc:
            url, not_a_url = httpx.URL("https://invalid"), f"server_url {str(server_url)!r} is not a URL ({exc})"
        timeout = finite_float(timeout_s)
        bare = token.strip() if isinstance(token, str) else ""
        problems = (  # (refused?, message): the first that holds is raised
            (bool(not_a_url), not_a_url),
            (url.scheme != "https", f"server_url must be https://..., got {str(server_url)!r}"),
            (not bare, "token must be a non-empty string"),
            (not all("\x21" <= ch <= "\x7e" for ch in bare),  # it travels in the Authorization header
             "token must be printable ASCII without spaces or control characters (it is sent in an HTTP header); "
             "check the token file for stray bytes"),
            (isinstance(retries, bool) or not isinstance(retries, numbers.Integral) or retries < 0,
             f"retries must be an int >= 0, got {retries!r}"),
            *((finite_float(v) is None or v < 0, f"{name} must be a finite number of seconds >= 0, got {v!r}")
              for name, v in (("backoff_s", backoff_s), ("max_backoff_s", max_backoff_s))),
            (timeout is None or timeout <= 0, f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}"),
            (not isinstance(eval_log, EvalLog), f"eval_log must be an sdk.EvalLog, got {type(eval_log).__name__}"),
            (not isinstance(bundle_dir, (str, os.PathLike)), f"bundle_dir must be a path, got {type(bundle_dir).__name__}"),
            (isinstance(min_count_floor, bool) or not isinstance(min_count_floor, int) or min_count_floor < 1,
             f"min_count_floor must be an int >= 1, got {min_count_floor!r}"),
            (upload_format not in ("msgpack", "json"), f"upload_format must be 'msgpack' or 'json', got {upload_format!r}"),
        )
        problem = next((message for refused, message in problems if refused), None)
        if problem:
            raise InvalidInputError(problem)
        self.upload_format = upload_format
        self.eval_log = eval_log
        self.bundle_dir = Path(bundle_dir)
        self.public_key = fmt.load_public_key(public_key)
        self.state_path = Path(state_path) if state_path else self.bundle_dir.parent / f".{self.bundle_dir.name}.sync.json"
        self.retries, self.backoff_s, self.max_backoff_s, self._sleep = int(retries), backoff_s, max_backoff_s, sleep
        self.mlp_trainer = mlp_trainer
        self.allow_repartition = bool(allow_repartition)
        self.min_count_floor = min_count_floor
        try:
            verify = ssl.create_default_context(cafile=str(ca_cert)) if ca_cert else True
        except (OSError, ssl.SSLError) as exc:
            raise InvalidInputError(f"ca_cert {ca_cert} is not a readable PEM certificate file ({exc})") from exc
        self._http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {bare}"},
                                  timeout=timeout, verify=verify, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one sync -----------------------------------------------------------------------------

    def run_once(self) -> SyncResult:
        """Upload this round's update (if a round is open), then install a newer bundle (if any).

        The bundle step also runs when the upload step raised SyncRejectedError, ShapeError or
        EvalLogError, which is raised afterwards with a note on the bundle. Raises SyncRejectedError (a
        4xx; ``status`` says why), SyncError (unreachable or 5xx after the retries, an unexpected status
        or answer, an answer over its size limit, an unreadable state, a closed client), BundleError (a
        bundle that fails verification or the probe; nothing installed), ShapeError (the log does not
        fit the round's embedder), EvalLogError, OSError (writing the state or bundle), and what
        ``mlp_trainer`` raises.
        """
        if self._http.is_closed:  # httpx's own error would be a raw RuntimeError
            raise SyncError(f"this SyncClient of {self._http.base_url} is closed; create a new one to sync again")
        # One sync at a time per device: two would hold back against the same sent record.
        with bundle_install.locked(self.state_path):
            return self._run_once()

    def _run_once(self) -> SyncResult:
        state = self._read_state()
        try:
            round_id, uploaded, late, update_id, log_size, skipped, warnings = self._sync_round(state)
        except (SyncRejectedError, ShapeError, EvalLogError) as upload_error:  # the bundle may be the fix
            try:
                version, updated = self._update_bundle(state)
            except (FedrouteError, OSError) as bundle_error:
                upload_error.add_note(f"the bundle update failed too: {bundle_error!r}")
                raise upload_error  # the upload error is the one to report; the bundle's is its context
            upload_error.add_note(f"the bundle step still ran: version {version} in use"
                                  f"{' (newly installed)' if updated else ''}")
            raise
        version, updated = self._update_bundle(state)
        return SyncResult(round_id, uploaded, late, update_id, log_size, version, updated, skipped, warnings)

    def _sync_round(self, state: SyncState) -> tuple[int | None, bool, bool, int | None, int | None, str | None,
                                                     tuple[str, ...]]:
        """The upload step: (round id, uploaded, late, update id, log size, why skipped, log warnings)."""
        round_id: int | None = None
        update_id: int | None = None
        log_size: int | None = None
        skipped: str | None = None
        uploaded = late = False
        warnings: tuple[str, ...] = ()
        answer = self._request("GET", "/v1/rounds/current", ok=(200, 204), limit=MAX_ANSWER_BYTES)
        if answer.status_code == 204:
            return round_id, uploaded, late, update_id, log_size, skipped, warnings
        description = _json(answer)
        round_id, payload, content_type, skipped, sent, warnings = self._prepare_upload(description, state)
        if payload is None:
            return round_id, uploaded, late, update_id, log_size, skipped, warnings
        key = upload_key(round_id, description.get("deadline_utc"), payload)
        last = state.last_upload or {}
        if last.get("key") == key:  # acknowledged before: same round, same body
            return (round_id, False, bool(last.get("late")), last.get("update_id"), last.get("log_size"), None,
                    warnings)
        previous_sent = state.sent
        if sent is not None:  # what the server may see from now on, recorded before it is sent
            state.sent = sent
            self._write_state(state)
        try:
            receipt_json = _json(self._request(
                "POST", f"/v1/rounds/{round_id}/updates", content=payload, limit=MAX_RECEIPT_BYTES,
                headers={"Idempotency-Key": key, "Content-Type": content_type}))
        except SyncRejectedError as exc:  # refused (4xx): not stored, so hold against what the server has
            if sent is not None:
                state.sent = previous_sent
                self._write_state(state)
            if exc.status == 422 and previous_sent is None and DIFFERENCE_REFUSAL_PHRASE in exc.detail:
                exc.add_note(_NO_SENT_RECORD_NOTE)
            raise
        receipt = Receipt.from_json(receipt_json)
        update_id, late, uploaded, log_size = receipt.update_id, receipt.late, True, receipt.log_size
        state.last_upload = {"round_id": round_id, "key": key, "update_id": update_id,
                                "late": late, "log_size": log_size}
        self._write_state(state)
        return round_id, uploaded, late, update_id, log_size, None, warnings

    def _prepare_upload(self, body: dict[str, Any], state: SyncState) -> tuple[
            int, bytes | None, str, str | None, dict[str, Any] | None, tuple[str, ...]]:
        """(round id, upload body or None, its content type, why nothing is uploaded, the sent
        record to keep in the state or None, degenerate-log warnings), from the round kind's device
        handler (:mod:`sdk.kinds`)."""
        family, name = body.get("family", kinds.ROUTER_FAMILY), body.get("kind")
        if not isinstance(family, str) or not isinstance(name, str):
            raise SyncError(f"malformed round description from the server: family {family!r}, kind {name!r}")
        try:
            handler = kinds.get(family, name).round_handler
        except kinds.UnknownKindError as exc:
            handler, why = None, f"this SDK cannot take part in the round: {exc}"
        else:
            why = f"{family} kind {name!r} has no device round handler"
        if handler is None:
            try:
                return int(body["round_id"]), None, "", why, None, ()
            except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: round_id 1e400 (inf)
                raise SyncError(f"malformed round description from the server: {exc!r}") from exc
        context = DeviceRoundContext(
            client_id=str(body.get("client_id", "")), rows=self.eval_log.rows, sent=state.sent,
            min_count_floor=self.min_count_floor, allow_repartition=self.allow_repartition,
            fetch=lambda path, limit: self._request("GET", path, ok=(200,), limit=limit).content,
            local_trainer=self.mlp_trainer, state_path=str(self.state_path), upload_format=self.upload_format)
        prepared = handler.prepare(body, context)
        return (prepared.round_id, prepared.payload, prepared.content_type, prepared.skipped, prepared.sent,
                tuple(prepared.warnings))

    # -- bundle -------------------------------------------------------------------------------

    def _update_bundle(self, state: SyncState) -> tuple[int | None, bool]:
        current = bundle_install.read_version(self.bundle_dir)
        headers: dict[str, str] = {}
        if state.bundle_etag and state.bundle_version == current:
            headers["If-None-Match"] = state.bundle_etag
        answer = self._request("GET", "/v1/bundles/latest", headers=headers, ok=(200, 304, 404),
                               limit=fmt.MAX_MANIFEST_BYTES)
        if answer.status_code in (304, 404):
            return current, False
        raw = answer.content
        manifest = fmt.verify_manifest(raw, self.public_key)
        kinds.check_manifest_kinds(manifest)  # registered kinds and their fields: refused before install
        version = int(manifest["bundle_version"])
        installed = (current is None or version > current) and self._install(manifest, raw)
        in_use = bundle_install.read_version(self.bundle_dir)
        state.bundle_etag, state.bundle_version = answer.headers.get("etag"), in_use
        self._write_state(state)
        return in_use, installed

    def _install(self, manifest: dict[str, Any], raw: bytes) -> bool:
        """Install the verified ``manifest`` (bytes ``raw``) as the new bundle; False if a version at
        least as new was installed meanwhile (by another process)."""
        version = int(manifest["bundle_version"])
        with bundle_install.locked(self.bundle_dir):
            if (bundle_install.read_version(self.bundle_dir) or 0) >= version:
                return False
            local = self._local_files()  # under the lock: new_version_dir keeps the bundle in use
            target = bundle_install.new_version_dir(self.bundle_dir, version)
            try:
                for name, digest in manifest["files"].items():
                    if not (digest in local and _copy_verified(local[digest], target / name, digest)):
                        self._download(digest, target / name)
                bundle_install.write_synced(target / fmt.MANIFEST_FILE, raw)
                # Every file was hashed above (download or verified copy); Router.load verifies the
                # signature and the files it uses again, and refuses router / embedder / price mismatches.
                router = Router.load(target, self.public_key)
                try:
                    accuracy, _ = router.predict([PROBE_QUERY])
                except InvalidQueryError:  # a static vocabulary without the probe's word (another language)
                    accuracy, _ = router.predict_from_embeddings(np.eye(1, router.d_emb, dtype=np.float32))
                if not np.isfinite(accuracy).any():
                    raise BundleError(f"bundle version {version}: no model has an accuracy estimate for the probe "
                                      f"query {PROBE_QUERY!r}, so every choose() would fail; not installed")
            except BaseException:
                shutil.rmtree(target, ignore_errors=True)
                raise
            bundle_install.publish(self.bundle_dir, target)
        return True

    def _local_files(self) -> dict[str, Path]:
        """sha256 -> path of the files of the bundle in use, as its manifest lists them (unverified:
        :func:`_copy_verified` checks each copy). Call under :func:`bundle_install.locked`."""
        try:
            directory = self.bundle_dir.resolve()
            listed = json.loads((directory / fmt.MANIFEST_FILE).read_text())["files"]
            return {h: directory / n for n, h in listed.items() if fmt.is_plain_file_name(n)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def _download(self, digest: str, path: Path) -> None:
        """Stream the bundle file ``digest`` to ``path`` (fsynced), through :meth:`_retrying`.

        Raises BundleError (over the size limit, another sha256), SyncRejectedError (4xx), SyncError."""

        def once() -> None:
            h = hashlib.sha256()
            size = 0
            with self._http.stream("GET", f"/v1/bundles/files/{digest}") as answer:
                if answer.status_code != 200:
                    raise _failure(answer)
                with path.open("wb") as f:
                    for chunk in answer.iter_bytes(1 << 20):
                        size += len(chunk)
                        if size > fmt.MAX_FILE_BYTES:
                            break
                        h.update(chunk)
                        f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
            problem = (f"download over the {fmt.MAX_FILE_BYTES}-byte limit" if size > fmt.MAX_FILE_BYTES
                       else "downloaded sha256 does not match the manifest" if h.hexdigest() != digest else None)
            if problem:
                raise BundleError(f"{path.name}: {problem}")

        self._retrying(f"downloading {path.name}", once)

    # -- HTTP with retries --------------------------------------------------------------------

    def _request(self, method: str, path: str, *, ok: tuple[int, ...] = (200, 201, 204),
                 limit: int = MAX_RECEIPT_BYTES, **kwargs: Any) -> _Reply:
        """One request, retried after transport errors and 5xx; the body read up to ``limit`` bytes.

        Raises SyncRejectedError (4xx), SyncError (another status not in ``ok``, a body over
        ``limit``, or still failing after the retries)."""

        def once() -> _Reply:
            try:
                with self._http.stream(method, path, **kwargs) as answer:
                    if answer.status_code in ok:
                        return _Reply(answer.status_code, answer.headers,
                                      _read_limited(answer, limit, f"{method} {path}"), path)
                    raise _failure(answer)
            except httpx.DecodingError as exc:  # a body its Content-Encoding cannot decode
                raise SyncError(f"{method} {path}: undecodable answer ({exc})") from exc

        return self._retrying(f"{method} {path}", once)

    def _retrying(self, what: str, once: Callable[[], _T]) -> _T:
        """The one retry loop: ``once()`` again after a transport error or a 5xx (:class:`_Transient`),
        with exponential backoff and jitter, at most ``retries`` times; other errors propagate.

        Raises SyncError when every attempt failed (the last reason quoted), or at once for a server
        certificate that does not verify."""
        last = ""
        for attempt in range(self.retries + 1):
            try:
                return once()
            except _Transient as exc:
                last = exc.reason
            except httpx.TransportError as exc:  # connect/read/write errors and timeouts
                _raise_if_certificate_error(exc)
                last = repr(exc)
            if attempt < self.retries:
                self._backoff(attempt)
        raise SyncError(f"{what} failed after {self.retries + 1} attempts: {last}")

    def _backoff(self, attempt: int) -> None:
        delay = min(self.max_backoff_s, self.backoff_s * (2 ** attempt))
        self._sleep(delay * (0.5 + random.random() / 2))

    # -- state --------------------------------------------------------------------------------

    def _read_state(self) -> SyncState:
        try:
            raw = self.state_path.read_bytes()
        except FileNotFoundError:
            return SyncState()
        except OSError as exc:
            raise SyncError(f"sync state {self.state_path} cannot be read ({exc.strerror or exc}): check its "
                            f"permissions and the disk; {STATE_LOSS_ADVICE}") from exc
        return decode_sync_state(raw, str(self.state_path))

    def _write_state(self, state: SyncState) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.state_path, encode_sync_state(state))


#: Added to the server's 422 for an upload too close to its previous one when this device has no record
#: of what it sent (a new or lost sync state): the device could not hold the small changes back.
_NO_SENT_RECORD_NOTE = (
    "this device has no record of its last upload for these centroids (its sync state is new or was lost), "
    "so it could not hold back the changes the server refuses; the server keeps its previous upload and "
    "accepts one once every changed entry has moved by at least min_count since it (later syncs, as the log "
    "grows; nothing to repair meanwhile, and deleting the sync state again does not help)")


class _Transient(Exception):
    """A failure worth retrying (a 5xx answer); ``reason`` quotes it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class _Reply:
    """An answer read in full (within its size limit)."""

    status_code: int
    headers: httpx.Headers
    content: bytes
    path: str


def _read_limited(answer: httpx.Response, limit: int, what: str) -> bytes:
    """The (decoded) body of a streamed ``answer``, refusing more than ``limit`` bytes (SyncError)."""
    declared = answer.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit  # then not read at all
    body = bytearray()
    for chunk in () if too_big else answer.iter_bytes():
        body += chunk
        if len(body) > limit:
            break
    if too_big or len(body) > limit:
        raise SyncError(f"{what}: answer {f'of {declared} bytes is ' if too_big else ''}over the {limit}-byte limit")
    return bytes(body)


def _json(answer: _Reply) -> dict[str, Any]:
    try:
        body = json.loads(answer.content)
        problem = None if isinstance(body, dict) else "JSON that is not an object"
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays or objects nested too deeply
        problem = f"non-JSON ({answer.status_code}, {type(exc).__name__})"
    if problem:
        raise SyncError(f"{answer.path} answered {problem}")
    return body  # type: ignore[no-any-return]  # json.loads is untyped; an object, checked above


def _detail(answer: httpx.Response) -> str:
    """The server's explanation in a streamed error ``answer`` (its first MAX_ERROR_BYTES)."""
    body = bytearray()
    try:
        for chunk in answer.iter_bytes():
            body += chunk
            if len(body) >= MAX_ERROR_BYTES:
                break
    except httpx.HTTPError:
        pass
    text = bytes(body[:MAX_ERROR_BYTES]).decode("utf-8", "replace")
    try:
        detail = json.loads(text).get("detail", text)
    except (ValueError, AttributeError, RecursionError):  # not JSON, not an object, nested too deeply
        detail = text
    return str(detail)


def _failure(answer: httpx.Response) -> Exception:
    """The error for an unexpected status: :class:`_Transient` for 5xx (retried), SyncRejectedError for
    4xx, else SyncError."""
    status = answer.status_code
    detail = _detail(answer)
    if 500 <= status < 600:
        return _Transient(f"{status} {detail[:200]}")
    if 400 <= status < 500:
        return SyncRejectedError(status, detail[:500])
    where = answer.headers.get("location")
    return SyncError(f"{answer.request.url.path} answered {status}{f' (to {where})' if where else ''}: "
                     f"{detail[:200]}")


def _copy_verified(source: Path, target: Path, digest: str) -> bool:
    """Copy ``source`` to ``target`` (fsynced) if its sha256 is ``digest``; False (and nothing at
    ``target``) if it is not, is over the size limit or cannot be read."""
    h = hashlib.sha256()
    size = 0
    try:
        with source.open("rb") as fin, target.open("wb") as fout:
            while chunk := fin.read(1 << 20):
                size += len(chunk)
                if size > fmt.MAX_FILE_BYTES:
                    break
                h.update(chunk)
                fout.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())
    except OSError:
        target.unlink(missing_ok=True)
        return False
    if size > fmt.MAX_FILE_BYTES or h.hexdigest() != digest:
        target.unlink(missing_ok=True)
        return False
    return True


#: OpenSSL's verify codes (``X509_V_ERR_*``) of a certificate outside its validity dates, and of one
#: issued for other host names or addresses.
_CERT_DATES = {9: "not yet valid", 10: "expired"}
_CERT_NAME = (62, 64)


def _raise_if_certificate_error(exc: BaseException) -> None:
    """A server certificate that does not verify is not a transient error: raise SyncError at once,
    with the fix for its reason (the device's clock for a certificate outside its dates, the server
    name for one issued to other names, else the CA)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            reason = getattr(seen, "verify_message", None) or seen
            code = getattr(seen, "verify_code", None)
            if code in _CERT_DATES:  # often a device clock that is wrong (no RTC, no NTP yet), not the server
                now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                fix = (f"check this device's clock (it reads {now} UTC) against the certificate's validity dates; "
                       "a certificate is valid only between them")
            elif code in _CERT_NAME:
                fix = "use a server name or address the certificate was issued for in the server URL (--server)"
            else:
                fix = "pass the CA that signed it as ca_cert / --ca-cert"
            raise SyncError(f"the server's TLS certificate does not verify ({reason}); {fix}") from exc
        seen = seen.__cause__ or seen.__context__
