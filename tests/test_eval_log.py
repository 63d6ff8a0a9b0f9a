"""The device-local evaluation log (sdk.eval_log): round trip, validation, privacy, retention,
file-format checks, crash safety under SIGKILL and sharing between threads."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from sdk.errors import EvalLogError, InvalidInputError, ShapeError, UnknownModelError
from sdk.eval_log import SCHEMA_VERSION, EvalLog, Evaluations

pytestmark = pytest.mark.sdk  # runs in the base-install venv of .ci/run too


ROOT = Path(__file__).resolve().parents[1]
MODELS = ("gpt-4o", "llama-3-8b", "mixtral-8x7b")
DIM = 8


def _emb(seed: int, dim: int = DIM) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(dim)
    return (v / np.linalg.norm(v)).astype(np.float32)  # unit norm, like Choice.embedding


# --------------------------------------------------------------------------- round trip


def test_round_trip_all_fields_since_id_and_reopen(tmp_path):
    path = tmp_path / "sub" / "dir" / "evals.sqlite"  # parent directories created on demand
    now = time.time()
    written = [
        dict(model="gpt-4o", score=1.0, cost_usd=0.0123, latency_ms=850.5, embedding=_emb(0),
             cell=4, bundle_version=7, query="what is 2+2?", timestamp=now - 30.0),
        dict(model="llama-3-8b", score=0.0, cost_usd=0.0, cell=0, timestamp=now - 20.0),
        dict(model="mixtral-8x7b", score=0.25, cost_usd=1e-5, embedding=_emb(2),
             bundle_version=0, query="translate 'chat'", timestamp=now - 10.0),
    ]
    with EvalLog(path, list(MODELS), store_text=True) as log:
        assert log.path == path
        assert log.models == MODELS
        ids = [log.record(**kw) for kw in written]
        assert ids == sorted(ids) and len(set(ids)) == 3
        assert len(log) == 3
        ev = log.rows()

    assert isinstance(ev, Evaluations) and len(ev) == 3
    np.testing.assert_array_equal(ev.id, np.array(ids, dtype=np.int64))
    assert ev.id.dtype == np.int64
    np.testing.assert_allclose(ev.timestamp, [now - 30.0, now - 20.0, now - 10.0], rtol=0, atol=1e-6)
    assert ev.timestamp.dtype == np.float64
    assert ev.model == ("gpt-4o", "llama-3-8b", "mixtral-8x7b")
    np.testing.assert_array_equal(ev.score, [1.0, 0.0, 0.25])
    np.testing.assert_array_equal(ev.cost_usd, [0.0123, 0.0, 1e-5])
    assert ev.latency_ms[0] == 850.5 and np.isnan(ev.latency_ms[1:]).all()
    np.testing.assert_array_equal(ev.cell, [4, 0, -1])
    np.testing.assert_array_equal(ev.bundle_version, [7, -1, 0])
    assert ev.embedding.shape == (3, DIM) and ev.embedding.dtype == np.float32
    np.testing.assert_array_equal(ev.embedding[0], _emb(0))
    assert np.isnan(ev.embedding[1]).all()
    np.testing.assert_array_equal(ev.embedding[2], _emb(2))
    assert ev.query == ("what is 2+2?", None, "translate 'chat'")
    with pytest.raises(ValueError):  # returned columns are read-only
        ev.score[0] = 0.5

    # Reopen the closed file: same rows; since_id selects strictly newer ids.
    with EvalLog(path, MODELS, store_text=True) as log:
        again = log.rows()
        np.testing.assert_array_equal(again.id, ev.id)
        np.testing.assert_array_equal(again.embedding, ev.embedding)
        assert again.query == ev.query and again.model == ev.model
        tail = log.rows(since_id=ids[0])
        np.testing.assert_array_equal(tail.id, ids[1:])
        assert tail.model == ("llama-3-8b", "mixtral-8x7b")
        assert tail.embedding.shape == (2, DIM)
        assert len(log.rows(since_id=ids[-1])) == 0
        # New rows after reopen continue the id sequence.
        new_id = log.record("gpt-4o", 0.5, 0.01, cell=1)
        assert new_id > ids[-1]
        np.testing.assert_array_equal(log.rows(since_id=ids[-1]).id, [new_id])


def test_no_embedding_anywhere_gives_n_by_0(tmp_path):
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log:
        log.record("gpt-4o", 0.5, 0.01, cell=3)
        log.record("gpt-4o", 0.7, 0.02, cell=1)
        ev = log.rows()
    assert ev.embedding.shape == (2, 0) and ev.embedding.dtype == np.float32
    np.testing.assert_array_equal(ev.cell, [3, 1])
    empty = EvalLog(tmp_path / "empty.sqlite", MODELS)
    try:
        e = empty.rows()
        assert len(e) == 0 and e.id.shape == (0,) and e.embedding.shape == (0, 0)
    finally:
        empty.close()


def test_closed_log_raises_and_close_is_idempotent(tmp_path):
    log = EvalLog(tmp_path / "log.sqlite", MODELS)
    log.close()
    log.close()
    with pytest.raises(EvalLogError, match="closed"):
        log.record("gpt-4o", 0.5, 0.01, cell=0)
    with pytest.raises(EvalLogError, match="closed"):
        log.rows()


# --------------------------------------------------------------------------- validation

BAD_RECORDS = [  # (override, error type, the argument its message names)
    pytest.param(dict(model="gpt-5"), UnknownModelError, "model", id="unknown-model"),
    pytest.param(dict(model=3), UnknownModelError, "model", id="model-not-str"),
    pytest.param(dict(score=1.5), InvalidInputError, "score", id="score>1"),
    pytest.param(dict(score=-0.1), InvalidInputError, "score", id="score<0"),
    pytest.param(dict(score=float("nan")), InvalidInputError, "score", id="score-nan"),
    pytest.param(dict(score=True), InvalidInputError, "score", id="score-bool"),
    pytest.param(dict(score="0.5"), InvalidInputError, "score", id="score-str"),
    pytest.param(dict(cost_usd=-0.01), InvalidInputError, "cost_usd", id="cost<0"),
    pytest.param(dict(cost_usd=float("inf")), InvalidInputError, "cost_usd", id="cost-inf"),
    pytest.param(dict(cost_usd=float("nan")), InvalidInputError, "cost_usd", id="cost-nan"),
    pytest.param(dict(cost_usd=2100.0), InvalidInputError, "cost_usd", id="cost-above-the-sync-bound"),
    pytest.param(dict(latency_ms=-1.0), InvalidInputError, "latency_ms", id="latency<0"),
    pytest.param(dict(latency_ms=float("inf")), InvalidInputError, "latency_ms", id="latency-inf"),
    pytest.param(dict(embedding=np.ones((2, DIM))), ShapeError, "embedding", id="emb-2d"),
    pytest.param(dict(embedding=np.float32(1.0)), ShapeError, "embedding", id="emb-0d"),
    pytest.param(dict(embedding=np.array([1.0, np.nan] * 4)), ShapeError, "embedding", id="emb-nan"),
    pytest.param(dict(embedding=np.array([1.0, np.inf] * 4)), ShapeError, "embedding", id="emb-inf"),
    pytest.param(dict(embedding=np.full(DIM, 1e300)), ShapeError, "embedding", id="emb-overflows-float32"),
    pytest.param(dict(embedding=np.array(["a"] * DIM)), ShapeError, "embedding", id="emb-str"),
    pytest.param(dict(embedding=np.full(DIM, 0.5)), ShapeError, "got norm 1.41421", id="emb-not-unit-norm"),
    pytest.param(dict(embedding=np.zeros(DIM)), ShapeError, "got norm 0:", id="emb-zero"),
    pytest.param(dict(embedding=None, cell=-1), InvalidInputError, "cell", id="cell<0"),
    pytest.param(dict(embedding=None, cell=2.0), InvalidInputError, "cell", id="cell-float"),
    pytest.param(dict(embedding=None, cell=True), InvalidInputError, "cell", id="cell-bool"),
    pytest.param(dict(embedding=None, cell=None), InvalidInputError, "embedding", id="neither-embedding-nor-cell"),
    pytest.param(dict(bundle_version=-2), InvalidInputError, "bundle_version", id="bundle<0"),
    pytest.param(dict(timestamp=float("nan")), InvalidInputError, "timestamp", id="ts-nan"),
    pytest.param(dict(timestamp=-float("inf")), InvalidInputError, "timestamp", id="ts-minus-inf"),
    pytest.param(dict(timestamp=-5.0), InvalidInputError, "timestamp", id="ts<0"),
    pytest.param(dict(query=b"bytes"), InvalidInputError, "query", id="query-bytes"),
]


@pytest.mark.parametrize("override, exc, field", BAD_RECORDS)
def test_record_rejects_bad_input_and_writes_nothing(tmp_path, override, exc, field):
    kwargs = dict(model="gpt-4o", score=0.5, cost_usd=0.01, embedding=_emb(0))
    kwargs.update(override)
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log:
        with pytest.raises(exc) as info:
            log.record(**kwargs)
        assert field in str(info.value) and type(info.value) is exc
        assert len(log) == 0
        # The log stays usable after a rejected call.
        assert log.record("gpt-4o", 0.5, 0.01, cell=0) == 1


BAD_CONSTRUCTORS = [
    pytest.param(dict(models=[]), r"models must not be empty", id="models-empty"),
    pytest.param(dict(models=["a", "b", "a"]), r"duplicates \['a'\]", id="models-duplicate"),
    pytest.param(dict(models="gpt-4o"), r"models must be a sequence", id="models-bare-str"),
    pytest.param(dict(models=["a", 2]), r"non-empty strings.*2", id="models-non-str"),
    pytest.param(dict(max_rows=0), r"max_rows.*0", id="max_rows-0"),
    pytest.param(dict(max_rows=-5), r"max_rows.*-5", id="max_rows-negative"),
    pytest.param(dict(max_rows=2.5), r"max_rows.*2\.5", id="max_rows-float"),
    pytest.param(dict(max_age_days=0), r"max_age_days.*0", id="max_age-0"),
    pytest.param(dict(max_age_days=float("nan")), r"max_age_days.*nan", id="max_age-nan"),
    pytest.param(dict(store_text="yes"), r"store_text.*'yes'", id="store_text-str"),
]


@pytest.mark.parametrize("override, match", BAD_CONSTRUCTORS)
def test_constructor_rejects_bad_arguments(tmp_path, override, match):
    kwargs = dict(models=MODELS)
    kwargs.update(override)
    path = tmp_path / "log.sqlite"
    with pytest.raises(InvalidInputError, match=match):
        EvalLog(path, **kwargs)
    assert not path.exists()  # validated before the file is created


@pytest.mark.parametrize("path", [":memory:", "file::memory:?cache=shared", "file:evals.sqlite"])
def test_an_in_memory_path_is_refused_and_creates_nothing(tmp_path, monkeypatch, path):
    """SQLite opens ':memory:' (and these URIs) as an in-memory database: the log could keep nothing and the
    refusal read "cannot put ... in WAL mode (got 'memory')", after an empty file of that name was created
    in the working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInputError, match="in-memory SQLite"):
        EvalLog(path, MODELS)
    assert list(tmp_path.iterdir()) == []


