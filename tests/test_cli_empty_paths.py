"""An empty path option (``--out "$OUT"`` with ``$OUT`` unset) is refused while the command line is
parsed: typer turned ``""`` into ``Path("")`` == ``Path(".")``, so the command wrote into (or read
from) the current folder. sdk.cli_paths wraps every ``Path`` option of ``fedroute`` and ``fedroute-sync``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import click.testing
import pytest
from typer.main import get_command
from typer.testing import CliRunner

from sdk.cli_paths import NonEmptyPath
from sdk.sync_cli import make_app as make_sync_app
from trainer.cli import app

ROOT = Path(__file__).resolve().parents[1]
MESSAGE = "the path is empty ('{}'); is the shell variable that should hold it unset? Give a path (. for the current folder)"


def flat(output: str) -> str:
    """The message without rich's box and line breaks."""
    return " ".join(output.replace("│", " ").split())


# (console script, arguments before the empty value, option given the empty value)
CASES = [
    ("fedroute", ["export"], "--out"),
    ("fedroute", ["export", "--out", "bundle"], "--signing-key"),
    ("fedroute", ["keygen"], "--out"),
    ("fedroute", ["simulate"], "--out"),
    ("fedroute", ["simulate"], "--data"),
    ("fedroute", ["ablate"], "--cache-dir"),
    ("fedroute", ["prism", "train"], "--out"),
    ("fedroute", ["prism", "label"], "--run"),
    ("fedroute", ["prism", "dpo"], "--prefs"),
    ("fedroute", ["mor", "eval"], "--out"),
    ("fedroute", ["mor", "train"], "--cache"),
    ("fedroute", ["mor", "grpo"], "--out"),
    ("fedroute", ["mor", "export"], "--mixture"),
    ("fedroute", ["serve"], "--bundle-dir"),
    ("fedroute", ["serve"], "--tls-cert"),  # exists=True: refused as empty, not as "does not exist"
    ("fedroute", ["publish"], "--bundle-dir"),
    ("fedroute", ["rounds", "open"], "--bundle-dir"),
    ("fedroute", ["proxy"], "--config"),
    ("fedroute", ["proxy"], "--token-file"),
    ("fedroute", ["demo-log"], "--out"),
    ("fedroute", ["add-model"], "--out"),
    ("fedroute", ["sync"], "--log"),
    ("fedroute-sync", [], "--log"),
    ("fedroute-sync", [], "--bundle"),
    ("fedroute-sync", [], "--state"),
    ("fedroute-sync", [], "--ca-cert"),
]


def app_of(script: str):
    return app if script == "fedroute" else make_sync_app()


@pytest.mark.parametrize("value", ["", "  "], ids=["empty", "blank"])
@pytest.mark.parametrize("script, args, option", CASES, ids=[" ".join([s, *a, o]) for s, a, o in CASES])
def test_an_empty_path_option_is_refused_and_nothing_is_written(tmp_path, monkeypatch, script, args, option, value):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app_of(script), [*args, option, value], env={"COLUMNS": "500", "FEDROUTE_TOKEN": "t"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert flat(f"Invalid value for '{option}': {MESSAGE.format(value)}") in flat(result.output)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    ["-m", "trainer.cli", "export", "--out", "", "--router", "r", "--signing-key", "k"],
    ["-m", "trainer.cli", "mor", "eval", "--out", ""],
    ["-m", "sdk.sync_cli", "--server", "https://127.0.0.1:9", "--log", "", "--bundle", "b", "--public-key", "k"],
], ids=["fedroute export", "fedroute mor eval", "fedroute-sync"])
def test_the_console_scripts_refuse_an_empty_path(tmp_path, argv):
    """The console scripts' main() (sdk.console.run_app) as a shell runs them: exit 2, click's one error."""
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "500", "FEDROUTE_TOKEN": "t"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    option = argv[argv.index("") - 1]
    assert f"Invalid value for '{option}': {MESSAGE.format('')}" in flat(out.stderr)
    assert list(tmp_path.iterdir()) == []


