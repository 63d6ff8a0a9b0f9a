"""The one way fedroute writes a file so that readers see the old content or the new, never a mix.

:func:`write_atomic` writes a fresh temporary file beside the target (``O_EXCL | O_NOFOLLOW``, final
permissions from the start), fsyncs it, ``os.replace``s it over the target and fsyncs the folder.
Files a library writes itself go to :func:`temporary_path` and :func:`commit_file`; folders are
swapped in whole with :func:`replace_dir`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory (its renames become durable); a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (PermissionError, IsADirectoryError):  # Windows
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to the new file ``path`` and fsync it (inside a folder published atomically)."""
    with Path(path).open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def temporary_path(path: Path) -> Path:
    """A fresh, unused name beside ``path`` (same folder, so the final rename is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def _removed_on_error(tmp: Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def commit_file(tmp: Path, path: Path) -> None:
    """fsync ``tmp``, rename it over ``path``, fsync the folder; ``tmp`` is removed if a step fails."""
    with _removed_on_error(tmp):
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    fsync_dir(Path(path).parent)


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` (its folder must exist) with ``data`` atomically and durably; ``mode``: the new
    file's permission bits. OSError (folder missing or not writable, disk full) leaves the old file."""
    path = Path(path)
    tmp = temporary_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    with _removed_on_error(tmp), os.fdopen(fd, "wb") as f:
        f.write(data)
    commit_file(tmp, path)


def replace_dir(staged: Path, final: Path) -> None:
    """Replace the folder ``final`` with the folder ``staged`` (same parent): readers see the old folder,
    none (between two renames) or the new one, never a mix. OSError (FileNotFoundError: no ``staged``)
    when a rename fails; ``final`` is restored when it can be."""
    staged, final = Path(staged), Path(final)
    old = None
    if final.exists() or final.is_symlink():
        old = temporary_path(final)
        os.replace(final, old)
    try:
        os.replace(staged, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    fsync_dir(final.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