def test_embedding_dimension_is_fixed_by_first_embedding(tmp_path):
    path = tmp_path / "log.sqlite"
    with EvalLog(path, MODELS) as log:
        log.record("gpt-4o", 0.5, 0.01, cell=2)  # a cell-only row fixes nothing
        log.record("gpt-4o", 0.5, 0.01, embedding=_emb(0, 6))
        with pytest.raises(ShapeError, match=r"\(6,\).*\(5,\)"):
            log.record("gpt-4o", 0.5, 0.01, embedding=_emb(1, 5))
        assert len(log) == 2
    # The dimension survives reopen (kept in the meta table).
    with EvalLog(path, MODELS) as log:
        with pytest.raises(ShapeError, match=r"\(6,\)"):
            log.record("gpt-4o", 0.5, 0.01, embedding=_emb(1, 7))
        log.record("gpt-4o", 0.5, 0.01, embedding=_emb(2, 6).astype(np.float64))
        ev = log.rows()
    assert ev.embedding.shape == (3, 6)
    assert np.isnan(ev.embedding[0]).all()
    np.testing.assert_array_equal(ev.embedding[2], _emb(2, 6))


# --------------------------------------------------------------------------- privacy

SECRET = "my bank PIN is 4921 and my SSN is 078-05-1120"


