"""A command run without the extra it needs says which extra to install (sdk.console.run_app), no traceback.

The full venv has every extra, so each case hides one module (``sys.modules[name] = None``: the import
raises ModuleNotFoundError as in a venv without it) and runs the console script's main()."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from sdk.console import run_app

pytestmark = pytest.mark.sdk  # runs in the base-install venv of .ci/run too

ROOT = Path(__file__).resolve().parents[1]
# what each hidden module's extra imports first (trainer.server: sqlalchemy; sdk.proxy: uvicorn, then openai)
EXTRA_MODULES = {"server": ("sqlalchemy",), "proxy": ("uvicorn", "openai")}


def _run_hiding(module: str, script: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    code = (f"import sys; sys.modules[{module!r}] = None; sys.argv = ['prog', *{argv!r}]; "
            f"from {script} import main; main()")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "500"})


@pytest.mark.parametrize(("module", "argv", "extra"), [
    ("sqlalchemy", ["clients", "add", "phone-1", "--db", "sqlite:///fed.db"], "server"),
    ("sqlalchemy", ["rounds", "close", "--db", "sqlite:///fed.db"], "server"),
    ("uvicorn", ["proxy", "--config", "proxy.json", "--token-file", "tokens"], "proxy"),
    ("openai", ["proxy", "--config", "proxy.json", "--token-file", "tokens"], "proxy"),
], ids=["clients add", "rounds close", "proxy without uvicorn", "proxy without openai"])
def test_a_command_without_its_extra_names_the_extra(tmp_path, module, argv, extra):
    (tmp_path / "proxy.json").write_text("{}")
    (tmp_path / "tokens").write_text("t\n")
    out = _run_hiding(module, "trainer.cli", argv, tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    # the first missing module of the extra is named: the hidden one, unless this venv lacks another (the base
    # install of .ci/run has no uvicorn, which the proxy imports before openai)
    first_missing = next(m for m in EXTRA_MODULES[extra] if m == module or importlib.util.find_spec(m) is None)
    assert f"needs the {extra} extra ({first_missing} is missing): pip install 'fedroute[{extra}]'" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proxy.json", "tokens"]  # nothing written


def test_a_missing_module_of_no_extra_propagates(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["prog"])
    app = typer.Typer()

    @app.command()
    def broken() -> None:
        import fedroute_no_such_module  # noqa: F401

    with pytest.raises(ModuleNotFoundError, match="fedroute_no_such_module"):
        run_app(app)
