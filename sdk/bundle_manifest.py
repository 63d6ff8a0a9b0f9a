"""The bundle format shared by ``export`` (writer) and ``sdk`` (reader): ARCHITECTURE.md §5.

A bundle is a directory holding ``manifest.json`` and the files it names. The manifest lists the
sha256 of every file and carries an Ed25519 signature (``cryptography``) over its canonical form
(:func:`canonical_bytes`: without ``signature``, sorted keys, no whitespace, ASCII, no NaN); manifests
with duplicate keys are refused, so every JSON parser reads the same signed content. This module
checks the format only; what each artefact kind needs is checked by :func:`sdk.kinds.check_manifest`.
Small files are read into memory and the verified bytes are what the caller uses; large graphs are
hashed from one open descriptor and loaded by that descriptor's path (:mod:`sdk.verified_file`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

try:
    # cryptography's PEM loader itself (``serialization.load_pem_public_key`` is this object; tests/test_cold_path.py
    # checks it), reached without the ``serialization`` package's imports: about half of cryptography's import time
    # on a cold start (docs/benchmarks.md, "Static cold start: where the time goes").
    from cryptography.hazmat.bindings._rust import openssl as _rust_openssl

    _load_pem_public_key = _rust_openssl.keys.load_pem_public_key
except (ImportError, AttributeError):  # a cryptography whose internals differ: the public name
    from cryptography.hazmat.primitives.serialization import load_pem_public_key as _load_pem_public_key

from sdk.embedder import MAX_QUERY_CHARS
from sdk.errors import BundleError
from sdk.real_numbers import finite_float
from sdk.verified_file import VerifiedFile, check_digest, open_regular, read_descriptor, sha256_of_descriptor

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
#: Embedder precision -> file name (``int8``: FFN output projections of the first two thirds of the layers kept
#: in fp32; ``int8-all``: every weight MatMul in int8; :mod:`export.embedder_onnx`).
EMBEDDER_FILES = {"fp32": "embedder.onnx", "int8": "embedder.int8.onnx", "int8-all": "embedder.int8-all.onnx"}
MAX_MANIFEST_BYTES = 1 << 20
MAX_FILE_BYTES = 1 << 30
MAX_KEY_BYTES = 1 << 16
#: The SQLite INTEGER range, so that every :class:`~sdk.eval_log.EvalLog` row can hold the version.
MAX_BUNDLE_VERSION = 2**63 - 1
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_PRICES = ("price_per_1k_input_usd", "price_per_1k_output_usd", "mean_cost_usd")

PublicKey = Ed25519PublicKey | str | bytes | os.PathLike[str]


def is_plain_file_name(name: object) -> bool:
    """True for a bundle file name: letters, digits, ``.``, ``_``, ``-``, not starting with a dot."""
    return isinstance(name, str) and _FILE_NAME.fullmatch(name) is not None


def need(cond: object, what: str) -> None:
    """Raise ``BundleError("manifest: <what>")`` unless ``cond``: one rule of the manifest schema."""
    if not cond:
        raise BundleError(f"manifest: {what}")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys {sorted({k for k in keys if keys.count(k) > 1})}")
    return dict(pairs)


def canonical_bytes(manifest: Mapping[str, Any]) -> bytes:
    """The signed bytes: ``manifest`` minus ``signature`` as canonical JSON. Raises BundleError on NaN/inf."""
    body = {k: v for k, v in manifest.items() if k != "signature"}
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise BundleError(f"manifest is not canonical JSON: {exc}") from exc
    return text.encode("ascii")


def encode_manifest_file(manifest: Mapping[str, Any]) -> bytes:
    """``manifest.json`` as the writer stores it: sorted keys, two-space indent, ASCII, final newline."""
    return (json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n").encode("ascii")


def sha256_hex(data: bytes) -> str:
    """Lower-case hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def load_public_key(public_key: PublicKey) -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM file path, PEM text (str or bytes) or a ``cryptography`` key.

    Raises
    ------
    BundleError
        The file is missing, not a regular file, over :data:`MAX_KEY_BYTES`, empty, or not an Ed25519
        public key (the message names the file).
    """
    if isinstance(public_key, Ed25519PublicKey):
        return public_key
    name = "public key"
    if isinstance(public_key, str) and public_key.lstrip().startswith("-----BEGIN"):
        data = public_key.encode("ascii", "replace")
    elif isinstance(public_key, (str, os.PathLike)):
        data, name = _read_key_file(Path(public_key)), f"public key {public_key}"
    elif isinstance(public_key, bytes):
        data = public_key
    else:
        raise BundleError(f"public_key must be a path, PEM bytes or Ed25519PublicKey, got {type(public_key).__name__}")
    try:
        key = _load_pem_public_key(data) if data.strip() else None
        problem = ("is an empty file; expected the PEM signing.pub written by `fedroute keygen`" if key is None
                   else "" if isinstance(key, Ed25519PublicKey) else f"is {type(key).__name__}, expected Ed25519")
    except (ValueError, TypeError) as exc:
        problem = f"is not a PEM public key: {exc}"
    if problem or not isinstance(key, Ed25519PublicKey):
        raise BundleError(f"{name} {problem}")
    return key


def _read_key_file(path: Path) -> bytes:
    """A regular file (symlinks followed) of at most :data:`MAX_KEY_BYTES`: a FIFO fails instead of blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise BundleError(f"cannot read public key {str(path)!r}: {exc}") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BundleError(f"public key {path} is not a regular file")
    return read_descriptor(fd, f"public key {path}", MAX_KEY_BYTES)


