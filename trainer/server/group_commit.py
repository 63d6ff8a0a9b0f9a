"""Group commit of accepted uploads: one writer thread stores every upload waiting, in one transaction.

The upload route hands each checked upload to :meth:`GroupWriter.insert` and awaits it; the writer
thread takes all the uploads waiting (at most ``max_batch``), runs each one's single ``INSERT ...
SELECT`` (:meth:`trainer.server.store.Store.insert_updates`) in ONE transaction, commits it (on
SQLite: WAL, ``synchronous=FULL``, so the commit is durable when it returns) and only then answers
the waiting requests. So no receipt (201) is sent before its row is durable, as without grouping,
while a burst of N uploads costs one commit (one fsync) instead of N. If a batch fails as a whole
(e.g. a PostgreSQL serialisation error), each of its uploads is retried alone.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

log = logging.getLogger("fedroute.server")


class GroupWriter:
    """The writer thread over ``store`` (started on first use, stopped by :meth:`close`)."""

    def __init__(self, store, max_batch: int = 64, commit_delay_s: float = 0.005) -> None:
        self.store, self.max_batch, self.commit_delay_s = store, int(max_batch), float(commit_delay_s)
        #: Uploads inside the upload route (the app counts them, on the event loop); those not yet
        #: queued here are the siblings a batch waits for (see the module docstring).
        self.active = 0
        self._queued = 0  # handed to insert() and not yet answered (event loop only)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.batches = 0
        self.rows = 0

    async def insert(self, **row) -> dict | None:
        """Store one upload (the keyword arguments of :meth:`Store.insert_update`) with the next
        batch; returns its receipt once the batch is committed, or None when nothing was stored
        (the state moved; see :meth:`Store.insert_update`).

        Raises
        ------
        Exception
            Whatever storing it alone raised (a database error).
        """
        self._ensure_started()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queued += 1
        try:
            self._queue.put((row, future, loop))
            return await future
        finally:
            self._queued -= 1

    def close(self) -> None:
        """Stop the thread after the uploads already queued are stored; log the rows per commit."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
            log.info("group commit: %d uploads in %d transactions (%.2f per commit)", self.rows, self.batches,
                     self.rows / max(self.batches, 1))

    def _ensure_started(self) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="fedroute-writer", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            batch = [job]
            while len(batch) < self.max_batch:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(job)
            self._wait_for_siblings(batch)
            try:
                results = self.store.insert_updates([row for row, _, _ in batch])
                outcomes = [(True, r) for r in results]
            except Exception:  # noqa: BLE001 - one bad batch must not fail the others' uploads: retry alone
                log.warning("a batch of %d uploads failed; storing them one by one", len(batch), exc_info=True)
                outcomes = []
                for row, _, _ in batch:
                    try:
                        outcomes.append((True, self.store.insert_update(**row)))
                    except Exception as exc:  # noqa: BLE001 - handed to the request that sent it
                        outcomes.append((False, exc))
            self.batches += 1
            self.rows += len(batch)
            for (_, future, loop), (ok, value) in zip(batch, outcomes):
                loop.call_soon_threadsafe(_settle, future, ok, value)


    def _wait_for_siblings(self, batch: list) -> None:
        """Add to ``batch`` the uploads that arrive within ``commit_delay_s`` while others are on their
        way (``active`` uploads not yet queued); a stop request ends the wait (and is put back)."""
        deadline = time.monotonic() + self.commit_delay_s
        while len(batch) < self.max_batch and self.active - self._queued > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                job = self._queue.get(timeout=remaining)
            except queue.Empty:
                return
            if job is None:
                self._queue.put(None)
                return
            batch.append(job)


def _settle(future: asyncio.Future, ok: bool, value) -> None:
    if future.cancelled():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)
