"""Bundle files read and hashed in a worker thread while the loader goes on (``Router.load``).

``Router.load`` of a static embedder reads and hashes its 7.5-15 MB table, then builds the
tokenizer; ``hashlib`` and the file read release the GIL, so the table can be read and hashed on
another core while the tokenizer is built. The integrity rule is unchanged: a file is handed out
only once its sha256 matched the (signature-verified) manifest; :class:`PendingFiles` waits for
the worker and checks the digest when the file is first looked up, and raises
:class:`~sdk.errors.BundleError` there if it does not match, so nothing of the file is used
before.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator, Mapping

from sdk.errors import BundleError


def read_descriptor(fd: int, name: str, limit: int) -> bytes:
    """All bytes of the open file ``fd`` (closed afterwards), at most ``limit``.

    Raises
    ------
    BundleError
        A read error, or more than ``limit`` bytes.
    """
    try:
        with os.fdopen(fd, "rb", closefd=True) as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise BundleError(f"{name}: cannot be read ({exc})") from exc
    if len(data) > limit:
        raise BundleError(f"{name}: over the {limit}-byte limit")
    return data


def check_digest(name: str, data: bytes, digest: str) -> bytes:
    """``data`` if its sha256 (hex) is ``digest``.

    Raises
    ------
    BundleError
        The sha256 differs (file corrupt or tampered).
    """
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise BundleError(f"{name}: sha256 {actual[:16]}… does not match the manifest's {digest[:16]}… "
                          "(file corrupt or tampered)")
    return data


class BackgroundRead:
    """One file read (:func:`read_descriptor`) and hashed by a worker thread started at once.

    Parameters
    ----------
    fd : an open read-only descriptor on the file (the worker closes it).
    name : the file name (for errors).
    digest : the manifest's lower-case hex sha256 of the file.
    limit : largest accepted size in bytes.
    """

    def __init__(self, fd: int, name: str, digest: str, limit: int) -> None:
        self.name = name
        self._digest = digest
        self._data: bytes | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fd, limit), name=f"fedroute-verify-{name}",
                                        daemon=True)
        self._thread.start()

    def _run(self, fd: int, limit: int) -> None:
        try:
            self._data = check_digest(self.name, read_descriptor(fd, self.name, limit), self._digest)
        except BaseException as exc:  # re-raised in the caller's thread by result()
            self._error = exc

    def result(self) -> bytes:
        """The file's bytes once read and verified (waits for the worker).

        Raises
        ------
        BundleError
            The file could not be read, is over the limit, or its sha256 differs from the manifest's.
        """
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._data

    def join(self) -> None:
        """Wait for the worker, ignoring its outcome."""
        self._thread.join()


class PendingFiles(Mapping):
    """File name -> verified bytes, some of them still being read and hashed by :class:`BackgroundRead`
    workers: looking one up waits for its worker and raises :class:`~sdk.errors.BundleError` if the
    file did not verify. :meth:`close` waits for the workers not looked up."""

    def __init__(self) -> None:
        self._ready: dict[str, bytes] = {}
        self._pending: dict[str, BackgroundRead] = {}

    def add(self, name: str, data: bytes) -> None:
        """Store a file already verified."""
        self._ready[name] = data

    def add_pending(self, read: BackgroundRead) -> None:
        """Store a file being verified by ``read``."""
        self._pending[read.name] = read

    def __getitem__(self, name: str) -> bytes:
        pending = self._pending.get(name)
        if pending is not None:
            self._ready[name] = pending.result()
            del self._pending[name]
        return self._ready[name]

    def __contains__(self, name: object) -> bool:
        return name in self._ready or name in self._pending

    def __iter__(self) -> Iterator[str]:
        return iter([*self._ready, *self._pending])

    def __len__(self) -> int:
        return len(self._ready) + len(self._pending)

    def check_all(self) -> None:
        """Wait for every file not looked up yet and check it, as a lookup would.

        Raises
        ------
        BundleError
            A file that could not be read or whose sha256 differs from the manifest's.
        """
        for name in list(self._pending):
            self[name]

    def close(self) -> None:
        """Wait for the workers whose files were not looked up (their bytes are dropped)."""
        for read in self._pending.values():
            read.join()
        self._pending.clear()
