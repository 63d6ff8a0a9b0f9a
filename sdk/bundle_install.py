"""Atomic installation of a bundle version behind a symbolic link (ARCHITECTURE.md §5).

Shared by the exporter (:mod:`export.bundle_writer`, which publishes) and the device's sync job
(:mod:`sdk.sync`, which installs what the server published), so both replace a bundle the same way.

Layout: the bundle path ``out`` is a symbolic link to a hidden, versioned sibling directory
``.<name>.v<version>-<random>``. A new version is written and fsynced into a fresh directory, then
published by replacing the link with ``os.replace``, one atomic step: a reader that resolves ``out``
sees the old bundle or the new one, never a mix and never nothing (``sdk.Router.load`` resolves the
link once). The previous version's directory is kept for readers still loading it; older ones are
removed. A crash before the link is replaced leaves the old bundle in place and an unused directory
that the next install removes. Writers of one ``out`` are serialised by a lock file
``.<name>.lock`` (the ``filelock`` package: POSIX and Windows; not reliable on NFS). On POSIX the file
stays after release, on purpose (filelock's design: waiters must lock the same inode); only a folder that
an export created and failed in has it removed, under the lock (:mod:`export.scratch_folder`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

from sdk.atomic_write import fsync_dir, write_synced
from sdk.bundle_manifest import MANIFEST_FILE

__all__ = ["fsync_dir", "lock_path", "locked", "new_version_dir", "publish", "read_version", "version_dirs",
           "write_synced"]

VERSION_DIR = re.compile(r"\.(?P<name>.+)\.v(?P<version>\d+)-[0-9a-f]{12}")


def read_version(directory: Path) -> int | None:
    """``bundle_version`` of the manifest in ``directory`` (unverified), or None if unreadable."""
    try:
        manifest = json.loads((Path(directory) / MANIFEST_FILE).read_text())
        return int(manifest["bundle_version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def version_dirs(out: Path) -> list[Path]:
    """This bundle's versioned directories beside ``out``, published or not."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    found = []
    for p in out.parent.iterdir():
        m = VERSION_DIR.fullmatch(p.name)
        if m and m["name"] == out.name and p.is_dir() and not p.is_symlink():
            found.append(p)
    return found


def lock_path(out: Path) -> Path:
    """The lock file ``.<name>.lock`` beside ``out`` that :func:`locked` takes."""
    out = Path(out)
    return out.parent / f".{out.name}.lock"


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Exclusive lock on :func:`lock_path` of ``out`` for the duration of the block (``filelock``: ``flock``
    on POSIX, ``msvcrt.locking`` on Windows); ``out``'s folder is created with its parents if missing."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(lock_path(out)):
        yield


def new_version_dir(out: Path, version: int) -> Path:
    """Create and return an empty ``.<name>.v<version>-<random>`` directory beside ``out``
    (call under :func:`locked`). Unpublished directories left by a crash are removed first."""
    out = Path(out)
    previous = out.resolve() if out.is_symlink() else None
    for stale in version_dirs(out):  # left by a crash: never published, or two versions old
        if stale.resolve() != previous:  # compare resolved: ``out`` may be relative or hold ".."
            shutil.rmtree(stale, ignore_errors=True)
    target = out.parent / f".{out.name}.v{int(version)}-{secrets.token_hex(6)}"
    target.mkdir()
    return target


def publish(out: Path, target: Path) -> None:
    """Point ``out`` at the fully written and fsynced directory ``target`` in one atomic step
    (call under :func:`locked`). A plain folder at ``out`` (a bundle copied by hand or written by
    an older exporter) is moved aside and removed. On failure ``target`` is removed unless it
    is published, and the exception propagates."""
    out, target = Path(out), Path(target)
    link = out.parent / f".{out.name}.link-{secrets.token_hex(6)}"
    try:
        fsync_dir(target)
        os.symlink(target.name, link)
        if out.is_dir() and not out.is_symlink():
            legacy = out.parent / f".{out.name}.legacy-{secrets.token_hex(6)}"
            os.rename(out, legacy)
            os.replace(link, out)
            shutil.rmtree(legacy, ignore_errors=True)
        else:
            os.replace(link, out)
        fsync_dir(out.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        if out.resolve() != target.resolve():
            shutil.rmtree(target, ignore_errors=True)
        raise
