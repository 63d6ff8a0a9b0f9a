"""Bad input to the ``fedroute`` console commands: one clear error line and exit status 2, before any
data is read or training starts (no traceback, nothing written)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from trainer.cli import app


def flat(output: str) -> str:
    """The message without rich's box and line breaks."""
    return " ".join(output.replace("│", " ").split())


@pytest.mark.parametrize("alpha", ["nan", "inf"])
def test_simulate_rejects_a_non_finite_alpha_before_reading_data(tmp_path, alpha):
    """--alpha nan used to pass typer's min=1e-6 (NaN compares False) and numpy's Dirichlet then drew NaN
    task shares: a silent wrong split after the embeddings were computed."""
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["simulate", "--alpha", alpha, "--data", str(tmp_path / "absent"),
                                      "--out", str(out)], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert f"alpha (a Dirichlet concentration) must be a finite number > 0, got {alpha}" in flat(result.output)
    assert not out.exists()


@pytest.fixture()
def prefs(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c", "prompt_id": 1}\n')
    return path


@pytest.mark.parametrize("content, suffix, expected", [
    (b"PAR1 not really", ".parquet", "Parquet magic bytes not found"),
    (b"hello notes\n", ".jsonl", "ValueError: Expected object or value at position 0"),
])
def test_prism_dpo_names_a_corrupt_preference_file(tmp_path, content, suffix, expected):
    """A corrupt --prefs used to end in an ArrowInvalid / ValueError traceback."""
    bad = tmp_path / f"prefs{suffix}"
    bad.write_bytes(content)
    result = CliRunner().invoke(app, ["prism", "dpo", "--prefs", str(bad), "--out", str(tmp_path / "dpo"), "--tiny"],
                                env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    message = flat(result.output)
    assert f"--prefs {bad}: not a preference set written by `fedroute prism label`" in message and expected in message
    assert not (tmp_path / "dpo").exists()


def test_prism_dpo_rejects_a_nan_heldout_fraction_and_a_file_as_out(tmp_path, prefs):
    """--heldout-fraction nan passed (int(round(nan)) traceback after reading); --out FILE ended in FileExistsError."""
    result = CliRunner().invoke(app, ["prism", "dpo", "--prefs", str(prefs), "--out", str(tmp_path / "dpo"), "--tiny",
                                      "--heldout-fraction", "nan"], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and "--heldout-fraction must lie in [0, 1), got nan" in flat(result.output)
    assert not (tmp_path / "dpo").exists()
    (tmp_path / "notes.txt").write_text("keep me")
    result = CliRunner().invoke(app, ["prism", "dpo", "--prefs", str(prefs), "--out", str(tmp_path / "notes.txt"),
                                      "--tiny"], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and f"--out {tmp_path / 'notes.txt'} exists and is not a folder" in flat(result.output)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("command", [["prism", "train", "--quick"], ["prism", "label", "--run", "RUN"]])
def test_prism_train_and_label_refuse_a_file_as_out_before_any_work(tmp_path, command):
    """`prism train --out FILE` used to end in a NotADirectoryError traceback after the data preparation."""
    (tmp_path / "notes.txt").write_text("keep me")
    args = [str(tmp_path) if a == "RUN" else a for a in command]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "notes.txt"), "--data", str(tmp_path / "absent")],
                                env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert f"--out {tmp_path / 'notes.txt'} exists and is not a folder" in flat(result.output)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("command", [["mor", "train"], ["mor", "eval"], ["mor", "audit"]])
def test_mor_commands_refuse_a_file_as_out_before_training(tmp_path, command):
    """`mor train|eval|audit --out FILE` used to train first and then fail writing (the run was lost)."""
    (tmp_path / "notes.txt").write_text("keep me")
    result = CliRunner().invoke(app, [*command, "--quick", "--out", str(tmp_path / "notes.txt"),
                                      "--data", str(tmp_path / "absent")], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert f"--out {tmp_path / 'notes.txt'} exists and is not a folder" in flat(result.output)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_mor_audit_rejects_a_nan_clip(tmp_path):
    result = CliRunner().invoke(app, ["mor", "audit", "--quick", "--clip", "nan", "--out", str(tmp_path / "audit"),
                                      "--data", str(tmp_path / "absent")], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and "--clip must be a number >= 0.01, got nan" in flat(result.output)
    assert not (tmp_path / "audit").exists()


@pytest.mark.parametrize("args, message", [
    (["--tick-s", "nan"], "--tick-s must be a finite number, got nan"),
    (["--body-timeout-s", "inf"], "--body-timeout-s must be a finite number, got inf"),
    (["--bundle-dir", "NOTES"], "--bundle-dir NOTES is a file, not a bundle folder"),
])
def test_serve_refuses_non_finite_timings_and_a_file_as_bundle_dir(tmp_path, args, message):
    """`serve --tick-s nan` used to start and its round closer died at once (rounds never closed); a file as
    --bundle-dir was served as if it were a bundle. Both are refused before the TLS files are even read."""
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    args = [str(notes) if a == "NOTES" else a for a in args]
    result = CliRunner().invoke(app, ["serve", "--tls-cert", str(notes), "--tls-key", str(notes), "--db",
                                      f"sqlite:///{tmp_path / 'fed.db'}", *args], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert message.replace("NOTES", str(notes)) in flat(result.output)
    assert not (tmp_path / "fed.db").exists() and notes.read_text() == "keep me"


@pytest.mark.parametrize("args, message", [
    (["--ts-lambda", "nan"], "--ts-lambda / --ts-nu: lam must be a finite number > 0, got nan"),
    (["--beta", "nan"], "--beta must be a finite number > 0, got nan"),
    (["--learning-rate", "-1"], "--learning-rate must be a finite number > 0, got -1.0"),
    (["--steps", "0"], "Invalid value for '--steps': 0 is not in the range x>=1"),
])
def test_mor_grpo_checks_its_numbers_before_writing_out(tmp_path, args, message):
    """--ts-lambda nan used to fail only after OUT/tiny_policy was written; --steps 0 was passed to TRL."""
    (tmp_path / "mixture.json").write_text("{}")
    out = tmp_path / "grpo"
    result = CliRunner().invoke(app, ["mor", "grpo", "--mixture", str(tmp_path), "--out", str(out), *args],
                                env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert message in flat(result.output)
    assert not out.exists()
