"""CoalescingTransport: the writes of one event-loop iteration leave as one write, in order, nothing lost."""

import asyncio

from trainer.server.http_writes import CoalescingTransport


class RecordingTransport(asyncio.Transport):
    """A stand-in for the connection's transport (asyncio's): records what reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bytes | None]] = []
        self.closing = False

    def write(self, data) -> None:
        self.calls.append(("write", bytes(data)))

    def close(self) -> None:
        self.calls.append(("close", None))
        self.closing = True

    def abort(self) -> None:
        self.calls.append(("abort", None))
        self.closing = True

    def write_eof(self) -> None:
        self.calls.append(("write_eof", None))

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5)}.get(name, default)


def run(steps) -> list:
    """Run ``steps(wrapper)`` (a coroutine function) on a fresh loop; the wrapped transport's calls."""
    inner = RecordingTransport()

    async def main():
        await steps(CoalescingTransport(inner, asyncio.get_running_loop()))
        await asyncio.sleep(0)  # one more iteration: a pending flush runs

    asyncio.run(main())
    return inner.calls


def test_one_iteration_is_one_write_and_iterations_stay_apart():
    async def steps(t):
        t.write(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\n")
        t.write(b"")  # nothing to send: no write of its own
        t.write(b"{}")
        await asyncio.sleep(0)
        t.writelines([b"a", b"bc"])

    assert run(steps) == [("write", b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\n{}"), ("write", b"abc")]


def test_close_and_write_eof_send_what_is_pending_first_and_abort_drops_it():
    async def close(t):
        t.write(b"head")
        t.write(b"body")
        t.close()

    async def eof(t):
        t.write(b"x")
        t.write_eof()

    async def abort(t):
        t.write(b"lost")
        t.abort()

    assert run(close) == [("write", b"headbody"), ("close", None)]
    assert run(eof) == [("write", b"x"), ("write_eof", None)]
    assert run(abort) == [("abort", None)]


def test_other_calls_reach_the_transport_and_writes_after_closing_are_dropped():
    async def steps(t):
        assert t.get_extra_info("peername") == ("127.0.0.1", 5)
        assert t.is_closing() is False
        t.close()
        t.write(b"late")  # the transport is closing: dropped, as the transport would

    assert run(steps) == [("close", None)]
