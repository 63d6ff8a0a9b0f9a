"""Durable state of the aggregation server: clients, rounds and accepted updates (SQLAlchemy Core).

Design notes: docs/sync-protocol-and-operations.md (Module notes).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import secrets
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from sdk.protocol import KMeansUpdate, Receipt, centroids_hash, decode_kmeans_update_record
from sdk.sqlite_files import set_wal, table_names
from trainer.server.errors import IdempotencyKeyReused
from trainer.server.round_kind import RoundOutcome, RoundSettings

metadata = sa.MetaData()

clients = sa.Table(
    "clients", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("token_sha256", sa.String(64), nullable=False, unique=True),
    sa.Column("created_unix", sa.Float, nullable=False),
    sa.Column("revoked", sa.Boolean, nullable=False, default=False),
)

rounds = sa.Table(
    "rounds", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("opened_unix", sa.Float, nullable=False),
    sa.Column("deadline_unix", sa.Float, nullable=False),
    sa.Column("quorum", sa.Integer, nullable=False),
    sa.Column("min_count", sa.Integer, nullable=False),
    sa.Column("centroids", sa.LargeBinary),
    sa.Column("parameters", sa.LargeBinary),
    sa.Column("base_hash", sa.String(64), nullable=False),
    sa.Column("models", sa.Text, nullable=False),
    sa.Column("embedder", sa.Text, nullable=False),
    sa.Column("settings", sa.Text, nullable=False),
    sa.Column("close_snapshot", sa.Integer),
    sa.Column("close_owner", sa.String(64)),
    sa.Column("close_lease_unix", sa.Float),
    sa.Column("close_failures", sa.Integer, nullable=False, default=0),
    sa.Column("close_failed_unix", sa.Float),
    sa.Column("closed_unix", sa.Float),
    sa.Column("outcome", sa.Text),
    sa.Column("aggregate", sa.LargeBinary),
)

updates = sa.Table(
    "updates", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("client_id", sa.String(64), sa.ForeignKey("clients.id"), nullable=False),
    sa.Column("sent_round", sa.Integer, sa.ForeignKey("rounds.id"), nullable=False),
    sa.Column("counted_round", sa.Integer),
    sa.Column("late", sa.Boolean, nullable=False),
    sa.Column("base_hash", sa.String(64), nullable=False),
    sa.Column("idempotency_key", sa.String(128), nullable=False),
    sa.Column("body_sha256", sa.String(64), nullable=False),
    sa.Column("received_unix", sa.Float, nullable=False),
    sa.Column("log_size", sa.Integer, nullable=False),
    sa.Column("payload", sa.LargeBinary, nullable=False),
    sa.Column("receipt", sa.Text, nullable=False),
    sa.UniqueConstraint("client_id", "idempotency_key", name="one_update_per_key"),
)
sa.Index("updates_by_hash", updates.c.base_hash, updates.c.client_id, updates.c.id)
sa.Index("updates_by_counted_round", updates.c.counted_round, updates.c.client_id)
# At most one round that is not closed, on any database (NULL for closed rounds, 1 otherwise).
sa.Index("one_unclosed_round", sa.func.nullif(sa.case((rounds.c.status == "closed", 0), else_=1), 0), unique=True)


#: Page size of a new SQLite database (bytes; SQLite's default is 4096). A K-means upload is a row of
#: about 40 KB (32 cells x 384 float32 means); with 16 KiB pages it takes 3 WAL frames instead of 10,
#: about 0.06 ms less CPU per stored row in batches of 10 (docs/benchmarks.md). Existing databases
#: keep the page size they were created with.
SQLITE_PAGE_BYTES = 16384
#: Tables SQLite itself creates (AUTOINCREMENT's counters, ANALYZE's statistics): not foreign.
_SQLITE_INTERNAL_TABLES = frozenset({"sqlite_sequence", "sqlite_stat1", "sqlite_stat2", "sqlite_stat3",
                                     "sqlite_stat4"})


def _create_private(path: Path) -> None:
    """Create an empty SQLite file at ``path`` with mode 0600 unless it exists (it holds uploads and the DP noise seed)."""
    if not path.exists():
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))


def _sqlite_table_names(path: Path) -> list[str]:
    """Tables of the SQLite file at ``path`` (none if it does not exist), read without changing it."""
    if not path.is_file():
        return []
    with contextlib.closing(sqlite3.connect(f"file:{urllib.parse.quote(str(path))}?mode=ro", uri=True)) as conn:
        try:
            return sorted(table_names(conn))
        except sqlite3.DatabaseError:  # not SQLite: the engine's first statement says so
            return []


def _check_tables(url: str, names, create: bool) -> None:
    """Refuse (ValueError naming them) a database holding tables other than the server's, or, unless
    ``create``, lacking some of the server's."""
    foreign = sorted(set(names) - set(metadata.tables) - _SQLITE_INTERNAL_TABLES)
    if foreign:
        raise ValueError(f"database {url!r} holds tables that are not the aggregation server's: "
                         f"{foreign[:10]}{' ...' if len(foreign) > 10 else ''} (a device's eval log or another "
                         "program's database?); give --db a database of its own (a new SQLite file is created)")
    missing = sorted(set(metadata.tables) - set(names))
    if missing and not create:
        raise ValueError(f"database {url!r} is not an aggregation server's (it lacks the tables {missing}); "
                         "`fedroute clients add` or `fedroute rounds open` creates one")


