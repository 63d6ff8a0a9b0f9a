"""SQLite files opened by several processes at once (server store, EvalLog, pending-outcome store).

``PRAGMA journal_mode=WAL`` on a new file needs the exclusive lock, and SQLite can answer "database is
locked" at once, without waiting on the busy timeout, while another connection initialises the file
(measured: 2-10 of 60 trials of 8 threads failed); :func:`set_wal` retries.
"""

from __future__ import annotations

import sqlite3
import time


def set_wal(conn: sqlite3.Connection | sqlite3.Cursor, timeout_s: float) -> str:
    """Run ``PRAGMA journal_mode=WAL``, retrying while the database is locked for up to ``timeout_s``;
    returns the journal mode SQLite reports (``"wal"``, ``"memory"``...). Raises sqlite3.OperationalError."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            return str(conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 0.1)


def table_names(conn: sqlite3.Connection) -> set[str]:
    """Names of the tables in the database of ``conn``."""
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
