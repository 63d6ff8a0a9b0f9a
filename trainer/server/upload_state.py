"""In-memory state of the upload path: cached auth and rounds, each client's previous upload, the quota.

Nothing here is trusted for durability or for access: every upload's check ``SELECT`` and
``INSERT`` (:meth:`trainer.server.store.Store.insert_update`) re-check, in the same transaction, that the
token is still the client's active token, that the round is still open (or the latest), and that the
previous upload held here is still the client's latest. A revoke, a token rotation or a round close
made by the CLI in another process therefore takes effect on the very next upload (the insert
stores nothing; the checked path answers 401 / 409 and drops the stale entry). The state is lost on
restart (rebuilt on demand from the database), including the quota's windows.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import OrderedDict, deque
from typing import Any

#: Default upload quota: uploads (requests to the upload route) per client per window.
DEFAULT_QUOTA_UPLOADS = 30
DEFAULT_QUOTA_WINDOW_S = 60.0


class _Lru:
    """A thread-safe least-recently-used map of at most ``size`` entries."""

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key, value) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def drop(self, key) -> None:
        with self._lock:
            self._items.pop(key, None)


class UploadState:
    """Caches of the upload path (see the module docstring).

    Parameters
    ----------
    max_previous : clients whose previous upload is kept (a K-means update of 32 cells x 384
        dimensions is about 100 KB, so 1024 clients hold about 100 MB); others are read back from
        the database when they upload.
    max_tokens : bearer tokens (sha256) remembered with their client id.
    max_rounds : rounds remembered (their immutable part: base, models, settings).
    """

    def __init__(self, max_previous: int = 1024, max_tokens: int = 100_000, max_rounds: int = 8) -> None:
        self.tokens = _Lru(max_tokens)
        self.rounds = _Lru(max_rounds)
        self.previous = _Lru(max_previous)  # (client, base hash) -> (update id, memo)
        self._locks: dict[str, asyncio.Lock] = {}
        self._counted: OrderedDict[int, set[str]] = OrderedDict()  # round id -> clients counted in it
        self._max_rounds = int(max_rounds)

    def first_in_round(self, round_id: int, client_id: str) -> bool:
        """Record that an upload of ``client_id`` was counted in ``round_id``; True the first time
        (in this process, for the last ``max_rounds`` rounds): only then can the round's quorum of
        distinct clients have been reached, so only then is the closer woken early."""
        clients = self._counted.get(round_id)
        if clients is None:
            clients = self._counted[round_id] = set()
            while len(self._counted) > max(self._max_rounds, 1):
                self._counted.popitem(last=False)
        if client_id in clients:
            return False
        clients.add(client_id)
        return True

    def client_lock(self, client_id: str) -> asyncio.Lock:
        """The lock (on the event loop) that serialises one client's uploads in this process
        (check against the previous upload, insert, cache update)."""
        lock = self._locks.get(client_id)
        if lock is None:  # not setdefault: that would build a Lock on every call
            lock = self._locks[client_id] = asyncio.Lock()
        return lock


class UploadQuota:
    """At most ``uploads`` requests per client in any ``window_s`` seconds (a sliding window of
    request times per client, in memory: a restart forgets it). ``uploads <= 0`` disables it."""

    def __init__(self, uploads: int = DEFAULT_QUOTA_UPLOADS, window_s: float = DEFAULT_QUOTA_WINDOW_S,
                 clock=time.monotonic) -> None:
        self.uploads, self.window_s, self.clock = int(uploads), float(window_s), clock
        self._times: dict[str, deque] = {}
        self._lock = threading.Lock()

    def take(self, client_id: str) -> int | None:
        """Count one request of ``client_id``: None if within the quota, else the whole seconds
        until it may try again (the ``Retry-After`` value, >= 1); a refused request is not counted."""
        if self.uploads <= 0:
            return None
        now = self.clock()
        with self._lock:
            times = self._times.setdefault(client_id, deque())
            while times and times[0] <= now - self.window_s:
                times.popleft()
            if len(times) >= self.uploads:
                return max(1, math.ceil(times[0] + self.window_s - now))
            times.append(now)
            return None