#: How long a SQLite connection waits for another's lock (ms): the busy timeout, and the bound on retrying
#: the switch of a new database to WAL (:func:`sdk.sqlite_files.set_wal`).
SQLITE_BUSY_TIMEOUT_MS = 30_000


def create_engine(url: str) -> Engine:
    """Engine for ``url``; SQLite gets WAL, ``synchronous=FULL``, a busy timeout, BEGIN IMMEDIATE
    and, for a new database, :data:`SQLITE_PAGE_BYTES` pages.

    Raises
    ------
    sqlalchemy.exc.ArgumentError
        An unparsable URL.
    """
    engine = sa.create_engine(url, future=True)
    if engine.dialect.name == "sqlite":
        @sa.event.listens_for(engine, "connect")
        def _connect(dbapi_conn, _record) -> None:  # SQLAlchemy docs: "Serializable isolation / Savepoints"
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            # Only takes effect in a new database (before its first table): uploads are rows of tens of
            # KB, and larger pages write them in fewer WAL frames (SQLITE_PAGE_BYTES, docs/benchmarks.md).
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute(f"PRAGMA page_size={SQLITE_PAGE_BYTES}")
            set_wal(cur, SQLITE_BUSY_TIMEOUT_MS / 1000)  # retried: a new file's switch can fail at once
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @sa.event.listens_for(engine, "begin")
        def _begin(conn) -> None:  # writes (Store.transaction) lock up front; reads stay deferred (WAL)
            conn.exec_driver_sql("BEGIN " + conn.get_execution_options().get("sqlite_begin", "DEFERRED"))
    return engine


def hash_token(token: str) -> str:
    """sha256 (hex) of a bearer token. Tokens carry 256 random bits, so a fast hash is enough."""
    return hashlib.sha256(token.encode()).hexdigest()


def array_bytes(**arrays: np.ndarray) -> bytes:
    """``.npz`` bytes of named arrays (no pickle)."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def read_arrays(data: bytes) -> dict[str, np.ndarray]:
    """Arrays of ``.npz`` bytes written by :func:`array_bytes` (pickle refused)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


@dataclass(frozen=True)
class Round:
    """A round as stored; times in unix seconds.

    K-means rounds: ``centroids`` (n_cells, d_emb) float32, ``parameters`` None. MLP rounds:
    ``parameters`` the global parameters (safetensors bytes), ``centroids`` None. ``base_hash`` is
    the sha256 that identifies the base (:func:`sdk.local_update.centroids_hash` of the centroids,
    or of the parameters bytes).
    """

    id: int
    kind: str
    status: str
    opened_unix: float
    deadline_unix: float
    quorum: int
    min_count: int
    centroids: np.ndarray | None
    parameters: bytes | None
    base_hash: str
    models: tuple[str, ...]
    embedder: dict
    settings: RoundSettings
    closed_unix: float | None
    outcome: RoundOutcome | None

    @property
    def centroids_hash(self) -> str:
        """The base hash of a K-means round (the name the K-means wire format uses)."""
        return self.base_hash


_RECEIPT_COLUMNS = (updates.c.id, updates.c.client_id, updates.c.sent_round, updates.c.late, updates.c.log_size)


def _check_insert(check_previous: bool):
    """The check ``SELECT`` of :meth:`Store.insert_update`: a row only when the round is open or the latest, the
    token is the client's active one, the key is new and (``check_previous``) the client's latest update for the
    round's base is ``previous_id`` (0: none). Run in the insert's write transaction, so nothing it checked can
    change before the insert; a separate SELECT, since SQLite's ``INSERT ... SELECT`` copies each row through a
    temporary table."""
    r = rounds.alias("r")
    client_id = sa.bindparam("client_id", type_=sa.String)
    newest = sa.select(sa.func.max(rounds.c.id)).scalar_subquery()
    cond = ((r.c.id == sa.bindparam("round_id", type_=sa.Integer)) & ((r.c.status == "open") | (r.c.id == newest))
            & sa.exists(sa.select(clients.c.id).where((clients.c.id == client_id)
                                                     & (clients.c.token_sha256 == sa.bindparam("token_sha256"))
                                                     & (clients.c.revoked == sa.false())))
            & ~sa.exists(sa.select(updates.c.id).where((updates.c.client_id == client_id)
                                                      & (updates.c.idempotency_key == sa.bindparam("key")))))
    if check_previous:
        latest = (sa.select(sa.func.coalesce(sa.func.max(updates.c.id), 0))
                  .where((updates.c.client_id == client_id) & (updates.c.base_hash == r.c.base_hash))
                  .scalar_subquery())
        cond = cond & (latest == sa.bindparam("previous_id", type_=sa.Integer))
    return sa.select(r.c.id, r.c.status, r.c.base_hash).where(cond)


