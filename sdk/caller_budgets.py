"""``CallerBudgets``: the budget controllers of a :class:`sdk.routed_chat.RoutedChat`, per caller, bounded, kept on disk.

One :class:`sdk.budget.BudgetController` per ``(caller, budget)`` (``fedroute proxy``: the caller is the
sha256 of its bearer token), so one caller's spend never moves another's ``lam``; at most
``max_per_caller`` per caller and ``max_total`` overall, least recently used dropped (the caller's own
first), so a caller sending ever new budgets only cycles its own slots. With a ``path``, :meth:`save`
writes every changed controller's state in one SQLite transaction (a kill leaves the previous save),
restored on first use after a restart; the file keeps the newest ``max_total`` rows. Thread-safe.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from sdk.budget import BudgetController
from sdk.errors import EvalLogError, InvalidInputError
from sdk.sqlite_files import set_wal

log = logging.getLogger("fedroute.budget")

DEFAULT_MAX_PER_CALLER = 16
DEFAULT_MAX_TOTAL = 1024

Key = tuple[str, float]


class CallerBudgets:
    """Budget controllers per ``(caller, budget USD per 1k queries)`` (module docstring).

    Parameters
    ----------
    make : callable ``budget -> BudgetController`` (the router and seed are the caller's).
    max_per_caller, max_total : int >= 1, controllers kept per caller and overall.
    path : SQLite file of the saved state, or None (state in memory only).

    Raises
    ------
    InvalidInputError
        A bound that is not an int >= 1.
    EvalLogError
        ``path`` cannot be opened as an SQLite file.
    """

    def __init__(self, make: Callable[[float], BudgetController], *, max_per_caller: int = DEFAULT_MAX_PER_CALLER,
                 max_total: int = DEFAULT_MAX_TOTAL, path: str | os.PathLike[str] | None = None) -> None:
        for name, value in (("max_per_caller", max_per_caller), ("max_total", max_total)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(f"{name} must be an int >= 1, got {value!r}")
        self._make, self.max_per_caller, self.max_total = make, max_per_caller, max_total
        self._controllers: OrderedDict[Key, BudgetController] = OrderedDict()  # least recently used first
        self._saved: dict[Key, tuple[int, int]] = {}  # (n_chosen, n_recorded) at the last save
        self._dropped: set[Key] = set()
        self._lock = threading.Lock()
        self._conn = None
        if path is not None:
            try:
                if not Path(path).exists():  # owner-only, as the EvalLog (callers' token hashes and spend)
                    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
                self._conn = sqlite3.connect(Path(path), isolation_level=None, check_same_thread=False, timeout=10.0)
                set_wal(self._conn, 10.0)
                self._conn.execute("CREATE TABLE IF NOT EXISTS budget_state (caller TEXT NOT NULL, budget REAL NOT NULL,"
                                   " state TEXT NOT NULL, saved REAL NOT NULL, PRIMARY KEY (caller, budget))")
                # Rows of controllers never used again since earlier runs: the file keeps the newest max_total.
                self._conn.execute("DELETE FROM budget_state WHERE rowid NOT IN (SELECT rowid FROM budget_state "
                                   "ORDER BY saved DESC LIMIT ?)", (max_total,))
            except (OSError, sqlite3.Error) as exc:
                raise EvalLogError(f"budget state {path}: cannot open it as an SQLite file ({exc})") from exc

    def get(self, caller: str, budget: float) -> BudgetController:
        """The controller of ``(caller, budget)``: kept, restored from the file, or new (evicting as above)."""
        key = (caller, budget)
        with self._lock:
            controller = self._controllers.get(key)
            if controller is not None:
                self._controllers.move_to_end(key)
                return controller
            mine = [k for k in self._controllers if k[0] == caller]
            if len(mine) >= self.max_per_caller:
                self._drop(mine[0])
            elif len(self._controllers) >= self.max_total:
                self._drop(next(iter(self._controllers)))
            controller = self._make(budget)
            self._restore(key, controller)
            self._controllers[key] = controller
            return controller

    def _drop(self, key: Key) -> None:
        del self._controllers[key]
        self._saved.pop(key, None)
        self._dropped.add(key)

    def _restore(self, key: Key, controller: BudgetController) -> None:
        if self._conn is None:
            return
        row = self._conn.execute("SELECT state FROM budget_state WHERE caller = ? AND budget = ?", key).fetchone()
        if row is None:
            return
        try:
            controller.restore(json.loads(row[0]))
        except (InvalidInputError, ValueError, KeyError, TypeError) as exc:  # another bundle's models or window
            log.warning("budget %g of caller %s…: saved state not restored (%s); starting afresh", key[1],
                        key[0][:8], exc)
            return
        self._saved[key] = (controller.n_chosen, controller.n_recorded)
        self._dropped.discard(key)

    def controllers(self) -> dict[Key, BudgetController]:
        """{(caller, budget): controller} kept now, least recently used first."""
        with self._lock:
            return dict(self._controllers)

    def save(self) -> int:
        """Write the controllers changed since the last save (and delete the dropped ones) in one
        transaction; returns how many rows were written. A no-op without a path.

        Raises
        ------
        EvalLogError
            The file cannot be written (the previous save stays).
        """
        if self._conn is None:
            return 0
        with self._lock:
            changed = {k: c for k, c in self._controllers.items()
                       if self._saved.get(k) != (c.n_chosen, c.n_recorded)}
            if not changed and not self._dropped:
                return 0
            states = {k: (c.state(), (c.n_chosen, c.n_recorded)) for k, c in changed.items()}
            try:
                with self._conn:
                    self._conn.execute("BEGIN IMMEDIATE")
                    self._conn.executemany("DELETE FROM budget_state WHERE caller = ? AND budget = ?", self._dropped)
                    now = time.time()
                    self._conn.executemany("INSERT OR REPLACE INTO budget_state VALUES (?, ?, ?, ?)",
                                           [(*k, json.dumps(s), now) for k, (s, _) in states.items()])
            except sqlite3.Error as exc:
                raise EvalLogError(f"budget state: cannot save it ({exc})") from exc
            self._dropped.clear()
            self._saved.update({k: n for k, (_, n) in states.items()})
            return len(states)

    def close(self) -> None:
        """:meth:`save`, then close the file."""
        if self._conn is not None:
            self.save()
            self._conn.close()
            self._conn = None
