"""The proxy's HTTP API (FastAPI; served by uvicorn, :mod:`sdk.proxy.cli`), OpenAI-compatible.

Routes: ``POST /v1/chat/completions`` (routed for ``model`` ``"fedroute"``, ``"fedroute:lam=X"``,
``"fedroute:budget=Y"`` or absent, else passed through), ``GET /v1/models[/{id}]``, ``POST
/v1/fedroute/feedback`` (``{"id", "score"}``), ``GET /metrics`` (Prometheus) and ``GET /health`` (no auth);
every other route needs ``Authorization: Bearer <token>`` (401 ``invalid_api_key``). Errors are
OpenAI-style ``{"error": {"message", "type", "param", "code"}}``: 400 a malformed body, ``messages``
(over ``max_messages``: ``too_many_messages``) or ``model=``; 413 a body over ``max_body_bytes``; 404 an
unknown model, URL or feedback id; 405 another method; 409 feedback without a log; the upstream's 4xx;
429 / 502 / 504 when every try failed. Statuses, headers and limits in full: docs/openai_proxy.md.
"""
# No "from __future__ import annotations": FastAPI resolves the route annotations.

import asyncio
import contextlib
import hashlib
import hmac
import inspect
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

import openai
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.resources.chat.completions import AsyncCompletions
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from sdk.errors import (EvalLogError, FedrouteError, InvalidInputError, InvalidQueryError, ModelSpecError,
                        UnknownModelError, UnknownResponseError, UpstreamError)
from sdk.http_limits import HttpLimits, RequestLimits
from sdk.model_spec import ROUTED_MODEL
from sdk.proxy.metrics import ProxyMetrics
from sdk.routed_chat import AsyncRoutedStream, Route, RoutedChat

#: Request fields passed to ``chat.completions.create`` by name; the others go in ``extra_body``.
_KNOWN = frozenset(inspect.signature(AsyncCompletions.create).parameters) - {
    "self", "messages", "model", "extra_headers", "extra_query", "extra_body", "timeout"}
log = logging.getLogger("fedroute.proxy")
_EXHAUSTED_STATUS = {"rate_limit": 429, "server_error": 502, "invalid_response": 502, "connection": 502, "timeout": 504}