def _file_bytes(path: Path) -> bytes:
    data = b""
    for suffix in ("", "-wal"):
        candidate = Path(str(path) + suffix)
        if candidate.exists():
            data += candidate.read_bytes()
    return data


def test_query_text_never_written_without_store_text(tmp_path):
    path = tmp_path / "log.sqlite"
    log = EvalLog(path, MODELS)  # store_text defaults to False
    for i in range(5):
        log.record("gpt-4o", 0.5, 0.01, embedding=_emb(i), query=SECRET)
    wal = Path(str(path) + "-wal")
    assert wal.exists() and wal.stat().st_size > 0  # the WAL holds the commits while open
    needle = SECRET.encode()
    assert needle not in _file_bytes(path)
    assert "4921".encode() not in _file_bytes(path)
    assert log.rows().query == (None,) * 5
    log.close()
    assert path.stat().st_size > 0 and needle not in _file_bytes(path)


def test_query_text_stored_and_returned_with_store_text(tmp_path):
    path = tmp_path / "log.sqlite"
    with EvalLog(path, MODELS, store_text=True) as log:
        log.record("gpt-4o", 0.5, 0.01, cell=1, query=SECRET)
        log.record("gpt-4o", 0.5, 0.01, cell=1)
        assert log.rows().query == (SECRET, None)
        assert SECRET.encode() in _file_bytes(path)  # the positive control of the test above


