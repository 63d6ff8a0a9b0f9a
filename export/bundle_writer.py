"""Publish a signed bundle atomically (ARCHITECTURE.md §5).

Layout: ``out`` is a symbolic link to a hidden, versioned sibling directory
``.<name>.v<version>-<random>`` that holds the files and ``manifest.json``. A new version is written
and fsynced into a fresh directory, then published by replacing the link with ``os.replace``, one
atomic step: a reader that resolves ``out`` sees the old bundle or the new one, never a mix and
never nothing (``sdk`` resolves the link once per load). The previous version's directory is kept
for readers still loading it; older ones are removed. A crash before the link is replaced leaves
the old bundle published and an unused directory that the next export removes.

One export at a time per ``out``: the whole check-write-publish runs under an exclusive lock on
``.<name>.lock``. A folder is replaced only if it is a fedroute bundle (a signed manifest and no
file it does not list), so a mistyped ``--out`` never deletes a user's folder.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Iterator, Mapping

from export.errors import ExportError
from export.signing import sign_manifest
from sdk import bundle_manifest as fmt

_VERSION_DIR = re.compile(r"\.(?P<name>.+)\.v(?P<version>\d+)-[0-9a-f]{12}")


def _read_version(directory: Path) -> int | None:
    try:
        manifest = json.loads((directory / fmt.MANIFEST_FILE).read_text())
        return int(manifest["bundle_version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _version_dirs(out: Path) -> list[Path]:
    """This bundle's versioned directories beside ``out``, published or not."""
    if not out.parent.is_dir():
        return []
    found = []
    for p in out.parent.iterdir():
        m = _VERSION_DIR.fullmatch(p.name)
        if m and m["name"] == out.name and p.is_dir() and not p.is_symlink():
            found.append(p)
    return found


def next_bundle_version(out: Path) -> int:
    """1 + the highest ``bundle_version`` at ``out`` or in its versioned directories (1 if none)."""
    out = Path(out)
    versions = [v for v in [_read_version(out), *(_read_version(d) for d in _version_dirs(out))] if v is not None]
    return max(versions, default=0) + 1


def is_bundle(directory: Path) -> bool:
    """True if ``directory`` holds a fedroute bundle: a manifest with format_version, files and a
    signature, and no entry other than ``manifest.json`` and the files it lists."""
    try:
        manifest = json.loads((Path(directory) / fmt.MANIFEST_FILE).read_text())
        listed = set(manifest["files"]) | {fmt.MANIFEST_FILE}
        ok = isinstance(manifest["format_version"], int) and isinstance(manifest["signature"], dict)
        return ok and {p.name for p in Path(directory).iterdir()} <= listed
    except (OSError, ValueError, KeyError, TypeError):
        return False


def check_replaceable(out: Path) -> None:
    """Raise ExportError unless ``out`` is absent, an empty folder, or a fedroute bundle."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and (not any(out.iterdir()) or is_bundle(out)):
        return
    raise ExportError(f"{out} exists and is not a fedroute bundle; refusing to replace it")


def check_version(out: Path, bundle_version: int) -> None:
    """Raise ExportError unless ``bundle_version`` is >= 1 and above every version published at
    ``out`` (versions are monotonic: a device never takes an older bundle for a newer one)."""
    if bundle_version < 1:
        raise ExportError(f"bundle_version must be >= 1, got {bundle_version}")
    current = next_bundle_version(out) - 1
    if bundle_version <= current:
        raise ExportError(f"bundle_version {bundle_version} is not above the version {current} already at {out}")


def build_manifest(files: Mapping[str, bytes], fields: Mapping, key) -> dict:
    """Signed manifest for ``files``: ``fields`` + format_version, created_utc, files {name: sha256}.

    Raises
    ------
    ExportError
        A file name that is not a plain file name, or ``fields`` that set reserved keys.
    """
    reserved = {"format_version", "created_utc", "files", "signature"} & set(fields)
    if reserved:
        raise ExportError(f"manifest fields {sorted(reserved)} are set by the writer")
    bad = [n for n in files if not fmt.is_plain_file_name(n) or n == fmt.MANIFEST_FILE]
    if bad:
        raise ExportError(f"bundle file names must be plain file names, got {bad}")
    manifest = {
        "format_version": fmt.FORMAT_VERSION,
        "created_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **fields,
        "files": {name: fmt.sha256_hex(data) for name, data in sorted(files.items())},
    }
    return sign_manifest(manifest, key)


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def write_bundle(out: Path, files: Mapping[str, bytes], fields: Mapping, key) -> dict:
    """Write ``files`` and their signed manifest as a new version of the bundle ``out``.

    Parameters
    ----------
    out : Path of the bundle (a symlink to the published version directory; see module docstring).
    files : file name -> bytes.
    fields : manifest fields other than format_version, created_utc, files, signature;
        ``bundle_version`` must be above every version already published at ``out``.
    key : Ed25519 private key.

    Returns
    -------
    dict, the signed manifest.

    Raises
    ------
    ExportError
        ``out`` is a file, a symlink to something else, or a non-empty folder that is not a
        bundle; a bundle_version not above the current one; a bad file name.
    """
    out = Path(out)
    with _locked(out):
        check_replaceable(out)
        check_version(out, int(fields["bundle_version"]))
        manifest = build_manifest(files, fields, key)
        previous = out.resolve() if out.is_symlink() else None
        for stale in _version_dirs(out):  # left by a crash: never published, or two versions old
            if stale != previous:
                shutil.rmtree(stale, ignore_errors=True)
        target = out.parent / f".{out.name}.v{manifest['bundle_version']}-{secrets.token_hex(6)}"
        link = out.parent / f".{out.name}.link-{secrets.token_hex(6)}"
        target.mkdir()
        try:
            for name, data in files.items():
                _write_synced(target / name, data)
            _write_synced(target / fmt.MANIFEST_FILE,
                          (json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n").encode())
            _fsync_dir(target)
            os.symlink(target.name, link)
            if out.is_dir() and not out.is_symlink():
                # A plain folder (empty, or a bundle from an older exporter): move it aside first.
                legacy = out.parent / f".{out.name}.legacy-{secrets.token_hex(6)}"
                os.rename(out, legacy)
                os.replace(link, out)
                shutil.rmtree(legacy, ignore_errors=True)
            else:
                os.replace(link, out)
            _fsync_dir(out.parent)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            if out.resolve() != target.resolve():
                shutil.rmtree(target, ignore_errors=True)
            raise
    return manifest
