"""A throwaway PostgreSQL server for tests: ``initdb`` into a temporary folder (in memory, under
``/dev/shm``, where the machine has it), ``pg_ctl start`` on a Unix socket only (no TCP), stopped and
deleted afterwards.

Needs PostgreSQL's ``initdb`` and ``pg_ctl`` on PATH (Debian: ``apt install postgresql``) and the
``psycopg`` driver (dev extra). PostgreSQL refuses to run as root, so under root the server runs as
the ``postgres`` system user through ``runuser``. :func:`start` returns None, with the reason, when
any of this is missing, and the tests that need it skip with that reason.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Each test gets a fresh database (~11 MB written and fsynced, then deleted): on disk, a module of ~60
# PostgreSQL tests spent ~0.8 s creating each and 80 s deleting the 670 MB at the end (load 15).
MEMORY_DIR = Path("/dev/shm")


@dataclass
class PostgresServer:
    """A running throwaway server; ``url`` is its SQLAlchemy URL (database ``fedroute``)."""

    directory: Path
    url: str
    run_as: list[str]

    def stop(self) -> None:
        subprocess.run([*self.run_as, "pg_ctl", "-D", str(self.directory / "data"), "-m", "immediate", "stop"],
                       capture_output=True, check=False, timeout=60)
        shutil.rmtree(self.directory, ignore_errors=True)


def start() -> tuple[PostgresServer | None, str]:
    """Start a server; returns ``(server, "")`` or ``(None, why not)``."""
    if shutil.which("initdb") is None or shutil.which("pg_ctl") is None:
        return None, "PostgreSQL (initdb, pg_ctl) is not installed"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return None, "the psycopg driver is not installed (pip install 'psycopg[binary]')"
    run_as: list[str] = []
    directory = Path(tempfile.mkdtemp(prefix="fedroute-pg-", dir=MEMORY_DIR if MEMORY_DIR.is_dir() else None))
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            return None, "running as root and there is no 'postgres' user to run PostgreSQL as"
        if shutil.which("runuser") is None:
            return None, "running as root without runuser"
        os.chown(directory, user.pw_uid, user.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    data, socket_dir = directory / "data", directory
    init = subprocess.run([*run_as, "initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"],
                          capture_output=True, text=True, check=False, timeout=120)
    if init.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        return None, f"initdb failed: {init.stderr[-300:]}"
    options = f"-c listen_addresses='' -k {socket_dir} -c fsync=on"
    started = subprocess.run([*run_as, "pg_ctl", "-D", str(data), "-o", options, "-l", str(directory / "log"),
                              "-w", "start"], capture_output=True, text=True, check=False, timeout=120)
    if started.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        return None, f"pg_ctl start failed: {started.stderr[-300:]}"
    server = PostgresServer(directory, "", run_as)
    created = subprocess.run([*run_as, "createdb", "-h", str(socket_dir), "-U", "postgres", "fedroute"],
                             capture_output=True, text=True, check=False, timeout=60)
    if created.returncode != 0:
        server.stop()
        return None, f"createdb failed: {created.stderr[-300:]}"
    server.url = f"postgresql+psycopg://postgres@/fedroute?host={socket_dir}"
    return server, ""


def fresh_database(server: PostgresServer) -> str:
    """URL of a new, empty database on ``server`` (one per test)."""
    import secrets

    import sqlalchemy as sa

    name = f"t_{secrets.token_hex(6)}"
    engine = sa.create_engine(server.url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    engine.dispose()
    return server.url.replace("/fedroute?", f"/{name}?")