# --------------------------------------------------------------------------- retention


def test_max_rows_keeps_exactly_the_newest_ids(tmp_path):
    path = tmp_path / "log.sqlite"
    with EvalLog(path, MODELS, max_rows=5) as log:
        ids = [log.record("gpt-4o", 0.1 * (i % 10), 0.01, cell=i) for i in range(12)]
        assert len(log) == 5
        ev = log.rows()
        np.testing.assert_array_equal(ev.id, ids[-5:])
        np.testing.assert_array_equal(ev.cell, np.arange(7, 12))
    # Ids are never reused, even after deletions and a reopen.
    with EvalLog(path, MODELS, max_rows=3) as log:
        new_id = log.record("gpt-4o", 0.5, 0.01, cell=99)
        assert new_id == ids[-1] + 1
        np.testing.assert_array_equal(log.rows().id, [ids[-2], ids[-1], new_id])


def test_max_age_days_drops_old_rows(tmp_path):
    day = 86_400.0
    now = time.time()
    with EvalLog(tmp_path / "log.sqlite", MODELS, max_age_days=30) as log:
        ancient = log.record("gpt-4o", 0.5, 0.01, cell=0, timestamp=now - 100 * day)
        recent = log.record("gpt-4o", 0.5, 0.01, cell=1, timestamp=now - 10 * day)
        ev = log.rows()
        assert ancient not in ev.id
        np.testing.assert_array_equal(ev.id, [recent])
        np.testing.assert_array_equal(ev.cell, [1])
    # With max_age_days=None an old row is kept; reopening with a limit removes it at the next insert.
    path = tmp_path / "forever.sqlite"
    with EvalLog(path, MODELS, max_age_days=None) as log:
        old = log.record("gpt-4o", 0.5, 0.01, cell=0, timestamp=now - 400 * day)
        mid = log.record("gpt-4o", 0.5, 0.01, cell=1, timestamp=now - 50 * day)
        np.testing.assert_array_equal(log.rows().id, [old, mid])
    with EvalLog(path, MODELS, max_age_days=60) as log:
        assert len(log) == 2
        new = log.record("gpt-4o", 0.5, 0.01, cell=2)
        np.testing.assert_array_equal(log.rows().id, [mid, new])


