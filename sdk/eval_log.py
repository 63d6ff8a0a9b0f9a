"""Device-local log of sparse evaluations, kept in one SQLite file.

Each routed query is answered by one model, so its outcome (score, cost, latency) is known for that
model only: a *sparse evaluation*. :class:`EvalLog` appends one row per routed query (one committed
transaction, WAL; a killed process loses at most the row whose ``record`` had not returned) and the
sync job reads them back with ``rows(since_id=...)``. The query text is written only with
``store_text=True`` (else dropped before anything is written); the file is mode 0600 with
``secure_delete``. Retention after each insert, in its transaction: rows older than ``max_age_days``
go as a prefix in the order of recording (a clock more than :data:`CLOCK_STEP_S` ahead of the newest
row is trusted only once it has held that long), then all but the newest ``max_rows``. Schema 1 is
migrated to 2 when opened; newer files are refused. Details: docs/device-and-bundles.md#evallog.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from sdk.errors import EvalLogError, InvalidInputError, ShapeError, UnknownModelError
from sdk.real_numbers import finite_float, is_real_number, shown
from sdk.sqlite_files import set_wal, table_names

__all__ = ["CLOCK_STEP_S", "MAX_COST_PER_QUERY_USD", "SCHEMA_VERSION", "UNIT_NORM_TOLERANCE", "EvalLog", "Evaluations"]

#: ``PRAGMA user_version`` written; version 1 is migrated to it, other non-zero values are refused.
SCHEMA_VERSION = 2

_INT64_MAX = 2**63 - 1
#: Largest cost of one query a row may record, USD: the sync server refuses means above it.
MAX_COST_PER_QUERY_USD = 1000.0
#: Largest embedding dimension a log file may declare (far above any encoder's); a bigger one is a damaged file.
_MAX_EMBEDDING_DIM = 1 << 16
_EMBEDDING_DTYPE = np.dtype("<f4")  # little-endian float32, whatever the host byte order
#: How far an embedding's L2 norm may be from 1: the sync server refuses cell means of norm above ``1 + 1e-4``.
UNIT_NORM_TOLERANCE = 5e-5
_SECONDS_PER_DAY = 86_400.0
#: A wall clock more than this many seconds ahead of the newest row is trusted once it has held that long.
CLOCK_STEP_S = _SECONDS_PER_DAY
_BUSY_TIMEOUT_S = 10.0

_SCHEMA = """
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE evaluations (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    timestamp      REAL    NOT NULL,
    model          TEXT    NOT NULL,
    score          REAL    NOT NULL CHECK (score >= 0 AND score <= 1),
    cost_usd       REAL    NOT NULL CHECK (cost_usd >= 0),
    latency_ms     REAL             CHECK (latency_ms IS NULL OR latency_ms >= 0),
    cell           INTEGER          CHECK (cell IS NULL OR cell >= 0),
    embedding      BLOB,
    bundle_version INTEGER,
    query          TEXT,
    policy         TEXT,
    propensity     REAL             CHECK (propensity IS NULL OR (propensity > 0 AND propensity <= 1)),
    CHECK (embedding IS NOT NULL OR cell IS NOT NULL)
);
CREATE INDEX evaluations_timestamp ON evaluations (timestamp);
"""

#: Schema 1 -> 2: the columns a version-1 file lacks (ALTER TABLE keeps its rows; they read NULL).
_MIGRATE_1_TO_2 = (
    "ALTER TABLE evaluations ADD COLUMN policy TEXT",
    "ALTER TABLE evaluations ADD COLUMN propensity REAL CHECK (propensity IS NULL OR (propensity > 0 AND propensity <= 1))",
)

_COLUMNS = "id, timestamp, model, score, cost_usd, latency_ms, cell, embedding, bundle_version, query, policy, propensity"


@dataclass(frozen=True)
class Evaluations:
    """Rows of an :class:`EvalLog` as read-only column arrays, all of length ``n``, ascending ``id``.

    ``id`` int64; ``timestamp`` float64 unix s; ``model`` tuple of str; ``score`` float64 in [0, 1];
    ``cost_usd`` float64 USD; ``latency_ms`` float64 (NaN: not recorded); ``cell`` int64 (-1: none);
    ``embedding`` (n, d) float32 (rows of NaN: none; d = 0 if the log never stored one);
    ``bundle_version`` int64 (-1: none); ``query`` tuple of str or None (not stored); ``policy``
    tuple of str or None and ``propensity`` float64 in (0, 1] (NaN): the policy that chose the model
    and its probability. ShapeError on construction for columns of different lengths.
    """

    id: npt.NDArray[np.int64]
    timestamp: npt.NDArray[np.float64]
    model: tuple[str, ...]
    score: npt.NDArray[np.float64]
    cost_usd: npt.NDArray[np.float64]
    latency_ms: npt.NDArray[np.float64]
    cell: npt.NDArray[np.int64]
    embedding: npt.NDArray[np.float32]
    bundle_version: npt.NDArray[np.int64]
    query: tuple[str | None, ...]
    policy: tuple[str | None, ...] | None = None
    propensity: npt.NDArray[np.float64] | None = None

    def __post_init__(self) -> None:
        n_rows = len(self.query)
        object.__setattr__(self, "policy", tuple(self.policy) if self.policy is not None else (None,) * n_rows)
        if self.propensity is None:
            object.__setattr__(self, "propensity", np.full(n_rows, np.nan))
        dtypes = {
            "id": np.int64,
            "timestamp": np.float64,
            "score": np.float64,
            "cost_usd": np.float64,
            "latency_ms": np.float64,
            "cell": np.int64,
            "embedding": np.float32,
            "bundle_version": np.int64,
            "propensity": np.float64,
        }
        for name, dtype in dtypes.items():
            arr = np.array(getattr(self, name), dtype=dtype)  # a private copy, then frozen
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "model", tuple(self.model))
        object.__setattr__(self, "query", tuple(self.query))
        n = self.id.shape[0] if self.id.ndim == 1 else -1
        lengths = {name: np.shape(getattr(self, name))[:1] for name in (*dtypes, "model", "query", "policy")}
        if n < 0 or self.embedding.ndim != 2 or any(length != (n,) for length in lengths.values()):
            raise ShapeError(f"all columns must have one length n and embedding shape (n, d), got {lengths}, "
                             f"embedding {self.embedding.shape}")

    def __len__(self) -> int:
        return int(self.id.shape[0])


class EvalLog:
    """Append-only (up to retention) SQLite log of sparse evaluations on the device; thread-safe (one
    connection under a lock); a context manager.

    Parameters
    ----------
    path : the SQLite file (str or os.PathLike, not ``":memory:"``); created with its folder if missing.
    models : non-empty sequence of distinct, non-empty str, the model ids :meth:`record` accepts. An existing
        log keeps the rows of models its pool has since lost; it must share a model with ``models``.
    store_text : bool, default False: the ``query`` given to :meth:`record` is dropped, never written.
    max_rows : int in [1, 2**63 - 1], default 20,000: the newest rows (by id) kept.
    max_age_days : real > 0 or None (keep forever), default 90: rows older than this are deleted at each insert.
    durable : bool, default True: ``synchronous=FULL`` (fsync per commit), else ``NORMAL``.
    clock : wall-clock time in unix seconds, default ``time.time``.

    Raises InvalidInputError naming the argument that is out of range or of the wrong type (nothing is
    created then); EvalLogError, naming the path, for a file that cannot be opened or created, is not
    SQLite, is another database, has a newer schema, or holds rows of none of ``models``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        models: Sequence[str],
        *,
        store_text: bool = False,
        max_rows: int = 20_000,
        max_age_days: float | None = 90.0,
        durable: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._models = _check_models(models)
        self._model_set = frozenset(self._models)
        memory = isinstance(path, str) and (path == ":memory:" or path.startswith("file:"))
        problems = (  # (refused?, message): the first that holds is raised
            *((not isinstance(flag, bool), f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
              for name, flag in (("store_text", store_text), ("durable", durable))),
            (isinstance(max_rows, bool) or not isinstance(max_rows, numbers.Integral)
             or not 1 <= max_rows <= _INT64_MAX, f"max_rows must be an int in [1, 2**63 - 1], got {shown(max_rows)}"),
            (not isinstance(path, (str, os.PathLike)), f"path must be a str or os.PathLike, got {type(path).__name__}"),
            # SQLite would open an in-memory database (nothing kept), after creating a file of that name
            (memory, f"path {path!r} names an in-memory SQLite database; an EvalLog is a file that keeps its rows "
                     "across restarts and that fedroute-sync reads: give a file path"),
            (not callable(clock), f"clock must be a function returning unix seconds, got {type(clock).__name__}"),
        )
        problem = next((message for refused, message in problems if refused), None)
        if problem:
            raise InvalidInputError(problem)
        if max_age_days is not None:
            max_age_days = _real("max_age_days", max_age_days, 0.0, np.inf, open_low=True,
                                 note=" (or None to keep rows forever)")
        self._path = Path(path)
        self._store_text = store_text
        self._max_rows = int(max_rows)
        self._max_age_days = max_age_days
        self._durable = durable
        self._clock = clock
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = self._open()

    # ------------------------------------------------------------------ opening

    def _open(self) -> sqlite3.Connection:
        path, conn = self._path, None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Pre-create owner-only (SQLite gives its -wal/-shm files the same permissions); a folder fails here.
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            conn = sqlite3.connect(str(path), timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            self._init_connection(conn)
            return conn
        except BaseException as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, (OSError, sqlite3.Error, ValueError)):  # ValueError: a NUL byte in the path
                raise EvalLogError(f"cannot open evaluation log {str(path)!r}: {exc}" if conn is None else
                                   f"{str(path)!r} is not a usable SQLite evaluation log: {exc}") from exc
            raise

    def _init_connection(self, conn: sqlite3.Connection) -> None:
        path = str(self._path)
        # Reading the header first: a non-SQLite file fails here ("file is not a database"), and a
        # foreign or newer file is refused before any pragma changes it.
        # One read transaction: another process creating the log commits its tables and user_version
        # together, and two autocommit reads could see the version before and the tables after.
        with _transaction(conn, "BEGIN"):
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = table_names(conn)
        problem = _schema_problem(version, tables, path)
        mode = None if problem else set_wal(conn, _BUSY_TIMEOUT_S)  # retried: a new file may fail to switch at once
        if problem or str(mode).lower() != "wal":
            raise EvalLogError(problem or f"cannot put evaluation log {path!r} in WAL mode (got {mode!r})")
        conn.execute(f"PRAGMA synchronous={'FULL' if self._durable else 'NORMAL'}")
        conn.execute(f"PRAGMA fullfsync={'ON' if self._durable else 'OFF'}")  # macOS/iOS only
        conn.execute(f"PRAGMA checkpoint_fullfsync={'ON' if self._durable else 'OFF'}")
        conn.execute("PRAGMA secure_delete=ON")
        conn.execute("PRAGMA journal_size_limit=0")  # truncate the -wal file at each checkpoint
        with _transaction(conn, "BEGIN IMMEDIATE"):
            # Re-read under the write lock: another process may have created the schema meanwhile.
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            problem = _schema_problem(version, table_names(conn), path)  # a fedroute creator sets both at once
            if version in (0, 1) and not problem:  # created or migrated in this write transaction: all or nothing
                for statement in [t for t in _SCHEMA.split(";") if t.strip()] if version == 0 else _MIGRATE_1_TO_2:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            missing = {"meta", "evaluations"} - table_names(conn)
            problem = problem or (f"evaluation log {path!r} is damaged: table(s) {sorted(missing)} missing"
                                  if missing else self._pool_problem(conn, path))
            if problem:
                raise EvalLogError(problem)
            _read_embedding_dim(conn, path)  # fails early on a damaged meta table

    def _pool_problem(self, conn: sqlite3.Connection, path: str) -> str | None:
        """Why the log's rows, naming none of :attr:`models`, are another pool's, or None (a pool that gained or
        lost models keeps its log: :func:`sdk.local_update.kmeans_update` skips rows of other models)."""
        logged = sorted(m for (m,) in conn.execute("SELECT DISTINCT model FROM evaluations"))
        if not logged or self._model_set.intersection(logged):
            return None
        return (f"evaluation log {path!r} holds rows of models {logged!s:.200}, none of models {list(self._models)!s:.200}: "
                "another app's or pool's log; give this pool its own log file")

    # ------------------------------------------------------------------ public API

    @property
    def path(self) -> Path:
        """Path of the SQLite file."""
        return self._path

    @property
    def models(self) -> tuple[str, ...]:
        """The model ids rows may name, in the order given at construction."""
        return self._models

    def record(
        self,
        model: str,
        score: float,
        cost_usd: float,
        *,
        latency_ms: float | None = None,
        embedding: np.ndarray | None = None,
        cell: int | None = None,
        bundle_version: int | None = None,
        query: str | None = None,
        timestamp: float | None = None,
        policy: str | None = None,
        propensity: float | None = None,
    ) -> int:
        """Append one evaluation and apply retention, in one committed transaction; returns the row's id
        (the row may already be gone to retention if ``timestamp`` is older than ``max_age_days``).

        Parameters
        ----------
        model : one of :attr:`models`, the model the query was sent to.
        score : real in [0, 1], the observed quality of the answer.
        cost_usd : real in [0, :data:`MAX_COST_PER_QUERY_USD`], USD.
        latency_ms : real >= 0, milliseconds, or None.
        embedding : (d,) real, finite, unit L2 norm (within :data:`UNIT_NORM_TOLERANCE`, like
            ``Choice.embedding``), stored as float32; ``d`` is fixed by the log's first embedding.
        cell : int >= 0, the query's Voronoi cell; at least one of ``embedding`` and ``cell`` is needed.
        bundle_version : int >= 0, the routing bundle that made the decision.
        query : str, stored only with ``store_text=True``.
        timestamp : real >= 0, unix seconds, at most a day ahead of ``clock()`` (default: ``clock()``).
        policy, propensity : the policy that chose ``model`` (non-empty str) and the probability that it
            did (real in (0, 1]), both or neither; kept for offline evaluation, never uploaded.

        Raises UnknownModelError (a model not in :attr:`models`), InvalidInputError naming the argument
        out of range or of the wrong type, ShapeError (``embedding`` not 1-D, not finite in float32, not
        of unit norm, or of another dimension than the log's), EvalLogError (closed, or SQLite failed:
        nothing is written).
        """
        if not isinstance(model, str) or model not in self._model_set:
            raise UnknownModelError(
                f"model {model!r} is not in this log's models; known ids: {list(self._models)}"
            )
        score_f = _real("score", score, 0.0, 1.0)
        cost_f = _real("cost_usd", cost_usd, 0.0, MAX_COST_PER_QUERY_USD, note=" (USD per query; the sync server "
                       "refuses more)")
        latency_f = None if latency_ms is None else _real("latency_ms", latency_ms, 0.0, np.inf, note=" (milliseconds)")
        cell_i = None if cell is None else _index("cell", cell)
        bundle_i = None if bundle_version is None else _index("bundle_version", bundle_version)
        now = _real("clock()", self._clock(), -np.inf, np.inf)
        ts = now if timestamp is None else _real("timestamp", timestamp, 0.0, now + _SECONDS_PER_DAY,
                                                 note=" (unix seconds, at most a day in the future)")
        problems = (  # (refused?, message): the first that holds is raised
            (query is not None and not isinstance(query, str), f"query must be a str or None, got {type(query).__name__}"),
            (embedding is None and cell is None,
             "each row needs at least one of embedding or cell; got embedding=None and cell=None"),
            ((policy is None) != (propensity is None), f"policy and propensity go together (both or neither), got "
                                                       f"policy={policy!r} and propensity={shown(propensity)}"),
            (policy is not None and (not isinstance(policy, str) or not policy),
             f"policy must be a non-empty str, got {shown(policy)}"),
        )
        problem = next((message for refused, message in problems if refused), None)
        if problem:
            raise InvalidInputError(problem)
        if query is not None and self._store_text:
            _check_utf8("query", query)  # SQLite stores UTF-8: lone surrogates cannot be written
        if policy is not None:
            _check_utf8("policy", policy)
            propensity = _real("propensity", propensity, 0.0, 1.0, open_low=True,
                               note=" (a probability of the logged choice)")
        vector = None if embedding is None else _check_embedding(embedding)
        dim = None if vector is None else int(vector.shape[0])
        blob = None if vector is None else vector.tobytes()
        text = query if self._store_text else None  # privacy: dropped here, never written

        with self._using("write to") as conn, _transaction(conn, "BEGIN IMMEDIATE"):
            if dim is not None:
                self._claim_embedding_dim(conn, dim)
            reference = self._retention_time(conn, now)  # before the insert: the rows' newest time
            cursor = conn.execute(
                "INSERT INTO evaluations (timestamp, model, score, cost_usd, latency_ms, "
                "cell, embedding, bundle_version, query, policy, propensity) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (ts, model, score_f, cost_f, latency_f, cell_i, blob, bundle_i, text, policy, propensity),
            )
            row_id = int(cursor.lastrowid or 0)  # set by the INSERT
            self._apply_retention(conn, reference)
        return row_id

    def record_choice(
        self,
        choice: Any,
        score: float,
        cost_usd: float,
        *,
        latency_ms: float | None = None,
        model: str | None = None,
        query: str | None = None,
    ) -> int:
        """:meth:`record` the outcome of a :class:`sdk.router.Choice` (its embedding, cell, bundle version,
        policy and propensity); ``model`` overrides ``choice.model`` when the app sent the query elsewhere
        (then no policy nor propensity). :meth:`record`'s errors, and InvalidInputError for a ``choice``
        that is not a ``Choice``."""
        try:  # duck-typed: this module does not import sdk.router
            chosen, embedding, cell, version = choice.model, choice.embedding, choice.cell, choice.bundle_version
            policy, propensity = choice.policy, choice.propensity
        except AttributeError:
            raise InvalidInputError(f"choice must be the sdk.Choice that Router.choose returned, got "
                                    f"{type(choice).__name__} {choice!r:.80} (EvalLog.record takes a model id)"
                                    ) from None
        if model is not None and model != chosen:
            policy = propensity = None
        return self.record(
            chosen if model is None else model, score, cost_usd, latency_ms=latency_ms,
            embedding=embedding, cell=cell, bundle_version=version, query=query,
            policy=policy, propensity=propensity,
        )

    def rows(self, since_id: int = 0) -> Evaluations:
        """The rows with ``id > since_id`` (int; the last id already synced) in ascending id, as one
        consistent snapshot. InvalidInputError for a ``since_id`` that is not an int; EvalLogError when the
        log is closed, SQLite fails or a stored embedding has the wrong size."""
        if isinstance(since_id, bool) or not isinstance(since_id, numbers.Integral):
            raise InvalidInputError(f"since_id must be an int, got {type(since_id).__name__} {since_id!r}")
        since = max(-1, min(int(since_id), _INT64_MAX))
        with self._using("read") as conn, _transaction(conn, "BEGIN"):
            dim = _read_embedding_dim(conn, str(self._path))
            records = conn.execute(f"SELECT {_COLUMNS} FROM evaluations WHERE id > ? ORDER BY id", (since,)).fetchall()
        return _to_evaluations(records, dim or 0, str(self._path))

    def __len__(self) -> int:
        """Number of rows currently in the log (after retention)."""
        with self._using("read") as conn:
            return int(conn.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0])

    def close(self) -> None:
        """Close the connection (checkpointing the WAL into the main file). Idempotent."""
        with self._lock:
            if self._conn is not None:
                conn, self._conn = self._conn, None
                conn.close()

    def __enter__(self) -> EvalLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._conn is None else "open"
        return f"EvalLog({str(self._path)!r}, models={list(self._models)}, {state})"

    # ------------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _using(self, doing: str) -> Iterator[sqlite3.Connection]:
        """The open connection under the lock; SQLite's errors as :class:`EvalLogError`."""
        with self._lock:
            if self._conn is None:
                raise EvalLogError(f"evaluation log {str(self._path)!r} is closed")
            try:
                yield self._conn
            except sqlite3.Error as exc:
                raise EvalLogError(f"cannot {doing} evaluation log {str(self._path)!r}: {exc}") from exc

    def _claim_embedding_dim(self, conn: sqlite3.Connection, dim: int) -> None:
        """Check ``dim`` against the log's dimension, fixing it if unset (inside a write transaction)."""
        stored = _read_embedding_dim(conn, str(self._path))  # another process may have fixed it
        if stored is None:
            conn.execute("INSERT INTO meta (key, value) VALUES ('embedding_dim', ?)", (str(dim),))
            stored = dim
        if dim != stored:
            raise ShapeError(
                f"embedding must have shape ({stored},) like the log's earlier embeddings, got ({dim},)"
            )

    def _retention_time(self, conn: sqlite3.Connection, now: float) -> float | None:
        """The time the age limit is measured from, before the insert; None without an age limit. A clock
        more than :data:`CLOCK_STEP_S` ahead of the newest row is not trusted until it has held that long
        (the step and its start are kept in the meta table meanwhile)."""
        if self._max_age_days is None:
            return None
        row = conn.execute("SELECT value FROM meta WHERE key = 'clock_step'").fetchone()
        if row is not None:
            try:
                before, seen = (float(v) for v in row[0].split())
            except ValueError:  # damaged: forget the step
                before = seen = now
            if seen <= now < seen + CLOCK_STEP_S:  # not confirmed yet: the time since the step counts
                return before + (now - seen)
            conn.execute("DELETE FROM meta WHERE key = 'clock_step'")  # held a day, or the clock went back
            return now
        newest = conn.execute("SELECT MAX(timestamp) FROM evaluations").fetchone()[0]
        if newest is not None and now > newest + CLOCK_STEP_S:
            conn.execute("INSERT INTO meta (key, value) VALUES ('clock_step', ?)", (f"{newest!r} {now!r}",))
            return float(newest)
        return now

    def _apply_retention(self, conn: sqlite3.Connection, reference: float | None) -> None:
        if reference is not None and self._max_age_days is not None:
            cutoff = reference - self._max_age_days * _SECONDS_PER_DAY
            # Only a prefix (by id, the order of recording) goes: rows up to the first one within the
            # limit. NOT INDEXED: scan ids from the oldest, stopping there (usually the first row).
            kept = conn.execute("SELECT id FROM evaluations NOT INDEXED WHERE timestamp >= ? ORDER BY id LIMIT 1",
                                (cutoff,)).fetchone()
            if kept is None:
                conn.execute("DELETE FROM evaluations")
            else:
                conn.execute("DELETE FROM evaluations WHERE id < ?", (kept[0],))
        # The id of the max_rows-th newest row; NULL (nothing deleted) when there are fewer rows.
        conn.execute(
            "DELETE FROM evaluations WHERE id < "
            "(SELECT id FROM evaluations ORDER BY id DESC LIMIT 1 OFFSET ?)",
            (self._max_rows - 1,),
        )


