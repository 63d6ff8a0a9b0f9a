"""Group commit of accepted uploads: one writer thread stores each batch of uploads in one transaction.

The upload route hands each checked upload to :meth:`GroupWriter.insert` and awaits it. The batch
is gathered on the event loop: while the writer thread stores one batch, the uploads that arrive
wait for the next; when the thread is free, the uploads waiting go at once, unless other uploads
are still on their way in the route (``active``), in which case the batch waits for them up to
``commit_delay_s`` (PostgreSQL's ``commit_delay``). The thread runs each upload's check ``SELECT`` and
``INSERT`` (:meth:`trainer.server.store.Store.insert_updates`) in ONE transaction, commits it (on
SQLite: WAL, ``synchronous=FULL``, so the commit is durable when it returns) and only then hands the
receipts back to the event loop, which answers the waiting requests. So no receipt (201) is sent
before its row is durable, as without grouping, while a burst of N uploads costs one commit (one
fsync) and one hand-over each way between the event loop and the thread, instead of N. If a batch
fails as a whole (e.g. a PostgreSQL serialisation error), each of its uploads is retried alone.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

log = logging.getLogger("fedroute.server")


class WriterClosed(RuntimeError):
    """An upload reached the group writer after :meth:`GroupWriter.close` (server shutting down)."""


class GroupWriter:
    """The writer thread over ``store`` (started on first use, stopped by :meth:`close`); used from
    one event loop at a time (the server's)."""

    def __init__(self, store, max_batch: int = 64, commit_delay_s: float = 0.005) -> None:
        self.store, self.max_batch, self.commit_delay_s = store, int(max_batch), float(commit_delay_s)
        #: Uploads inside the upload route (the app counts them, on the event loop); those not yet
        #: handed to :meth:`insert` are the siblings a batch waits for (see the module docstring).
        self.active = 0
        self._inside = 0  # uploads inside insert(), answered or not (event loop only)
        self._pending: list[tuple[dict, asyncio.Future]] = []  # waiting for the next batch (event loop only)
        self._storing = 0  # uploads of the batch the thread is storing (0: the thread is free)
        self._timer: asyncio.TimerHandle | None = None  # the commit delay of the pending uploads
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.batches = 0
        self.rows = 0

    async def insert(self, **row) -> dict | None:
        """Store one upload (the keyword arguments of :meth:`Store.insert_update`) with the next
        batch; returns its receipt once the batch is committed, or None when nothing was stored
        (the state moved; see :meth:`Store.insert_update`).

        Raises
        ------
        WriterClosed
            The writer was closed (the server is shutting down); nothing was stored.
        Exception
            Whatever storing it alone raised (a database error).
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inside += 1
        try:
            self._pending.append((row, future))
            self._hand_over(loop)
            return await future
        finally:
            self._inside -= 1

    def close(self) -> None:
        """Stop the thread after the batch it was handed is stored; log the rows per commit."""
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
            log.info("group commit: %d uploads in %d transactions (%.2f per commit)", self.rows, self.batches,
                     self.rows / max(self.batches, 1))

    # -- event loop ------------------------------------------------------------------------------

    def _hand_over(self, loop: asyncio.AbstractEventLoop, *, now: bool = False) -> None:
        """Give the pending uploads to the thread if it is free, and unless uploads still on their
        way in the route are worth waiting for (``now``: the commit delay ran out)."""
        if self._storing or not self._pending:
            return  # the thread takes them when it has stored its batch (_stored)
        on_their_way = self.active - self._inside
        if not now and on_their_way > 0 and len(self._pending) < self.max_batch and self.commit_delay_s > 0:
            if self._timer is None:
                self._timer = loop.call_later(self.commit_delay_s, self._delay_over, loop)
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
        if self._closed:
            for _, future in batch:
                _settle(future, False, WriterClosed("the server is shutting down; nothing was stored"))
            return
        self._storing = len(batch)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fedroute-writer", daemon=True)
            self._thread.start()
        self._queue.put((batch, loop))

    def _delay_over(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._hand_over(loop, now=True)

    def _stored(self, batch: list, outcomes: list, loop: asyncio.AbstractEventLoop) -> None:
        """The thread committed ``batch``: answer its uploads, then hand over the next batch."""
        self._storing = 0
        self.batches += 1
        self.rows += len(batch)
        for (_, future), (ok, value) in zip(batch, outcomes):
            _settle(future, ok, value)
        self._hand_over(loop)

    # -- writer thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            batch, loop = job
            try:
                outcomes = [(True, r) for r in self.store.insert_updates([row for row, _ in batch])]
            except Exception as exc:  # noqa: BLE001 - one bad batch must not fail the others' uploads: retry alone
                # no traceback here: each upload's error reaches its request, which answers it
                if len(batch) > 1:
                    log.warning("a batch of %d uploads failed (%s: %s); storing them one by one", len(batch),
                                type(exc).__name__, (str(exc).splitlines() or [""])[0])
                outcomes = [] if len(batch) > 1 else [(False, exc)]
                for row, _ in batch if len(batch) > 1 else ():
                    try:
                        outcomes.append((True, self.store.insert_update(**row)))
                    except Exception as exc:  # noqa: BLE001 - handed to the request that sent it
                        outcomes.append((False, exc))
            try:
                loop.call_soon_threadsafe(self._stored, batch, outcomes, loop)
            except RuntimeError:  # the loop is closed: nobody waits for these answers any more
                log.info("group commit: %d uploads stored after their event loop closed", len(batch))


def _settle(future: asyncio.Future, ok: bool, value) -> None:
    if future.cancelled():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)
