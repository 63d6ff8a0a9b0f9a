"""Ed25519 signing keys for bundles (``cryptography``): generate, load, sign.

``fedroute keygen --out KEYDIR`` writes ``signing.key`` (PKCS#8 PEM, unencrypted, mode 0600: keep it
on the build server) and ``signing.pub`` (SubjectPublicKeyInfo PEM: ship it with the app, pass it
to ``sdk.Router.load``). The signature covers the canonical manifest
(:func:`sdk.bundle_manifest.canonical_bytes`), which holds the sha256 of every file.

Like OpenSSH (``sshkey_perm_ok``), :func:`load_signing_key`, which every command that signs goes
through (``export``, ``mor export``, ``rounds open`` / ``serve`` / ``rounds close`` when they
publish), refuses a key file owned by the current user that group or others may access (any bit
of ``0o077``: mode 0644 from a plain ``cp`` or an editor), naming the file and the ``chmod 600`` to
run; set ``FEDROUTE_ALLOW_OPEN_SIGNING_KEY=1`` (:data:`ALLOW_OPEN_KEY_ENV`) to accept it anyway.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from export.errors import ExportError
from sdk.atomic_write import write_atomic
from sdk.bundle_manifest import canonical_bytes, public_key_id

PRIVATE_FILE = "signing.key"
PUBLIC_FILE = "signing.pub"
#: Environment variable: ``1`` accepts a signing key that group or others may access (module docstring).
ALLOW_OPEN_KEY_ENV = "FEDROUTE_ALLOW_OPEN_SIGNING_KEY"


def generate_keypair(out_dir: str | Path, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a new Ed25519 key pair into ``out_dir``; returns (private path, public path).

    Raises
    ------
    ExportError
        ``out_dir`` is an empty or blank str (``Path("")`` would be the current folder), a file, or it
        already holds ``signing.key`` or ``signing.pub`` and
        ``overwrite`` is False (a lost key cannot sign updates
        that deployed apps accept, so it is never replaced silently), or it cannot be created or
        written (e.g. a read-only folder, a file on its path).
    """
    if isinstance(out_dir, str) and not out_dir.strip():
        raise ExportError(f"the key folder is an empty path ({out_dir!r}); give a folder for signing.key and "
                          "signing.pub, e.g. keys/")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir} is a file; give a folder for signing.key and signing.pub")
    private_path, public_path = out_dir / PRIVATE_FILE, out_dir / PUBLIC_FILE
    if (private_path.exists() or public_path.exists()) and not overwrite:
        raise ExportError(f"{out_dir} already holds a signing key pair; refusing to replace it (pass overwrite=True / --force)")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(private_path, private_pem, mode=0o600)  # O_EXCL + O_NOFOLLOW: never through a planted file
        write_atomic(public_path, public_pem)
    except OSError as exc:  # a read-only or missing parent, a file on the way: one line, not mkdir's traceback
        raise ExportError(f"cannot write the key pair into {out_dir}: {exc.strerror or exc}; give a writable folder") from exc
    return private_path, public_path


def load_signing_key(path: Path):
    """The Ed25519 private key in PEM file ``path``.

    Raises
    ------
    ExportError
        Missing file, not a PEM private key, encrypted, or not Ed25519; or a key file owned by the
        current user that group or others may access (mode & 0o077, e.g. 0644: ``chmod 600 PATH``,
        or ``FEDROUTE_ALLOW_OPEN_SIGNING_KEY=1`` to accept it; not checked where the OS has no
        POSIX owner, i.e. Windows).
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
            st = os.fstat(f.fileno())  # the mode of the file read, not of whatever the path names later
    except OSError as exc:
        raise ExportError(f"cannot read signing key {path}: {exc}") from exc
    try:
        key = load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ExportError(f"{path} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ExportError(f"{path} holds a {type(key).__name__}, expected an Ed25519 key")
    open_bits = st.st_mode & 0o077
    if (open_bits and hasattr(os, "getuid") and st.st_uid == os.getuid()
            and os.environ.get(ALLOW_OPEN_KEY_ENV) != "1"):
        raise ExportError(f"signing key {path} has mode {st.st_mode & 0o777:04o}: group or others may access it, and a "
                          f"private key must be accessible by its owner only; run `chmod 600 {path}` (or set "
                          f"{ALLOW_OPEN_KEY_ENV}=1 to accept it)")
    return key


def sign_manifest(manifest: dict, key) -> dict:
    """``manifest`` with ``signature = {algorithm, key_id, value}`` over its canonical bytes."""
    body = {k: v for k, v in manifest.items() if k != "signature"}
    signature = key.sign(canonical_bytes(body))
    return {**body, "signature": {
        "algorithm": "ed25519",
        "key_id": public_key_id(key.public_key()),
        "value": base64.b64encode(signature).decode("ascii"),
    }}
