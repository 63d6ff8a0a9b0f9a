"""Limits of the aggregation server's HTTP layer: what a slow, idle, flooding or vanishing client can cost.

The server runs uvicorn with its **h11** parser (not httptools: uvicorn's header-size setting only
applies to h11, and httptools accepts any header size) and these limits (:class:`HttpLimits`,
``fedroute serve`` options; docs/sync-protocol-and-operations.md lists them):

========================  ========  ==========================================================================
limit                     default   where
========================  ========  ==========================================================================
header bytes              16 KiB    uvicorn ``h11_max_incomplete_event_size``: a larger request line +
                                    header block is answered 400 and the connection closed
header count              64        :class:`RequestLimits` (ASGI middleware): 431
header read time          10 s      :class:`DeadlineH11Protocol`: from the connection (or the first byte
                                    of the next request) to the end of the headers; then 408 and close
body read time            30 s      :class:`RequestLimits`: from the end of the headers to the end of the
                                    body (a slow or stalled upload); 408 and close
idle keep-alive           5 s       uvicorn ``timeout_keep_alive``: between requests on one connection
TLS handshake             60 s      asyncio's ``ssl_handshake_timeout`` (its default)
concurrent connections    1000      uvicorn ``limit_concurrency``: 503 above it
body size                 4 MiB     the upload route (``max_body_bytes``): 413
========================  ========  ==========================================================================

A client that disconnects mid-body ends its request quietly (one INFO line, no traceback): the
route's ``ClientDisconnect`` handler (:mod:`trainer.server.app`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import anyio
from uvicorn.protocols.http.h11_impl import H11Protocol

_TIMEOUT_ANSWER = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 31\r\n" \
                  b"connection: close\r\n\r\nrequest headers took too long\r\n"


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP limits (see the module docstring): seconds and bytes."""

    max_header_bytes: int = 16 * 1024
    max_headers: int = 64
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    limit_concurrency: int = 1000

    def uvicorn_options(self) -> dict:
        """Keyword arguments of ``uvicorn.run`` / ``uvicorn.Config`` for these limits (the h11 parser
        with the header deadline, the header-size cap, keep-alive and concurrency)."""
        protocol = type("LimitedH11Protocol", (DeadlineH11Protocol,), {"header_timeout_s": self.header_timeout_s})
        return {"http": protocol, "h11_max_incomplete_event_size": self.max_header_bytes,
                "timeout_keep_alive": self.keep_alive_s, "limit_concurrency": self.limit_concurrency}


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on reading a request's headers: armed when the
    connection opens and when the first bytes of a next request arrive, cancelled once h11 has the
    whole request head; at the deadline the connection gets a 408 and is closed (uvicorn itself
    only times out idle keep-alive connections, so a client trickling header bytes, or one that
    connects and sends nothing, would hold its connection forever)."""

    header_timeout_s: float = 10.0
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self._header_deadline is None and self._between_requests():
            self._arm_header_deadline()
        super().data_received(data)
        if not self._between_requests():
            self._cancel_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_timeout(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or not self._between_requests():
            return
        if self.timeout_keep_alive_task is not None:  # idle keep-alive: uvicorn's own timer closes it
            return
        self.logger.info("closing a connection that sent no complete request head in %.0f s", self.header_timeout_s)
        self.transport.write(_TIMEOUT_ANSWER)
        self.transport.close()


class BodyTimeout(Exception):
    """The request body did not arrive within the body deadline (answered 408 by the app)."""


class RequestLimits:
    """ASGI middleware: at most ``max_headers`` request headers (431), and the whole request body
    within ``body_timeout_s`` of the headers (:class:`BodyTimeout` raised into the route, which the
    app answers 408 with ``Connection: close``). ``anyio.fail_after`` bounds each wait for a body
    chunk by the time left."""

    def __init__(self, app, *, max_headers: int = 64, body_timeout_s: float = 30.0) -> None:
        self.app, self.max_headers, self.body_timeout_s = app, max_headers, body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if len(scope["headers"]) > self.max_headers:
            body = f"more than {self.max_headers} request headers".encode()
            await send({"type": "http.response.start", "status": 431,
                        "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        deadline = time.monotonic() + self.body_timeout_s
        body_done = False

        async def receive_in_time():
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                with anyio.fail_after(max(deadline - time.monotonic(), 0.0)):
                    message = await receive()
            except TimeoutError as exc:
                raise BodyTimeout(f"request body not received within {self.body_timeout_s:g} s") from exc
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, receive_in_time, send)
