"""``trainer.embedder_paths.hub_offline`` answers as huggingface_hub decides offline mode: the first non-empty of
``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``, upper-cased, in ``ENV_VARS_TRUE_VALUES``, blanks not stripped. It
used to read both variables and strip blanks, so ``HF_HUB_OFFLINE=0 TRANSFORMERS_OFFLINE=1`` or
``HF_HUB_OFFLINE=" 1"`` made a load error say "HF_HUB_OFFLINE is set" while huggingface_hub was online."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainer.embedder_paths import hub_offline, model_load_problem

# (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE); None: unset.
CASES = [(None, None), ("1", None), (None, "1"), ("0", "1"), ("1", "0"), ("", "1"), (" 1", None), ("1 ", None),
         ("yes", None), ("On", None), ("true", None), ("2", None), ("0", None), (None, " yes"), ("auto", None)]


def _set(monkeypatch, hf: str | None, tf: str | None) -> None:
    for var, value in (("HF_HUB_OFFLINE", hf), ("TRANSFORMERS_OFFLINE", tf)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)


def test_hf_hub_offline_zero_wins_over_transformers_offline(monkeypatch):
    _set(monkeypatch, "0", "1")
    assert hub_offline() is False
    assert model_load_problem("fedroute-tests/no-such-model", OSError("not found")) == "not found"


def test_blanks_around_the_value_are_not_stripped(monkeypatch):
    _set(monkeypatch, " 1", None)
    assert hub_offline() is False
    _set(monkeypatch, "1", None)
    assert hub_offline() is True  # read at each call, after import


def test_the_message_names_the_variable_that_turned_downloads_off(monkeypatch):
    _set(monkeypatch, "", "1")
    assert model_load_problem("fedroute-tests/no-such-model", OSError("x")) == (
        "'fedroute-tests/no-such-model' is not a local folder and TRANSFORMERS_OFFLINE is set (no download); give a "
        "local model folder (saved with save_pretrained) or unset TRANSFORMERS_OFFLINE with network access")


@pytest.fixture(scope="module")
def library() -> dict:
    """huggingface_hub.constants.HF_HUB_OFFLINE as the library computes it at import, per case (one fresh
    interpreter that reloads the module for each case; the library's module state in this process is left alone)."""
    code = (
        "import importlib, json, os, sys\n"
        "import huggingface_hub.constants as c\n"
        "out = []\n"
        "for hf, tf in json.loads(sys.argv[1]):\n"
        "    for var, value in (('HF_HUB_OFFLINE', hf), ('TRANSFORMERS_OFFLINE', tf)):\n"
        "        os.environ.pop(var, None)\n"
        "        if value is not None: os.environ[var] = value\n"
        "    out.append(importlib.reload(c).HF_HUB_OFFLINE)\n"
        "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(CASES)], env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    return dict(zip(CASES, json.loads(done.stdout)))


def test_the_library_answers_are_the_documented_edge_cases(library):
    assert library[("0", "1")] is False and library[(" 1", None)] is False and library[("", "1")] is True


@pytest.mark.parametrize("hf,tf", CASES)
def test_matches_huggingface_hub(monkeypatch, library, hf, tf):
    _set(monkeypatch, hf, tf)
    assert hub_offline() is library[(hf, tf)]