# ---------------------------------------------------------------------- helpers


def _check_models(models: object) -> tuple[str, ...]:
    sequence = isinstance(models, Sequence) and not isinstance(models, (str, bytes))
    ids: tuple[Any, ...] = tuple(models) if isinstance(models, Sequence) and sequence else ()
    duplicates = sorted({m for m in ids if ids.count(m) > 1}) if all(isinstance(m, str) for m in ids) else []
    problem = (f"models must be a sequence of model id strings, got {type(models).__name__} {models!r}" if not sequence
               else "models must not be empty" if not ids
               else f"models must be non-empty strings, got {[m for m in ids if not isinstance(m, str) or not m]!r} "
                    f"in {list(ids)!r}" if not all(isinstance(m, str) and m for m in ids)
               else f"models must not repeat ids, got duplicates {duplicates} in {list(ids)}" if duplicates else None)
    if problem:
        raise InvalidInputError(problem)
    for m in ids:
        _check_utf8("models", m)
    return ids


def _check_utf8(name: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"{name} is not valid Unicode ({exc.reason} at position {exc.start}): SQLite "
                                "stores UTF-8 text") from exc


def _real(name: str, value: object, low: float, high: float, *, open_low: bool = False, note: str = "") -> float:
    """``value`` as a float when it is a finite real number in ``[low, high]`` (``(low, high]``), else
    InvalidInputError naming ``name``."""
    result = finite_float(value)
    if result is None or not (low < result if open_low else low <= result) or not result <= high:
        why = ("a real number" if not is_real_number(value) else "finite" if result is None
               else f"in {'(' if open_low else '['}{low:g}, {high:g}]{note}")
        raise InvalidInputError(f"{name} must be {why}, got {shown(value)}")
    return result