_CHECK_INSERT = {False: _check_insert(False), True: _check_insert(True)}
#: The insert of :meth:`Store.insert_update` after :data:`_CHECK_INSERT` found its row, ``RETURNING``
#: the receipt's columns.
_INSERT_ROW = updates.insert().values(
    client_id=sa.bindparam("client_id", type_=sa.String), sent_round=sa.bindparam("round_id", type_=sa.Integer),
    counted_round=sa.bindparam("counted_round", type_=sa.Integer), late=sa.bindparam("late", type_=sa.Boolean),
    base_hash=sa.bindparam("base_hash", type_=sa.String), idempotency_key=sa.bindparam("key", type_=sa.String),
    body_sha256=sa.bindparam("body_sha256", type_=sa.String), received_unix=sa.bindparam("now", type_=sa.Float),
    log_size=sa.bindparam("log_size", type_=sa.Integer), payload=sa.bindparam("payload", type_=sa.LargeBinary),
    receipt=sa.literal(""),
).returning(*_RECEIPT_COLUMNS)


class _DriverStatement:
    """A Core statement compiled ONCE for a dialect and run on the DBAPI cursor of a connection.

    The hot insert (one per accepted upload) skips SQLAlchemy's per-execution work: the compiled-
    cache lookup, the execution context, parameter and result processing and the Row objects
    (about 0.1-0.2 ms of CPU per row, docs/benchmarks.md). Only for statements whose parameters
    the driver takes as they are (str, int, float, bytes) and whose results need no processing.
    """

    def __init__(self, statement, dialect) -> None:
        compiled = statement.compile(dialect=dialect)
        self.sql = compiled.string
        if compiled.escaped_bind_names:
            raise ValueError("bound parameter names that the dialect escapes are not supported here")
        # The statement's own literals (status values, '') with their values; the rest come per call.
        self._literals = {name: bind.effective_value for bind, name in compiled.bind_names.items() if not bind.required}
        self._order = tuple(compiled.positiontup) if compiled.positional else None

    def rows(self, conn, params: dict) -> list[tuple]:
        """All rows (tuples) of the statement run with ``params`` (bound parameter name -> value)
        in the transaction of ``conn`` (a SQLAlchemy Connection, or a DBAPI connection)."""
        values = {**self._literals, **params}
        dbapi = conn.connection.dbapi_connection if isinstance(conn, Connection) else conn
        cursor = dbapi.cursor()
        try:
            cursor.execute(self.sql, values if self._order is None else [values[k] for k in self._order])
            return cursor.fetchall()  # to the end: the statement is finished before the commit
        finally:
            cursor.close()


def dbapi_errors(engine: Engine) -> type:
    """The base class of the errors of ``engine``'s DBAPI driver (``sqlite3.Error``, ...)."""
    return engine.dialect.loaded_dbapi.Error


def receipt_of(row) -> dict:
    """The receipt JSON (:class:`sdk.protocol.Receipt`) of a stored update row (``id``,
    ``client_id``, ``sent_round``, ``late``, ``log_size``, in that order: a Row or a tuple): an
    on-time update counts in the round it was sent for, a late one in none yet (the receipt never
    changes after the 201)."""
    update_id, client_id, sent_round, late, log_size = row[:5]
    late = bool(late)
    return Receipt(int(update_id), client_id, int(sent_round), late, None if late else int(sent_round),
                   int(log_size)).to_json()


def _clients_counted(round_id: int):
    """``SELECT`` of the number of active clients with an update counted in ``round_id`` (its quorum)."""
    return (sa.select(sa.func.count(sa.distinct(updates.c.client_id)))
            .join(clients, clients.c.id == updates.c.client_id)
            .where((updates.c.counted_round == round_id) & (clients.c.revoked == sa.false())))


def _round(row) -> Round:
    return Round(
        id=row.id, kind=row.kind, status=row.status, opened_unix=row.opened_unix, deadline_unix=row.deadline_unix,
        quorum=row.quorum, min_count=row.min_count,
        centroids=None if row.centroids is None else np.load(io.BytesIO(row.centroids), allow_pickle=False),
        parameters=row.parameters, base_hash=row.base_hash, models=tuple(json.loads(row.models)), embedder=json.loads(row.embedder),
        settings=RoundSettings.from_json(json.loads(row.settings)), closed_unix=row.closed_unix,
        outcome=None if row.outcome is None else RoundOutcome.from_json(json.loads(row.outcome)),
    )