class _Clock:
    """A wall clock the test sets (an injected function, as EvalLog's ``clock`` takes)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_clock_jumping_ahead_does_not_wipe_the_log(tmp_path):
    """A clock jumping ten years ahead (a bad RTC or NTP answer) deleted every row at the next record,
    since each was 'older than 90 days'. Now the jump is not trusted until it has held for a day."""
    day, t0 = 86_400.0, 1_800_000_000.0
    clock = _Clock(t0)
    with EvalLog(tmp_path / "log.sqlite", MODELS, max_age_days=90, clock=clock) as log:
        first = [log.record("gpt-4o", 0.5, 0.01, cell=i) for i in range(3)]
        clock.now = t0 + 3650 * day
        during = [log.record("gpt-4o", 0.5, 0.01, cell=3 + i) for i in range(2)]
        assert log.rows().id.tolist() == first + during
        clock.now = t0 + 60.0  # corrected within the day: nothing was lost
        after = log.record("gpt-4o", 0.5, 0.01, cell=9)
        assert log.rows().id.tolist() == first + during + [after]
        assert log.rows().timestamp.tolist()[:3] == [t0] * 3


def test_a_clock_step_that_holds_a_day_is_taken_as_right(tmp_path):
    """A device idle for 100 days: its old rows go once the new time has held for a day."""
    day, t0 = 86_400.0, 1_800_000_000.0
    clock = _Clock(t0)
    with EvalLog(tmp_path / "log.sqlite", MODELS, max_age_days=90, clock=clock) as log:
        old = log.record("gpt-4o", 0.5, 0.01, cell=0)
        clock.now = t0 + 100 * day
        new = log.record("gpt-4o", 0.5, 0.01, cell=1)
        assert log.rows().id.tolist() == [old, new]  # not trusted yet
        clock.now = t0 + 100.5 * day
        mid = log.record("gpt-4o", 0.5, 0.01, cell=2)
        assert log.rows().id.tolist() == [old, new, mid]
        clock.now = t0 + 101 * day + 1
        last = log.record("gpt-4o", 0.5, 0.01, cell=3)
        assert log.rows().id.tolist() == [new, mid, last]  # held a day: the 101-day-old row goes


def test_rows_logged_while_the_clock_was_behind_survive_its_correction(tmp_path):
    """An edge box whose clock fell back 200 days (no RTC battery, before NTP) stamped its rows with
    old times; once the clock was corrected they were deleted as older than 90 days."""
    day, t0 = 86_400.0, 1_800_000_000.0
    clock = _Clock(t0)
    with EvalLog(tmp_path / "log.sqlite", MODELS, max_age_days=90, clock=clock) as log:
        good = log.record("gpt-4o", 0.5, 0.01, cell=0)
        clock.now = t0 - 200 * day
        behind = [log.record("gpt-4o", 0.5, 0.01, cell=1 + i) for i in range(2)]
        clock.now = t0 + 3600.0  # NTP corrects it
        fixed = log.record("gpt-4o", 0.5, 0.01, cell=5)
        assert log.rows().id.tolist() == [good, *behind, fixed]
        assert log.rows().timestamp.tolist() == [t0, t0 - 200 * day, t0 - 200 * day, t0 + 3600.0]
        clock.now = t0 + 91 * day  # a step of over a day: trusted once it held a day
        log.record("gpt-4o", 0.5, 0.01, cell=6)
        clock.now = t0 + 92 * day
        kept = log.record("gpt-4o", 0.5, 0.01, cell=7)
        assert log.rows().id.tolist()[-1] == kept and good not in log.rows().id.tolist()
        assert behind[0] not in log.rows().id.tolist()  # they go with the rows recorded before them


def test_a_row_stamped_older_than_a_row_recorded_before_it_waits_for_that_row(tmp_path):
    """The same with the real clock: a row stamped 200 days back after a fresh row was deleted at once."""
    now = time.time()
    with EvalLog(tmp_path / "log.sqlite", MODELS, max_age_days=90) as log:
        fresh = log.record("gpt-4o", 0.5, 0.01, cell=0)
        behind = log.record("gpt-4o", 0.5, 0.01, cell=1, timestamp=now - 200 * 86_400.0)
        assert log.rows().id.tolist() == [fresh, behind]


def test_the_clock_must_be_callable(tmp_path):
    with pytest.raises(InvalidInputError, match="clock"):
        EvalLog(tmp_path / "log.sqlite", MODELS, clock=1.0)


# --------------------------------------------------------------------------- file format


def test_non_sqlite_file_raises_eval_log_error_naming_path(tmp_path):
    path = tmp_path / "garbage.sqlite"
    original = np.random.default_rng(0).bytes(8192)
    path.write_bytes(original)
    with pytest.raises(EvalLogError, match="garbage.sqlite"):
        EvalLog(path, MODELS)
    assert path.read_bytes() == original  # left untouched


def test_a_folder_given_as_the_log_is_named_as_a_folder(tmp_path):
    (tmp_path / "logs").mkdir()
    with pytest.raises(EvalLogError, match=r"logs'.*Is a directory"):  # not SQLite's "unable to open database file"
        EvalLog(tmp_path / "logs", MODELS)


def test_newer_schema_version_raises_eval_log_error(tmp_path):
    path = tmp_path / "future.sqlite"
    with EvalLog(path, MODELS) as log:
        log.record("gpt-4o", 0.5, 0.01, cell=0)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(EvalLogError, match=rf"future\.sqlite.*version {SCHEMA_VERSION + 1}"):
        EvalLog(path, MODELS)


def test_newer_schema_file_is_refused_before_being_modified(tmp_path):
    path = tmp_path / "newer.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version=99")
    conn.commit()
    conn.close()
    with pytest.raises(EvalLogError, match=r"newer\.sqlite.*version 99"):
        EvalLog(path, MODELS)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not switched to WAL
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 99
    conn.close()


def test_foreign_sqlite_database_raises_eval_log_error(tmp_path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE contacts (name TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(EvalLogError, match=r"other\.db.*not a fedroute evaluation log"):
        EvalLog(path, MODELS)


def test_a_log_of_another_pool_is_refused_and_a_changed_pool_keeps_its_log(tmp_path):
    path = tmp_path / "evals.sqlite"
    with EvalLog(path, MODELS) as log:
        log.record("gpt-4o", 0.5, 0.01, cell=0)
    with pytest.raises(EvalLogError, match=r"\['gpt-4o'\]") as exc:
        EvalLog(path, ["claude-3", "qwen-2"])
    assert "models" in str(exc.value)
    with EvalLog(path, ["gpt-4o", "qwen-2"]) as log:  # a model added, two lost: the old rows stay
        log.record("qwen-2", 1.0, 0.02, cell=1)
        assert log.rows().model == ("gpt-4o", "qwen-2")
    with EvalLog(path, ["qwen-2"]) as log:  # shares qwen-2 with the rows
        assert len(log) == 2
    EvalLog(tmp_path / "empty.sqlite", MODELS).close()
    EvalLog(tmp_path / "empty.sqlite", ["claude-3"]).close()  # no rows: any pool


def test_wal_mode_and_synchronous_setting(tmp_path):
    # synchronous is per connection, so read it on the log's own connection.
    for durable, expected in ((True, 2), (False, 1)):  # FULL = 2, NORMAL = 1
        with EvalLog(tmp_path / f"log-{durable}.sqlite", MODELS, durable=durable) as log:
            conn = log._conn
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert conn.execute("PRAGMA synchronous").fetchone()[0] == expected


# --------------------------------------------------------------------------- crash safety

CHILD = """
import sys
import numpy as np
from sdk.eval_log import EvalLog

