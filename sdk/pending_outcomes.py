"""Answered calls that wait for their score, kept in a small SQLite file until the app scores them.

A routed call stores what an :class:`sdk.eval_log.EvalLog` row needs except the score, keyed by the
response id; :meth:`sdk.routed_chat.RoutedChat.feedback` writes the row once the app gives the score
(a call never scored never reaches the log). WAL, one transaction per write, ``synchronous=NORMAL``
(survives killed processes); entries older than ``max_age_s`` and all but the newest ``max_rows``
are dropped on insert. ``":memory:"`` keeps them in memory only.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from sdk.errors import EvalLogError, InvalidInputError
from sdk.sqlite_files import set_wal, table_names

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pending (
    response_id    TEXT PRIMARY KEY,
    seq            INTEGER NOT NULL,
    timestamp      REAL    NOT NULL,
    model          TEXT    NOT NULL,
    cost_usd       REAL    NOT NULL,
    latency_ms     REAL    NOT NULL,
    embedding      BLOB    NOT NULL,
    cell           INTEGER,
    bundle_version INTEGER NOT NULL,
    policy         TEXT,
    propensity     REAL
)
"""

_SELECT = ("SELECT response_id, timestamp, model, cost_usd, latency_ms, embedding, cell, bundle_version, policy, "
           "propensity FROM pending WHERE response_id = ?")
T = TypeVar("T")

_COLUMNS = ("response_id", "seq", "timestamp", "model", "cost_usd", "latency_ms", "embedding", "cell", "bundle_version",
            "policy", "propensity")
#: A store written before exploration (no policy nor propensity): its entries are kept, the columns added.
_COLUMNS_1 = _COLUMNS[:-2]


def storable_id(response_id: object) -> bool:
    """True for a response id this store can hold: a non-empty ``str`` that encodes as UTF-8."""
    if not isinstance(response_id, str) or not response_id:
        return False
    try:
        response_id.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class PendingOutcome:
    """An answered routed call waiting for its score: the completion's ``id``, arrival time (unix s), the
    model that answered, observed cost (USD) and latency (ms), the routed text's (d_emb,) float32
    embedding, its K-means cell (or None) and the routing bundle's version; ``policy`` and ``propensity``
    of an explored choice that the chosen model answered (else None: :meth:`sdk.EvalLog.record`'s pair)."""

    response_id: str
    timestamp: float
    model: str
    cost_usd: float
    latency_ms: float
    embedding: npt.NDArray[np.float32]
    cell: int | None
    bundle_version: int
    policy: str | None = None
    propensity: float | None = None


