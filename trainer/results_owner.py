"""Which command wrote an output folder's ``results.json``.

``fedroute simulate``, ``fedroute prism train`` and ``fedroute mor eval`` all write ``results.json`` and
``results.md`` into their ``--out``; pointed at another command's folder, one replaced the other's results
without a word. Each records its name under :data:`OWNER_KEY` in the file it writes, and
:func:`claim_results` refuses, before any work, an ``--out`` whose ``results.json`` belongs to another
command.

A ``results.json`` without the key was written before the key existed, or by something else. Its owner
is then read from its top-level keys (:data:`LEGACY_KEYS`: each command's results have carried these
since the command's first version, e.g. ``docs/results/prism_*/results.json``); a file that matches no
command, is not a JSON object, or cannot be read is refused for every command, since replacing it
could lose results that no key protects: the user picks another ``--out`` or removes the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from sdk.errors import InvalidInputError

OWNER_KEY = "command"

#: Top-level keys that identify a ``results.json`` written without :data:`OWNER_KEY`, per command.
LEGACY_KEYS: dict[str, frozenset[str]] = {
    "simulate": frozenset({"references", "routers"}),
    "prism train": frozenset({"eval_split", "methods"}),
    "mor eval": frozenset({"methods", "single_rms"}),
}


def results_owner(results: object) -> str | None:
    """The command that wrote the parsed ``results.json`` ``results``: its :data:`OWNER_KEY` (any
    value, as written), else the one command whose :data:`LEGACY_KEYS` it holds; None when neither
    tells (not a JSON object, no key, or the keys of no command or of several)."""
    if not isinstance(results, dict):
        return None
    if OWNER_KEY in results:
        return results[OWNER_KEY]
    matches = [command for command, keys in LEGACY_KEYS.items() if keys <= results.keys()]
    return matches[0] if len(matches) == 1 else None


def claim_results(out: Path, command: str) -> None:
    """Refuse ``out`` unless its ``results.json`` is absent or was written by ``command``.

    Parameters
    ----------
    out : the command's output folder (need not exist).
    command : the command's name without ``fedroute``, e.g. ``"prism train"``.

    Raises
    ------
    InvalidInputError
        ``out/results.json`` belongs to another command (its ``{"command": ...}``, or for an older file
        its keys, :data:`LEGACY_KEYS`), or exists but no command can be told from it (not readable,
        not a JSON object, or keys of no command): the message names the folder and says to give
        another ``--out`` or remove the file.
    """
    path = Path(out) / "results.json"
    if not path.exists() and not path.is_symlink():
        return
    try:
        owner = results_owner(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:  # a folder, unreadable, not UTF-8 or not JSON
        raise InvalidInputError(f"--out {out} holds a results.json that cannot be read as JSON ({exc}); "
                                f"`fedroute {command}` would replace it: give another folder or remove "
                                f"{path}") from exc
    if owner is None:
        raise InvalidInputError(f"--out {out} holds a results.json that no fedroute command is known to have "
                                f"written (no {OWNER_KEY!r} key); `fedroute {command}` would replace it: give "
                                f"another folder or remove {path}")
    if owner != command:
        raise InvalidInputError(f"--out {out} holds the results of `fedroute {owner}`; `fedroute {command}` would "
                                "replace them: give another folder")
