"""The ``--out`` check of the commands that work for minutes before they write: one test, before any work.

A command that trains, evaluates or exports for minutes and then finds its ``--out`` unusable (an
existing file, a path under a file, a read-only or otherwise unwritable folder) loses the run. The
commands call :func:`check_out_folder` first; those that refuse their options with typer's
``BadParameter`` call :func:`check_out_option`. A folder option the command writes later (an embedding
cache) carries :func:`cache_folder_option`, checked while the command line is parsed.

Writability is tested by creating (and at once removing) an empty file in the folder that would be
written, or in the nearest folder of ``out`` that exists when it does not exist yet: the permission
bits do not tell (root ignores them, a read-only mount or ``/proc`` refuses root too). Nothing else
is created: a folder ``out`` that does not exist yet is still created by the command itself.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import typer

from sdk.errors import InvalidInputError

#: Prefix of the empty file created and removed by the writability test.
PROBE_PREFIX = ".fedroute-write-test-"


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (a dangling link counts as existing)."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_out_folder(out: Path, option: str = "--out", *, beside: bool = False) -> None:
    """Refuse, before any work, an output folder the command could not write.

    Parameters
    ----------
    out : the folder (need not exist; its missing parents are created by the command).
    option : the option's name for the message, e.g. ``"--out"``.
    beside : the command writes beside ``out`` rather than into it (a bundle: versioned sibling
        folders and a lock file in ``out``'s parent, ``out`` then a link to one of them): the parent
        must be writable, and ``out`` may be anything the writer itself checks.

    Raises
    ------
    InvalidInputError
        ``out`` exists and is not a folder (unless ``beside``); a part of its path is a file; or the
        folder that would be written cannot be written (read-only, no permission, a pseudo
        file system such as ``/proc``). The message names ``option``, ``out`` and the folder.
    """
    out = Path(out)
    absolute = Path(os.path.abspath(out))
    target = absolute.parent if beside else absolute
    if not beside and os.path.lexists(absolute) and not absolute.is_dir():
        raise InvalidInputError(f"{option} {out} exists and is not a folder")
    existing = _nearest_existing(target)
    if not existing.is_dir():
        raise InvalidInputError(f"{option} {out}: {existing} is a file, not a folder, so {out} cannot be written")
    try:
        fd, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=existing)
    except OSError as exc:
        raise InvalidInputError(f"{option} {out}: cannot write in {existing} ({exc.strerror or exc}); give a "
                                "writable folder") from exc
    os.close(fd)
    os.unlink(probe)


def check_out_option(out: Path, option: str = "--out", *, beside: bool = False) -> None:
    """:func:`check_out_folder` for a typer command: the refusal as ``typer.BadParameter`` (exit 2 with
    the usage line), like the command's other option checks."""
    try:
        check_out_folder(out, option, beside=beside)
    except InvalidInputError as exc:
        raise typer.BadParameter(str(exc)) from exc


def cache_folder_option(value: Path | None) -> Path | None:
    """typer ``callback=`` of a cache-folder option (``--cache-dir``, ``--cache``): ``value`` unchanged when
    :func:`check_out_folder` accepts it (or None: not given).

    Raises
    ------
    typer.BadParameter
        The folder cannot be written; click prefixes the option's name and exits with status 2.
    """
    if value is not None:
        try:
            check_out_folder(value, "cache folder")
        except InvalidInputError as exc:
            raise typer.BadParameter(str(exc)) from exc
    return value
