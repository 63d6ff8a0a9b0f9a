"""SQLite files opened by several processes at once (the server store, the EvalLog, the pending-outcome
store): switching a database to WAL, and listing its tables.

``PRAGMA journal_mode=WAL`` on a new file needs the database's exclusive lock, and SQLite can answer
"database is locked" at once, without waiting on the connection's busy timeout, while another
connection opens or initialises the same file (measured: 8 threads opening one new file, 2-10 of 60
trials failed for the server store, the evaluation log and the pending-outcome store). Once a
database is in WAL mode (it persists in the file), the pragma takes no lock.
"""

from __future__ import annotations

import sqlite3
import time


def set_wal(conn, timeout_s: float) -> str:
    """Run ``PRAGMA journal_mode=WAL`` on ``conn`` (an ``sqlite3`` connection or cursor), retrying
    while the database is locked, for up to ``timeout_s`` seconds (sleeps of 5 ms doubling to 100 ms).

    Returns
    -------
    str, the journal mode SQLite reports afterwards (``"wal"``, or e.g. ``"memory"`` for an in-memory
    database: the caller decides whether that is acceptable).

    Raises
    ------
    sqlite3.OperationalError
        Still locked after ``timeout_s``, or any other SQLite error.
    """
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


def table_names(conn) -> set[str]:
    """Names of the tables in the database of ``conn`` (an ``sqlite3`` connection)."""
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
