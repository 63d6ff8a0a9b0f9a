"""Device-local log of sparse evaluations, kept in one SQLite file.

Each routed query is answered by exactly one model, so its outcome (score, cost, latency) is known
for that model only: a *sparse evaluation*. :class:`EvalLog` appends one row per routed query and
the federated-sync job reads them back, incrementally, with ``rows(since_id=...)``.

What a row holds
----------------
``id`` (increasing, never reused, also after retention deleted rows), ``timestamp`` (unix seconds),
``model`` (the id of the model the query was sent to), ``score`` (in [0, 1]), ``cost_usd`` (USD),
optionally ``latency_ms``, the query embedding (a float32 vector; the log's dimension is fixed by
the first stored embedding) and/or the Voronoi ``cell`` of the query (at least one of the two is
required), the ``bundle_version`` that made the decision, the ``policy`` that chose the model and its
``propensity`` (the probability that the policy chose it: 1 for the greedy ``Router.choose``, below 1
for an exploring :class:`sdk.Explorer`; kept for offline evaluation of other policies, never uploaded)
and, only if allowed, the query text.

Schema versions: 1 (no policy columns) is migrated to 2 when opened, in one transaction (its rows
read policy None and propensity NaN); a file of a newer version is refused.

Privacy
-------
The raw query text is written only when the log is opened with ``store_text=True``. Otherwise a
``query`` passed to :meth:`EvalLog.record` is dropped before anything is written: it never touches
the database file nor its ``-wal`` journal. The file is created with mode 0600 (owner only), and
``PRAGMA secure_delete`` is on, so rows removed by retention are overwritten with zeros instead of
lingering in free pages of the database file. In WAL mode their old content can stay in the
``-wal`` file until the next checkpoint (SQLite's automatic one, every ~1000 pages, or
:meth:`EvalLog.close`); the WAL is truncated at each checkpoint (``journal_size_limit=0``). (Text
stored by an earlier ``store_text=True`` session stays until its row is removed by retention.)

Retention
---------
Applied after each insert, in the same transaction as the insert:

1. rows older than ``max_age_days`` are deleted (``max_age_days=None`` keeps rows forever), as a
   prefix in the order of recording: the rows (by id) before the first one whose ``timestamp`` is
   within ``max_age_days`` of the retention time, so a row goes no sooner than the rows recorded
   before it. A row recorded with a timestamp already older than that is deleted at once (``record``
   still returns its id) unless rows recorded before it are younger;
2. then only the newest ``max_rows`` rows (by id) are kept.

The retention time is the wall clock (``clock``, default ``time.time()``), with two guards against
a clock that jumps (before 2026-12-02 a clock jumping ahead wiped the log at the next ``record``,
and rows logged while the clock was behind were deleted once it was corrected):

- a clock more than :data:`CLOCK_STEP_S` (a day) ahead of the newest row's timestamp is not trusted
  until it has held for a day: until then the retention time is that newest timestamp plus the time
  since the step (a clock set back before the step ends the wait). A device idle for longer than a
  day therefore deletes its aged rows up to a day late; a clock that stays wrong for a day is taken
  as right;
- rows stamped while the clock was behind sit (by id) after rows with later timestamps, which the
  prefix rule keeps them behind. Not covered: a log whose *first* rows were stamped while the clock
  was behind (they are deleted once the corrected clock has held a day), and rows stamped while the
  clock was ahead, which stay (with the rows after them) until the clock passes their timestamps
  or ``max_rows`` pushes them out.

Lowering ``max_rows`` or ``max_age_days`` on reopen takes effect at the next ``record``.

Durability
----------
SQLite in WAL mode; every :meth:`EvalLog.record` is one transaction and returns after its commit.
A process killed at any point (SIGKILL included) loses at most the row whose ``record`` had not
returned and never leaves a corrupt file. With ``durable=True`` (``synchronous=FULL``) each commit
is also fsynced, so it survives a power loss or OS crash; with ``durable=False``
(``synchronous=NORMAL``) the file stays consistent but the last commits may be lost on power loss.

Size
----
About 1.6 kB per row with a 384-d embedding (1,536 bytes of float32 plus ~60 bytes of other
columns and SQLite overhead; more with stored query text), so ~32 MB at the default
``max_rows=20_000``. Without an embedding a row is under 100 bytes.

This module imports only the standard library, numpy and :mod:`sdk.errors`.
"""

from __future__ import annotations