def path_params():
    """(command line, option, its type) of every parameter of both console scripts whose type is (or
    wraps) click.Path, and the number of commands walked."""
    found, commands = [], 0

    def walk(command: click.Command, path: list[str]) -> None:
        nonlocal commands
        commands += 1
        for param in command.params:
            if isinstance(param.type, (click.Path, NonEmptyPath)):
                found.append((" ".join(path), param.opts[0], param.type))
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])

    walk(get_command(app), ["fedroute"])
    walk(get_command(make_sync_app()), ["fedroute-sync"])
    from trainer.experts.cli import app as prism_app
    from trainer.rewards.cli import app as mor_app
    from trainer.server.cli import clients_app, rounds_app

    for name, sub_app in (("prism", prism_app), ("mor", mor_app), ("clients", clients_app), ("rounds", rounds_app)):
        walk(get_command(sub_app), [f"{name} (its own app)"])  # the sub-apps invoked on their own too
    return found, commands


def test_every_path_option_of_both_scripts_is_wrapped():
    """A new Path option (or a new command or sub-app) gets the check without a line of its own. `keygen --out`
    was a str option with a check of its own in generate_keypair (an ExportError after parsing, not click's)."""
    found, commands = path_params()
    assert commands > 30 and len(found) > 70  # guards the walk: 80 path options of the two scripts today
    assert ("mor (its own app) eval", "--out") in {(c, o) for c, o, _ in found}
    assert {("fedroute prism train", "--out"), ("fedroute mor grpo", "--mixture"), ("fedroute rounds open", "--prior-router"),
            ("fedroute serve", "--tls-key-password-file"), ("fedroute proxy", "--config"), ("fedroute sync", "--state"),
            ("fedroute-sync", "--log"), ("fedroute keygen", "--out")} <= {(c, o) for c, o, _ in found}
    unwrapped = [(c, o) for c, o, t in found if not isinstance(t, NonEmptyPath)]
    assert unwrapped == []
    assert all(isinstance(t.inner, click.Path) for _, _, t in found)


def test_the_wrapped_type_keeps_clicks_own_path_checks(tmp_path, monkeypatch):
    """exists=True / dir_okay=False still apply to a non-empty value, with click's own message."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["proxy", "--config", "absent.json"], env={"COLUMNS": "500"})
    assert result.exit_code == 2
    assert "Invalid value for '--config': File 'absent.json' does not exist." in flat(result.output)
    (tmp_path / "folder").mkdir()
    result = CliRunner().invoke(app, ["serve", "--tls-cert", "folder"], env={"COLUMNS": "500"})
    assert result.exit_code == 2
    assert "Invalid value for '--tls-cert': File 'folder' is a directory." in flat(result.output)


def test_a_non_empty_path_still_reaches_the_command_as_a_path(tmp_path, monkeypatch):
    """`--out .` (the current folder, said on purpose) is not refused: the command's own checks run."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(make_sync_app(), ["--server", "https://127.0.0.1:9", "--log", ".", "--bundle", "b",
                                                  "--public-key", "k"], env={"COLUMNS": "500", "FEDROUTE_TOKEN": "t"})
    assert result.exit_code == 2
    assert "--log . is not a file (the app's EvalLog file)" in flat(result.output)


def test_help_is_the_same_as_with_the_bare_click_path_types():
    """The wrapper keeps click.Path's metavar (PATH, FILE, DIRECTORY) and help: every command's --help
    renders the same text with the wrapped types as with the click.Path types they wrap."""
    def commands(command: click.Command, path: list[str]):
        yield path, command
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                yield from commands(sub, [*path, name])

    checked = 0
    for root in (get_command(app), get_command(make_sync_app())):
        for path, command in commands(root, []):
            wrapped = [p for p in command.params if isinstance(p.type, NonEmptyPath)]
            if not wrapped:
                continue
            before = click.testing.CliRunner().invoke(command, ["--help"], prog_name="x", env={"COLUMNS": "200"})
            for param in wrapped:
                param.type = param.type.inner
            after = click.testing.CliRunner().invoke(command, ["--help"], prog_name="x", env={"COLUMNS": "200"})
            assert before.exit_code == after.exit_code == 0 and before.output == after.output, path
            checked += 1
    assert checked == 21  # 20 fedroute commands with path options, and fedroute-sync
    out_line = next(line for line in CliRunner().invoke(app, ["export", "--help"], env={"COLUMNS": "200"}).output.splitlines()
                    if " --out " in line)
    assert " PATH " in out_line
