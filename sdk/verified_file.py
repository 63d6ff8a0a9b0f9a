"""Bundle files opened once, hashed from that descriptor, and handed to a native library by path.

A large graph (the ONNX encoder: 28-90 MB) is not read into Python memory: :class:`VerifiedFile` opens it
(``O_NOFOLLOW``, regular files only), streams its sha256 from that descriptor and keeps it open; the library
is given :attr:`VerifiedFile.library_path`, which names the open file (``/proc/self/fd/<fd>`` on Linux,
``/dev/fd/<fd>`` on macOS and the BSDs; on Windows the path itself, which cannot be replaced while Python
holds it open). A write into the verified inode between the hash and the library's read changes its ctime:
:meth:`VerifiedFile.check_unchanged` compares the identity (device, inode, size, mtime, ctime in ns) recorded
at the hash and fails closed, unless the write lands within the same timestamp tick. Bundle files are never
written in place (:mod:`sdk.bundle_install` publishes a new version as a new directory).
"""

from __future__ import annotations

import hashlib
import os
import stat
import weakref
from pathlib import Path

from sdk.errors import BundleError

#: Read size when hashing (bytes).
CHUNK = 1 << 20


def open_regular(path: Path) -> int:
    """A read-only descriptor on ``path``, a regular file and not a symlink (checked on the descriptor).

    Raises
    ------
    BundleError
        Missing, a symlink, a directory, a FIFO or device, or not readable.
    """
    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:  # ENOENT; ELOOP for a symlink, EISDIR, EACCES, ...
        why = f"cannot be opened as a regular file: {exc.strerror}"
        if isinstance(exc, FileNotFoundError) and not path.is_symlink():
            why = f"missing from bundle {path.parent}"
        elif path.is_symlink():  # O_NOFOLLOW's ELOOP reads "Too many levels of symbolic links" for one link
            why = (f"cannot be opened as a regular file: it is a symbolic link (to {os.readlink(path)!s:.200}); a "
                   "bundle's files must be regular files in its folder (copy a bundle with its files, e.g. `cp -rL`, "
                   "not links to them)")
        raise BundleError(f"{path.name}: {why}") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BundleError(f"{path.name}: is not a regular file")
    return fd


def read_descriptor(fd: int, name: str, limit: int) -> bytes:
    """All bytes of the open file ``fd`` (closed afterwards). Raises BundleError on a read error or over ``limit``."""
    try:
        with os.fdopen(fd, "rb", closefd=True) as f:
            data = f.read(limit + 1)
        problem = f"over the {limit}-byte limit" if len(data) > limit else None
    except OSError as exc:
        data, problem = b"", f"cannot be read ({exc})"
    if problem:
        raise BundleError(f"{name}: {problem}")
    return data


def check_digest(name: str, actual: str, digest: str) -> None:
    """Raise BundleError unless the file's hex sha256 ``actual`` is the manifest's ``digest``."""
    if actual != digest:
        raise BundleError(f"{name}: sha256 {actual[:16]}… does not match the manifest's {digest[:16]}… "
                          "(file corrupt or tampered)")


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def sha256_of_descriptor(fd: int, name: str, limit: int) -> str:
    """Hex sha256 of the open file ``fd`` from offset 0. Raises BundleError on a read error or over ``limit``."""
    h = hashlib.sha256()
    read = 0
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        while (block := os.read(fd, CHUNK)) and read <= limit:
            read += len(block)
            h.update(block)
        problem = f"over the {limit}-byte limit" if read > limit else None
    except OSError as exc:
        problem = f"cannot be read ({exc})"
    if problem:
        raise BundleError(f"{name}: {problem}")
    return h.hexdigest()


class VerifiedFile:
    """A bundle file at ``path`` whose sha256 matched ``digest`` (at most ``limit`` bytes), kept open.

    Attributes: ``name``, ``size`` (bytes), ``library_path`` (what to give a library that opens the file).
    Close it with :meth:`close` or as a context manager (also closed when garbage-collected).

    Raises
    ------
    BundleError
        Not a regular file, over ``limit``, changed while it was hashed, or its sha256 is not ``digest``.
    """

    def __init__(self, path: Path, digest: str, limit: int) -> None:
        self._path = Path(path)
        self.name = self._path.name
        self._fd = open_regular(self._path)
        self._closer = weakref.finalize(self, os.close, self._fd)
        try:
            before = _identity(os.fstat(self._fd))
            actual = sha256_of_descriptor(self._fd, self.name, limit)
            self._identity = _identity(os.fstat(self._fd))
            if self._identity != before:
                raise BundleError(f"{self.name}: changed while it was being verified")
            check_digest(self.name, actual, digest)
            self.size = self._identity[2]
            self.library_path = self._descriptor_path()
        except BaseException:
            self.close()
            raise

    def _descriptor_path(self) -> str:
        for folder in ("/proc/self/fd", "/dev/fd"):
            candidate = f"{folder}/{self._fd}"
            try:
                if os.path.samestat(os.stat(candidate), os.fstat(self._fd)):
                    os.lseek(self._fd, 0, os.SEEK_SET)  # /dev/fd re-opens may share this offset
                    return candidate
            except OSError:
                continue
        return str(self._path)

    def check_unchanged(self) -> None:
        """Raise :class:`BundleError` if the file's identity differs from the verified one (call it once the
        library has read the file)."""
        same = self._closer.alive and _identity(os.fstat(self._fd)) == self._identity
        if same and self.library_path == str(self._path):  # no descriptor path: the path must still name it
            try:
                same = os.path.samestat(os.stat(self._path), os.fstat(self._fd))
            except OSError:
                same = False
        if not same:
            raise BundleError(f"{self.name}: changed after it was verified (or was closed); not loaded")

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        self._closer()

    def __enter__(self) -> VerifiedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VerifiedFile({self.name!r}, {self.size} bytes, {'open' if self._closer.alive else 'closed'})"