class PendingOutcomes:
    """The store of :class:`PendingOutcome` (thread-safe, one connection under a lock) in ``path`` (SQLite,
    created with mode 0600, or ``":memory:"``), keeping the newest ``max_rows`` (int >= 1) entries of
    age up to ``max_age_s`` (> 0). InvalidInputError for other values; EvalLogError when the file is
    not this store (not SQLite, another database such as the EvalLog's) or SQLite fails later.
    """

    def __init__(self, path: str | os.PathLike[str], *, max_rows: int = 50_000, max_age_s: float = 7 * 86_400.0) -> None:
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1 \
                or not isinstance(max_age_s, (int, float)) or isinstance(max_age_s, bool) or not max_age_s > 0:
            raise InvalidInputError(f"max_rows must be an int >= 1 and max_age_s a number > 0 (seconds), got "
                                    f"{max_rows!r} and {max_age_s!r}")
        self._max_rows, self._max_age_s = max_rows, float(max_age_s)
        self._lock = threading.Lock()
        self._closed = False
        self._path = str(path)
        try:
            if self._path != ":memory:":
                Path(self._path).parent.mkdir(parents=True, exist_ok=True)
                if not Path(self._path).exists():
                    os.close(os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600))
            self._conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False, timeout=10.0)
            set_wal(self._conn, 10.0)  # retried: a new file's switch to WAL can fail at once
            # WAL + NORMAL: a committed entry survives a killed process; a power loss may drop the last
            # few (no fsync per call, which would dominate the proxy's bookkeeping time).
            self._conn.execute("PRAGMA synchronous=NORMAL")
            tables = table_names(self._conn)
            if not tables - {"pending"}:  # a new file, or a store: never add the table to another database
                self._conn.execute(_SCHEMA)
            columns = self._columns()
            if columns == _COLUMNS_1 and not tables - {"pending"}:  # under the write lock: one process migrates
                self._conn.execute("BEGIN IMMEDIATE")
                if self._columns() == _COLUMNS_1:  # not migrated meanwhile by another process
                    self._conn.execute("ALTER TABLE pending ADD COLUMN policy TEXT")
                    self._conn.execute("ALTER TABLE pending ADD COLUMN propensity REAL")
                self._conn.execute("COMMIT")
                columns = self._columns()
        except (OSError, sqlite3.Error, ValueError) as exc:  # ValueError: a NUL byte in the path
            raise EvalLogError(f"cannot open the pending-outcome store {self._path!r}: {exc}") from exc
        if tables - {"pending"} or columns != _COLUMNS:  # e.g. the EvalLog's own file given as the store
            self._conn.close()
            raise EvalLogError(f"{self._path!r} is an SQLite database but not a pending-outcome store (tables "
                               f"{sorted(tables)}, pending columns {list(columns)}); give a file of its own")

    def _columns(self) -> tuple[str, ...]:
        return tuple(r[1] for r in self._conn.execute("PRAGMA table_info(pending)"))

    def add(self, outcome: PendingOutcome) -> None:
        """Store ``outcome`` (replacing an entry of its id) and apply retention, in one transaction.
        InvalidInputError for an id that is not :func:`storable_id`; EvalLogError (rolled back) when SQLite fails."""
        if not storable_id(outcome.response_id):
            raise InvalidInputError(f"response id {outcome.response_id!r:.80} cannot be stored: a non-empty str of "
                                    "valid Unicode is needed")
        blob = np.ascontiguousarray(outcome.embedding, dtype="<f4").tobytes()
        with self._transaction("write") as conn:
            seq = conn.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM pending").fetchone()[0]
            conn.execute("INSERT OR REPLACE INTO pending VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (outcome.response_id, seq, outcome.timestamp, outcome.model, outcome.cost_usd,
                          outcome.latency_ms, blob, outcome.cell, outcome.bundle_version, outcome.policy,
                          outcome.propensity))
            conn.execute("DELETE FROM pending WHERE timestamp < ?", (time.time() - self._max_age_s,))
            conn.execute("DELETE FROM pending WHERE seq <= ?", (seq - self._max_rows,))

    def get(self, response_id: str) -> PendingOutcome | None:
        """The entry for ``response_id``, or None (unknown, already scored or expired, or an id no
        entry can have: not a :func:`storable_id`)."""
        if not storable_id(response_id):
            return None
        with self._lock:
            row = self._read(lambda: self._conn.execute(_SELECT, (response_id,)).fetchone())
        return None if row is None else _outcome(row)

    def take(self, response_id: str, record: Callable[[PendingOutcome], T]) -> T | None:
        """``record(entry)`` for the entry of ``response_id``, then the entry deleted, under the write lock
        throughout (each answer is recorded once; None when there is no entry). When ``record`` raises,
        or the process dies before the delete commits, the entry stays. EvalLogError when SQLite fails."""
        if not storable_id(response_id):
            return None
        with self._transaction("use") as conn:
            row = conn.execute(_SELECT, (response_id,)).fetchone()
            result = None if row is None else record(_outcome(row))
            if row is not None:
                conn.execute("DELETE FROM pending WHERE response_id = ?", (response_id,))
        return result

    def remove(self, response_id: str) -> bool:
        """Delete the entry; True if there was one."""
        if not storable_id(response_id):
            return False
        with self._lock:
            return self._read(lambda: self._conn.execute("DELETE FROM pending WHERE response_id = ?",
                                                          (response_id,)).rowcount > 0)

    def __len__(self) -> int:
        with self._lock:
            return self._read(lambda: int(self._conn.execute("SELECT COUNT(*) FROM pending").fetchone()[0]))

    def close(self) -> None:
        """Close the file. Idempotent."""
        with self._lock:
            self._conn.close()
            self._closed = True

    @contextlib.contextmanager
    def _transaction(self, doing: str) -> Iterator[sqlite3.Connection]:
        """A write transaction under the lock, committed, or rolled back on any error (else every later
        write would fail); SQLite's errors as :class:`EvalLogError`."""
        with self._lock:
            self._read(lambda: self._conn.execute("BEGIN IMMEDIATE"))
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException as exc:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise EvalLogError(f"cannot {doing} the pending-outcome store {self._path!r}: {exc}") from exc
                raise

    def _read(self, query: Callable[[], T]) -> T:
        """``query()`` on the open store, with SQLite's errors as :class:`EvalLogError`."""
        if self._closed:
            raise EvalLogError(f"the pending-outcome store {self._path!r} is closed")
        try:
            return query()
        except sqlite3.Error as exc:
            raise EvalLogError(f"cannot use the pending-outcome store {self._path!r}: {exc}") from exc


def _outcome(row: tuple[Any, ...]) -> PendingOutcome:
    return PendingOutcome(row[0], row[1], row[2], row[3], row[4], np.frombuffer(row[5], dtype="<f4").copy(), row[6],
                          row[7], row[8], row[9])