import numbers
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from sdk.errors import EvalLogError, InvalidInputError, ShapeError, UnknownModelError
from sdk.real_numbers import finite_float, is_real_number, shown
from sdk.sqlite_files import set_wal, table_names

__all__ = ["CLOCK_STEP_S", "MAX_COST_PER_QUERY_USD", "SCHEMA_VERSION", "UNIT_NORM_TOLERANCE", "EvalLog", "Evaluations"]

#: Value of ``PRAGMA user_version`` written by this version; a version-1 file is migrated to it when
#: opened, a file with another non-zero value is refused with :class:`EvalLogError`.
SCHEMA_VERSION = 2

_INT64_MAX = 2**63 - 1
#: Largest cost of one query a row may record, USD. The aggregation server refuses every upload whose
#: mean cost in an entry is above it (``trainer/server/validation.py`` imports this bound), so a log
#: holding such rows could never sync again: a unit mistake (micro-USD, cents) is refused at ``record``.
MAX_COST_PER_QUERY_USD = 1000.0
#: Largest embedding dimension a log file may declare (far above any encoder's); a bigger one is a damaged file.
_MAX_EMBEDDING_DIM = 1 << 16
_EMBEDDING_DTYPE = np.dtype("<f4")  # little-endian float32, whatever the host byte order
#: How far an embedding's L2 norm may be from 1 (float32 rounding of a normalised vector is ~1e-7). The
#: sync server refuses a cell mean of norm above ``1 + 1e-4`` (``trainer/server/validation.py``): a log
#: of longer vectors could never sync, so :meth:`EvalLog.record` refuses them.
UNIT_NORM_TOLERANCE = 5e-5
_SECONDS_PER_DAY = 86_400.0
#: A wall clock more than this many seconds ahead of the log's newest row is not trusted by the
#: retention until it has held that long (module docstring, Retention).
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

    Attributes
    ----------
    id : ndarray of shape (n,), int64, row ids (strictly increasing).
    timestamp : ndarray of shape (n,), float64, unix seconds.
    model : tuple of n str, the model id each query was sent to.
    score : ndarray of shape (n,), float64, in [0, 1].
    cost_usd : ndarray of shape (n,), float64, USD, >= 0.
    latency_ms : ndarray of shape (n,), float64, milliseconds; NaN where not recorded.
    cell : ndarray of shape (n,), int64, Voronoi cell index; -1 where not recorded.
    embedding : ndarray of shape (n, d), float32; rows of NaN where not recorded. ``d`` is the log's
        embedding dimension, 0 if the log never stored an embedding (shape ``(n, 0)``).
    bundle_version : ndarray of shape (n,), int64; -1 where not recorded.
    query : tuple of n (str or None), the query text; None where not stored (``store_text=False``).
    policy : tuple of n (str or None), the policy that chose the model (``"greedy"``, ``"thompson"``);
        None where not recorded (default: all None).
    propensity : ndarray of shape (n,), float64, in (0, 1], the probability that ``policy`` chose
        ``model``; NaN where not recorded (default: all NaN).

    Raises
    ------
    ShapeError
        On construction, if the columns do not all have length ``n`` or ``embedding`` is not 2-D.
    """

    id: np.ndarray
    timestamp: np.ndarray
    model: tuple[str, ...]
    score: np.ndarray
    cost_usd: np.ndarray
    latency_ms: np.ndarray
    cell: np.ndarray
    embedding: np.ndarray
    bundle_version: np.ndarray
    query: tuple[str | None, ...]
    policy: tuple[str | None, ...] | None = None
    propensity: np.ndarray | None = None

    def __post_init__(self) -> None:
        n_rows = len(self.query)
        if self.policy is None:
            object.__setattr__(self, "policy", (None,) * n_rows)
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
        object.__setattr__(self, "policy", tuple(self.policy))
        n = self.id.shape[0] if self.id.ndim == 1 else -1
        if self.embedding.ndim != 2:
            raise ShapeError(f"embedding must have shape (n, d), got {self.embedding.shape}")
        lengths = {name: np.shape(getattr(self, name))[:1] for name in (*dtypes, "model", "query", "policy")}
        if n < 0 or any(length != (n,) for length in lengths.values()):
            raise ShapeError(f"all columns must have one length n, got {lengths}")

    def __len__(self) -> int:
        return int(self.id.shape[0])


class EvalLog:
    """Append-only (up to retention) SQLite log of sparse evaluations on the device.

    Thread-safe: one connection guarded by a lock, so one instance can be shared by threads. Use as a
    context manager or call :meth:`close`. See the module docstring for privacy, retention and
    durability.

    Parameters
    ----------
    path : str or os.PathLike, the SQLite file; created (with its parent directory) if missing.
    models : sequence of str, non-empty and without duplicates, the model ids rows may name.
    store_text : bool, keyword-only, default False. If False the ``query`` text given to
        :meth:`record` is dropped and never written.
    max_rows : int, keyword-only, >= 1, default 20,000; the newest ``max_rows`` rows (by id) are kept.
    max_age_days : float or None, keyword-only, > 0, default 90; rows older than this (by timestamp,
        against the wall clock, guarded against clock jumps: module docstring) are deleted at each
        insert. None keeps rows forever.
    durable : bool, keyword-only, default True. ``synchronous=FULL`` (each commit fsynced) if True,
        ``synchronous=NORMAL`` otherwise (consistent, but a power loss may drop the last commits).
    clock : function returning the wall-clock time in unix seconds, keyword-only, default
        ``time.time`` (the default timestamp of a row and the retention's time; see the module
        docstring for how a clock that jumps is handled).

    Raises
    ------
    InvalidInputError
        ``path`` ``":memory:"`` or a ``file:`` URI (nothing is created), ``models`` empty, not a sequence
        of non-empty str (valid Unicode), or with duplicates; ``max_rows`` not an
        int in [1, 2**63 - 1]; ``max_age_days`` not None nor a finite real > 0; ``store_text``/``durable`` not bool;
        ``clock`` not callable.
    EvalLogError
        The file cannot be opened or created, is not SQLite, is another SQLite database, or has a
        schema version this code does not understand. The message names the path.
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
        for name, flag in (("store_text", store_text), ("durable", durable)):
            if not isinstance(flag, bool):
                raise InvalidInputError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
        if isinstance(max_rows, bool) or not isinstance(max_rows, numbers.Integral) or not 1 <= max_rows <= _INT64_MAX:
            raise InvalidInputError(f"max_rows must be an int in [1, 2**63 - 1], got {shown(max_rows)}")
        if max_age_days is not None:
            max_age_days = _check_real("max_age_days", max_age_days)
            if max_age_days <= 0:
                raise InvalidInputError(
                    f"max_age_days must be > 0 (or None to keep rows forever), got {max_age_days!r}"
                )
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidInputError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        if isinstance(path, str) and (path == ":memory:" or path.startswith("file:")):
            # SQLite would open an in-memory database (no WAL, nothing kept), after a file of that name was created
            raise InvalidInputError(f"path {path!r} names an in-memory SQLite database; an EvalLog is a file that "
                                    "keeps its rows across restarts and that fedroute-sync reads: give a file path")
        self._path = Path(path)
        self._store_text = store_text
        self._max_rows = int(max_rows)
        self._max_age_days = max_age_days
        self._durable = durable
        if not callable(clock):
            raise InvalidInputError(f"clock must be a function returning unix seconds, got {type(clock).__name__}")
        self._clock = clock
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = self._open()

    # ------------------------------------------------------------------ opening

    def _open(self) -> sqlite3.Connection:
        path = self._path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                # Pre-create owner-only; SQLite gives its -wal/-shm files the same permissions.
                os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            conn = sqlite3.connect(
                str(path), timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
        except (OSError, sqlite3.Error, ValueError) as exc:  # ValueError: a NUL byte in the path
            raise EvalLogError(f"cannot open evaluation log {str(path)!r}: {exc}") from exc
        try:
            self._init_connection(conn)
        except EvalLogError:
            conn.close()
            raise
        except sqlite3.Error as exc:
            conn.close()
            raise EvalLogError(
                f"{str(path)!r} is not a usable SQLite evaluation log: {exc}"
            ) from exc
        return conn

    def _init_connection(self, conn: sqlite3.Connection) -> None:
        path = str(self._path)
        # Reading the header first: a non-SQLite file fails here ("file is not a database"), and a
        # foreign or newer file is refused before any pragma changes it.
        # One read transaction: another process creating the log commits its tables and user_version
        # together, and two autocommit reads could see the version before and the tables after.
        conn.execute("BEGIN")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = table_names(conn)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        if version not in (0, 1, SCHEMA_VERSION):
            raise EvalLogError(
                f"evaluation log {path!r} has schema version {version}; this fedroute understands "
                f"versions 1 to {SCHEMA_VERSION} (written by a newer or unknown program)"
            )
        if version == 0 and tables:
            raise EvalLogError(_NOT_A_LOG.format(path=path))
        mode = set_wal(conn, _BUSY_TIMEOUT_S)  # retried: a new file's switch to WAL can fail at once
        if str(mode).lower() != "wal":
            raise EvalLogError(f"cannot put evaluation log {path!r} in WAL mode (got {mode!r})")
        conn.execute(f"PRAGMA synchronous={'FULL' if self._durable else 'NORMAL'}")
        conn.execute(f"PRAGMA fullfsync={'ON' if self._durable else 'OFF'}")  # macOS/iOS only
        conn.execute(f"PRAGMA checkpoint_fullfsync={'ON' if self._durable else 'OFF'}")
        conn.execute("PRAGMA secure_delete=ON")
        conn.execute("PRAGMA journal_size_limit=0")  # truncate the -wal file at each checkpoint
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Re-read under the write lock: another process may have created the schema meanwhile.
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:
                if table_names(conn):  # under the write lock: a fedroute creator sets both at once
                    raise EvalLogError(_NOT_A_LOG.format(path=path))
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            elif version == 1:  # migrated in this write transaction: all or nothing
                for statement in _MIGRATE_1_TO_2:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            elif version != SCHEMA_VERSION:
                raise EvalLogError(
                    f"evaluation log {path!r} has schema version {version}; this fedroute "
                    f"understands versions 1 to {SCHEMA_VERSION}"
                )
            missing = {"meta", "evaluations"} - table_names(conn)
            if missing:
                raise EvalLogError(
                    f"evaluation log {path!r} is damaged: table(s) {sorted(missing)} missing"
                )
            _read_embedding_dim(conn, path)  # fails early on a damaged meta table
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

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
        """Append one evaluation and apply retention, in one committed transaction.

        Parameters
        ----------
        model : str, one of :attr:`models`, the model the query was sent to.
        score : real number in [0, 1] (bools rejected), the observed quality of the answer.
        cost_usd : real number, USD, in [0, :data:`MAX_COST_PER_QUERY_USD`] (1000).
        latency_ms : real number, milliseconds, finite and >= 0, or None (stored as NULL).
        embedding : array-like of shape (d,), real, finite, unit L2 norm (within
            :data:`UNIT_NORM_TOLERANCE`, like ``Choice.embedding``), or None; stored as float32. ``d``
            must equal the log's embedding dimension, which the first stored embedding fixes.
        cell : int >= 0 or None, the Voronoi cell of the query. At least one of ``embedding`` and
            ``cell`` must be given.
        bundle_version : int >= 0 or None, the routing bundle that made the decision.
        query : str or None, the query text. Stored only if the log was opened with
            ``store_text=True``; otherwise dropped without being written anywhere.
        timestamp : real number, unix seconds, at most one day ahead of the clock, or None for
            ``clock()`` (default ``time.time()``).
        policy, propensity : the policy that chose ``model`` (non-empty str) and the probability that
            it did (real number in (0, 1]), both or neither (NULL: not recorded). Kept on the device
            for offline evaluation (inverse propensity weighting); the statistics upload ignores them.

        Returns
        -------
        int, the id of the new row; the row is committed when this returns (it may already have
        been removed by retention if its ``timestamp`` is older than ``max_age_days``).

        Raises
        ------
        UnknownModelError
            ``model`` is not a str or not in :attr:`models` (the message lists the known ids).
        InvalidInputError
            ``score``, ``cost_usd``, ``latency_ms``, ``cell``, ``bundle_version``, ``query``,
            ``timestamp``, ``policy`` or ``propensity`` out of range or of the wrong type, only one of
            ``policy`` and ``propensity``, a ``query`` to store that is not valid
            Unicode (lone surrogates), or neither ``embedding`` nor ``cell``.
        ShapeError
            ``embedding`` not 1-D, empty, not real-valued, non-finite (also after the cast to
            float32), not of unit norm (the message gives the norm found), or of another dimension
            than the log's.
        EvalLogError
            The log is closed, or SQLite failed to write (disk full, file locked too long, ...);
            nothing is written then.
        """
        if not isinstance(model, str) or model not in self._model_set:
            raise UnknownModelError(
                f"model {model!r} is not in this log's models; known ids: {list(self._models)}"
            )
        score_f = _check_real("score", score)
        if not 0.0 <= score_f <= 1.0:
            raise InvalidInputError(f"score must lie in [0, 1], got {score_f!r}")
        cost_f = _check_real("cost_usd", cost_usd)
        if not 0 <= cost_f <= MAX_COST_PER_QUERY_USD:
            raise InvalidInputError(f"cost_usd must lie in [0, {MAX_COST_PER_QUERY_USD:g}] (USD per query; the sync "
                                    f"server refuses more), got {cost_f!r}")
        latency_f = None
        if latency_ms is not None:
            latency_f = _check_real("latency_ms", latency_ms)
            if latency_f < 0:
                raise InvalidInputError(f"latency_ms must be >= 0 (milliseconds), got {latency_f!r}")
        cell_i = None if cell is None else _check_index("cell", cell)
        bundle_i = None if bundle_version is None else _check_index("bundle_version", bundle_version)
        now = _check_real("clock()", self._clock())
        ts = now if timestamp is None else _check_real("timestamp", timestamp)
        if ts > now + _SECONDS_PER_DAY:
            # A row from the future would never age out of the retention window.
            raise InvalidInputError(f"timestamp {ts!r} is more than a day in the future (now {now:.0f})")
        if query is not None and not isinstance(query, str):
            raise InvalidInputError(f"query must be a str or None, got {type(query).__name__}")
        if query is not None and self._store_text:
            _check_utf8("query", query)  # SQLite stores UTF-8: lone surrogates cannot be written
        blob = None
        dim = None
        if embedding is not None:
            vector = _check_embedding(embedding)
            dim = int(vector.shape[0])
            blob = vector.tobytes()
        if blob is None and cell_i is None:
            raise InvalidInputError(
                "each row needs at least one of embedding or cell; got embedding=None and cell=None"
            )
        if (policy is None) != (propensity is None):
            raise InvalidInputError(f"policy and propensity go together (both or neither), got policy={policy!r} "
                                    f"and propensity={shown(propensity)}")
        if policy is not None:
            if not isinstance(policy, str) or not policy:
                raise InvalidInputError(f"policy must be a non-empty str, got {shown(policy)}")
            _check_utf8("policy", policy)
            propensity = _check_real("propensity", propensity)
            if not 0.0 < propensity <= 1.0:
                raise InvalidInputError(f"propensity must lie in (0, 1] (a probability of the logged choice), "
                                        f"got {propensity!r}")
        text = query if self._store_text else None  # privacy: dropped here, never written

        with self._lock:
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    if dim is not None:
                        self._claim_embedding_dim(conn, dim)
                    reference = self._retention_time(conn, now)  # before the insert: the rows' newest time
                    cursor = conn.execute(
                        "INSERT INTO evaluations (timestamp, model, score, cost_usd, latency_ms, "
                        "cell, embedding, bundle_version, query, policy, propensity) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (ts, model, score_f, cost_f, latency_f, cell_i, blob, bundle_i, text, policy, propensity),
                    )
                    row_id = int(cursor.lastrowid)
                    self._apply_retention(conn, reference)
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise EvalLogError(f"cannot write to evaluation log {str(self._path)!r}: {exc}") from exc
        return row_id

    def record_choice(
        self,
        choice,
        score: float,
        cost_usd: float,
        *,
        latency_ms: float | None = None,
        model: str | None = None,
        query: str | None = None,
    ) -> int:
        """:meth:`record` the outcome of a :class:`sdk.router.Choice`: its embedding, cell, bundle
        version, policy and propensity are taken from the choice; ``model`` overrides ``choice.model``
        when the app sent the query elsewhere (the row then records no policy nor propensity: the
        policy did not choose that model). Same errors as :meth:`record`, and
        :class:`InvalidInputError` for a ``choice`` that is not a ``Choice`` (e.g. its model id)."""
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
        """The rows with ``id > since_id``, in ascending id, as one consistent snapshot.

        Parameters
        ----------
        since_id : int, default 0 (all rows). Pass the last id already synced to read only new rows.

        Returns
        -------
        Evaluations, the column arrays (see :class:`Evaluations` for shapes, dtypes and the values
        that stand for "not recorded").

        Raises
        ------
        InvalidInputError
            ``since_id`` is not an int.
        EvalLogError
            The log is closed, SQLite failed to read, or a stored embedding has the wrong size.
        """
        if isinstance(since_id, bool) or not isinstance(since_id, numbers.Integral):
            raise InvalidInputError(f"since_id must be an int, got {type(since_id).__name__} {since_id!r}")
        since = max(-1, min(int(since_id), _INT64_MAX))
        with self._lock:
            conn = self._connection()
            try:
                conn.execute("BEGIN")
                try:
                    dim = _read_embedding_dim(conn, str(self._path))
                    records = conn.execute(
                        f"SELECT {_COLUMNS} FROM evaluations WHERE id > ? ORDER BY id", (since,)
                    ).fetchall()
                finally:
                    conn.execute("COMMIT")
            except sqlite3.Error as exc:
                raise EvalLogError(f"cannot read evaluation log {str(self._path)!r}: {exc}") from exc
        return _to_evaluations(records, dim or 0, str(self._path))

    def __len__(self) -> int:
        """Number of rows currently in the log (after retention)."""
        with self._lock:
            conn = self._connection()
            try:
                return int(conn.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0])
            except sqlite3.Error as exc:
                raise EvalLogError(f"cannot read evaluation log {str(self._path)!r}: {exc}") from exc

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

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise EvalLogError(f"evaluation log {str(self._path)!r} is closed")
        return self._conn

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
        """The time the age limit is measured from (module docstring, Retention), inside the write
        transaction and before the insert; None without an age limit. A clock more than
        :data:`CLOCK_STEP_S` ahead of the newest row is not trusted until it has held for
        :data:`CLOCK_STEP_S` (the step and its start are kept in the meta table meanwhile)."""
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
        if reference is not None:
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
    if isinstance(models, (str, bytes)) or not isinstance(models, Sequence):
        raise InvalidInputError(
            f"models must be a sequence of model id strings, got {type(models).__name__} {models!r}"
        )
    ids = tuple(models)
    if not ids:
        raise InvalidInputError("models must not be empty")
    bad = [m for m in ids if not isinstance(m, str) or not m]
    if bad:
        raise InvalidInputError(f"models must be non-empty strings, got {bad!r} in {list(ids)!r}")
    for m in ids:
        _check_utf8("models", m)
    duplicates = sorted({m for m in ids if ids.count(m) > 1})
    if duplicates:
        raise InvalidInputError(f"models must not repeat ids, got duplicates {duplicates} in {list(ids)}")
    return ids