class Store:
    """Transactions of the server over one SQLAlchemy engine. Thread-safe (one connection per call)."""

    def __init__(self, url: str, *, create: bool = True) -> None:
        """Open the database at ``url``, creating the server's tables if ``create``; raises ValueError for
        an in-memory database, one holding other tables, or (``create=False``: nothing is written) one
        without the server's tables."""
        self.url = url
        parsed = sa.engine.make_url(url)
        if parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:"):
            raise ValueError(f"{url!r} is an in-memory database: nothing would be kept (use sqlite:///fed.db)")
        plain_sqlite = parsed.get_backend_name() == "sqlite" and not parsed.query.get("uri")
        if plain_sqlite:
            # Read with a plain read-only connection first: the engine's connections set WAL mode.
            _check_tables(url, _sqlite_table_names(Path(parsed.database)), create)
            _create_private(Path(parsed.database))
        self.engine = create_engine(url)
        self._writer = self.engine.execution_options(sqlite_begin="IMMEDIATE")
        # SQLite has one writer: this process's writers queue on a lock rather than in SQLite's busy
        # handler (which sleeps in steps of up to 100 ms); other processes still wait on busy_timeout.
        self._write_lock = threading.Lock() if self.engine.dialect.name == "sqlite" else contextlib.nullcontext()
        self._check_insert = {flag: _DriverStatement(statement, self.engine.dialect)
                              for flag, statement in _CHECK_INSERT.items()}
        self._insert_row = _DriverStatement(_INSERT_ROW, self.engine.dialect)
        self._batch_connection = None  # SQLite: the DBAPI connection of insert_updates (under _write_lock)
        if not plain_sqlite:
            _check_tables(url, sa.inspect(self.engine).get_table_names(), create)
        self._create_tables()
        inspector = sa.inspect(self.engine)
        for table in (clients, rounds, updates):
            missing = {c.name for c in table.columns} - {c["name"] for c in inspector.get_columns(table.name)}
            if missing:  # no migrations yet: refuse rather than fail on the first query
                raise ValueError(f"database {url!r} was created by another fedroute version (table {table.name} "
                                 f"lacks {sorted(missing)}); use a new database")

    def _create_tables(self) -> None:
        """Create the tables a new database lacks, one creator at a time (SQLite write lock or a PostgreSQL advisory lock)."""
        if set(metadata.tables) <= set(sa.inspect(self.engine).get_table_names()):
            return  # the usual case: no write lock taken
        with self._write_lock, self._writer.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7346261)")  # any fixed key: fedroute's schema
            metadata.create_all(conn)

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A write transaction (``BEGIN IMMEDIATE`` on SQLite, one at a time per process), committed on exit."""
        with self._write_lock, self._writer.begin() as conn:
            yield conn

    def close(self) -> None:
        with self._write_lock:
            if self._batch_connection is not None:
                self._batch_connection.close()
                self._batch_connection = None
        self.engine.dispose()

    # -- clients ---------------------------------------------------------------------------------

    def add_client(self, client_id: str) -> str:
        """Create a client and return its new bearer token (shown once; only its hash is stored).

        Raises
        ------
        ValueError
            The id exists or is not 1-64 characters of ``[A-Za-z0-9_.-]``.
        """
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", client_id or ""):
            raise ValueError(f"client id must be 1-64 characters of [A-Za-z0-9_.-], got {client_id!r}")
        token = "fr_" + secrets.token_urlsafe(32)
        with self.transaction() as conn:
            if conn.execute(sa.select(clients.c.id).where(clients.c.id == client_id)).first():
                raise ValueError(f"client {client_id!r} exists (give it a new token with `clients rotate`)")
            conn.execute(clients.insert().values(id=client_id, token_sha256=hash_token(token),
                                                 created_unix=time.time(), revoked=False))
        return token

    def rotate_token(self, client_id: str) -> str | None:
        """A new bearer token for an existing client (the old one stops working; a revoked client is
        re-activated); None if no such client."""
        token = "fr_" + secrets.token_urlsafe(32)
        with self.transaction() as conn:
            done = conn.execute(clients.update().where(clients.c.id == client_id)
                                .values(token_sha256=hash_token(token), revoked=False))
        return token if done.rowcount == 1 else None

    def revoke_client(self, client_id: str) -> bool:
        """Revoke a client's token; False if no such client."""
        with self.transaction() as conn:
            return conn.execute(clients.update().where(clients.c.id == client_id).values(revoked=True)).rowcount > 0

    def list_clients(self) -> list[dict]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(clients.c.id, clients.c.created_unix, clients.c.revoked)
                                .order_by(clients.c.id)).all()
        return [{"id": r.id, "created_unix": r.created_unix, "revoked": bool(r.revoked)} for r in rows]

    def authenticate(self, token: str) -> str | None:
        """The id of the active client whose token this is, else None."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(clients.c.id).where(
                (clients.c.token_sha256 == hash_token(token)) & (clients.c.revoked == sa.false()))).first()
        return None if row is None else row.id

    # -- rounds ----------------------------------------------------------------------------------

    def open_round(self, *, kind: str, models, embedder: dict, deadline_unix: float, quorum: int, min_count: int,
                   settings: RoundSettings, centroids: np.ndarray | None = None,
                   parameters: bytes | None = None) -> Round:
        """Open a new round over ``centroids`` (K-means) or ``parameters`` (MLP, safetensors bytes).

        Raises
        ------
        ValueError
            A round is still open or closing, or the base does not match the kind.
        """
        if (centroids is None) == (parameters is None):
            raise ValueError(f"a {kind!r} round needs either centroids or parameters as its base (one of them)")
        blob = base_hash = None
        if centroids is not None:
            c = np.ascontiguousarray(centroids, dtype=np.float32)
            buf = io.BytesIO()
            np.save(buf, c, allow_pickle=False)
            blob, base_hash = buf.getvalue(), centroids_hash(c)
        else:
            base_hash = hashlib.sha256(parameters).hexdigest()
        try:
            with self.transaction() as conn:
                busy = conn.execute(sa.select(rounds.c.id, rounds.c.status, rounds.c.close_owner)
                                    .where(rounds.c.status != "closed")).first()
                if busy and busy.status == "closing":
                    raise ValueError(f"round {busy.id} is still closing (by {busy.close_owner}); a new round opens "
                                     "once it is closed (`fedroute rounds status`)")
                if busy:
                    raise ValueError(f"round {busy.id} is still open; close it first")
                rid = conn.execute(rounds.insert().values(
                    kind=kind, status="open", opened_unix=time.time(), deadline_unix=float(deadline_unix),
                    quorum=int(quorum), min_count=int(min_count), centroids=blob, parameters=parameters,
                    base_hash=base_hash, models=json.dumps(list(models)), embedder=json.dumps(embedder),
                    settings=json.dumps(settings.to_json(), sort_keys=True), close_failures=0,
                )).inserted_primary_key[0]
        except sa.exc.IntegrityError as exc:  # a concurrent open won (one_unclosed_round)
            raise ValueError("another round is open; close it first") from exc
        return self.get_round(int(rid))


    def get_round(self, round_id: int) -> Round | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(rounds).where(rounds.c.id == round_id)).first()
        return None if row is None else _round(row)

    def current_round(self) -> Round | None:
        """The open round, else None."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(rounds).where(rounds.c.status == "open")).first()
        return None if row is None else _round(row)

    def latest_round(self) -> Round | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(rounds).order_by(rounds.c.id.desc()).limit(1)).first()
        return None if row is None else _round(row)

    def rounds_to_close(self, now: float) -> list[int]:
        """Open rounds past their deadline or with ``quorum`` clients in, and rounds left closing
        by a crash."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(rounds.c.id, rounds.c.status, rounds.c.deadline_unix, rounds.c.quorum)
                                .where(rounds.c.status != "closed")).all()
            due = []
            for r in rows:
                if r.status == "closing" or r.deadline_unix <= now:
                    due.append(r.id)
                    continue
                if conn.execute(_clients_counted(r.id)).scalar_one() >= r.quorum:
                    due.append(r.id)
        return due

    def claim_close(self, round_id: int, owner: str, lease_s: float = 600.0, force: bool = False) -> int | None:
        """Move an open round to ``closing`` (uploads for it are then late) for ``owner`` and return the
        snapshot: the highest update id it aggregates.

        A round already closing is handed over (with its recorded snapshot, so the result does not
        depend on who finishes) only to the same owner, after its lease of ``lease_s`` seconds has
        run out, or with ``force`` (a server restarting after a crash takes over its own closes).
        Returns None for a closed or unknown round, or one another owner is closing.
        """
        now = time.time()
        with self.transaction() as conn:
            if conn.dialect.name == "postgresql":  # in-flight uploads (ids below max) commit first
                conn.exec_driver_sql("LOCK TABLE updates IN SHARE MODE")
            # The round's row lock orders this against add_update (which locks it too): an upload
            # either commits before the snapshot (and is in it) or sees the round closing (late).
            row = conn.execute(sa.select(rounds.c.status, rounds.c.close_snapshot, rounds.c.close_owner,
                                         rounds.c.close_lease_unix)
                               .where(rounds.c.id == round_id).with_for_update()).first()
            if row is None or row.status == "closed":
                return None
            lease = {"close_owner": owner, "close_lease_unix": now + lease_s}
            if row.status == "closing":
                if row.close_owner != owner and not force and (row.close_lease_unix or 0) > now:
                    return None
                conn.execute(rounds.update().where(rounds.c.id == round_id).values(**lease))
                return int(row.close_snapshot)
            snapshot = conn.execute(sa.select(sa.func.coalesce(sa.func.max(updates.c.id), 0))).scalar_one()
            conn.execute(rounds.update().where(rounds.c.id == round_id)
                         .values(status="closing", close_snapshot=int(snapshot), **lease))
            return int(snapshot)

    def release_close(self, round_id: int, owner: str) -> None:
        """End ``owner``'s lease on the closing of ``round_id`` now (its close failed): the round stays
        ``closing`` with its snapshot, and the next closer (a rerun of ``fedroute rounds close``, the
        server) takes it over at once instead of after the lease."""
        with self.transaction() as conn:
            conn.execute(rounds.update().where((rounds.c.id == round_id) & (rounds.c.status == "closing")
                                               & (rounds.c.close_owner == owner)).values(close_lease_unix=0.0))

    def close_holder(self, round_id: int) -> tuple[str, str | None, float] | None:
        """(status, closer, unix time its lease runs out) of ``round_id``, None if there is no such
        round; the closer and the lease are those of the last claim (:meth:`claim_close`)."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(rounds.c.status, rounds.c.close_owner, rounds.c.close_lease_unix)
                               .where(rounds.c.id == round_id)).first()
        return None if row is None else (row.status, row.close_owner, float(row.close_lease_unix or 0.0))

    def closing_rounds(self) -> list[tuple[int, str | None]]:
        """(id, owner) of rounds left ``closing`` (by a crash, or by a closer still at work)."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(rounds.c.id, rounds.c.close_owner).where(rounds.c.status == "closing")).all()
        return [(r.id, r.close_owner) for r in rows]

    def close_failures(self, round_id: int) -> tuple[int, float]:
        """(failed close attempts, unix time of the last one) of ``round_id``."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(rounds.c.close_failures, rounds.c.close_failed_unix)
                               .where(rounds.c.id == round_id)).first()
        return (0, 0.0) if row is None else (int(row.close_failures or 0), float(row.close_failed_unix or 0.0))

    def record_close_failure(self, round_id: int, when: float | None = None) -> int:
        """Count a failed close attempt of ``round_id`` (at ``when``, default now); returns the failures so far."""
        with self.transaction() as conn:
            conn.execute(rounds.update().where(rounds.c.id == round_id).values(
                close_failures=rounds.c.close_failures + 1, close_failed_unix=time.time() if when is None else when))
            return int(conn.execute(sa.select(rounds.c.close_failures).where(rounds.c.id == round_id)).scalar_one())

    def finish_close(self, round_id: int, outcome: RoundOutcome, aggregate: bytes | None,
                     counted_late: list[int], stale: list[int], owner: str) -> bool:
        """Record the close (outcome, aggregate, which waiting late updates were counted or are
        stale) if ``owner`` still holds it; returns False (nothing written) if another closer took
        the round over or finished it."""
        with self.transaction() as conn:
            done = conn.execute(rounds.update().where(
                (rounds.c.id == round_id) & (rounds.c.status == "closing") & (rounds.c.close_owner == owner)).values(
                status="closed", closed_unix=time.time(), outcome=json.dumps(outcome.to_json(), sort_keys=True),
                aggregate=aggregate))
            if done.rowcount != 1:
                return False
            if counted_late:
                conn.execute(updates.update().where(updates.c.id.in_(counted_late)).values(counted_round=round_id))
            if stale:
                conn.execute(updates.update().where(updates.c.id.in_(stale)).values(counted_round=-1))
            return True

    def aggregate_of(self, round_id: int) -> dict[str, np.ndarray] | None:
        with self.engine.connect() as conn:
            data = conn.execute(sa.select(rounds.c.aggregate).where(rounds.c.id == round_id)).scalar_one_or_none()
        return None if data is None else read_arrays(data)

    # -- updates ---------------------------------------------------------------------------------

    def find_update(self, client_id: str, key: str) -> tuple[str, dict] | None:
        """(sha256 of the body, receipt JSON) of the update ``client_id`` stored under ``key``, else None."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(*_RECEIPT_COLUMNS, updates.c.body_sha256).where(
                (updates.c.client_id == client_id) & (updates.c.idempotency_key == key))).first()
        return None if row is None else (row.body_sha256, receipt_of(row))

    def previous_update(self, client_id: str, base_hash: str) -> tuple[int, bytes] | None:
        """(id, payload) of ``client_id``'s latest update for the base ``base_hash``, else None."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(updates.c.id, updates.c.payload).where(
                (updates.c.client_id == client_id) & (updates.c.base_hash == base_hash))
                .order_by(updates.c.id.desc()).limit(1)).first()
        return None if row is None else (int(row.id), row.payload)

    def insert_update(self, *, client_id: str, token_sha256: str, round_id: int, key: str, body_sha256: str,
                      payload: bytes, log_size: int, previous_id: int | None) -> dict | None:
        """Store an update checked against cached state with a check ``SELECT`` and an ``INSERT``
        that re-check that state in the same transaction, and return its receipt once committed (durable), or
        None (nothing stored) when the state moved: the token is no longer the client's active
        token (revoked or rotated, possibly by the CLI in another process), the round is neither
        open nor the latest one, ``previous_id`` (the id the client's previous update for the
        round's base was checked against; None: not checked) is no longer its latest, or the key
        is stored already. The caller then takes the checked path (:meth:`add_update`).

        The update counts in the round if the round is open at the insert, else it waits for the
        next round (late), as in :meth:`add_update`.
        """
        try:
            return self.insert_updates([{"client_id": client_id, "token_sha256": token_sha256, "round_id": round_id,
                                         "key": key, "body_sha256": body_sha256, "payload": payload,
                                         "log_size": log_size, "previous_id": previous_id}])[0]
        except sa.exc.IntegrityError:
            return None  # another process stored the key meanwhile (PostgreSQL): the checked path answers it

    def insert_updates(self, rows: list[dict]) -> list[dict | None]:
        """:meth:`insert_update` for each of ``rows`` (dicts of its keyword arguments), all in ONE
        transaction committed before this returns (group commit: one fsync for the batch); the
        receipt or None of each row, in order.

        On SQLite the batch runs on one DBAPI connection kept for it (``BEGIN IMMEDIATE``, the
        statements, ``COMMIT``, under the process's write lock) rather than through a SQLAlchemy
        transaction, whose begin and commit cost about 0.2-0.4 ms of CPU each time
        (docs/benchmarks.md); the connection comes from the engine's pool, with its settings (WAL,
        ``synchronous=FULL``, foreign keys, busy timeout).

        Raises
        ------
        sqlalchemy.exc.SQLAlchemyError
            The transaction failed (nothing of the batch is stored).
        """
        if self.engine.dialect.name == "sqlite":
            return self._insert_updates_sqlite(rows)
        with self.transaction() as conn:
            results = []
            for row in rows:
                conn.execute(sa.select(clients.c.id).where(clients.c.id == row["client_id"]).with_for_update())
                conn.execute(sa.select(rounds.c.status).where(rounds.c.id == row["round_id"])
                             .with_for_update(read=True))  # see claim_close
                results.append(self._insert_one(conn.connection.dbapi_connection, row))
            return results

    def _insert_updates_sqlite(self, rows: list[dict]) -> list[dict | None]:
        with self._write_lock:
            if self._batch_connection is None:
                self._batch_connection = self.engine.raw_connection()
            dbapi = self._batch_connection.driver_connection
            try:
                dbapi.execute("BEGIN IMMEDIATE")
                try:
                    results = [self._insert_one(dbapi, row) for row in rows]
                    dbapi.execute("COMMIT")  # WAL, synchronous=FULL: durable when it returns
                except BaseException:
                    if dbapi.in_transaction:
                        dbapi.execute("ROLLBACK")
                    raise
            except Exception as exc:
                # A fresh connection next time; the error as SQLAlchemy's (IntegrityError, ...).
                self._batch_connection.invalidate()
                self._batch_connection = None
                if isinstance(exc, dbapi_errors(self.engine)):
                    raise sa.exc.DBAPIError.instance("insert_updates", None, exc, dbapi_errors(self.engine)) from exc
                raise
            return results

    def _insert_one(self, dbapi, row: dict) -> dict | None:
        """The check and the insert of one row of :meth:`insert_updates` in the open transaction of
        ``dbapi`` (a DBAPI connection): its receipt, or None when the check found no row."""
        previous_id = row["previous_id"]
        checked = self._check_insert[previous_id is not None].rows(dbapi, {
            "client_id": row["client_id"], "round_id": int(row["round_id"]), "key": row["key"],
            "token_sha256": row["token_sha256"], "previous_id": int(previous_id or 0)})
        if not checked:
            return None
        round_id, status, base_hash = checked[0]
        late = status != "open"
        stored = self._insert_row.rows(dbapi, {
            "client_id": row["client_id"], "round_id": round_id, "counted_round": None if late else round_id,
            "late": late, "base_hash": base_hash, "key": row["key"], "body_sha256": row["body_sha256"],
            "now": time.time(), "log_size": int(row["log_size"]), "payload": row["payload"]})
        return receipt_of(stored[0])

    def add_update(self, *, client_id: str, round_: Round, key: str, body_sha256: str, payload: bytes,
                   log_size: int, receipt_for, check_previous=None) -> tuple[dict, bool]:
        """Store an accepted update durably (committed before this returns) and return
        ``(receipt, created)``. A retry with a stored key returns the stored receipt and False.

        ``receipt_for(update_id, late, counted_round)`` builds the receipt. The update counts in the
        round it was sent for if that round is open now, else it waits for the next round (late).
        ``check_previous(previous payload bytes or None)``, if given, runs inside the transaction with
        the client's row locked (so two concurrent uploads of one client are checked one after the
        other) and may raise to refuse the update.

        Raises
        ------
        IdempotencyKeyReused
            The key was used before with a different body.
        """
        while True:
            try:
                with self.transaction() as conn:
                    conn.execute(sa.select(clients.c.id).where(clients.c.id == client_id).with_for_update())
                    old = conn.execute(sa.select(*_RECEIPT_COLUMNS, updates.c.body_sha256).where(
                        (updates.c.client_id == client_id) & (updates.c.idempotency_key == key))).first()
                    if old is not None:
                        if old.body_sha256 != body_sha256:
                            raise IdempotencyKeyReused("Idempotency-Key was already used with a different body")
                        return receipt_of(old), False
                    if check_previous is not None:
                        prev = conn.execute(sa.select(updates.c.payload).where(
                            (updates.c.client_id == client_id) & (updates.c.base_hash == round_.base_hash))
                            .order_by(updates.c.id.desc()).limit(1)).scalar_one_or_none()
                        check_previous(prev)
                    status = conn.execute(sa.select(rounds.c.status).where(rounds.c.id == round_.id)
                                          .with_for_update(read=True)).scalar_one()  # see claim_close
                    late = status != "open"
                    counted = None if late else round_.id
                    uid = conn.execute(updates.insert().values(
                        client_id=client_id, sent_round=round_.id, counted_round=counted, late=late,
                        base_hash=round_.base_hash, idempotency_key=key, body_sha256=body_sha256,
                        received_unix=time.time(), log_size=int(log_size), payload=payload,
                        receipt="{}",
                    )).inserted_primary_key[0]
                    receipt = receipt_for(int(uid), late, counted)
                    conn.execute(updates.update().where(updates.c.id == uid).values(receipt=json.dumps(receipt)))
                    return receipt, True
            except sa.exc.IntegrityError:
                if self.find_update(client_id, key) is None:
                    raise  # not the (client_id, idempotency_key) race
                continue  # a concurrent request with the same key won the insert: answer as a retry

    def clients_counted(self, round_id: int) -> int:
        """Active (not revoked) clients with an update counted in ``round_id``: what its quorum counts."""
        with self.engine.connect() as conn:
            return int(conn.execute(_clients_counted(round_id)).scalar_one())

    def round_updates(self, round_id: int) -> list[int]:
        """Ids of the updates counted in ``round_id`` (sent on time)."""
        with self.engine.connect() as conn:
            return list(conn.execute(sa.select(updates.c.id).where(updates.c.counted_round == round_id)).scalars())

    def waiting_late(self, up_to_id: int, kind: str) -> list[tuple[int, str, int]]:
        """(id, base_hash, sent_round) of late updates of ``kind`` rounds with id <= ``up_to_id`` not
        yet counted."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(updates.c.id, updates.c.base_hash, updates.c.sent_round)
                                .join(rounds, rounds.c.id == updates.c.sent_round).where(
                (updates.c.late == sa.true()) & updates.c.counted_round.is_(None) & (updates.c.id <= up_to_id)
                & rounds.c.kind.in_([kind]))).all()
        return [(r.id, r.base_hash, r.sent_round) for r in rows]

    def latest_updates(self, base_hash: str, up_to_id: int | None = None) -> dict[str, tuple[int, KMeansUpdate]]:
        """Each active client's latest K-means update for the partition ``base_hash`` (paper 002 keeps
        it in use until replaced), excluding stale ones and revoked clients, optionally only ids <=
        ``up_to_id``."""
        cond = (updates.c.base_hash == base_hash) & (
            updates.c.counted_round.is_(None) | (updates.c.counted_round != -1))
        if up_to_id is not None:
            cond = cond & (updates.c.id <= up_to_id)
        cond = cond & updates.c.client_id.in_(sa.select(clients.c.id).where(clients.c.revoked == sa.false()))
        latest = (sa.select(updates.c.client_id, sa.func.max(updates.c.id).label("id"))
                  .where(cond).group_by(updates.c.client_id).subquery())
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(updates.c.client_id, updates.c.id, updates.c.payload)
                                .join(latest, updates.c.id == latest.c.id)).all()
        return {r.client_id: (r.id, decode_kmeans_update_record(r.payload)) for r in rows}

    def update_payloads(self, ids: list[int]) -> list[tuple[int, str, int, bytes]]:
        """(id, client_id, sent_round, payload) of the given updates of active (not revoked) clients, by id."""
        if not ids:
            return []
        active = sa.select(clients.c.id).where(clients.c.revoked == sa.false())
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(updates.c.id, updates.c.client_id, updates.c.sent_round, updates.c.payload)
                                .where(updates.c.id.in_(ids) & updates.c.client_id.in_(active))
                                .order_by(updates.c.id)).all()
        return [(r.id, r.client_id, r.sent_round, r.payload) for r in rows]

    def last_aggregate_of_kind(self, kind: str, published_only: bool = False) -> tuple[int, dict[str, np.ndarray]] | None:
        """(round id, arrays) of the most recent aggregated round of ``kind`` (with
        ``published_only``, whose outcome says it was published: :attr:`RoundOutcome.published`), else None."""
        query = (sa.select(rounds.c.id, rounds.c.outcome).where(rounds.c.aggregate.is_not(None) & rounds.c.kind.in_([kind]))
                 .order_by(rounds.c.id.desc()))
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        for row in rows:
            if not published_only or RoundOutcome.from_json(json.loads(row.outcome)).published:
                return row.id, self.aggregate_of(row.id)
        return None

    def count_updates(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(updates)).scalar_one())

    def update_ids(self) -> set[int]:
        with self.engine.connect() as conn:
            return set(conn.execute(sa.select(updates.c.id)).scalars())
