"""The one way fedroute writes a file so that readers see the old content or the new, never a mix.

:func:`write_atomic` writes the bytes to a fresh temporary file beside the target (created with
``O_EXCL`` and ``O_NOFOLLOW``, so never through a planted file or symlink, with the requested
permissions from the start), fsyncs it, renames it over the target with ``os.replace`` (atomic on
POSIX and Windows) and fsyncs the folder, so the rename survives a power loss. Files that a library
writes itself (a quantised ONNX graph) are written to :func:`temporary_path` and committed with
:func:`commit_file`; folders that a library writes (a saved model) are written beside their target and
swapped in whole with :func:`replace_dir`. Used by the SDK (sync state, bundles), the trainer (routers, reports, figures)
and the exporter (keys, bundles).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory (makes renames and new entries in it durable); a no-op where directories
    cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (PermissionError, IsADirectoryError):  # Windows
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to the new file ``path`` and fsync it (for files inside a folder that is
    itself published atomically, e.g. a bundle version)."""
    with Path(path).open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def temporary_path(path: Path) -> Path:
    """A fresh, unused name beside ``path`` (same folder, so the final rename is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def commit_file(tmp: Path, path: Path) -> None:
    """fsync the complete file ``tmp``, rename it over ``path`` and fsync the folder; ``tmp`` is
    removed if any step fails."""
    try:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(Path(path).parent)


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically and durably (module docstring).

    Parameters
    ----------
    path : the file to write; its folder must exist.
    data : bytes.
    mode : permission bits of the new file (``0o600`` for a private key), set at creation.

    Raises
    ------
    OSError
        The folder is missing or not writable, or the disk is full (the old file stays).
    """
    path = Path(path)
    tmp = temporary_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    commit_file(tmp, path)


def replace_dir(staged: Path, final: Path) -> None:
    """Replace the folder ``final`` with the complete folder ``staged`` (same parent folder): readers see
    the old folder, no folder (between two renames), or the new one, never old and new files mixed, and
    no file of the old folder survives. The old folder is renamed away, ``staged`` renamed to ``final``,
    the parent fsynced, then the old folder deleted.

    Raises
    ------
    FileNotFoundError
        ``staged`` does not exist (``final`` is left as it was).
    OSError
        A rename failed (``final`` is restored when it can be).
    """
    staged, final = Path(staged), Path(final)
    if not staged.is_dir():
        raise FileNotFoundError(f"no staged folder at {staged}")
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
