"""One write per response: the writes an HTTP connection makes in one event-loop iteration, sent as one.

uvicorn writes a response's head (``http.response.start``) and its body (``http.response.body``) with
two ``transport.write`` calls; over TLS each is its own TLS record and, as uvloop sends at once
when the socket has nothing queued, its own ``send`` system call (on 127.0.0.1 the kernel also runs
the receiving side's TCP processing in the sender's time). :class:`CoalescedWrites`, mixed into the server's uvicorn protocol classes
(:mod:`trainer.server.http_limits`), puts a :class:`CoalescingTransport` between uvicorn and the
connection's transport: the writes of one event-loop iteration (a route's whole answer: the upload
route sends its head and body in one task step) are joined and written once, at the end of the
iteration (``loop.call_soon``), and before a ``close`` or ``write_eof``. The bytes on the wire and
their order are the same; only their grouping into writes changes. With TLS, 64 devices and
MessagePack bodies, the bare floor app (``benchmarks/http_floor_app.py``) cost 0.05-0.06 ms less
CPU per request with it, in two sets of alternating runs (9 of 11 pairs lower); on the full upload
path the difference was within the noise of those runs (docs/benchmarks.md, round 5).
"""

from __future__ import annotations

import asyncio


class CoalescingTransport:
    """``transport``'s writes of one event-loop iteration of ``loop`` joined into one ``write``;
    ``close``/``write_eof`` send what is pending first, ``abort`` drops it; anything else is the
    wrapped transport's (``is_closing``, ``pause_reading``, ``get_extra_info``...). Bytes written
    after the transport started closing are dropped, as the transport itself would."""

    __slots__ = ("_transport", "_loop", "_parts")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._parts:
            self._loop.call_soon(self._flush)
        self._parts.append(data)

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._parts.clear()
        self._transport.abort()

    def _flush(self) -> None:
        parts = self._parts
        if not parts:
            return  # sent already (close / write_eof)
        self._parts = []
        if not self._transport.is_closing():
            self._transport.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class CoalescedWrites:
    """Mixed into a uvicorn HTTP protocol class (before it): its ``transport`` is a
    :class:`CoalescingTransport` over the connection's (uvicorn's flow control keeps the
    connection's own transport: pausing and resuming reads is immediate)."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = CoalescingTransport(transport, self.loop)
