"""`fedroute-sync` names what is wrong with its token before it touches the network or the bundle."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from sdk.sync_cli import make_app

pytestmark = pytest.mark.sdk  # runs in the base-install venv of .ci/run too


def run_sync(tmp_path, *args, env=None):
    app = make_app()  # fedroute-sync as its console script builds it
    base = ["--server", "https://127.0.0.1:9", "--log", str(tmp_path / "log.sqlite"), "--bundle", str(tmp_path / "b"),
            "--public-key", str(tmp_path / "k.pub")]
    return CliRunner().invoke(app, [*base, *args], env={"FEDROUTE_TOKEN": "", "COLUMNS": "500", **(env or {})})


def flat(output: str) -> str:
    """The message without rich's box and line breaks."""
    return " ".join(output.replace("│", " ").split())


def test_an_empty_token_file_is_named_not_reported_as_missing(tmp_path):
    """Rerunning the README's operator block empties device-N/token (`clients add` of an existing client
    fails after the shell truncated the file); sync used to say 'give --token-file or set FEDROUTE_TOKEN'."""
    (tmp_path / "token").write_text("\n")
    result = run_sync(tmp_path, "--token-file", str(tmp_path / "token"))
    assert result.exit_code == 2
    assert (f"--token-file {tmp_path / 'token'} is empty; the operator issues a token with `fedroute clients add` "
            "(`fedroute clients rotate` for an existing client)") in flat(result.output)


def test_a_missing_token_file_and_no_token_at_all(tmp_path):
    result = run_sync(tmp_path, "--token-file", str(tmp_path / "absent"))
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert f"--token-file {tmp_path / 'absent'}: cannot read it (No such file or directory)" in flat(result.output)
    result = run_sync(tmp_path)
    assert result.exit_code == 2 and "give --token-file or set FEDROUTE_TOKEN" in flat(result.output)


def test_a_binary_token_file_is_named_not_a_traceback(tmp_path):
    """Giving the EvalLog (SQLite) or a key as --token-file used to end in a UnicodeDecodeError traceback."""
    (tmp_path / "token").write_bytes(b"tok\xf8en")
    result = run_sync(tmp_path, "--token-file", str(tmp_path / "token"))
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert (f"--token-file {tmp_path / 'token'} is not a text file (byte 3 is not UTF-8); it holds the token "
            "`fedroute clients add` printed") in flat(result.output)


def test_a_log_that_is_a_folder_is_not_reported_as_missing(tmp_path):
    result = run_sync(tmp_path, "--log", str(tmp_path), env={"FEDROUTE_TOKEN": "tok"})
    assert result.exit_code == 2 and f"--log {tmp_path} is not a file (the app's EvalLog file)" in flat(result.output)
    result = run_sync(tmp_path, env={"FEDROUTE_TOKEN": "tok"})
    assert f"--log {tmp_path / 'log.sqlite'} does not exist (the app's EvalLog file)" in flat(result.output)