def error_json(status: int, message: str, type_: str, *, param: str | None = None, code: str | None = None,
               headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error response."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


def token_digests(tokens: Iterable[str]) -> frozenset[str]:
    """sha256 hex digests of the non-blank ``tokens`` (the proxy keeps only these).

    Raises
    ------
    InvalidInputError
        No token.
    """
    digests = frozenset(hashlib.sha256(t.strip().encode()).hexdigest() for t in tokens if t.strip())
    if not digests:
        raise InvalidInputError("the proxy needs at least one caller token (bearer auth)")
    return digests


#: Largest request body the proxy reads by default (bytes): a long conversation fits many times over.
MAX_BODY_BYTES = 32 << 20
#: Most messages per chat request by default (config ``max_messages``).
MAX_MESSAGES = 4096


def create_app(chat: RoutedChat, tokens: Iterable[str], metrics: ProxyMetrics | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, max_messages: int = MAX_MESSAGES,
               max_headers: int = HttpLimits.max_headers, budget_save_s: float = 5.0,
               reload_s: float = 30.0) -> FastAPI:
    """The FastAPI application over ``chat`` (built with ``observer=metrics``).

    Parameters
    ----------
    chat : the :class:`RoutedChat` that routes, calls and records.
    tokens : the callers' bearer tokens (kept as sha256 digests).
    metrics : the :class:`ProxyMetrics` that ``chat`` reports to; a fresh one (then ``chat`` reports
        nothing but requests and feedback are counted) when None.
    max_body_bytes : int >= 1, the largest request body read (bytes); a larger one is answered 413.
    max_messages : int >= 1, the most ``messages`` in a chat request; more is answered 400.
    max_headers : int >= 1, the most request headers; more is answered 431.
    budget_save_s : seconds between saves of the budget state (0: only at shutdown).
    reload_s : seconds between checks for a newer installed bundle (0: never).

    Raises
    ------
    InvalidInputError
        No token, or ``max_body_bytes`` / ``max_messages`` not an int >= 1.
    """
    for name, value in (("max_body_bytes", max_body_bytes), ("max_messages", max_messages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidInputError(f"{name} must be an int >= 1, got {value!r}")
    digests = token_digests(tokens)
    metrics = metrics if metrics is not None else ProxyMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(_every(seconds, job, what)) for seconds, job, what in (
            (budget_save_s, chat.save_budgets, "saving the budget state"),
            (reload_s, chat.reload, "reloading the bundle")) if seconds > 0]
        yield
        for task in tasks:
            task.cancel()
        await _run_logged(chat.save_budgets, "saving the budget state")

    app = FastAPI(title="fedroute proxy", version="1", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.add_middleware(RequestLimits, max_headers=max_headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_json(404, f"unknown URL: {request.method} {request.url.path}; this proxy serves "
                              "/v1/chat/completions, /v1/models, /v1/fedroute/feedback, /metrics and /health",
                              "invalid_request_error", code="unknown_url")
        if exc.status_code == 405:
            return error_json(405, f"{request.method} is not allowed on {request.url.path}", "invalid_request_error",
                              code="method_not_allowed", headers=exc.headers)
        return error_json(exc.status_code, str(exc.detail), "invalid_request_error", headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _exc: ClientDisconnect) -> Response:
        log.info("client disconnected during %s %s", request.method, request.url.path)
        return Response(status_code=400)  # nobody reads it

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.url.path != "/health":
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            given = hashlib.sha256(token.strip().encode()).hexdigest()
            if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, d) for d in digests):
                return error_json(401, "missing or invalid bearer token", "invalid_request_error",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            request.state.caller = given  # whose budget controllers
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "bundle_version": chat.router.bundle_version}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_object(m) for m in (ROUTED_MODEL, *chat.models)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id not in (ROUTED_MODEL, *chat.models):
            return error_json(404, f"model {model_id!r} has no upstream; callable: {[ROUTED_MODEL, *chat.models]}",
                              "invalid_request_error", param="model", code="model_not_found")
        return JSONResponse(_model_object(model_id))

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> Response:
        route_label = "invalid"
        try:
            body = await _json_object(request, max_body_bytes)
            model = body.pop("model", None)
            messages = body.pop("messages", None)
            if messages is None:
                raise InvalidQueryError("'messages' is required")
            if isinstance(messages, list) and len(messages) > max_messages:
                raise _TooManyMessages(f"{len(messages)} messages, over the proxy's max_messages = {max_messages} "
                                       "(its config's \"max_messages\")", param="messages")
            route_label = "routed" if model is None or str(model).startswith(ROUTED_MODEL) else "passthrough"
            kwargs = {k: v for k, v in body.items() if k in _KNOWN}
            extra = {k: v for k, v in body.items() if k not in _KNOWN}
            if extra:
                kwargs["extra_body"] = extra
            result = await chat.acreate_routed(messages=messages, model=model, caller=request.state.caller, **kwargs)
        except FedrouteError as exc:
            response = _error_for(exc)
            # A request the proxy refuses itself (malformed body, messages or model= string, a model id
            # with no upstream) took no route, whatever its model= began with.
            refused = isinstance(exc, (InvalidInputError, UnknownModelError))
            metrics.requests.labels("invalid" if refused else route_label, str(response.status_code)).inc()
            return response
        metrics.requests.labels(route_label, "200").inc()
        if isinstance(result, AsyncRoutedStream):
            return StreamingResponse(_events(result), media_type="text/event-stream", headers=_headers(result.route))
        return JSONResponse(result.completion.model_dump(mode="json", exclude_unset=True),
                            headers=_headers(result.outcome.route))

    @app.post("/v1/fedroute/feedback")
    async def feedback(request: Request) -> JSONResponse:
        if chat.pending is None:
            return error_json(409, "the proxy runs without an EvalLog (no \"log\" in its config): scores cannot be "
                              "recorded", "invalid_request_error", code="no_eval_log")
        try:
            body = await _json_object(request, max_body_bytes)
        except InvalidInputError as exc:  # not a JSON object (400), or too large (413)
            metrics.feedback.labels("invalid").inc()
            return _error_for(exc)
        response_id, score = body.get("id"), body.get("score")
        if not isinstance(response_id, str) or not response_id:
            metrics.feedback.labels("invalid").inc()
            return error_json(400, f"'id' (the completion id) must be a non-empty string, got {response_id!r:.80}",
                              "invalid_request_error", param="id")
        try:
            row = await chat.afeedback(response_id, score)
        except UnknownResponseError as exc:
            metrics.feedback.labels("unknown").inc()
            return error_json(404, str(exc), "invalid_request_error", param="id", code="unknown_response")
        except InvalidInputError as exc:
            metrics.feedback.labels("invalid").inc()
            return error_json(400, str(exc), "invalid_request_error", param="score")
        except FedrouteError as exc:  # the log or the pending store failed: the proxy's fault, not the caller's
            metrics.feedback.labels("error").inc()
            return _error_for(exc)
        metrics.feedback.labels("recorded").inc()
        return JSONResponse({"recorded": row})

    return app


async def _run_logged(job: Callable[[], object], what: str) -> None:
    """``job()`` in a worker thread; a FedrouteError or OSError is logged (the proxy keeps serving)."""
    try:
        await asyncio.to_thread(job)
    except (FedrouteError, OSError) as exc:
        log.warning("%s failed: %s", what, exc)


async def _every(seconds: float, job: Callable[[], object], what: str) -> None:
    while True:
        await asyncio.sleep(seconds)
        await _run_logged(job, what)


class _BodyTooLarge(InvalidInputError):
    """A request body over the proxy's ``max_body_bytes`` (answered 413)."""


class _TooManyMessages(InvalidInputError):
    """More ``messages`` than the proxy's ``max_messages`` (answered 400)."""


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number standard JSON allows")


async def _json_object(request: Request, max_body_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object, read up to ``max_body_bytes``.

    Raises
    ------
    InvalidInputError
        Not JSON (NaN/Infinity included: standard JSON has no such numbers, and the ``openai``
        client could not send them on), nested too deeply, or not an object.
    _BodyTooLarge
        More than ``max_body_bytes`` bytes (the read stops there).
    """
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise _BodyTooLarge(f"the body is over the proxy's {max_body_bytes}-byte limit")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks), parse_constant=_refuse_constant)
        problem = None if isinstance(body, dict) else "must be a JSON object"
    except ValueError as exc:
        problem = f"is not JSON ({exc})"
    except RecursionError:
        problem = "is not JSON this proxy reads (nested too deeply)"
    if problem:
        raise InvalidInputError(f"the body {problem}")
    return body  # type: ignore[no-any-return]


def _error_for(exc: FedrouteError) -> JSONResponse:
    if isinstance(exc, _BodyTooLarge):
        return error_json(413, str(exc), "invalid_request_error", code="request_too_large")
    if isinstance(exc, UnknownModelError):
        return error_json(404, str(exc), "invalid_request_error", param="model", code="model_not_found")
    if isinstance(exc, _TooManyMessages):
        return error_json(400, str(exc), "invalid_request_error", param="messages", code="too_many_messages")
    if isinstance(exc, ModelSpecError):
        return error_json(400, str(exc), "invalid_request_error", param="model", code="invalid_model")
    if isinstance(exc, InvalidQueryError):
        return error_json(400, str(exc), "invalid_request_error", param="messages")
    if isinstance(exc, InvalidInputError):
        return error_json(400, str(exc), "invalid_request_error", param=exc.param)
    if isinstance(exc, UpstreamError):
        status = exc.status if exc.kind == "client_error" and exc.status else _EXHAUSTED_STATUS.get(exc.kind, 502)
        return error_json(status, str(exc), "upstream_error", code=exc.kind)
    if isinstance(exc, EvalLogError):
        return error_json(500, f"the proxy could not record the call: {exc}", "server_error")
    return error_json(500, str(exc), "server_error")


def _model_object(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "fedroute"}


def _headers(route: Route) -> dict[str, str]:
    headers = {"x-fedroute-model": route.model, "x-fedroute-fallbacks": str(len(route.failed))}
    if route.plan is not None:
        headers["x-fedroute-routing-ms"] = f"{route.plan.routing_ms:.3f}"
    return headers


async def _events(stream: AsyncRoutedStream) -> AsyncIterator[str]:
    try:
        async for chunk in stream:
            yield f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
    except (openai.OpenAIError, UpstreamError) as exc:  # the upstream failed mid-stream: the status is already sent
        error = {"error": {"message": f"the upstream failed mid-stream: {exc}", "type": "upstream_error",
                           "param": None, "code": None}}
        yield f"data: {json.dumps(error)}\n\n"
    yield "data: [DONE]\n\n"