def _check_utf8(name: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"{name} is not valid Unicode ({exc.reason} at position {exc.start}): SQLite "
                                "stores UTF-8 text") from exc


def _check_real(name: str, value: object) -> float:
    if not is_real_number(value):
        raise InvalidInputError(f"{name} must be a real number, got {shown(value)}")
    result = finite_float(value)
    if result is None:
        raise InvalidInputError(f"{name} must be finite, got {shown(value)}")
    return result


def _check_index(name: str, value: object) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise InvalidInputError(f"{name} must be an int >= 0, got "
                                f"{type(value).__name__ + ' ' if is_real_number(value) else ''}{shown(value)}")
    result = int(value)
    if not 0 <= result <= _INT64_MAX:
        raise InvalidInputError(f"{name} must be an int in [0, 2**63 - 1], got {shown(result)}")
    return result


def _check_embedding(embedding: object) -> np.ndarray:
    try:
        arr = np.asarray(embedding)
    except (TypeError, ValueError) as exc:
        raise ShapeError(f"embedding must be a 1-D array of reals, got {type(embedding).__name__}") from exc
    if arr.dtype.kind not in "fiu":
        raise ShapeError(f"embedding must hold real numbers, got dtype {arr.dtype}")
    if arr.ndim != 1 or not 1 <= arr.shape[0] <= _MAX_EMBEDDING_DIM:
        raise ShapeError(f"embedding must have shape (d,) with 1 <= d <= {_MAX_EMBEDDING_DIM}, got {arr.shape}")
    with np.errstate(over="ignore", invalid="ignore"):
        vector = arr.astype(_EMBEDDING_DTYPE)
    if not np.isfinite(vector).all():
        raise ShapeError("embedding must be finite (no NaN/inf, and within float32 range)")
    norm = float(np.sqrt(np.dot(vector.astype(np.float64), vector.astype(np.float64))))
    if not abs(norm - 1.0) <= UNIT_NORM_TOLERANCE:
        raise ShapeError(f"embedding must have unit L2 norm (1 +- {UNIT_NORM_TOLERANCE:g}, as the bundle's embedder "
                         f"and Choice.embedding give it; the sync server refuses means of longer vectors), got norm "
                         f"{norm:.6g}: pass the router's embedding, or divide by its norm")
    return vector


_NOT_A_LOG = "{path!r} is an SQLite database but not a fedroute evaluation log (user_version 0 with tables in it)"


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


def _to_evaluations(records: list[tuple], dim: int, path: str) -> Evaluations:
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
