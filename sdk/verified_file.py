"""A bundle file hashed from one open descriptor and handed to a native library by path.

Large graphs (the ONNX encoder: 28-90 MB) are not read into Python memory to be verified and then
copied again by onnxruntime: :class:`VerifiedFile` opens the file once (``O_NOFOLLOW``, regular
files only), streams its sha256 from that descriptor, and keeps the descriptor open. A library is
then given :attr:`VerifiedFile.library_path`, which names the *open file*, not the bundle path:

- Linux: ``/proc/self/fd/<fd>`` (re-opening it opens the same inode, even if the bundle path has
  been renamed, replaced or unlinked meanwhile), likewise ``/dev/fd/<fd>`` on macOS and the BSDs
  (there a re-open shares the descriptor's offset, so it is rewound to 0 first);
- elsewhere (Windows) the bundle path itself: a file Python holds open there cannot be renamed,
  replaced or deleted (no ``FILE_SHARE_DELETE``), and :meth:`VerifiedFile.check_unchanged` also
  compares the path's device and file index with the descriptor's.

What is left is a write *into* the verified inode between the hash and the library's read. The
file's identity (device, inode, size, mtime and ctime in ns) is recorded when it is opened and
compared after hashing and again by :meth:`VerifiedFile.check_unchanged`, called once the library
has loaded it; any write or ``utime`` sets ctime to the current time, so a change is seen unless
it lands within the same filesystem timestamp tick as the hash (a few ms on Linux before 6.13).
Renaming another file over the path or unlinking it also changes the verified inode's ctime, so
that too is refused (the library read the verified inode, but the load fails closed).
Bundle files are never written in place (a new version is a new directory, published by renaming
a link: :mod:`sdk.bundle_install`), so that residue needs write access to the installed version's
own files, which also lets an attacker replace them before any check.
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
    """A read-only descriptor on ``path``, which must be a regular file and not a symlink.

    The checks run on the opened descriptor (``fstat``), so a path swapped after the check is
    never read; ``O_NONBLOCK`` keeps a FIFO from blocking the open.

    Raises
    ------
    BundleError
        Missing, a symlink, a directory, a FIFO or device, or not readable.
    """
    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as exc:
        raise BundleError(f"{path.name}: missing from bundle {path.parent}") from exc
    except OSError as exc:  # ELOOP for a symlink, EISDIR, EACCES, ...
        if path.is_symlink():  # O_NOFOLLOW's ELOOP reads "Too many levels of symbolic links" for one link
            raise BundleError(f"{path.name}: cannot be opened as a regular file: it is a symbolic link (to "
                              f"{os.readlink(path)!s:.200}); a bundle's files must be regular files in its folder "
                              "(copy a bundle with its files, e.g. `cp -rL`, not links to them)") from exc
        raise BundleError(f"{path.name}: cannot be opened as a regular file ({exc.strerror})") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BundleError(f"{path.name}: is not a regular file")
    return fd


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def sha256_of_descriptor(fd: int, name: str, limit: int) -> str:
    """Hex sha256 of the open file ``fd`` from offset 0, streamed in :data:`CHUNK` blocks.

    Raises
    ------
    BundleError
        More than ``limit`` bytes, or a read error.
    """
    h = hashlib.sha256()
    read = 0
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        while block := os.read(fd, CHUNK):
            read += len(block)
            if read > limit:
                raise BundleError(f"{name}: over the {limit}-byte limit")
            h.update(block)
    except OSError as exc:
        raise BundleError(f"{name}: cannot be read ({exc})") from exc
    return h.hexdigest()


class VerifiedFile:
    """A bundle file whose sha256 matched ``digest``, kept open for a library to load by path.

    Parameters
    ----------
    path : Path of the file inside the (resolved) bundle directory.
    digest : the manifest's lower-case hex sha256 of the file.
    limit : largest accepted size in bytes.

    Attributes
    ----------
    name : the file name.
    size : size in bytes.
    library_path : str to give a library that opens the file itself (see the module docstring).

    Raises
    ------
    BundleError
        The file cannot be opened as a regular file, is over ``limit``, changed while it was
        hashed, or its sha256 is not ``digest``.

    Use as a context manager, or call :meth:`close`; the descriptor is also closed when the object
    is garbage-collected.
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
            if actual != digest:
                raise BundleError(f"{self.name}: sha256 {actual[:16]}… does not match the manifest's {digest[:16]}… "
                                  "(file corrupt or tampered)")
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
        """Raise :class:`BundleError` if the file's identity differs from the verified one (call it
        once the library has read the file; see the module docstring for what this covers)."""
        if self._closer.alive:
            now = _identity(os.fstat(self._fd))
            same_path = True
            if self.library_path == str(self._path):  # no descriptor path: the path must still name it
                try:
                    same_path = os.path.samestat(os.stat(self._path), os.fstat(self._fd))
                except OSError:
                    same_path = False
            if now == self._identity and same_path:
                return
        raise BundleError(f"{self.name}: changed after it was verified (or was closed); not loaded")

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        self._closer()

    def __enter__(self) -> VerifiedFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VerifiedFile({self.name!r}, {self.size} bytes, {'open' if self._closer.alive else 'closed'})"