def _index(name: str, value: object) -> int:
    """``value`` as an int in [0, 2**63 - 1] (bools refused), else InvalidInputError naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or not 0 <= int(value) <= _INT64_MAX:
        shown_type = f"{type(value).__name__} " if is_real_number(value) or isinstance(value, (bool, np.bool_)) else ""
        raise InvalidInputError(f"{name} must be an int in [0, 2**63 - 1], got {shown_type}{shown(value)}")
    return int(value)


def _check_embedding(embedding: object) -> npt.NDArray[np.float32]:
    """``embedding`` as a unit-norm (d,) little-endian float32 vector, else ShapeError."""
    try:
        arr = np.asarray(embedding)
    except (TypeError, ValueError):
        arr = np.asarray(None)  # refused below as not real
    vector = norm = None
    if arr.dtype.kind in "fiu" and arr.ndim == 1 and 1 <= arr.shape[0] <= _MAX_EMBEDDING_DIM:
        with np.errstate(over="ignore", invalid="ignore"):
            vector = arr.astype(_EMBEDDING_DTYPE)
        wide = vector.astype(np.float64)
        norm = float(np.sqrt(np.dot(wide, wide)))
    problem = (f"embedding must hold real numbers, got dtype {arr.dtype}" if arr.dtype.kind not in "fiu"
               else f"embedding must have shape (d,) with 1 <= d <= {_MAX_EMBEDDING_DIM}, got {arr.shape}"
               if vector is None or norm is None
               else "embedding must be finite (no NaN/inf, and within float32 range)" if not np.isfinite(vector).all()
               else f"embedding must have unit L2 norm (1 +- {UNIT_NORM_TOLERANCE:g}, as the bundle's embedder and "
                    f"Choice.embedding give it; the sync server refuses means of longer vectors), got norm {norm:.6g}: "
                    "pass the router's embedding, or divide by its norm" if not abs(norm - 1.0) <= UNIT_NORM_TOLERANCE
               else None)
    if problem or vector is None:
        raise ShapeError(problem)
    return vector


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection, begin: str) -> Iterator[None]:
    """``begin`` ... ``COMMIT``, rolled back on any error."""
    conn.execute(begin)
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _schema_problem(version: int, tables: set[str], path: str) -> str | None:
    """Why a file of ``version`` holding ``tables`` is not a log this code opens, or None."""
    if version not in (0, 1, SCHEMA_VERSION):
        return (f"evaluation log {path!r} has schema version {version}; this fedroute understands versions 1 to "
                f"{SCHEMA_VERSION} (written by a newer or unknown program)")
    if version == 0 and tables:
        return f"{path!r} is an SQLite database but not a fedroute evaluation log (user_version 0 with tables in it)"
    return None


def _read_embedding_dim(conn: sqlite3.Connection, path: str) -> int | None:
    row = conn.execute("SELECT value FROM meta WHERE key = 'embedding_dim'").fetchone()
    if row is None:
        return None
    try:
        dim = int(row[0])
    except ValueError:
        dim = 0
    if not 1 <= dim <= _MAX_EMBEDDING_DIM:
        raise EvalLogError(f"evaluation log {path!r} is damaged: bad embedding_dim {row[0]!r}")
    return dim


def _to_evaluations(records: list[tuple[Any, ...]], dim: int, path: str) -> Evaluations:
    n = len(records)
    embedding = np.full((n, dim), np.nan, dtype=np.float32)
    for i, r in enumerate(records):
        blob = r[7]
        if blob is None:
            continue
        if not isinstance(blob, bytes) or len(blob) != dim * _EMBEDDING_DTYPE.itemsize:
            # Checked before np.frombuffer, which raises on a str or a size that is not a multiple of 4.
            size = f"{len(blob)} bytes" if isinstance(blob, bytes) else f"a {type(blob).__name__}"
            raise EvalLogError(
                f"evaluation log {path!r} is damaged: row {r[0]} has an embedding of {size}, "
                f"the log's dimension {dim} needs {dim * _EMBEDDING_DTYPE.itemsize} bytes"
            )
        embedding[i] = np.frombuffer(blob, dtype=_EMBEDDING_DTYPE)
    return Evaluations(
        id=np.array([r[0] for r in records], dtype=np.int64),
        timestamp=np.array([r[1] for r in records], dtype=np.float64),
        model=tuple(r[2] for r in records),
        score=np.array([r[3] for r in records], dtype=np.float64),
        cost_usd=np.array([r[4] for r in records], dtype=np.float64),
        latency_ms=np.array([np.nan if r[5] is None else r[5] for r in records], dtype=np.float64),
        cell=np.array([-1 if r[6] is None else r[6] for r in records], dtype=np.int64),
        embedding=embedding,
        bundle_version=np.array([-1 if r[8] is None else r[8] for r in records], dtype=np.int64),
        query=tuple(r[9] for r in records),
        policy=tuple(r[10] for r in records),
        propensity=np.array([np.nan if r[11] is None else r[11] for r in records], dtype=np.float64),
    )