log = EvalLog(sys.argv[1], ["m"], store_text=False, durable=True, max_rows=1_000_000)
rng = np.random.default_rng(0)
i = 0
while True:
    v = rng.standard_normal(384)
    row_id = log.record("m", 0.5, 0.001, embedding=v / np.linalg.norm(v), cell=i % 7,
                        latency_ms=1.0, bundle_version=1)
    print(row_id, flush=True)
    i += 1
"""


def test_killed_mid_write_keeps_every_acknowledged_row(tmp_path):
    path = tmp_path / "crash.sqlite"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    watchdog = threading.Timer(30.0, child.kill)  # never hang the suite
    watchdog.start()
    acknowledged: list[int] = []
    try:
        while len(acknowledged) < 50:
            line = child.stdout.readline()
            if not line:
                pytest.fail(f"child exited early: {child.wait()} {child.stderr.read()}")
            acknowledged.append(int(line))
        os.kill(child.pid, signal.SIGKILL)  # while it is busy writing the next rows
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        watchdog.cancel()
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()

    assert acknowledged == list(range(1, 51))
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    with EvalLog(path, ["m"]) as log:
        ev = log.rows()
    assert set(acknowledged) <= set(ev.id.tolist())
    assert len(ev) >= 50 and ev.embedding.shape == (len(ev), 384)
    assert np.isfinite(ev.embedding).all()


# --------------------------------------------------------------------------- threads


def test_threads_share_one_log(tmp_path):
    n_threads, per_thread = 4, 100
    ids: list[list[int]] = [[] for _ in range(n_threads)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads)

    with EvalLog(tmp_path / "log.sqlite", MODELS, durable=False) as log:

        def worker(t: int) -> None:
            try:
                barrier.wait()
                for i in range(per_thread):
                    ids[t].append(
                        log.record(MODELS[t % 3], 0.5, 0.01, embedding=_emb(i), cell=t)
                    )
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=30)
        assert errors == []
        assert len(log) == n_threads * per_thread
        ev = log.rows()

    all_ids = [i for chunk in ids for i in chunk]
    assert len(all_ids) == 400 and len(set(all_ids)) == 400
    np.testing.assert_array_equal(ev.id, sorted(all_ids))
    for t in range(n_threads):
        assert sorted(ev.id[ev.cell == t].tolist()) == sorted(ids[t])
        assert ids[t] == sorted(ids[t])  # each thread sees its own ids increase


def test_import_loads_no_torch_or_trainer():
    code = (
        "import sys, sdk.eval_log\n"
        "print(','.join(m for m in ('torch', 'trainer', 'transformers', 'export') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert out.stdout.strip() == ""


def test_timestamp_from_the_future_is_refused(tmp_path):
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log:
        with pytest.raises(InvalidInputError, match="timestamp"):
            log.record(MODELS[0], 1.0, 0.001, cell=0, timestamp=time.time() + 3 * 86_400)
        log.record(MODELS[0], 1.0, 0.001, cell=0, timestamp=time.time() + 60)  # clock skew is fine
        assert len(log) == 1


def test_record_choice_given_a_model_id_instead_of_the_choice_is_an_invalid_input(tmp_path):
    # A new user's slip (the model id, or None when routing was skipped) was a raw AttributeError.
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log:
        for wrong in (MODELS[0], None):
            with pytest.raises(InvalidInputError, match=f"choice.*got {type(wrong).__name__}"):
                log.record_choice(wrong, score=1.0, cost_usd=0.001)
        assert len(log) == 0


@pytest.mark.parametrize("store", ["eval_log", "pending_outcomes"])
def test_threads_opening_one_new_file_together_all_succeed(tmp_path, store):
    """An app and its sync job (or two proxy processes) opening the same new file at once: the switch of a
    new file to WAL answered "database is locked" at once, without the busy timeout, and the EvalLog read
    user_version and the table names in two snapshots, so a log another connection had just created was
    refused as "not a fedroute evaluation log". Before the fix, of 60 trials of 8 threads, 10 (EvalLog) and
    4 (pending store) failed; here 30 new files each."""
    from sdk.pending_outcomes import PendingOutcomes

    for k in range(30):
        path = tmp_path / f"{k}.sqlite"
        start, errors = threading.Barrier(8), []

        def open_it() -> None:
            start.wait()
            try:
                if store == "eval_log":
                    EvalLog(path, MODELS).close()
                else:
                    PendingOutcomes(path).close()
            except Exception as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=open_it) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [], (k, errors[:2])
