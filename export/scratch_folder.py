"""The scratch folder of an export, beside the bundle it writes, and the removal of those a killed export left.

Design notes: docs/device-and-bundles.md (Module notes).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from export.errors import ExportError
from sdk.bundle_install import lock_path

#: ``.<name>.export-<host>-<pid>-<8 hex>``; the host may hold '-' and '.', the pid and the suffix do not.
_SCRATCH = re.compile(r"\.(?P<name>.+)\.export-(?P<host>.+)-(?P<pid>[0-9]+)-[0-9a-f]{8}")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # another user's process, or not a pid: keep it
        return True
    return True


def stale_scratch_folders(out: Path) -> list[Path]:
    """The scratch folders beside ``out`` left by exports of this host whose process is gone."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    host, found = _host(), []
    for p in out.parent.iterdir():
        m = _SCRATCH.fullmatch(p.name)
        if m and m["name"] == out.name and m["host"] == host and p.is_dir() and not p.is_symlink() \
                and not _alive(int(m["pid"])):
            found.append(p)
    return found


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those of its ancestors that do not exist, deepest first (what ``mkdir(parents=True)``
    creates)."""
    missing = []
    while not os.path.lexists(folder) and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_if_empty(folders: list[Path]) -> None:
    """``rmdir`` each of ``folders`` (deepest first), stopping at the first that is not empty or is gone."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _remove_created(created: list[Path], out: Path) -> None:
    """Remove the folders a failed export created, deepest first, when empty; ``out``'s lock file is unlinked
    (under the lock, taken without waiting) only when its folder is one this export created and holds nothing else."""
    lock = lock_path(out)
    if not created or created[0] != lock.parent or not os.path.lexists(lock):
        _remove_if_empty(created)
        return
    with contextlib.suppress(Timeout, OSError), FileLock(lock, timeout=0):
        if [p.name for p in lock.parent.iterdir()] == [lock.name]:
            lock.unlink()
        _remove_if_empty(created)


@contextlib.contextmanager
def scratch_folder(out: Path) -> Iterator[Path]:
    """A new empty scratch folder beside ``out`` for the duration of the block, removed after it
    (whether it ends or raises); the stale ones of ``out`` (:func:`stale_scratch_folders`) are
    removed first. ``out``'s parent is created with its own parents if missing; when the block raises
    (or the scratch folder cannot be made), the folders so created are removed again if empty, or holding
    only ``out``'s unused lock file (:func:`_remove_created`): a failed export leaves no folder that was not
    there before.

    Raises
    ------
    ExportError
        The folder beside ``out`` cannot be created (a read-only folder, a file on the path).
    """
    out = Path(out)
    for stale in stale_scratch_folders(out):
        shutil.rmtree(stale, ignore_errors=True)
    folder = out.parent / f".{out.name}.export-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
    created = _missing_folders(out.parent)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        folder.mkdir()
    except OSError as exc:
        _remove_if_empty(created)
        raise ExportError(f"cannot create the export's scratch folder beside {out}: {exc.strerror or exc}; "
                          "give an --out in a writable folder") from exc
    try:
        yield folder
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        _remove_created(created, out)  # the bundle was not written: the parents this export made go too
        raise
    shutil.rmtree(folder, ignore_errors=True)
