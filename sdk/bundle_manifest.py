"""The bundle format shared by ``export`` (writer) and ``sdk`` (reader): ARCHITECTURE.md §5.

A bundle is a directory holding ``manifest.json`` and the files it names. The manifest lists the
sha256 of every file and carries an Ed25519 signature over its *canonical* form: the manifest
without its ``signature`` entry, serialised as JSON with sorted keys, no whitespace, ASCII only
and no NaN (:func:`canonical_bytes`; Python's float repr, so a verifier in another language must
re-serialise floats the same way). Manifests with duplicate keys are refused, so every JSON
parser reads the same signed content. Verification order in :func:`read_verified` is: manifest
size and JSON, signature, schema, then each file's size and hash. Small files are read into memory
once and the verified bytes are what the caller uses, so a file swapped after the check is never
loaded; large graphs can instead be hashed from one open descriptor and handed to onnxruntime by
that descriptor's path (:class:`sdk.verified_file.VerifiedFile`). A loader may verify only the
files it uses (``verify_unused=False``): the others were verified at export and are verified at
install (:mod:`sdk.sync` hashes every file it downloads or copies) and by :func:`verify_all`.

Ed25519 comes from ``cryptography`` (never hand-written crypto).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

try:
    # cryptography's PEM public-key loader itself: ``serialization.load_pem_public_key`` is this
    # object (cryptography 46 here; tests/test_cold_path.py checks it), reached without importing the
    # ``serialization`` package, whose SSH module pulls the RSA, EC, DSA, padding and cipher
    # modules and ``random``: about half of the cryptography import time on a device's cold start
    # (docs/benchmarks.md, "Static cold start: where the time goes").
    from cryptography.hazmat.bindings._rust import openssl as _rust_openssl

    _load_pem_public_key = _rust_openssl.keys.load_pem_public_key
except (ImportError, AttributeError):  # a cryptography whose internals differ: the public name
    from cryptography.hazmat.primitives.serialization import load_pem_public_key as _load_pem_public_key

from sdk import kinds
from sdk.background_read import BackgroundRead, PendingFiles, check_digest, read_descriptor
from sdk.builtin_kinds import TOKENIZER_FILE  # noqa: F401  (re-exported: the bundle format names it)
from sdk.embedder import MAX_QUERY_CHARS
from sdk.errors import BundleError
from sdk.real_numbers import finite_float
from sdk.verified_file import VerifiedFile, open_regular, sha256_of_descriptor

#: Version 1 names each artefact's kind with a ``"<family>_kind"`` key (:mod:`sdk.kinds`); every
#: bundle written before artefact families existed (``router_kind`` only) is already of this form.
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
#: Embedder precision -> file name. ``int8``: onnxruntime dynamic int8 with the FFN output
#: projections of the first two thirds of the layers kept in fp32; ``int8-all``: every weight
#: MatMul in int8 (faster; gated on routing decisions and AUC, not cosine). See
#: :mod:`export.embedder_onnx`.
EMBEDDER_FILES = {"fp32": "embedder.onnx", "int8": "embedder.int8.onnx", "int8-all": "embedder.int8-all.onnx"}
#: Largest manifest and largest single file accepted (bytes); a bigger one is a corrupt bundle.
MAX_MANIFEST_BYTES = 1 << 20
MAX_FILE_BYTES = 1 << 30
#: Largest public-key file read (bytes); an Ed25519 PEM is 113.
MAX_KEY_BYTES = 1 << 16
#: Largest bundle version accepted: the SQLite INTEGER range, so that every row an
#: :class:`~sdk.eval_log.EvalLog` records for the bundle can hold it.
MAX_BUNDLE_VERSION = 2**63 - 1
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def is_plain_file_name(name: object) -> bool:
    """True for a bundle file name: letters, digits, ``.``, ``_``, ``-``, not starting with a dot."""
    return isinstance(name, str) and _FILE_NAME.fullmatch(name) is not None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys {sorted({k for k in keys if keys.count(k) > 1})}")
    return dict(pairs)


def canonical_bytes(manifest: Mapping) -> bytes:
    """The bytes that are signed: ``manifest`` minus ``signature``, as canonical JSON (UTF-8).

    Raises
    ------
    BundleError
        The manifest holds NaN/inf or values JSON cannot represent.
    """
    body = {k: v for k, v in manifest.items() if k != "signature"}
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise BundleError(f"manifest is not canonical JSON: {exc}") from exc
    return text.encode("ascii")


def encode_manifest_file(manifest: Mapping) -> bytes:
    """The bytes of ``manifest.json`` as the writer stores it: JSON with sorted keys, two-space
    indent, ASCII, no NaN, and a final newline (readers accept any JSON; the signature covers
    :func:`canonical_bytes`, not these bytes)."""
    return (json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n").encode("ascii")


def sha256_hex(data: bytes) -> str:
    """Lower-case hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def load_public_key(public_key):
    """An Ed25519 public key from a PEM file path, PEM text (str or bytes) or a ``cryptography`` key.

    Raises
    ------
    BundleError
        The file is missing, not a regular file (a FIFO, a device), over :data:`MAX_KEY_BYTES`, empty,
        or not an Ed25519 public key (the message names the file).
    """
    if isinstance(public_key, Ed25519PublicKey):
        return public_key
    name = "public key"  # the messages name the file when the key comes from one
    if isinstance(public_key, str) and public_key.lstrip().startswith("-----BEGIN"):
        data = public_key.encode("ascii", "replace")
    elif isinstance(public_key, (str, Path)):
        data, name = _read_key_file(Path(public_key)), f"public key {public_key}"
        if not data.strip():
            raise BundleError(f"{name} is an empty file; expected the PEM signing.pub written by `fedroute keygen`")
    elif isinstance(public_key, bytes):
        data = public_key
    else:
        raise BundleError(f"public_key must be a path, PEM bytes or Ed25519PublicKey, got {type(public_key).__name__}")
    try:
        key = _load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise BundleError(f"{name} is not a PEM public key: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise BundleError(f"{name} is {type(key).__name__}, expected Ed25519")
    return key


def _read_key_file(path: Path) -> bytes:
    """The bytes of a public-key file: a regular file (symlinks followed) of at most
    :data:`MAX_KEY_BYTES`, so a key path naming a FIFO or ``/dev/zero`` fails instead of blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise BundleError(f"cannot read public key {str(path)!r}: {exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BundleError(f"public key {path} is not a regular file")
        return read_descriptor(os.dup(fd), f"public key {path}", MAX_KEY_BYTES)
    finally:
        os.close(fd)


def public_key_id(key) -> str:
    """sha256 (hex) of the raw 32-byte Ed25519 public key: names the key in the manifest."""
    return sha256_hex(key.public_bytes_raw())


@dataclass(frozen=True)
class VerifiedBundle:
    """A bundle whose signature and hashes verified.

    Attributes
    ----------
    directory : Path of the bundle.
    manifest : dict, the parsed manifest (signature included).
    files : mapping file name -> bytes, only the files asked for (all verified against the manifest;
        with ``read_verified(..., background_bytes=...)`` a :class:`~sdk.background_read.PendingFiles`
        whose large files are verified when first looked up).
    opened : dict file name -> :class:`~sdk.verified_file.VerifiedFile`, the files asked for by path
        (verified, still open); close them with :meth:`close` or by using the bundle as a context manager.
    """

    directory: Path
    manifest: dict
    files: Mapping[str, bytes]
    opened: dict[str, VerifiedFile] = field(default_factory=dict)

    def close(self) -> None:
        """Close the files held open in :attr:`opened` (and wait for background reads not looked up)."""
        for f in self.opened.values():
            f.close()
        if isinstance(self.files, PendingFiles):
            self.files.close()

    def __enter__(self) -> VerifiedBundle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_limited(path: Path, limit: int) -> bytes:
    return read_descriptor(open_regular(path), path.name, limit)


def _check_schema(manifest: dict) -> None:
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise BundleError(f"manifest: {what}")

    need(type(manifest.get("format_version")) is int and manifest["format_version"] == FORMAT_VERSION,
         f"format_version {manifest.get('format_version')!r} is not supported (this SDK reads {FORMAT_VERSION})")
    need(type(manifest.get("bundle_version")) is int and 1 <= manifest["bundle_version"] <= MAX_BUNDLE_VERSION,
         f"bundle_version must be an integer in [1, 2**63 - 1], got {str(manifest.get('bundle_version'))[:40]}")
    kinds.import_named_families(manifest)  # a selector / reward-scorer bundle: its family's module
    for family in kinds.families():
        key = kinds.manifest_key(family)
        need(key not in manifest or isinstance(manifest[key], str), f"{key} must be a string")
    files = manifest.get("files")
    need(isinstance(files, dict) and files, "files must map file name -> sha256")
    for name, digest in files.items():
        need(is_plain_file_name(name) and name != MANIFEST_FILE,
             f"file name {name!r} is not a plain file name")
        need(isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest) is not None,
             f"sha256 of {name} is not 64 lower-case hex digits")
    if kinds.needs_embedder(manifest):  # routers, reward scorers: the query embedder (+ model table)
        _check_embedder_and_models(manifest, need)
    kinds.check_manifest_kinds(manifest)  # registered kinds, the files each needs, their own fields


def _check_embedder_and_models(manifest: dict, need: Callable[[bool, str], None]) -> None:
    # The LLM price table belongs to bundles that route between models; a bundle without a router
    # (e.g. a reward scorer) may omit it, but one it carries is checked the same way.
    needs_models = kinds.manifest_key(kinds.ROUTER_FAMILY) in manifest
    models = manifest.get("models", None if needs_models else [])
    need(isinstance(models, list) and (len(models) >= 1 or not needs_models)
         and all(isinstance(m, dict) for m in models),
         "models must be a non-empty list of objects")
    ids = [m.get("id") for m in models]
    need(all(isinstance(i, str) and i for i in ids), "every model needs a non-empty string id")
    need(all(_is_utf8(i) for i in ids), f"model ids must be valid Unicode (no lone surrogates), got {ids!r:.200}")
    need(len(set(ids)) == len(ids), f"duplicate model ids in {ids}")
    for m in models:
        for price in ("price_per_1k_input_usd", "price_per_1k_output_usd", "mean_cost_usd"):
            value = m.get(price)
            usd = finite_float(value)
            need(value is None or (usd is not None and usd >= 0),
                 f"model {m['id']!r}: {price} must be a number >= 0 (USD) or null, got {value!r}")
    emb = manifest.get("embedder")
    need(isinstance(emb, dict), "embedder must be an object")
    need(isinstance(emb.get("name"), str) and emb["name"], "embedder.name must be a non-empty string")
    need(type(emb.get("dim")) is int and emb["dim"] > 0, "embedder.dim must be a positive integer")
    need(type(emb.get("max_tokens")) is int and 2 < emb["max_tokens"] <= MAX_QUERY_CHARS,
         f"embedder.max_tokens must be an integer in [3, {MAX_QUERY_CHARS}] (a token spans at least one of the "
         f"query's last {MAX_QUERY_CHARS} characters the embedder reads), got {str(emb.get('max_tokens'))[:40]}")
    need(emb.get("truncation_side") in ("left", "right"), "embedder.truncation_side must be 'left' or 'right'")
    need(isinstance(emb.get("files"), dict) and emb["files"], "embedder.files must map precision -> file name")
    for precision, name in emb["files"].items():
        need(is_plain_file_name(name) and name in manifest["files"],
             f"embedder file {name!r:.80} ({precision}) is not a file name listed in files")


def verify_manifest(raw: bytes, public_key) -> dict:
    """Parse ``manifest.json`` bytes, verify their Ed25519 signature, then the schema.

    Parameters
    ----------
    raw : the manifest's bytes (at most MAX_MANIFEST_BYTES).
    public_key : path to ``signing.pub`` (PEM), PEM bytes or an ``Ed25519PublicKey``.

    Returns
    -------
    dict, the verified manifest.

    Raises
    ------
    BundleError
        Oversized or unparsable JSON, duplicate keys, missing or invalid signature, a signature by
        another key, an unsupported format or a schema violation.
    """
    if len(raw) > MAX_MANIFEST_BYTES:
        raise BundleError(f"{MANIFEST_FILE} is over the {MAX_MANIFEST_BYTES}-byte limit")
    key = load_public_key(public_key)
    try:
        manifest = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise BundleError(f"{MANIFEST_FILE} is not valid JSON: {type(exc).__name__}") from exc
    if not isinstance(manifest, dict):
        raise BundleError(f"{MANIFEST_FILE} must hold a JSON object")
    sig = manifest.get("signature")
    if not isinstance(sig, dict) or sig.get("algorithm") != "ed25519" or not isinstance(sig.get("value"), str):
        raise BundleError("manifest has no Ed25519 signature (expected signature.algorithm == 'ed25519')")
    try:
        signature = base64.b64decode(sig["value"], validate=True)
        key.verify(signature, canonical_bytes(manifest))
    except (InvalidSignature, ValueError) as exc:
        raise BundleError(
            f"manifest signature does not verify with public key {public_key_id(key)[:16]}…: "
            "the bundle was modified or signed by another key"
        ) from exc
    _check_schema(manifest)
    return manifest


Names = Iterable[str] | Callable[[dict], Iterable[str]]


def read_verified(directory, public_key, wanted: Names | None = None, *, by_path: Names = (),
                  verify_unused: bool = True, background_bytes: int | None = None) -> VerifiedBundle:
    """Read ``manifest.json`` and files of the bundle at ``directory``, verifying what is used.

    Parameters
    ----------
    directory : path of the bundle.
    public_key : path to ``signing.pub`` (PEM), PEM bytes or an ``Ed25519PublicKey``.
    wanted : names of the files to return as bytes, or a function of the (signature-verified)
        manifest that returns them. ``None`` returns all.
    by_path : names (or a function of the manifest, called after ``wanted``) of files to return
        open instead of as bytes (:class:`~sdk.verified_file.VerifiedFile`: hashed from one
        descriptor, never read into memory); a name in both is returned open only.
    verify_unused : also hash the listed files that are neither wanted nor by path (streamed, not
        kept). ``Router.load`` passes False: an unused precision's 90 MB encoder is not read at
        every load; :func:`verify_all` and the sync install check every file.
    background_bytes : if set, wanted files of at least this many bytes are read and hashed by
        worker threads (:class:`~sdk.background_read.BackgroundRead`, started before the other
        files are read) and this returns without waiting for them: looking such a file up in
        ``files`` waits for it and raises BundleError there if it does not verify, so it is never
        handed out unverified. ``Router.load`` passes 1 MiB: a static table is hashed while the
        tokenizer is built.

    Returns
    -------
    VerifiedBundle (close it, or use it as a context manager, when ``by_path`` is not empty).

    Raises
    ------
    BundleError
        A ``directory`` that is not a path (str or os.PathLike) or not a folder, a trained
        router's folder given for its bundle, a missing/oversized/unparsable manifest, missing or
        invalid signature, a signature by another
        key, unsupported format, a checked file missing or whose sha256 differs, a wanted file
        that the manifest does not list, or a published bundle whose version folder was removed by
        newer installs while it was read (the message says to load it again).
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise BundleError(f"bundle path must be a str or os.PathLike, got {type(directory).__name__}")
    given = Path(directory)
    if not given.is_dir():
        raise BundleError(f"bundle {given} is not a directory")
    if not (given / MANIFEST_FILE).exists() and (given / "router.json").is_file():
        raise BundleError(f"{given} is a trained router folder, not a bundle (no {MANIFEST_FILE}): make a bundle of it "
                          f"with `fedroute export --router {given} --out BUNDLE --signing-key KEY`")
    # Resolve a published bundle's symlink once: every file is read from the same version even if
    # the link is swapped to a newer one meanwhile.
    directory = given.resolve()
    manifest = verify_manifest(_read_limited(directory / MANIFEST_FILE, MAX_MANIFEST_BYTES), public_key)
    if callable(wanted):
        wanted = wanted(manifest)
    if callable(by_path):
        by_path = by_path(manifest)
    open_set = set(by_path)
    wanted_set = (set(manifest["files"]) if wanted is None else set(wanted)) - open_set
    unknown = (wanted_set | open_set) - set(manifest["files"])
    if unknown:
        raise BundleError(f"bundle does not list {sorted(unknown)}")
    files = PendingFiles() if background_bytes is not None else {}
    verified = VerifiedBundle(directory, manifest, files)
    try:
        small = {}  # wanted files read here, each an open descriptor
        for name in (n for n in manifest["files"] if n in wanted_set):
            fd = open_regular(directory / name)
            if background_bytes is not None and os.fstat(fd).st_size >= background_bytes:
                files.add_pending(BackgroundRead(fd, name, manifest["files"][name], MAX_FILE_BYTES))
            else:
                small[name] = fd
        for name, digest in manifest["files"].items():
            if name in open_set:
                verified.opened[name] = VerifiedFile(directory / name, digest, MAX_FILE_BYTES)
            elif name in small:
                data = check_digest(name, read_descriptor(small.pop(name), name, MAX_FILE_BYTES), digest)
                if background_bytes is not None:
                    files.add(name, data)
                else:
                    files[name] = data
            elif name not in wanted_set and verify_unused:
                actual = _stream_sha256(directory / name)
                if actual != digest:
                    raise BundleError(f"{name}: sha256 {actual[:16]}… does not match the manifest's {digest[:16]}… "
                                      "(file corrupt or tampered)")
    except BaseException as exc:
        for fd in small.values():
            os.close(fd)
        verified.close()
        if isinstance(exc, BundleError) and not directory.is_dir():
            # sdk.bundle_install keeps only the previous version: two installs during this read removed it
            raise BundleError(f"bundle {given} was replaced while it was being loaded (its version folder "
                              f"{directory.name} was removed by a newer install): load it again") from exc
        raise
    return verified


def verify_all(directory, public_key) -> dict:
    """Verify the signature and every listed file of the bundle at ``directory`` (streamed, nothing
    kept) and return the manifest: the full check that ``Router.load`` narrows to the files it uses.

    Raises
    ------
    BundleError
        As :func:`read_verified`.
    """
    return read_verified(directory, public_key, wanted=()).manifest


def _stream_sha256(path: Path) -> str:
    fd = open_regular(path)
    try:
        return sha256_of_descriptor(fd, path.name, MAX_FILE_BYTES)
    finally:
        os.close(fd)
