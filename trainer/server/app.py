"""The aggregation server's HTTP API (FastAPI; served over TLS by uvicorn, see :mod:`trainer.server.cli`).

Sync protocol v1 (ARCHITECTURE.md §6; routes, bodies and status codes in
docs/sync-protocol-and-operations.md and docs/protocol.md). Every route but ``/v1/health`` needs
``Authorization: Bearer <token>`` (401 otherwise). Rounds close in the background (quorum or deadline,
checked every ``tick_s`` seconds and after each accepted upload), also after a restart. An upload is
checked against cached state (:mod:`trainer.server.upload_state`) and stored by
:meth:`Store.insert_update`, which re-checks that state in its transaction; when the state moved it
takes the checked path (:meth:`Store.add_update`).
"""
# No "from __future__ import annotations": FastAPI resolves the route annotations, which name locals.


import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import os
import re
import secrets
import threading
from pathlib import Path
from typing import Annotated

import orjson
import sqlalchemy as sa
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi import Path as FastApiPath
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import ClientDisconnect

from sdk.protocol import Receipt
from trainer.server import round_kinds
from trainer.server.errors import IdempotencyKeyReused, UploadRejected
from trainer.server.group_commit import GroupWriter
from sdk.http_limits import HttpLimits, RequestLimits
from trainer.server.round_kind import Publisher
from trainer.server.rounds import close_due_rounds
from trainer.server.store import Store, hash_token
from trainer.server.upload_state import UploadQuota, UploadState
from trainer.server.validation import MAX_COUNT

