"""Publish a signed bundle atomically (ARCHITECTURE.md §5).

The layout (a symbolic link ``out`` to a versioned hidden sibling directory, replaced in one
atomic step, previous version kept) and its primitives live in :mod:`sdk.bundle_install`, shared
with the device's sync job. One export at a time per ``out``: the whole check-write-publish runs
under the bundle's lock. A folder is replaced only if it is a fedroute bundle (a signed manifest and
no file it does not list), so a mistyped ``--out`` never deletes a user's folder.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from collections.abc import Mapping
from pathlib import Path

from export.errors import ExportError, ParityError
from export.signing import sign_manifest
from sdk import bundle_manifest as fmt
from sdk import kinds as sdk_kinds
from sdk.errors import BundleError
from sdk.bundle_install import (
    locked,
    new_version_dir,
    publish,
    read_version,
    version_dirs,
    write_synced,
)


def next_bundle_version(out: Path) -> int:
    """1 + the highest ``bundle_version`` at ``out`` or in its versioned directories (1 if none)."""
    out = Path(out)
    versions = [v for v in [read_version(out), *(read_version(d) for d in version_dirs(out))] if v is not None]
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


def bundle_families(directory: Path) -> tuple[str, ...]:
    """The artefact families (other than the embedder) the bundle at ``directory`` carries, e.g.
    ``("router",)``, read from its manifest without verifying it; ``()`` when there is none to read."""
    try:
        manifest = json.loads((Path(directory) / fmt.MANIFEST_FILE).read_text())
        found = sdk_kinds.manifest_kinds(manifest) if isinstance(manifest, dict) else {}
    except (OSError, ValueError, BundleError):
        return ()
    return tuple(sorted(f for f in found if f != sdk_kinds.EMBEDDER_FAMILY))


def check_replaceable(out: Path, family: str | None = None) -> None:
    """Raise ExportError unless ``out`` is absent, an empty folder, or a fedroute bundle (of ``family``
    when given: a selector or reward-scorer bundle written over a router bundle left apps and
    ``fedroute serve --bundle-dir`` with a bundle they cannot load, and the other way round)."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not any(out.iterdir()):
        return
    if out.is_dir() and is_bundle(out):
        held = bundle_families(out)
        if family is not None and held and family not in held:
            raise ExportError(f"{out} holds a {'/'.join(held)} bundle; refusing to replace it with a {family} "
                              "bundle (what loads it expects a " + "/".join(held) + " bundle): give another --out")
        return
    raise ExportError(f"{out} exists and is not a fedroute bundle; refusing to replace it")


def check_version(out: Path, bundle_version: int) -> None:
    """Raise ExportError unless ``bundle_version`` is in [1, 2**63 - 1] (:data:`sdk.bundle_manifest.MAX_BUNDLE_VERSION`)
    and above every version published at ``out`` (versions are monotonic: a device never takes an older
    bundle for a newer one)."""
    if bundle_version < 1:
        raise ExportError(f"bundle_version must be >= 1, got {bundle_version}")
    if bundle_version > fmt.MAX_BUNDLE_VERSION:  # the SDK refuses such a manifest: the staged bundle failed to load
        raise ExportError(f"bundle_version must be at most 2**63 - 1 (what the SDK loads), got {bundle_version}")
    current = next_bundle_version(out) - 1
    if bundle_version <= current:
        raise ExportError(f"bundle_version {bundle_version} is not above the version {current} already at {out}")


def build_manifest(files: Mapping[str, bytes], fields: Mapping, key, created_utc: str | None = None) -> dict:
    """Signed manifest for ``files``: ``fields`` + format_version, created_utc (now, unless given as
    ``YYYY-MM-DDTHH:MM:SSZ``), files {name: sha256}.

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
        "created_utc": created_utc or dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **fields,
        "files": {name: fmt.sha256_hex(data) for name, data in sorted(files.items())},
    }
    return sign_manifest(manifest, key)


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
    families = [f for f in sdk_kinds.manifest_kinds(fields) if f != sdk_kinds.EMBEDDER_FAMILY]
    with locked(out):
        check_replaceable(out, families[0] if len(families) == 1 else None)
        check_version(out, int(fields["bundle_version"]))
        manifest = build_manifest(files, fields, key)
        target = new_version_dir(out, manifest["bundle_version"])
        try:
            for name, data in files.items():
                write_synced(target / name, data)
            write_synced(target / fmt.MANIFEST_FILE, fmt.encode_manifest_file(manifest))
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        publish(out, target)
    return manifest


#: The parity report every exported bundle carries beside its artefact files.
PARITY_FILE = "parity.json"


def write_checked_bundle(out: Path, files: dict[str, bytes], fields: Mapping, key, report: dict,
                         what: str = "parity check") -> dict:
    """Write the bundle at ``out`` with ``report`` as ``parity.json``, only if the staged copy passed.

    Parameters
    ----------
    files : {file name: bytes}, the artefact files (``parity.json`` is added to it).
    report : the kind's parity report: ``passed`` (bool) and ``failures`` (list of str).

    Returns
    -------
    dict, the signed manifest written.

    Raises
    ------
    ParityError
        ``report["passed"]`` is false; nothing is written.
    """
    if not report["passed"]:
        raise ParityError(f"{what} failed: " + "; ".join(report["failures"]), report)
    files[PARITY_FILE] = (json.dumps(report, indent=2, sort_keys=True) + "\n").encode()
    return write_bundle(out, files, fields, key)