def public_key_id(key: Ed25519PublicKey) -> str:
    """sha256 (hex) of the raw 32-byte Ed25519 public key: names the key in the manifest."""
    return sha256_hex(key.public_bytes_raw())


@dataclass(frozen=True)
class VerifiedBundle:
    """A bundle whose signature and the hashes of the files read verified.

    ``files``: file name -> verified bytes; ``opened``: file name -> :class:`~sdk.verified_file.VerifiedFile`
    (read by path, still open: close them with :meth:`close` or use the bundle as a context manager).
    """

    directory: Path
    manifest: dict[str, Any]
    files: dict[str, bytes] = field(default_factory=dict)
    opened: dict[str, VerifiedFile] = field(default_factory=dict)

    def close(self) -> None:
        """Close the files held open in :attr:`opened`."""
        for f in self.opened.values():
            f.close()

    def __enter__(self) -> VerifiedBundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_schema(manifest: dict[str, Any]) -> None:
    """The format's rules; inputs are the parsed, signature-verified manifest."""
    need(type(manifest.get("format_version")) is int and manifest["format_version"] == FORMAT_VERSION,
         f"format_version {manifest.get('format_version')!r} is not supported (this SDK reads {FORMAT_VERSION})")
    need(type(manifest.get("bundle_version")) is int and 1 <= manifest["bundle_version"] <= MAX_BUNDLE_VERSION,
         f"bundle_version must be an integer in [1, 2**63 - 1], got {str(manifest.get('bundle_version'))[:40]}")
    for key in (k for k in manifest if k.endswith("_kind")):
        need(isinstance(manifest[key], str), f"{key} must be a string")
    files: Any = manifest.get("files")
    need(isinstance(files, dict) and files, "files must map file name -> sha256")
    for name, digest in files.items():
        need(is_plain_file_name(name) and name != MANIFEST_FILE, f"file name {name!r} is not a plain file name")
        need(isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest),
             f"sha256 of {name} is not 64 lower-case hex digits")
    if "models" in manifest:
        _check_models(manifest["models"])
    if "embedder" in manifest:
        _check_embedder(manifest["embedder"], files)


def _check_models(models: Any) -> None:
    need(isinstance(models, list) and all(isinstance(m, dict) for m in models), "models must be a list of objects")
    ids = [m.get("id") for m in models]
    need(all(isinstance(i, str) and i for i in ids), "every model needs a non-empty string id")
    need(all(i.encode("utf-8", "replace") == i.encode("utf-8", "surrogatepass") for i in ids),
         f"model ids must be valid Unicode (no lone surrogates), got {ids!r:.200}")
    need(len(set(ids)) == len(ids), f"duplicate model ids in {ids}")
    for m in models:
        for price in _PRICES:
            usd = finite_float(m.get(price))
            need(m.get(price) is None or (usd is not None and usd >= 0),
                 f"model {m['id']!r}: {price} must be a number >= 0 (USD) or null, got {m.get(price)!r}")


def _check_embedder(emb: Any, files: dict[str, str]) -> None:
    need(isinstance(emb, dict), "embedder must be an object")
    need(isinstance(emb.get("name"), str) and emb["name"], "embedder.name must be a non-empty string")
    need(type(emb.get("dim")) is int and emb["dim"] > 0, "embedder.dim must be a positive integer")
    need(type(emb.get("max_tokens")) is int and 2 < emb["max_tokens"] <= MAX_QUERY_CHARS,
         f"embedder.max_tokens must be an integer in [3, {MAX_QUERY_CHARS}] (a token spans at least one of the "
         f"query's last {MAX_QUERY_CHARS} characters the embedder reads), got {str(emb.get('max_tokens'))[:40]}")
    need(emb.get("truncation_side") in ("left", "right"), "embedder.truncation_side must be 'left' or 'right'")
    need(isinstance(emb.get("files"), dict) and emb["files"], "embedder.files must map precision -> file name")
    for precision, name in emb["files"].items():
        need(is_plain_file_name(name) and name in files,
             f"embedder file {name!r:.80} ({precision}) is not a file name listed in files")


