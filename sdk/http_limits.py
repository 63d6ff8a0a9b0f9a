"""HTTP limits of ``fedroute serve`` and ``fedroute proxy``: what a slow, idle, flooding or vanishing client can cost.

Needs uvicorn (the ``server`` and ``proxy`` extras). Both servers run uvicorn's httptools parser by
default (h11 with ``--http-parser h11`` or without httptools); httptools would buffer a request head of
any size, so :class:`_Deadlines` caps the head itself for both parsers (docs/benchmarks.md has the
parser costs). The limits (:class:`HttpLimits`; docs/sync-protocol-and-operations.md, docs/openai_proxy.md):

========================  ========  ==========================================================================
limit                     default   where
========================  ========  ==========================================================================
header bytes              16 KiB    :class:`_Deadlines`, counted before parsing: 431 and close
header count              64        :class:`RequestLimits` (ASGI middleware): 431
header read time          10 s      :class:`_Deadlines`: from the connection (or the next request's first
                                    byte) to the end of the headers; 408 and close
body read time            30 s      :class:`_Deadlines`: from the end of the headers to the end of the body;
                                    408 and close (the route sees a disconnect and stores nothing)
idle keep-alive           5 s       uvicorn ``timeout_keep_alive``
TLS handshake             60 s      asyncio's ``ssl_handshake_timeout``
concurrent connections    1000      uvicorn ``limit_concurrency``: 503 above it
body size                 4 MiB     the server's upload route (the proxy's: 32 MiB): 413
========================  ========  ==========================================================================
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.h11_impl import H11Protocol

#: httptools is optional (uvicorn[standard]); h11 is always there.
HAS_HTTPTOOLS = importlib.util.find_spec("httptools") is not None
# The mixin's base for the type checker: the protocol attributes it uses (cycle, transport, loop, logger).
if TYPE_CHECKING:
    _Protocol = H11Protocol
else:
    _Protocol = object
_Scope = MutableMapping[str, Any]
_ASGI = Callable[[_Scope, Callable[[], Awaitable[_Scope]], Callable[[_Scope], Awaitable[None]]], Awaitable[None]]


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP limits (see the module docstring): seconds and bytes."""

    max_header_bytes: int = 16 * 1024
    max_headers: int = 64
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    limit_concurrency: int = 1000
    parser: str = "httptools" if HAS_HTTPTOOLS else "h11"

    def uvicorn_options(self) -> dict[str, Any]:
        """Keyword arguments of ``uvicorn.run`` / ``uvicorn.Config`` for these limits."""
        base: type = _httptools_protocol() if self.parser == "httptools" and HAS_HTTPTOOLS else DeadlineH11Protocol
        protocol = type("LimitedHttpProtocol", (base,), {"header_timeout_s": self.header_timeout_s,
                                                         "body_timeout_s": self.body_timeout_s,
                                                         "max_header_bytes": self.max_header_bytes})
        return {"http": protocol, "h11_max_incomplete_event_size": self.max_header_bytes,
                "timeout_keep_alive": self.keep_alive_s, "limit_concurrency": self.limit_concurrency}


