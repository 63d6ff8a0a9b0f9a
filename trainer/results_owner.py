"""Which command wrote an output folder's ``results.json``.

``fedroute simulate``, ``fedroute prism train`` and ``fedroute mor eval`` all write ``results.json`` and
``results.md`` into their ``--out``; pointed at another command's folder, one replaced the other's results
without a word. Each records its name under :data:`OWNER_KEY` in the file it writes, and
:func:`claim_results` refuses, before any work, an ``--out`` whose ``results.json`` names another command.
A ``results.json`` without the key (written before it existed, or by hand) is left to the command.
"""

from __future__ import annotations

import json
from pathlib import Path

from sdk.errors import InvalidInputError

OWNER_KEY = "command"


def claim_results(out: Path, command: str) -> None:
    """Refuse ``out`` if its ``results.json`` was written by a command other than ``command``.

    Parameters
    ----------
    out : the command's output folder (need not exist).
    command : the command's name without ``fedroute``, e.g. ``"prism train"``.

    Raises
    ------
    InvalidInputError
        ``out/results.json`` holds ``{"command": <another command>}``.
    """
    try:
        owner = json.loads((Path(out) / "results.json").read_text()).get(OWNER_KEY)
    except (OSError, ValueError, AttributeError):  # absent, unreadable or not a JSON object: nothing to protect
        return
    if owner is not None and owner != command:
        raise InvalidInputError(f"--out {out} holds the results of `fedroute {owner}`; `fedroute {command}` would "
                                "replace them: give another folder")