def verify_manifest(raw: bytes, public_key: PublicKey) -> dict[str, Any]:
    """Parse ``manifest.json`` bytes (read by the caller up to :data:`MAX_MANIFEST_BYTES`), verify their Ed25519
    signature, then the format's schema.

    Raises
    ------
    BundleError
        Unparsable JSON, duplicate keys, a missing or invalid signature, a signature by another key, an
        unsupported format or a schema violation.
    """
    key = load_public_key(public_key)
    try:
        manifest: Any = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise BundleError(f"{MANIFEST_FILE} is not valid JSON: {type(exc).__name__}") from exc
    sig = manifest.get("signature") if isinstance(manifest, dict) else None
    if not isinstance(sig, dict) or sig.get("algorithm") != "ed25519" or not isinstance(sig.get("value"), str):
        raise BundleError(f"{MANIFEST_FILE} holds no Ed25519 signature (expected a JSON object with "
                          "signature.algorithm == 'ed25519')")
    try:
        key.verify(base64.b64decode(sig["value"], validate=True), canonical_bytes(manifest))
    except (InvalidSignature, ValueError) as exc:
        raise BundleError(f"manifest signature does not verify with public key {public_key_id(key)[:16]}…: "
                          "the bundle was modified or signed by another key") from exc
    _check_schema(manifest)
    checked: dict[str, Any] = manifest
    return checked


def read_manifest(directory: str | os.PathLike[str], public_key: PublicKey) -> tuple[Path, dict[str, Any]]:
    """The bundle folder (a published link resolved once, so every file comes from one version) and its
    verified manifest (:func:`verify_manifest`).

    Raises
    ------
    BundleError
        ``directory`` is not a path to a folder, is a trained router's folder, or the manifest does not verify.
    """
    given = Path(directory) if isinstance(directory, (str, os.PathLike)) else None
    problem = (f"bundle path must be a str or os.PathLike, got {type(directory).__name__}" if given is None
               else f"bundle {given} is not a directory" if not given.is_dir()
               else f"{given} is a trained router folder, not a bundle (no {MANIFEST_FILE}): make a bundle of it with "
                    f"`fedroute export --router {given} --out BUNDLE --signing-key KEY`"
               if not (given / MANIFEST_FILE).exists() and (given / "router.json").is_file() else None)
    if problem or given is None:
        raise BundleError(problem)
    resolved = given.resolve()
    raw = read_descriptor(open_regular(resolved / MANIFEST_FILE), MANIFEST_FILE, MAX_MANIFEST_BYTES)
    return resolved, verify_manifest(raw, public_key)


def read_files(directory: Path, manifest: dict[str, Any], wanted: Iterable[str] | None = None,
               by_path: Iterable[str] = (), *, verify_unused: bool = True) -> VerifiedBundle:
    """Read and verify files of the bundle at the resolved ``directory`` whose verified manifest is ``manifest``.

    ``wanted``: files returned as bytes (None: all); ``by_path``: files returned open instead
    (:class:`~sdk.verified_file.VerifiedFile`, never read into memory); ``verify_unused``: also hash the other
    listed files (streamed). Loaders pass False: an unused precision's 90 MB encoder is not read at every
    load; :func:`verify_all` and the sync install check every file.

    Raises
    ------
    BundleError
        A file missing, not a regular file or whose sha256 differs, a name the manifest does not list, or the
        version folder removed by newer installs while it was read (the message says to load it again).
    """
    listed: dict[str, str] = manifest["files"]
    opened = set(by_path)
    read = (set(listed) if wanted is None else set(wanted)) - opened
    unknown = (read | opened) - set(listed)
    if unknown:
        raise BundleError(f"bundle does not list {sorted(unknown)}")
    bundle = VerifiedBundle(directory, manifest)
    try:
        for name, digest in listed.items():
            if name in opened:
                bundle.opened[name] = VerifiedFile(directory / name, digest, MAX_FILE_BYTES)
            elif name in read:
                data = read_descriptor(open_regular(directory / name), name, MAX_FILE_BYTES)
                check_digest(name, sha256_hex(data), digest)
                bundle.files[name] = data
            elif verify_unused:
                fd = open_regular(directory / name)
                try:
                    check_digest(name, sha256_of_descriptor(fd, name, MAX_FILE_BYTES), digest)
                finally:
                    os.close(fd)
    except BaseException as exc:
        bundle.close()
        if isinstance(exc, BundleError) and not directory.is_dir():
            # sdk.bundle_install keeps only the previous version: two installs during this read removed it
            raise BundleError(f"bundle version folder {directory} was removed by a newer install while it was "
                              "being loaded: load the bundle again") from exc
        raise
    return bundle


def read_verified(directory: str | os.PathLike[str], public_key: PublicKey, wanted: Iterable[str] | None = None, *,
                  by_path: Iterable[str] = (), verify_unused: bool = True) -> VerifiedBundle:
    """:func:`read_manifest` then :func:`read_files`: the verified bundle at ``directory`` (BundleError as they raise)."""
    resolved, manifest = read_manifest(directory, public_key)
    return read_files(resolved, manifest, wanted, by_path, verify_unused=verify_unused)


def verify_all(directory: str | os.PathLike[str], public_key: PublicKey) -> dict[str, Any]:
    """Verify the signature and every listed file (streamed, nothing kept); return the manifest (BundleError as
    :func:`read_verified`)."""
    return read_verified(directory, public_key, wanted=()).manifest