class _Deadlines(_Protocol):
    """Mixed into uvicorn's h11 or httptools protocol (uvicorn itself only times out idle keep-alive
    connections): a header deadline (armed when the connection opens or a next request's first bytes
    arrive, ended with the request head) and a body deadline (from the head to the end of the body),
    408 and close at either; and a 431 and close for a request head over ``max_header_bytes``, counted
    on the bytes before the parser sees them. One timer per connection: a phase notes its deadline, and
    the timer, when it fires, ends a phase past it or re-arms itself (docs/benchmarks.md, round 5)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 16 * 1024
    _timer: asyncio.TimerHandle | None = None  # the connection's timer (may be due before _due)
    _phase: str = ""  # "headers", "body" or "" (none running)
    _due: float = 0.0  # the running phase's deadline (loop time, s)
    _head_bytes: int = 0
    _tail: bytes = b""  # the last 3 bytes of the head read so far (its end may straddle two chunks)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers", self.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        reading_head = self.cycle is None or self.cycle.response_complete
        if reading_head:
            if not self._phase:
                self._arm("headers", self.header_timeout_s)
                self._head_bytes, self._tail = 0, b""
            before = self._head_bytes
            self._head_bytes += len(data)
            # Checked before the parser sees the bytes: a head that is complete in this chunk would be
            # dispatched at once (a 20 KB head arriving in one or two TLS records was served).
            if self._head_bytes > self.max_header_bytes and self._head_over_limit(data, before):
                return
            self._tail = data[-3:]
        super().data_received(data)
        cycle = self.cycle
        if cycle is None or cycle.response_complete:  # still between requests: the head is incomplete
            if reading_head and self._head_bytes > self.max_header_bytes and not self.transport.is_closing():
                self._stop()
                self.logger.info("closing a connection whose request head is over %d bytes", self.max_header_bytes)
                self.transport.write(_TOO_LARGE)
                self.transport.close()
            return  # the header deadline (if armed) keeps running
        if cycle.more_body:
            if self._phase != "body":
                self._arm("body", self.body_timeout_s)
        else:
            self._phase = ""  # the request is complete: its timer lapses (or serves the next phase)

    def _head_over_limit(self, data: bytes, before: int) -> bool:
        """True (after answering 431 and closing) if the request head that ``data`` continues, after
        ``before`` head bytes, ends past ``max_header_bytes`` or not in ``data`` (a body may follow it)."""
        joint = (self._tail + data[:3]).find(b"\r\n\r\n")  # the end straddling the two chunks comes first
        if joint >= 0:
            head = before - len(self._tail) + joint + 4
        else:
            end = data.find(b"\r\n\r\n")  # no copy of the chunk (a body may follow in it)
            head = self._head_bytes if end < 0 else before + end + 4
        if head <= self.max_header_bytes or self.transport.is_closing():
            return False
        self._stop()
        self.logger.info("closing a connection whose request head is over %d bytes", self.max_header_bytes)
        self.transport.write(_TOO_LARGE)
        self.transport.close()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, phase: str, seconds: float) -> None:
        self._phase, self._due = phase, self.loop.time() + seconds
        timer = self._timer
        if timer is not None:
            if timer.when() <= self._due:
                return  # it fires first, then waits for what is left of this phase
            timer.cancel()
        self._timer = self.loop.call_at(self._due, self._expired)

    def _stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, ""

    def _expired(self) -> None:
        self._timer = None
        phase = self._phase
        if not phase:
            return  # no phase running: the next one arms the timer
        if self._due - self.loop.time() > 0.001:  # a later phase than the one it was armed for
            self._timer = self.loop.call_at(self._due, self._expired)
            return
        self._phase = ""
        if self.transport.is_closing():
            return
        if phase == "headers":
            if not self._between_requests() or self.timeout_keep_alive_task is not None:
                return  # a request is running, or an idle keep-alive that uvicorn's own timer closes
            answer = _HEADERS_TIMEOUT
        else:
            if self._between_requests() or not self.cycle.more_body:
                return
            answer = b"" if self.cycle.response_started else _answer(
                f"request body not received within {self.body_timeout_s:g} s\n")
        self.logger.info("closing a connection: request %s not received within the deadline", phase)
        if answer:
            self.transport.write(answer)
        self.transport.close()


def _answer(text: str, status: bytes = b"408 Request Timeout") -> bytes:
    body = text.encode()
    return (b"HTTP/1.1 %s\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, len(body))) + body


_HEADERS_TIMEOUT = _answer("request headers not received within the deadline\n")
_TOO_LARGE = _answer("request headers too large\n", b"431 Request Header Fields Too Large")


class DeadlineH11Protocol(_Deadlines, H11Protocol):
    """uvicorn's h11 protocol with :class:`_Deadlines`."""


def _httptools_protocol() -> type:
    """uvicorn's httptools protocol (C parser, the cheaper one) with :class:`_Deadlines`."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # httptools is optional (uvicorn[standard])

    return type("DeadlineHttpToolsProtocol", (_Deadlines, HttpToolsProtocol), {})


class RequestLimits:
    """ASGI middleware: at most ``max_headers`` request headers (431 and close)."""

    def __init__(self, app: _ASGI, *, max_headers: int = 64) -> None:
        self.app, self.max_headers = app, max_headers

    async def __call__(self, scope: _Scope, receive: Callable[[], Awaitable[_Scope]],
                       send: Callable[[_Scope], Awaitable[None]]) -> None:
        if scope["type"] == "http" and len(scope["headers"]) > self.max_headers:
            body = f"more than {self.max_headers} request headers".encode()
            await send({"type": "http.response.start", "status": 431,
                        "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)