log = logging.getLogger("fedroute.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20
#: Upload bodies up to this size (bytes) are decoded and checked on the event loop (a MessagePack
#: K-means update of 32 cells is about 50 KB, under a millisecond); larger ones (JSON) in a thread.
INLINE_CHECK_BYTES = 128 << 10
#: Shortest gap (seconds) between two checks for rounds to close when uploads keep waking the closer.
MIN_CLOSE_CHECK_GAP_S = 0.25
#: Retry-After (seconds) of a 503 answered when the store cannot commit an upload (e.g. a full disk).
STORE_RETRY_AFTER_S = 30
RoundId = Annotated[int, FastApiPath(ge=1, le=MAX_COUNT)]
_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_UPLOAD_PATH = re.compile(r"/v1/rounds/([^/]+)/updates")


def create_app(store: Store, bundle_dir: Path | None = None, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               tick_s: float = 1.0, publisher: Publisher | None = None, quota: UploadQuota | None = None,
               limits: HttpLimits | None = None, state: UploadState | None = None,
               commit_delay_s: float = 0.005, freeze_gc: bool = False) -> FastAPI:
    """The FastAPI application over ``store``, serving the bundle published at ``bundle_dir``.

    Parameters
    ----------
    store : the server's :class:`trainer.server.store.Store`.
    bundle_dir : published bundle (symlink) served at ``/v1/bundles``; None serves none (404).
    max_body_bytes : largest accepted upload body (413 above).
    tick_s : seconds between checks for rounds to close.
    publisher : publishes the aggregate of rounds opened to publish (handed in by the console-script
        module: ``export.publish.BundlePublisher``); None: such rounds close with ``publish_skipped``.
    quota : the per-client upload quota (default :class:`UploadQuota`: 30 uploads per 60 s).
    limits : header count and body deadline of :class:`HttpLimits` (the rest are uvicorn's, see
        :meth:`HttpLimits.uvicorn_options`); default ``HttpLimits()``.
    state : the upload path's caches (default ``UploadState()``).
    commit_delay_s : longest wait (seconds) of a batch of uploads for others already in the route
        before its commit (:mod:`trainer.server.group_commit`); 0: commit at once.
    freeze_gc : at startup, move every object alive to the garbage collector's permanent
        generation (``gc.freeze()``); for a server process (``fedroute serve``), not a test process.
    """
    quota = UploadQuota() if quota is None else quota
    writer = GroupWriter(store, commit_delay_s=commit_delay_s)
    limits = HttpLimits() if limits is None else limits
    state = UploadState() if state is None else state
    wake = asyncio.Event()
    stopping = asyncio.Event()
    close_lock = threading.Lock()
    owner = f"server-{os.getpid()}-{secrets.token_hex(4)}"
    orphaned: set[int] = set()  # rounds a crashed server left closing: taken over at once

    def close_due() -> None:
        with close_lock:
            for round_id, outcome in close_due_rounds(store, progress=log.info, owner=owner, takeover=orphaned,
                                                      publisher=publisher):
                log.info("closed round %s: %s", round_id, outcome.result)

    async def pause(event: asyncio.Event, seconds: float) -> None:
        """Wait until ``event`` is set or ``seconds`` have passed, whichever comes first."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await event.wait()

    async def closer() -> None:
        # Ends when `stopping` is set, never by cancellation: a cancel that lands while a wait is
        # finishing can be swallowed (asyncio.wait_for on Python 3.11; a wait on a worker thread is
        # shielded), and the server would then hang at shutdown waiting for a loop that goes on.
        while not stopping.is_set():
            try:
                await run_in_threadpool(close_due)
            except sa.exc.OperationalError as exc:  # a database down: one line per tick, not a traceback
                log.error("closing rounds failed, the database is unavailable: %s; retrying", _first_line(exc))
            except Exception:
                log.exception("closing rounds failed; retrying")
            # A client's first upload in a round (quorum may be reached) or a late upload wakes it, at
            # most every MIN_CLOSE_CHECK_GAP_S; later uploads of the same client cannot reach the quorum.
            await pause(stopping, min(tick_s, MIN_CLOSE_CHECK_GAP_S))
            if stopping.is_set():
                return
            await pause(wake, max(tick_s - MIN_CLOSE_CHECK_GAP_S, 0.0))
            wake.clear()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        # Only closes a server left behind: a `fedroute rounds close` may be at work on another.
        orphaned.update(rid for rid, who in await run_in_threadpool(store.closing_rounds)
                        if (who or "").startswith("server-"))
        if freeze_gc:
            # Everything built so far (modules, the app, caches) lives as long as the process: out of
            # the cyclic garbage collector's way, whose collections then only walk what uploads
            # allocate (about 0.8-1.1 ms per upload otherwise, measured in-process; docs/benchmarks.md).
            gc.collect()
            gc.freeze()
        stopping.clear()  # an app served again (tests) starts its closer again
        task = asyncio.create_task(closer())
        try:
            yield
        finally:
            stopping.set()
            wake.set()  # out of its wait for an upload at once
            await task  # a close under way finishes first (its round is never left half-closed)
            await run_in_threadpool(writer.close)

    # No /docs, /redoc or /openapi.json: the API is documented here and in the README, not served.
    app = SyncServerApp(title="fedroute aggregation server", version="1", lifespan=lifespan,
                        docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestLimits, max_headers=limits.max_headers)
    bearer = HTTPBearer(auto_error=False)

    def client_of(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> str:
        client = None if credentials is None else store.authenticate(credentials.credentials)
        if client is None:
            raise HTTPException(401, "missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"})
        return client

    @app.exception_handler(UploadRejected)
    async def _rejected(_request: Request, exc: UploadRejected) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(sa.exc.OperationalError)
    async def _store_down(request: Request, exc: sa.exc.OperationalError) -> JSONResponse:
        # a database that went away (PostgreSQL stopped, an I/O error): 503, not 500
        log.error("%s %s: the database is unavailable: %s (answered 503)", request.method, request.url.path,
                  _first_line(exc))
        return JSONResponse({"detail": f"the server's database is unavailable ({_first_line(exc)}); retry later"},
                            status_code=503, headers={"Retry-After": str(STORE_RETRY_AFTER_S)})

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _exc: ClientDisconnect) -> Response:
        log.info("client disconnected during %s %s; nothing stored", request.method, request.url.path)
        return Response(status_code=400)  # nobody reads it

    @app.get("/v1/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/rounds/current")
    def current_round(client: Annotated[str, Depends(client_of)]):
        r = store.current_round()
        if r is None:
            return Response(status_code=204)
        return {**round_kinds.get(r.kind).describe(r), "client_id": client}

    def bearer_token(authorization: str) -> str:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise UploadRejected(401, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"})
        return token.strip()

    def authenticate(token: str, token_sha256: str) -> str:
        """The client of ``token`` from the database (caching it), else 401 (and forgotten)."""
        client = store.authenticate(token)
        if client is None:
            state.tokens.drop(token_sha256)
            raise UploadRejected(401, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"})
        state.tokens.put(token_sha256, client)
        return client

    async def upload(round_text: str, headers: dict[str, str], receive) -> tuple[int, bytes]:
        """``POST /v1/rounds/{round_id}/updates`` (served by :class:`UploadEndpoint`): the path's round
        id, the request headers it reads (lower-case names) and the ASGI ``receive``; returns the
        status (201, or 200 for a retry) and the receipt's JSON bytes. Raises UploadRejected (4xx)
        and ClientDisconnect, which the endpoint answers."""
        writer.active += 1  # the group writer waits briefly for uploads on their way (commit delay)
        try:
            return await _upload(round_text, headers, receive)
        except sa.exc.OperationalError as exc:  # a full disk, an I/O error, a lost database connection
            raise store_unavailable(exc) from exc
        finally:
            writer.active -= 1

    async def _upload(round_text: str, headers: dict[str, str], receive) -> tuple[int, bytes]:
        round_id = _path_round_id(round_text)
        idempotency_key = headers.get("idempotency-key")
        token = bearer_token(headers.get("authorization", ""))
        token_sha256 = hash_token(token)
        client = state.tokens.get(token_sha256) or await run_in_threadpool(authenticate, token, token_sha256)
        if idempotency_key is None or not _KEY.fullmatch(idempotency_key):
            raise UploadRejected(400, "header Idempotency-Key (1-128 of [A-Za-z0-9_.:-]) is required")
        retry_after = quota.take(client)
        if retry_after is not None:
            raise UploadRejected(429, f"client {client!r} is over its quota of {quota.uploads} uploads per "
                                      f"{quota.window_s:g} s; retry in {retry_after} s",
                                 {"Retry-After": str(retry_after)})
        raw = await _read_limited(receive, headers.get("content-length"), max_body_bytes)
        content_type = headers.get("content-type", "")
        # A small body of a known round is checked here: a hop to a thread costs more than the check.
        if len(raw) <= INLINE_CHECK_BYTES and state.rounds.get(round_id) is not None:
            checked = check_upload(round_id, client, raw, content_type)
        else:
            checked = await run_in_threadpool(check_upload, round_id, client, raw, content_type)
        async with state.client_lock(client):
            receipt = None if checked is None else await store_cached(checked, client, token_sha256, idempotency_key)
            if receipt is not None:
                created = True
            else:
                receipt, created = await run_in_threadpool(
                    accept_checked, round_id, token, token_sha256, client, idempotency_key, raw, content_type)
        if created and (receipt.get("late") or state.first_in_round(round_id, client)):
            wake.set()  # a late upload: its round is closing, perhaps left so by a crash
        return 201 if created else 200, orjson.dumps(receipt)

    # Served (POST) by SyncServerApp's short stack: the header-count limit around the bare ASGI
    # endpoint, without FastAPI's middleware or the router's path matching (SyncServerApp has matched
    # the path already); also listed in the app's router (an ASGI endpoint: the same callable).
    endpoint = UploadEndpoint(upload)
    app.router.add_route("/v1/rounds/{round_id}/updates", endpoint, methods=["POST"])
    app.upload_app = RequestLimits(endpoint, max_headers=limits.max_headers)

    def store_unavailable(exc: sa.exc.OperationalError) -> UploadRejected:
        """503 for an upload the store could not commit (one ERROR line in the log, no traceback: a
        full disk would log one per upload). Nothing was acknowledged; the device retries 5xx with the
        same Idempotency-Key, which is counted once whether or not the commit reached the disk."""
        reason = _first_line(exc)
        log.error("upload not stored, the database refused the write: %s (a full disk? answered 503)", reason)
        return UploadRejected(503, f"the server could not store the upload ({reason}); nothing was "
                                   f"acknowledged: retry later with the same Idempotency-Key",
                              {"Retry-After": str(STORE_RETRY_AFTER_S)})

    def check_upload(round_id: int, client: str, raw: bytes, content_type: str):
        """Decode and check an upload against the cached round: ``(upload, digest, round,
        accepted)``, or None when the round is not known (the checked path decides).

        Raises UploadRejected (400, 403, 409, 415, 422): content errors, whatever the state."""
        upload = round_kinds.parse_upload(raw, content_type)
        if upload.client_id != client:
            raise UploadRejected(403, f"this token belongs to client {client!r}, not {upload.client_id!r}")
        if upload.round_id != round_id:
            raise UploadRejected(422, f"round_id: body round_id {upload.round_id} differs from the URL's {round_id}")
        r = state.rounds.get(round_id)
        if r is None:
            r = store.get_round(round_id)
            if r is None:
                return None
            state.rounds.put(round_id, r)
        accepted = round_kinds.validate_upload(upload, r)  # depends only on the round's immutable part
        return upload, hashlib.sha256(raw).hexdigest(), r, accepted

    async def store_cached(checked, client: str, token_sha256: str, key: str) -> dict | None:
        """Check against the client's previous upload held in memory and store with the group
        writer (:meth:`Store.insert_updates`); None when nothing was stored (the state moved, or
        the previous-upload check failed: the checked path answers)."""
        _, digest, r, accepted = checked
        previous_id = None
        if accepted.check_previous is not None:
            previous = state.previous.get((client, r.base_hash))
            if previous is None:
                row = await run_in_threadpool(store.previous_update, client, r.base_hash)
                previous = (0, None) if row is None else (row[0], round_kinds.get(r.kind).memo_of(row[1]))
            previous_id = previous[0]
            try:
                accepted.check_previous(previous[1])
            except UploadRejected:
                return None  # a retry of a stored key answers 200: the checked path sorts it out
        receipt = await writer.insert(client_id=client, token_sha256=token_sha256, round_id=r.id, key=key,
                                      body_sha256=digest, payload=accepted.payload, log_size=accepted.log_size,
                                      previous_id=previous_id)
        if receipt is not None and accepted.check_previous is not None:
            remember_previous(client, r.base_hash, receipt["update_id"], accepted.memo)
        return receipt

    def remember_previous(client: str, base_hash: str, update_id: int, memo) -> None:
        """Keep the client's upload as its previous one (a kind that gives no memo: read back from the
        store next time, through its ``memo_of``)."""
        if memo is None:
            state.previous.drop((client, base_hash))
        else:
            state.previous.put((client, base_hash), (update_id, memo))

    def accept_checked(round_id: int, token: str, token_sha256: str, client: str, key: str, raw: bytes,
                       content_type: str) -> tuple[dict, bool]:
        authenticate(token, token_sha256)  # 401 if the cached path stored nothing because the token went
        upload = round_kinds.parse_upload(raw, content_type)
        digest = hashlib.sha256(raw).hexdigest()
        return _accept_checked(round_id, client, key, digest, upload)

    def _accept_checked(round_id: int, client: str, key: str, digest: str, upload) -> tuple[dict, bool]:
        """Every check against the database, in the order of the API (the path before caching)."""
        old = store.find_update(client, key)
        if old is not None:
            if old[0] != digest:
                raise UploadRejected(422, "Idempotency-Key was already used with a different body")
            return old[1], False
        r = store.get_round(round_id)
        latest = store.latest_round()
        if r is None:
            raise UploadRejected(409, f"round {round_id} does not exist")
        if r.status != "open" and r.id != latest.id:
            raise UploadRejected(409, f"round {round_id} is closed and round {latest.id} is newer; fetch /v1/rounds/current")
        accepted = round_kinds.validate_upload(upload, r)
        log_size = accepted.log_size
        kind = round_kinds.get(r.kind)

        def receipt_for(update_id: int, late: bool, counted: int | None) -> dict:
            return Receipt(update_id, client, round_id, late, counted, log_size).to_json()

        check = None if accepted.check_previous is None else (
            lambda payload: accepted.check_previous(None if payload is None else kind.memo_of(payload)))
        try:
            receipt, created = store.add_update(client_id=client, round_=r, key=key, body_sha256=digest,
                                                payload=accepted.payload, log_size=log_size,
                                                receipt_for=receipt_for, check_previous=check)
        except IdempotencyKeyReused as exc:
            raise UploadRejected(422, str(exc)) from exc
        if created and accepted.check_previous is not None:
            remember_previous(client, r.base_hash, receipt["update_id"], accepted.memo)
        return receipt, created

    def published() -> tuple[Path, bytes]:
        if bundle_dir is None or not Path(bundle_dir).exists():
            raise HTTPException(404, "no bundle is published")
        directory = Path(bundle_dir).resolve()
        try:
            return directory, (directory / "manifest.json").read_bytes()
        except OSError as exc:
            raise HTTPException(404, "no bundle is published") from exc

    @app.get("/v1/rounds/{round_id}/parameters")
    def round_parameters(round_id: RoundId, _client: Annotated[str, Depends(client_of)]):
        r = store.get_round(round_id)
        if r is None or r.parameters is None:
            raise HTTPException(404, f"round {round_id} is not an MLP round")
        return Response(r.parameters, media_type="application/x-safetensors", headers={"ETag": f'"{r.base_hash}"'})

    @app.get("/v1/bundles/latest")
    def latest_bundle(request: Request, _client: Annotated[str, Depends(client_of)]):
        _, manifest = published()
        etag = '"' + hashlib.sha256(manifest).hexdigest() + '"'
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers={"ETag": etag})
        return Response(manifest, media_type="application/json", headers={"ETag": etag})

    @app.get("/v1/bundles/files/{sha256}")
    def bundle_file(sha256: str, _client: Annotated[str, Depends(client_of)]):
        if not _SHA256.fullmatch(sha256):
            raise HTTPException(404, "not a sha256")
        directory, manifest = published()
        try:
            names = [n for n, h in json.loads(manifest)["files"].items() if h == sha256]
        except (ValueError, KeyError, AttributeError) as exc:
            raise HTTPException(404, "the published manifest is unreadable") from exc
        if not names:
            raise HTTPException(404, f"the published bundle lists no file with sha256 {sha256}")
        return FileResponse(directory / names[0], media_type="application/octet-stream")

    return app


class UploadEndpoint:
    """The ASGI endpoint of ``POST /v1/rounds/{round_id}/updates`` (the hot path: one request per
    device upload), without Starlette's request and response objects or exception middleware:
    ``handle(round_id text, headers, receive)`` (:func:`create_app`'s ``upload``) gets the path's round
    id (``scope["path_params"]``), the headers it reads (:data:`UPLOAD_HEADERS`, first occurrence,
    latin-1 as Starlette decodes them) and ``receive``; its ``(status, JSON bytes)`` is sent with
    ``content-length`` and ``content-type: application/json``, as Starlette's ``Response`` would. An
    :class:`UploadRejected` is answered as the app's handler answers it (``{"detail": ...}``, its
    status and headers: Starlette's ``JSONResponse``); a ``ClientDisconnect`` (the client went away
    mid-body) with one INFO line and a 400 nobody reads. Anything else propagates (uvicorn answers
    500)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def __call__(self, scope, receive, send) -> None:
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            if name in UPLOAD_HEADERS and UPLOAD_HEADERS[name] not in headers:
                headers[UPLOAD_HEADERS[name]] = value.decode("latin-1")
        try:
            status, body = await self.handle(scope["path_params"]["round_id"], headers, receive)
        except UploadRejected as exc:
            await JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)(scope, receive, send)
            return
        except ClientDisconnect:
            log.info("client disconnected during %s %s; nothing stored", scope["method"], scope["path"])
            await Response(status_code=400)(scope, receive, send)  # nobody reads it
            return
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


