"""Write a signed bundle directory atomically (ARCHITECTURE.md §5).

All files and ``manifest.json`` are written and fsynced in a staging directory next to the target,
then swapped in with renames: a reader sees the old bundle or the new one, never a mix, and a crash
leaves at most a hidden staging directory that the next export removes.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from pathlib import Path
from typing import Mapping

from export.errors import ExportError
from export.signing import sign_manifest
from sdk import bundle_manifest as fmt


def next_bundle_version(out: Path) -> int:
    """1 + the ``bundle_version`` of the bundle already at ``out`` (1 if none or unreadable)."""
    try:
        return int(json.loads((Path(out) / fmt.MANIFEST_FILE).read_text())["bundle_version"]) + 1
    except (OSError, ValueError, KeyError, TypeError):
        return 1


def check_replaceable(out: Path) -> None:
    """Raise ExportError unless ``out`` is absent, an empty folder, or a folder holding a bundle."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / fmt.MANIFEST_FILE).exists())):
        raise ExportError(f"{out} exists and is not a bundle; refusing to replace it")


def check_version(out: Path, bundle_version: int) -> None:
    """Raise ExportError unless ``bundle_version`` is >= 1 and above the version of the bundle at
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


def write_bundle(out: Path, files: Mapping[str, bytes], fields: Mapping, key) -> dict:
    """Write ``files`` and their signed manifest as the bundle directory ``out``; returns the manifest.

    Parameters
    ----------
    out : Path of the bundle directory (replaced atomically if it exists and holds a bundle).
    files : file name -> bytes.
    fields : manifest fields other than format_version, created_utc, files, signature.
    key : Ed25519 private key.

    Raises
    ------
    ExportError
        ``out`` exists and is a file, or a non-empty directory that is not a bundle.
    """
    out = Path(out)
    check_replaceable(out)
    manifest = build_manifest(files, fields, key)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    for stale in out.parent.glob(f".{out.name}.staging-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging.mkdir()
    try:
        for name, data in files.items():
            _write_synced(staging / name, data)
        _write_synced(staging / fmt.MANIFEST_FILE,
                      (json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n").encode())
        _fsync_dir(staging)
        if out.exists():
            os.rename(out, old)
        os.rename(staging, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if old.exists() and not out.exists():
            os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return manifest