#: The request headers the upload route reads: raw (lower-case, as ASGI servers give them) -> name.
UPLOAD_HEADERS = {h.encode(): h for h in ("authorization", "idempotency-key", "content-type", "content-length")}


class SyncServerApp(FastAPI):
    """The server's FastAPI application, except that ``POST /v1/rounds/{round_id}/updates`` (the hot
    path: one request per device upload) goes straight to :attr:`upload_app`, the bare ASGI
    :class:`UploadEndpoint` under the header-count limit (the path parameter taken from the path
    matched here), set by :func:`create_app`. FastAPI's own middleware stack (server-error,
    telemetry, body-limit and exit-stack middleware) cost a bare route about 0.27-0.3 ms of CPU per
    request more, Starlette's request/response objects and exception middleware some more
    (docs/benchmarks.md); an error the endpoint does not answer is answered 500 by uvicorn."""

    upload_app = None

    async def __call__(self, scope, receive, send) -> None:
        if self.upload_app is not None and scope["type"] == "http" and scope["method"] == "POST":
            match = _UPLOAD_PATH.fullmatch(scope["path"])
            if match is not None:
                scope["app"] = self
                scope["path_params"] = {"round_id": match.group(1)}
                await self.upload_app(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _first_line(exc: sa.exc.OperationalError) -> str:
    """The driver's message of a database error, its first line (no SQL, no SQLAlchemy footer)."""
    return (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0]


def _path_round_id(text: str) -> int:
    """The round id of an upload's path: an integer in [1, MAX_COUNT], else 422."""
    if not (text.isascii() and text.isdigit() and len(text) <= 10 and 1 <= int(text) <= MAX_COUNT):
        raise UploadRejected(422, f"round_id: the path's round id must be an integer in [1, {MAX_COUNT}]")
    return int(text)


async def _read_limited(receive, declared: str | None, limit: int) -> bytes:
    """The request body from ASGI ``receive``, or 413 as soon as it (or its Content-Length
    ``declared``) exceeds ``limit`` bytes; ClientDisconnect if the client goes away first (as
    Starlette's ``Request.stream``)."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise UploadRejected(413, f"body of {declared} bytes is over the {limit}-byte limit")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise UploadRejected(413, f"body is over the {limit}-byte limit")
                chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()
