"""Bad input to the ``fedroute`` console commands: one clear error line and exit status 2, before any
data is read or training starts (no traceback, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from sdk.errors import InvalidInputError
from sdk.sync_cli import make_app as make_sync_app
from trainer.cli import app


def flat(output: str) -> str:
    """The message without rich's box and line breaks."""
    return " ".join(output.replace("│", " ").split())


def sync_app() -> typer.Typer:
    """``fedroute-sync`` as its console script builds it (sdk.sync_cli.main)."""
    return make_sync_app()


def command_params() -> list[tuple[typer.Typer, list[str], click.Parameter]]:
    """(app, sub-command path, parameter) for every parameter of every ``fedroute`` and ``fedroute-sync``
    command (``fedroute-sync`` is one command: no sub-command name on its line)."""
    found = []

    def walk(command: click.Command, root: typer.Typer, path: list[str]) -> None:
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, root, [*path, name])
            return
        found.extend((root, path, param) for param in command.params)

    for root in (app, sync_app()):
        walk(get_command(root), root, [])
    return found


def float_options() -> list:
    """A test case per float option of every ``fedroute`` and ``fedroute-sync`` command: NaN, and the
    infinity that the option's range (typer's min=/max=) does not refuse itself."""
    cases = []
    for root, path, param in command_params():
        if isinstance(param.type, click.types.FloatParamType):  # FloatRange included
            bounds = (getattr(param.type, "min", None), getattr(param.type, "max", None))
            infinities = ["inf"] if bounds[1] is None else ["-inf"] if bounds[0] is None else []
            for value in ["nan", *infinities]:
                cases.append(pytest.param(root, path, param.opts[0], value, id=" ".join([*path, param.opts[0], value])))
    return cases


FLOAT_OPTIONS = float_options()


def test_the_float_option_walk_finds_the_commands_options():
    """Guards the walk itself: a typer change that hid the options would leave the next test empty."""
    ids = {c.id for c in FLOAT_OPTIONS}
    assert {"simulate --alpha nan", "simulate --alpha inf", "serve --tick-s inf", "demo-log --explore nan",
            "rounds open --clip-count inf", "rounds open --trim-fraction nan", "mor audit --clip inf", "mor grpo --ts-lambda nan",
            "prism dpo --lr inf", "add-model --price inf"} <= ids
    assert "demo-log --explore inf" not in ids  # max=1.0 refuses inf already (click's own message)


@pytest.mark.parametrize("root, path, option, value", FLOAT_OPTIONS)
def test_every_float_option_refuses_nan_and_inf_before_any_work(tmp_path, monkeypatch, root, path, option, value):
    """typer's min=/max= let NaN through (NaN compares False with every bound): --alpha nan drew NaN task
    shares after the embeddings were computed, --tick-s nan killed the round closer at start. Every float
    option carries sdk.finite_option, which refuses NaN and inf while the line is parsed: exit 2, one line
    naming the option, nothing written (relative defaults such as results/ and fed.db land in the cwd)."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(root, [*path, option, value], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert f"Invalid value for '{option}': must be a finite number, got {float(value)}" in flat(result.output)
    assert list(tmp_path.iterdir()) == []


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


def test_prism_dpo_rejects_a_heldout_fraction_of_one_and_a_file_as_out(tmp_path, prefs):
    """--heldout-fraction 1 would hold every prompt out; --out FILE ended in FileExistsError."""
    result = CliRunner().invoke(app, ["prism", "dpo", "--prefs", str(prefs), "--out", str(tmp_path / "dpo"), "--tiny",
                                      "--heldout-fraction", "1"], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and "--heldout-fraction must lie in (0, 1)" in flat(result.output)
    assert "got 1.0" in flat(result.output)
    # 0 held out one prompt anyway (max(1, ...)): refused rather than silently not what was asked
    result = CliRunner().invoke(app, ["prism", "dpo", "--prefs", str(prefs), "--tiny", "--out", str(tmp_path / "z"),
                                      "--heldout-fraction", "0"], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and "got 0.0" in flat(result.output) and not (tmp_path / "z").exists()
    assert not (tmp_path / "dpo").exists()
    (tmp_path / "notes.txt").write_text("keep me")
    result = CliRunner().invoke(app, ["prism", "dpo", "--prefs", str(prefs), "--out", str(tmp_path / "notes.txt"),
                                      "--tiny"], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and f"--out {tmp_path / 'notes.txt'} exists and is not a folder" in flat(result.output)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_prism_dpo_with_a_policy_that_does_not_load_leaves_no_out_folder(tmp_path, monkeypatch):
    """The command created --out before the policy loaded: a bad --policy left an empty folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("\n".join(json.dumps({"prompt_id": i, "prompt": f"question {i}?", "chosen": f"a good answer {i}",
                                            "rejected": f"bad {i}"}) for i in range(20)))
    result = CliRunner().invoke(app, ["prism", "dpo", "--prefs", str(prefs), "--out", str(tmp_path / "dpo"),
                                      "--policy", str(tmp_path / "no-such-policy")], env={"COLUMNS": "500"})
    assert result.exit_code != 0 and "cannot load a causal LM" in flat(str(result.exception) + result.output)
    assert not (tmp_path / "dpo").exists()


def test_prism_dpo_splits_hand_edited_prompt_ids_of_mixed_types(tmp_path):
    """prompt_id 1 in one row and "7" in another (a hand-edited file) ended in a TypeError traceback from
    sorting the ids; they are now split like any ids (here all held out, which is refused before any
    training), and a row without a prompt_id is named."""
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text('{"prompt": "a", "chosen": "b", "rejected": "c", "prompt_id": 1}\n'
                     '{"prompt": "d", "chosen": "e", "rejected": "f", "prompt_id": "7"}\n')
    args = ["prism", "dpo", "--prefs", str(prefs), "--out", str(tmp_path / "dpo"), "--tiny", "--heldout-fraction", "0.9"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "holds 2 prompt(s) and all are held out (--heldout-fraction 0.9)" in flat(result.output)
    prefs.write_text('{"prompt": "a", "chosen": "b", "rejected": "c", "prompt_id": 1}\n'
                     '{"prompt": "d", "chosen": "e", "rejected": "f"}\n')
    result = CliRunner().invoke(app, args, env={"COLUMNS": "500"})
    assert result.exit_code == 2 and "row 1 has no prompt_id (the held-out split is by prompt)" in flat(result.output)
    assert not (tmp_path / "dpo").exists()


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


def test_serve_refuses_a_file_as_bundle_dir(tmp_path):
    """A file as --bundle-dir was served as if it were a bundle; it is refused before the TLS files are even read."""
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    result = CliRunner().invoke(app, ["serve", "--tls-cert", str(notes), "--tls-key", str(notes), "--db",
                                      f"sqlite:///{tmp_path / 'fed.db'}", "--bundle-dir", str(notes)],
                                env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert f"--bundle-dir {notes} is a file, not a bundle folder" in flat(result.output)
    assert not (tmp_path / "fed.db").exists() and notes.read_text() == "keep me"


@pytest.mark.parametrize("args, message", [
    (["--ts-lambda", "-1"], "--ts-lambda / --ts-nu: lam must be a finite number > 0, got -1.0"),
    (["--ts-lambda", "1e308"], "--ts-lambda / --ts-nu: lam must be below 2 / lr = 4 (lr 0.5, the online SGD step), "
                               "got 1e+308: a larger lam * lr makes the pull-back to the offline router diverge"),
    (["--ts-nu", "1e300"], "--ts-lambda / --ts-nu: nu must be at most 1e+100, got 1e+300: a larger nu can overflow "
                           "the posterior sample mean + nu sigma z to +-inf"),
    (["--ts-lambda", "1e-320"], "--ts-lambda / --ts-nu: lam must be at least 1e-100, got 9.99989e-321"),
    (["--beta", "0"], "--beta must be a finite number > 0, got 0.0"),
    (["--learning-rate", "-1"], "--learning-rate must be a finite number > 0, got -1.0"),
    (["--steps", "0"], "Invalid value for '--steps': 0 is not in the range 1<=x<=2147483647"),
    (["--device", "bogus"], "device='bogus' should be one of ('cpu', 'cuda')"),
    (["--num-generations", "1"], "num_generations=1 should be an integer >= 2"),
    (["--seed", "-1"], "Invalid value for '--seed': -1 is not in the range 0<=x<=4294967295"),
    (["--n-prompts", "3"], "--n-prompts 3 is below --prompts-per-step 4: one optimiser step needs that many prompts, "
                           "so no step would run"),
])
def test_mor_grpo_checks_its_numbers_before_writing_out(tmp_path, args, message):
    """--ts-lambda -1 used to fail only after OUT/tiny_policy was written; --steps 0 was passed to TRL;
    --device bogus and --num-generations 1 were refused after the mixture and the data were read and
    OUT/tiny_policy was written; --seed -1 was blamed on --ts-lambda / --ts-nu; --n-prompts 3 with 4 prompts
    per step ran no step and ended in 'empty GRPO history' after the policy was built. --ts-nu 1e300 (or
    --ts-lambda 1e-320) gave +-inf (NaN) posterior samples whose argmax silently went to the lowest arm."""
    (tmp_path / "mixture.json").write_text("{}")
    out = tmp_path / "grpo"
    result = CliRunner().invoke(app, ["mor", "grpo", "--mixture", str(tmp_path), "--out", str(out), *args],
                                env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert message in flat(result.output)
    assert not out.exists()


@pytest.mark.parametrize("args, second_prompt, message", [
    (["--seed", "-1"], '"d"', "Invalid value for '--seed': -1 is not in the range 0<=x<=4294967295"),
    (["--lr", "-1"], '"d"', "DPORunConfig.learning_rate=-1.0 should be a finite number > 0"),
    (["--lr", "0"], '"d"', "DPORunConfig.learning_rate=0.0 should be a finite number > 0"),
    (["--seed", "1"], "null", "train rows: row 0 'prompt' should be a non-empty string, got nan"),
])
def test_prism_dpo_checks_its_settings_before_writing_out(tmp_path, args, second_prompt, message):
    """--seed -1 ended in numpy's ValueError traceback; --lr -1 was refused only after OUT/tiny_policy was
    written; --lr 0 was silently replaced by the default 1e-3; a row without a prompt was refused after
    OUT/tiny_policy was written."""
    two = tmp_path / "prefs.jsonl"  # two prompts: one to train on, one held out (seed 1 holds out prompt 1)
    two.write_text('{"prompt": "a", "chosen": "b", "rejected": "c", "prompt_id": 1}\n'
                   f'{{"prompt": {second_prompt}, "chosen": "e", "rejected": "f", "prompt_id": 2}}\n')
    out = tmp_path / "dpo"
    result = CliRunner().invoke(app, ["prism", "dpo", "--prefs", str(two), "--out", str(out), "--tiny", *args],
                                env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert message in flat(result.output)
    assert not out.exists()


def test_prism_dpo_refuses_a_set_whose_every_prompt_is_held_out(tmp_path, prefs):
    """One prompt, 20 % held out (at least one prompt): nothing to train on. It used to build OUT/ and end in
    the tokenizer's 'train_texts holds no non-empty string'."""
    out = tmp_path / "dpo"
    result = CliRunner().invoke(app, ["prism", "dpo", "--prefs", str(prefs), "--out", str(out), "--tiny"],
                                env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert (f"--prefs {prefs} holds 1 prompt(s) and all are held out (--heldout-fraction 0.2): "
            "no pair is left to train on") in flat(result.output)
    assert not out.exists()


def test_prism_dpo_options_given_with_gpu_override_the_preset():
    """--gpu used to drop --batch-size and --max-length silently (the preset's 8 and 1024 ran instead), and
    ran the CLI's 120 steps instead of the preset's documented 300 (docs/prism_device_and_dpo.md)."""
    from trainer.experts.cli import _dpo_config

    gpu = _dpo_config("p", gpu=True, tiny=False, steps=5, beta=0.2, lr=None, batch_size=2, max_length=512, seed=1)
    assert (gpu.batch_size, gpu.max_length, gpu.learning_rate, gpu.gradient_accumulation_steps) == (2, 512, 5e-7, 4)
    assert (gpu.max_steps, gpu.beta, gpu.seed, gpu.device) == (5, 0.2, 1, "cuda")
    preset = _dpo_config("p", gpu=True, tiny=False, steps=None, beta=0.2, lr=None, batch_size=None, max_length=None,
                         seed=1)
    assert (preset.max_steps, preset.batch_size, preset.max_length) == (300, 8, 1024)
    tiny = _dpo_config("p", gpu=False, tiny=True, steps=None, beta=0.2, lr=None, batch_size=None, max_length=None,
                       seed=0)
    assert (tiny.max_steps, tiny.learning_rate, tiny.batch_size, tiny.max_length, tiny.device) == (120, 1e-3, 8, 256, "cpu")
    assert _dpo_config("p", gpu=False, tiny=False, steps=5, beta=0.2, lr=2e-4, batch_size=None, max_length=None,
                       seed=0).learning_rate == 2e-4


def console(monkeypatch, capsys, args: list[str]) -> tuple[int, str]:
    """Run ``fedroute ARGS`` as the console script does (trainer.cli.main); (exit status, stderr)."""
    from trainer.cli import main

    monkeypatch.setattr("sys.argv", ["fedroute", *args])
    monkeypatch.setenv("COLUMNS", "500")
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("name, content, message", [
    ("fedprism_config.json", '{"n_experts": 2', "fedprism_config.json: unreadable (JSONDecodeError: Expecting ',' delimiter"),
    ("fedprism_config.json", '{"n_experts": "2"}', "fedprism_config.json: n_experts should be an int >= 1, got '2'"),
    ("splits.json", "[]", "splits.json: expected a JSON object, got list"),
    ("splits.json", '{"test": []}', "splits.json: no list of prompt ids under ['train']"),
    ("selector_config.json", "{}", "selector_config.json: not a selector config written by `fedroute prism train` "
                                   "(KeyError: 'encoding')"),
])
def test_prism_label_names_a_corrupt_file_of_the_run(tmp_path, monkeypatch, capsys, name, content, message):
    """A truncated or foreign file in RUN/fedprism_seed0/ ended in a JSONDecodeError / KeyError traceback."""
    saved = tmp_path / "run" / "fedprism_seed0"
    (saved / "expert_0").mkdir(parents=True)
    files = {"fedprism_config.json": '{"n_experts": 1}', "splits.json": '{"train": [], "test": []}',
             "selector_config.json": "{}"}
    for file, text in {**files, name: content}.items():
        (saved / file).write_text(text)
    code, err = console(monkeypatch, capsys, ["prism", "label", "--run", str(tmp_path / "run"),
                                              "--out", str(tmp_path / "phase3")])
    assert code == 2 and err.startswith(f"error: {saved}") and message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "phase3").exists()


@pytest.mark.parametrize("content", ['{"train": [1]', '{"train": [1]}'])
def test_export_selector_names_a_corrupt_splits_file(tmp_path, monkeypatch, capsys, content, signing_keys):
    """RUN/fedprism_seed0/splits.json truncated or without 'test': JSONDecodeError / KeyError tracebacks (after
    loading the preference data); now one line before the data is read."""
    expert = tmp_path / "fedprism_seed0" / "expert_0"
    (expert / "adapter").mkdir(parents=True)
    (expert.parent / "splits.json").write_text(content)
    (tmp_path / "no_data").mkdir()  # exists (a missing --data is refused first), holds no data
    code, err = console(monkeypatch, capsys, ["export", "--selector", str(expert), "--out", str(tmp_path / "bundle"),
                                              "--signing-key", str(signing_keys[0]),
                                              "--data", str(tmp_path / "no_data")])
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: {expert.parent / 'splits.json'}: not the splits.json of `fedroute prism train` "
                          "(no readable 'test' list: ")
    assert not (tmp_path / "bundle").exists()


def test_prism_label_names_a_run_whose_experts_were_not_all_written(tmp_path, monkeypatch, capsys):
    """A run killed while saving (expert_1/ and router.safetensors missing) ended in safetensors' traceback."""
    from trainer.experts.selector import SelectorConfig, save_selector_config

    saved = tmp_path / "run" / "fedprism_seed0"
    (saved / "expert_0").mkdir(parents=True)
    save_selector_config(SelectorConfig(), saved / "selector_config.json")
    (saved / "fedprism_config.json").write_text('{"n_experts": 2}')
    (saved / "splits.json").write_text('{"train": [], "test": []}')
    code, err = console(monkeypatch, capsys, ["prism", "label", "--run", str(tmp_path / "run"),
                                              "--out", str(tmp_path / "phase3")])
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: {saved}: cannot load its 2 experts and router (") and "interrupted" in err
    assert not (tmp_path / "phase3").exists()


@pytest.mark.parametrize("command", [["mor", "grpo", "--quick"],
                                     ["mor", "export", "--client", "harmlessness", "--signing-key", "KEY"]])
@pytest.mark.parametrize("content, message", [
    ('{"format_version": 1', "mixture.json: unreadable (JSONDecodeError: Expecting ',' delimiter"),
    ('{"format_version": 1}', "mixture.json: not a mixture written by `fedroute mor train` (KeyError: 'embedder')"),
    ("[1]", "mixture.json: format_version None, expected 1"),
])
def test_mor_commands_name_a_corrupt_mixture_json(tmp_path, monkeypatch, capsys, signing_keys, command, content,
                                                 message):
    """A truncated or foreign mixture.json ended in a JSONDecodeError / KeyError / AttributeError traceback.
    (`mor export` is given a valid signing key: a missing one is now refused before the mixture is read.)"""
    (tmp_path / "mix").mkdir()
    (tmp_path / "mix" / "mixture.json").write_text(content)
    args = [str(signing_keys[0]) if a == "KEY" else a for a in command]
    code, err = console(monkeypatch, capsys, [*args, "--mixture", str(tmp_path / "mix"), "--out", str(tmp_path / "out")])
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: {tmp_path / 'mix' / 'mixture.json'}") and message in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("methods", [",", " ", "fedprism,fedprism"])
def test_prism_train_refuses_no_or_repeated_methods_before_the_data(tmp_path, methods):
    """--methods ',' prepared the data and wrote an empty results table with exit 0; a repeated method was
    trained twice and its accuracies appended twice per seed."""
    result = CliRunner().invoke(app, ["prism", "train", "--quick", "--methods", methods, "--out", str(tmp_path / "run"),
                                      "--data", str(tmp_path / "absent")], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert f"--methods {methods!r}: give each method once, at least one; valid: fedprism," in flat(result.output)
    assert not (tmp_path / "run").exists()


def _write_db_file(path: Path, content: str) -> None:
    import sqlite3

    if content == "empty file":
        path.touch()
    elif content == "not SQLite":
        path.write_text("hello")
    elif content != "absent":  # SQLite without tables, or another program's
        with sqlite3.connect(path) as conn:
            conn.executescript("" if content == "SQLite, no tables" else "CREATE TABLE notes (x)")
        conn.close()


@pytest.mark.parametrize("content", ["absent", "empty file", "SQLite, no tables", "foreign SQLite", "not SQLite"])
@pytest.mark.parametrize("command", [["rounds", "status"], ["rounds", "close"], ["clients", "list"],
                                     ["clients", "revoke", "phone-1"], ["clients", "rotate", "phone-1"],
                                     ["publish", "--round", "1", "--bundle-dir", "B", "--signing-key", "K"]])
def test_operator_commands_refuse_a_file_that_is_not_a_server_database_and_write_nothing(tmp_path, command, content):
    """A typo in --db created an empty database: `rounds status` answered {"round_id": null} with exit 0 and
    `clients list` printed nothing, as if the server had no round and no client; an empty or another
    program's SQLite file got the server's tables written into it."""
    db = tmp_path / "fd.db"
    _write_db_file(db, content)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = CliRunner().invoke(app, [*command, "--db", f"sqlite:///{db}"], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert str(db) in flat(result.output)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_clients_add_still_creates_the_database(tmp_path):
    db = tmp_path / "fed.db"
    assert CliRunner().invoke(app, ["clients", "add", "phone-1", "--db", f"sqlite:///{db}"]).exit_code == 0
    listed = CliRunner().invoke(app, ["clients", "list", "--db", f"sqlite:///{db}"])
    assert listed.exit_code == 0 and "phone-1" in listed.output


def test_rounds_open_checks_its_paths_before_creating_the_database(tmp_path):
    """A mistyped --bundle-dir or key path was refused only after `rounds open` had created an empty
    database at --db (then `rounds status` found "no round" there instead of "no database")."""
    db, key = tmp_path / "fed.db", tmp_path / "signing.pub"
    key.write_bytes(b"x")
    cases = [(["--bundle-dir", str(tmp_path / "absent"), "--public-key", str(key)], "--bundle-dir"),
             (["--bundle-dir", str(tmp_path), "--public-key", str(tmp_path / "absent.pub")], "--public-key")]
    for args, named in cases:
        result = CliRunner().invoke(app, ["rounds", "open", *args, "--db", f"sqlite:///{db}"], env={"COLUMNS": "500"})
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
        assert named in flat(result.output) and ("no bundle folder there" in flat(result.output)
                                                 or "no key file there" in flat(result.output))
        assert not db.exists()


@pytest.mark.parametrize("args, named", [(["--recluster"], "--recluster"), (["--clip-norm", "1"], "clip_norm"),
                                         (["--kind", "mlp"], "--router"), (["--kind", "mlp", "--continue"], "--continue")])
@pytest.mark.parametrize("empty_file", [False, True], ids=["no_file", "empty_file"])
def test_a_refused_first_rounds_open_leaves_no_database(tmp_path, args, named, empty_file):
    """Options refused by the round kind (some need the database: --recluster, --continue) leave --db as it was:
    no file, or an existing 0-byte file still 0 bytes (no schema written before the refusal)."""
    from export.bundle_writer import write_bundle
    from export.signing import generate_keypair, load_signing_key

    key, pub = generate_keypair(tmp_path / "keys")
    write_bundle(tmp_path / "bundle", {"kmeans.npz": b"x"}, {"bundle_version": 1, "router_kind": "kmeans"},
                 load_signing_key(key))
    if empty_file:
        (tmp_path / "fed.db").touch()
    result = CliRunner().invoke(app, ["rounds", "open", "--bundle-dir", str(tmp_path / "bundle"), "--public-key",
                                      str(pub), "--db", f"sqlite:///{tmp_path / 'fed.db'}", *args], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert named in flat(result.output)
    assert {p.name: p.stat().st_size for p in tmp_path.glob("fed.db*")} == ({"fed.db": 0} if empty_file else {})


@pytest.mark.parametrize("mode, refused", [(0o600, False), (0o400, False), (0o644, True), (0o640, True),
                                           (0o604, True), (0o620, True)],
                         ids=["0600", "0400", "0644", "0640", "0604", "0620"])
def test_a_signing_key_that_group_or_others_may_access_is_refused_as_openssh_does(tmp_path, monkeypatch, mode, refused):
    """A world-readable signing.key (0644, e.g. after a plain copy or an editor's save) was accepted silently by
    every command that signs. Like OpenSSH, load_signing_key now refuses a key file of ours with any bit of
    0o077, naming the file and the chmod to run; FEDROUTE_ALLOW_OPEN_SIGNING_KEY=1 accepts it."""
    import os

    from export.errors import ExportError
    from export.signing import ALLOW_OPEN_KEY_ENV, generate_keypair, load_signing_key

    key, _ = generate_keypair(tmp_path / "keys")
    assert key.stat().st_mode & 0o777 == 0o600  # keygen writes owner-only
    os.chmod(key, mode)
    monkeypatch.delenv(ALLOW_OPEN_KEY_ENV, raising=False)
    if not refused:
        load_signing_key(key)
        return
    message = (f"signing key {key} has mode {mode:04o}: group or others may access it, and a private key must be "
               f"accessible by its owner only; run `chmod 600 {key}` (or set FEDROUTE_ALLOW_OPEN_SIGNING_KEY=1 to accept it)")
    with pytest.raises(ExportError) as info:
        load_signing_key(key)
    assert str(info.value) == message
    monkeypatch.setenv(ALLOW_OPEN_KEY_ENV, "1")
    load_signing_key(key)


def test_rounds_open_refuses_a_world_readable_signing_key_before_creating_the_database(tmp_path, monkeypatch,
                                                                                       capsys):
    import os

    from export.bundle_writer import write_bundle
    from export.signing import generate_keypair, load_signing_key

    key, _ = generate_keypair(tmp_path / "keys")
    write_bundle(tmp_path / "bundle", {"kmeans.npz": b"x"}, {"bundle_version": 1, "router_kind": "kmeans"},
                 load_signing_key(key))
    os.chmod(key, 0o644)
    monkeypatch.delenv("FEDROUTE_ALLOW_OPEN_SIGNING_KEY", raising=False)
    db = tmp_path / "fed.db"
    code, err = console(monkeypatch, capsys, ["rounds", "open", "--bundle-dir", str(tmp_path / "bundle"),
                                              "--signing-key", str(key), "--db", f"sqlite:///{db}"])
    assert code == 2 and "Traceback" not in err
    assert f"error: signing key {key} has mode 0644: group or others may access it" in flat(err)
    assert f"run `chmod 600 {key}`" in flat(err)
    assert not db.exists()


@pytest.mark.parametrize("option", ["--signing-key", "--public-key"])
def test_rounds_open_refuses_a_key_the_bundle_is_not_signed_with_before_creating_the_database(tmp_path, option):
    """`rounds open --signing-key` of another key pair than the bundle's created the database, then failed with
    'manifest signature does not verify with public key 197f...', naming neither the bundle nor the key file."""
    from export.bundle_writer import write_bundle
    from export.signing import generate_keypair, load_signing_key

    signed_with, _ = generate_keypair(tmp_path / "keys")
    other_private, other_public = generate_keypair(tmp_path / "other")
    write_bundle(tmp_path / "bundle", {"kmeans.npz": b"x"}, {"bundle_version": 1, "router_kind": "kmeans"},
                 load_signing_key(signed_with))
    db, key = tmp_path / "fed.db", other_private if option == "--signing-key" else other_public
    result = CliRunner().invoke(app, ["rounds", "open", "--bundle-dir", str(tmp_path / "bundle"), option, str(key),
                                      "--db", f"sqlite:///{db}"], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert (f"--bundle-dir {tmp_path / 'bundle'} (checked with {option} {key}): manifest signature does not verify"
            in flat(result.output))
    assert not db.exists()


@pytest.mark.parametrize("option", ["--n-parity", "--bundle-version"])
def test_mor_export_refuses_counts_below_one_while_parsing(tmp_path, option):
    """--n-parity -3 ended in pandas' 'A negative number of rows requested' traceback after the mixture and the
    data were loaded; --bundle-version 0 was refused only after that."""
    result = CliRunner().invoke(app, ["mor", "export", "--mixture", str(tmp_path), "--client", "c", "--out",
                                      str(tmp_path / "b"), "--signing-key", str(tmp_path / "k"), option, "-3"],
                                env={"COLUMNS": "500"})
    assert result.exit_code == 2 and f"Invalid value for '{option}': -3 is not in the range" in flat(result.output)
    assert not (tmp_path / "b").exists()


def test_prism_train_refuses_more_experts_than_public_prompts_before_the_data(tmp_path):
    """--n-experts 301 with --quick (300 public prompts) was refused by the router's K-means start only after
    the data preparation (minutes on a busy CPU)."""
    result = CliRunner().invoke(app, ["prism", "train", "--quick", "--n-experts", "301", "--out", str(tmp_path / "run"),
                                      "--data", str(tmp_path / "absent")], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert ("--n-experts 301: the quick preset holds 300 public prompts and the router's K-means start needs at "
            "least one per expert") in flat(result.output)
    assert not (tmp_path / "run").exists()


def test_no_help_text_shows_sphinx_markup():
    """`fedroute --help` listed serve as '... HTTP limits: :mod:`trainer.server.http_limits`.' (a docstring
    role meant for the API docs). Every command's and option's help text is checked."""
    found = []

    def walk(command: click.Command, path: list[str]) -> None:
        texts = [command.help or ""] + [getattr(param, "help", None) or "" for param in command.params]
        found.extend(f"{' '.join(path)}: {text}" for text in texts
                     if any(role in text for role in (":mod:", ":class:", ":func:", ":meth:", "``")))
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])

    walk(get_command(app), [])
    assert found == []


@pytest.mark.parametrize("command", ["simulate", "ablate"])
def test_simulate_refuses_the_same_file_as_train_and_test(routerbench_dir, tmp_path, command):
    """--train F --test F trained and scored on the same queries and reported the inflated figures (exit 0)."""
    same = routerbench_dir / "test.parquet"
    result = CliRunner().invoke(app, [command, "--train", str(same), "--test", str(routerbench_dir / ".." / "routerbench" /
                                                                               "test.parquet"),
                                      "--out", str(tmp_path / "out"), "--seeds", "1", "--routers", "kmeans"],
                                env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert f"--train and --test are the same file ({same}); give a held-out test file" in flat(result.output)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, rows, named", [(["simulate", "--n-clients", "4"], 3, "--n-clients 4"),
                                               (["simulate", "--online", "--n-clients", "4"], 3, "--n-clients 4"),
                                               (["ablate"], 39, "the ablation's N = 40")])
def test_simulate_refuses_more_clients_than_training_rows(routerbench_dir, tmp_path, args, rows, named):
    """More clients than training rows (--n-clients, or the ablation's largest N = 40) ran (347 s on RouterBench)
    with clients that held no query."""
    import pandas as pd

    for split in ("train", "test"):
        pd.read_parquet(routerbench_dir / f"{split}.parquet").iloc[:rows].to_parquet(tmp_path / f"{split}.parquet")
    result = CliRunner().invoke(app, [*args, "--train", str(tmp_path / "train.parquet"), "--test",
                                      str(tmp_path / "test.parquet"), "--out", str(tmp_path / "out")], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert named in flat(result.output) and f" {rows} training rows" in flat(result.output)
    assert not (tmp_path / "out").exists()


def test_simulate_refuses_a_repeated_router_kind_before_the_data(tmp_path):
    """--routers kmeans,kmeans trained K-means twice per seed and reported the second, drawn from another RNG
    state, so the figures differed from --routers kmeans without a word."""
    result = CliRunner().invoke(app, ["simulate", "--routers", "kmeans,kmeans", "--data", str(tmp_path / "absent"),
                                      "--out", str(tmp_path / "out")], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert "routers=('kmeans', 'kmeans'): give each kind once" in flat(result.output)
    assert not (tmp_path / "out").exists()


def test_export_selector_refuses_a_run_whose_test_prompts_are_not_in_the_data(tmp_path, monkeypatch, capsys, shared_data,
                                                                             signing_keys):
    """splits.json naming no prompt of --data (a run trained on other data) ended in pandas' 'No objects to
    concatenate' traceback."""
    expert = tmp_path / "fedprism_seed0" / "expert_0"
    (expert / "adapter").mkdir(parents=True)
    (expert.parent / "splits.json").write_text('{"train": [], "test": ["not-a-prompt-id"]}')
    code, err = console(monkeypatch, capsys, ["export", "--selector", str(expert), "--out", str(tmp_path / "bundle"),
                                              "--signing-key", str(signing_keys[0]), "--data", str(shared_data)])
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: no preference pair of {shared_data} is a held-out prompt of "
                          f"{expert.parent / 'splits.json'} for the parity check")
    assert not (tmp_path / "bundle").exists()


@pytest.mark.parametrize("owner, command", [
    ("prism train", ["mor", "eval", "--quick"]), ("prism train", ["simulate"]), ("mor eval", ["prism", "train", "--quick"]),
])
def test_a_command_refuses_the_results_folder_of_another(tmp_path, monkeypatch, capsys, owner, command):
    """`fedroute mor eval --out RUN` on a `prism train` folder (or simulate, or the other way) replaced its
    results.json and results.md without a word; refused now, before the data is read."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"command": owner, "methods": {}}))
    code, err = console(monkeypatch, capsys, [*command, "--out", str(out), "--data", str(tmp_path / "absent")])
    name = " ".join(c for c in command if not c.startswith("--"))
    assert code == 2 and err == (f"error: --out {out} holds the results of `fedroute {owner}`; `fedroute {name}` would "
                                 "replace them: give another folder\n")
    assert json.loads((out / "results.json").read_text()) == {"command": owner, "methods": {}}


def test_a_rerun_of_the_same_command_and_an_absent_results_file_are_allowed(tmp_path):
    from trainer.results_owner import claim_results

    (tmp_path / "results.json").write_text('{"command": "simulate"}')
    claim_results(tmp_path, "simulate")
    claim_results(tmp_path / "absent", "prism train")
    claim_results(tmp_path / "absent" / "deeper", "mor eval")


#: Top-level keys of each command's results.json as written before the owner key existed (the
#: prism one is docs/results/prism_quick/results.json's).
OLD_RESULTS = {
    "simulate": {"references": {}, "routers": {}, "client_distribution": {}, "config": {}, "seconds": 1.0},
    "prism train": json.loads((Path(__file__).resolve().parents[1] / "docs" / "results" / "prism_quick" /
                               "results.json").read_text()),
    "mor eval": {"methods": {}, "single_rms": {}, "router_weighting": {}, "routing_errors": {}, "seeds": [],
                 "seconds": 1.0},
}


@pytest.mark.parametrize("owner", sorted(OLD_RESULTS))
def test_an_older_results_file_without_the_owner_key_belongs_to_the_command_its_keys_name(tmp_path, owner):
    """A results.json written before the owner key existed was left to any command: `fedroute mor eval
    --out` on an old `prism train` folder replaced its results without a word. Its keys tell its command."""
    from trainer.results_owner import OWNER_KEY, claim_results

    assert OWNER_KEY not in OLD_RESULTS[owner]
    (tmp_path / "results.json").write_text(json.dumps(OLD_RESULTS[owner]))
    claim_results(tmp_path, owner)  # a rerun of the same command
    for command in sorted(set(OLD_RESULTS) - {owner}):
        with pytest.raises(InvalidInputError) as info:
            claim_results(tmp_path, command)
        assert str(info.value) == (f"--out {tmp_path} holds the results of `fedroute {owner}`; `fedroute {command}` "
                                   "would replace them: give another folder")


@pytest.mark.parametrize("content", ['{"routers": {}}', '{"notes": "mine"}', '{"eval_split": "test", "methods": {}, '
                                     '"single_rms": {}}', "[1, 2]", "null", "not json", b"\xff\xfe"])
def test_a_results_file_that_names_no_command_is_refused_by_every_command(tmp_path, content):
    """Such a file (hand-written, another tool's, keys of two commands, or not JSON) was treated as
    "nothing to protect" and replaced; now every command refuses it and says what to do."""
    from trainer.results_owner import claim_results

    path = tmp_path / "results.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    for command in OLD_RESULTS:
        with pytest.raises(InvalidInputError) as info:
            claim_results(tmp_path, command)
        message = str(info.value)
        assert message.startswith(f"--out {tmp_path} holds a results.json that ")
        assert message.endswith(f"`fedroute {command}` would replace it: give another folder or remove {path}")
    assert path.read_bytes() == (content if isinstance(content, bytes) else content.encode())


def test_a_folder_named_results_json_is_refused(tmp_path):
    from trainer.results_owner import claim_results

    (tmp_path / "results.json").mkdir()
    with pytest.raises(InvalidInputError, match="results.json"):
        claim_results(tmp_path, "simulate")


def test_mor_eval_refuses_an_old_prism_results_folder_before_the_data(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(OLD_RESULTS["prism train"]))
    code, err = console(monkeypatch, capsys, ["mor", "eval", "--quick", "--out", str(out),
                                              "--data", str(tmp_path / "absent")])
    assert code == 2 and err == (f"error: --out {out} holds the results of `fedroute prism train`; `fedroute mor eval` "
                                 "would replace them: give another folder\n")
    assert json.loads((out / "results.json").read_text()) == OLD_RESULTS["prism train"]


# ------------------------------------------------------------------ an unwritable --out, refused before any work

#: Each command that works for minutes before it writes its --out, with the options it needs to reach
#: its --out check (paths under tmp_path given as "TMP/...", the signing key as "KEY").
OUT_COMMANDS = {
    "simulate": ["simulate", "--data", "TMP/absent"],
    "ablate": ["ablate", "--data", "TMP/absent"],
    "prism train": ["prism", "train", "--quick", "--data", "TMP/absent"],
    "prism label": ["prism", "label", "--run", "TMP"],
    "prism dpo": ["prism", "dpo", "--prefs", "TMP/prefs.jsonl", "--tiny"],
    "mor train": ["mor", "train", "--quick", "--data", "TMP/absent"],
    "mor eval": ["mor", "eval", "--quick", "--data", "TMP/absent"],
    "mor audit": ["mor", "audit", "--quick", "--data", "TMP/absent"],
    "mor grpo": ["mor", "grpo", "--quick", "--mixture", "TMP/absent"],
    "mor export": ["mor", "export", "--mixture", "TMP/absent", "--client", "c", "--signing-key", "KEY"],
    "export": ["export", "--router", "TMP/router", "--signing-key", "KEY"],
    "add-model": ["add-model", "--router", "TMP/router", "--model", "new", "--calibration", "TMP/absent.csv"],
}


def unwritable_out(tmp_path, where: str):
    """An --out that cannot be written even by root (chmod does not stop root): a path under a regular
    file, or under /proc (no file can be created there). Returns (out, the message's tail)."""
    if where == "under a file":
        out = tmp_path / "notes.txt" / "out"
        return out, f"--out {out}: {tmp_path / 'notes.txt'} is a file, not a folder, so {out} cannot be written"
    out = Path("/proc") / "fedroute-no-such-folder" / "out"
    return out, f"--out {out}: cannot write in /proc ("


@pytest.mark.parametrize("where", ["under a file", "under /proc"])
@pytest.mark.parametrize("name", sorted(OUT_COMMANDS))
def test_an_unwritable_out_is_refused_before_any_work(tmp_path, monkeypatch, capsys, signing_keys, name, where):
    """An --out that could not be written (read-only, under a file) failed only when the results were
    saved, after minutes of training (simulate, prism, mor) or of export. One shared check
    (trainer.out_folder.check_out_folder) refuses it first: exit 2, one message naming --out."""
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "prefs.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c", "prompt_id": 1}\n')
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "router.json").write_text("{}")
    before = sorted(p.name for p in tmp_path.iterdir())
    out, message = unwritable_out(tmp_path, where)
    args = [str(signing_keys[0]) if a == "KEY" else a.replace("TMP", str(tmp_path)) for a in OUT_COMMANDS[name]]
    code, err = console(monkeypatch, capsys, [*args, "--out", str(out)])
    assert code == 2 and message in flat(err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no test file left
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_check_out_folder_accepts_what_can_be_written_and_leaves_nothing(tmp_path):
    from trainer.out_folder import check_out_folder

    check_out_folder(tmp_path)  # an existing folder
    check_out_folder(tmp_path / "new" / "deeper")  # created later by the command
    check_out_folder(tmp_path / "bundle", beside=True)
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")  # a bundle's link may point anywhere: the writer checks
    check_out_folder(tmp_path / "link", beside=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]
    with pytest.raises(InvalidInputError, match="^--bundle-dir "):
        check_out_folder(tmp_path / "link", "--bundle-dir")


# ------------------------------------------------------------------ fedroute export: argument errors before torch

EXPORT_CASES = [  # (arguments, message); TMP is a fresh folder, KEY a valid signing key
    (["--router", "TMP/nope", "--signing-key", "KEY", "--out", "TMP/b"],
     "--router TMP/nope is not a folder; give the folder of a trained router"),
    (["--router", "TMP", "--signing-key", "KEY", "--out", "TMP/b"],
     "--router TMP holds no router.json; give the folder of a trained router"),
    (["--router", "TMP/router", "--signing-key", "TMP/no.key", "--out", "TMP/b"],
     "error: cannot read signing key TMP/no.key"),
    (["--router", "TMP/router", "--signing-key", "TMP/router/router.json", "--out", "TMP/b"],
     "error: TMP/router/router.json is not an unencrypted PEM private key"),
    (["--router", "TMP/router", "--signing-key", "KEY", "--out", "TMP/notes.txt/b"],
     "error: --out TMP/notes.txt/b: TMP/notes.txt is a file, not a folder, so TMP/notes.txt/b cannot be written"),
    (["--router", "TMP/router", "--signing-key", "KEY", "--out", "TMP/router"],
     "error: TMP/router exists and is not a fedroute bundle; refusing to replace it"),
    (["--router", "TMP/router", "--signing-key", "KEY", "--out", "TMP/b", "--precision", "int4"],
     "--precision int4: unknown; known: ['int8', 'int8-all']"),
    (["--router", "TMP/router", "--signing-key", "KEY", "--out", "TMP/b", "--data", "TMP/absent"],
     "--data TMP/absent does not exist"),
    (["--router", "TMP/router", "--signing-key", "KEY", "--out", "TMP/b", "--prices", "TMP/notes.txt"],
     "--prices TMP/notes.txt: expected JSON {model: {"),
    (["--router", "TMP/router", "--signing-key", "KEY", "--out", "TMP/b", "--prior-domain", "alpacaeval"],
     "--prior-domain is for --selector bundles"),
    (["--router", "TMP/router", "--signing-key", "KEY", "--out", "TMP/b", "--bundle-version", str(2**63)],
     "Invalid value for '--bundle-version': 9223372036854775808 is not in the range 1<=x<=9223372036854775807"),
    (["--router", "TMP/router", "--selector", "TMP", "--signing-key", "KEY", "--out", "TMP/b"],
     "give exactly one of --router DIR and --selector DIR"),
    (["--selector", "TMP/nope", "--signing-key", "KEY", "--out", "TMP/b"],
     "--selector TMP/nope is not a folder; give a trained expert folder"),
]

_EXPORT_SCRIPT = """
import json, sys
from trainer.cli import main
heavy = ("torch", "sentence_transformers", "transformers", "optimum")
report = []
argvs, command = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for argv in argvs:
    sys.argv = ["fedroute", *command, *argv]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    print("@@", file=sys.stderr, flush=True)
    report.append({"code": code, "heavy": [m for m in heavy if m in sys.modules]})
print(json.dumps(report))
"""


def test_export_refuses_bad_arguments_before_importing_torch(tmp_path, signing_keys):
    """`fedroute export` imported sentence-transformers and torch (10-15 s) before it looked at its
    arguments: a missing router folder or key, a bad --out or --precision failed only then. Now each is
    refused first: exit 2, its message, and neither torch nor sentence-transformers imported
    (checked in a fresh interpreter, where nothing imported them before)."""
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "router.json").write_text("{}")
    cases = [([str(signing_keys[0]) if a == "KEY" else a.replace("TMP", str(tmp_path)) for a in args],
              message.replace("TMP", str(tmp_path))) for args, message in EXPORT_CASES]
    report, errors = run_export_script(tmp_path, ["export"], [a for a, _ in cases])
    assert len(report) == len(cases)
    for (args, message), got, err in zip(cases, report, errors):
        assert got == {"code": 2, "heavy": []}, (args, got, err)
        assert message in flat(err), (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "router"]  # nothing written


def run_export_script(cwd: Path, command: list[str], argvs: list[list[str]]) -> tuple[list[dict], list[str]]:
    """Run ``fedroute COMMAND ARGV`` for each ARGV in one fresh interpreter (_EXPORT_SCRIPT): ([{code, heavy
    modules imported}], [stderr of each])."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "500", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", _EXPORT_SCRIPT, json.dumps(argvs), json.dumps(command)], cwd=cwd,
                         env=env, capture_output=True, text=True, timeout=120)
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr.split("@@\n")


def test_mor_export_refuses_a_bad_signing_key_before_loading_the_mixture(tmp_path, signing_keys):
    """`fedroute mor export` loaded the mixture (torch, the reward models) before it read --signing-key: a
    missing or wrong key was refused only after that, and a corrupt mixture was reported instead of it. Now
    the key is checked first: exit 2, one line naming the key, torch not imported, nothing written."""
    (tmp_path / "mix").mkdir()
    (tmp_path / "mix" / "mixture.json").write_text("[1]")  # would be refused too, but after the key
    (tmp_path / "notes.txt").write_text("keep me")
    cases = [("absent.key", f"error: cannot read signing key {tmp_path / 'absent.key'}: "),
             ("notes.txt", f"error: {tmp_path / 'notes.txt'} is not an unencrypted PEM private key: "),
             (str(signing_keys[1]), f"error: {signing_keys[1]} is not an unencrypted PEM private key: ")]  # the .pub
    argvs = [["--mixture", str(tmp_path / "mix"), "--client", "c", "--out", str(tmp_path / "b"),
              "--signing-key", str(tmp_path / key)] for key, _ in cases]
    report, errors = run_export_script(tmp_path, ["mor", "export"], argvs)
    assert len(report) == len(cases)
    for (key, message), got, err in zip(cases, report, errors):
        assert got == {"code": 2, "heavy": []}, (key, got, err)
        assert err.startswith(message) and len(err.splitlines()) == 1, (key, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mix", "notes.txt"]  # nothing written


def test_mor_export_refuses_a_bundle_it_must_not_replace_before_loading_the_mixture(tmp_path, make_bundle, signing_keys):
    """A router bundle at --out was refused only after the mixture was loaded (torch, the reward models): now
    first, as the signing key is (exit 2, one line, torch not imported, the bundle untouched). The version
    check (--bundle-version above the one at --out) runs at the same point."""
    (tmp_path / "mix").mkdir()
    (tmp_path / "mix" / "mixture.json").write_text("[1]")  # would be refused too, but after --out
    make_bundle(tmp_path / "router")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "router").iterdir())
    argv = ["--mixture", str(tmp_path / "mix"), "--client", "c", "--signing-key", str(signing_keys[0]),
            "--out", str(tmp_path / "router")]
    report, errors = run_export_script(tmp_path, ["mor", "export"], [argv])
    assert report == [{"code": 2, "heavy": []}], errors
    assert errors[0].startswith(f"error: {tmp_path / 'router'} holds a router bundle; refusing to replace it")
    assert len(errors[0].splitlines()) == 1
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "router").iterdir()) == before


def test_mor_grpo_quick_keeps_the_lengths_given_on_the_line():
    """--quick replaced --steps, --n-prompts and --max-completion-length given on the line (--quick --steps 5
    ran 20 steps, silently); it now fills in only the ones left out."""
    from trainer.alignment.grpo_cli import run_lengths

    assert run_lengths(True, None, None, None) == (20, 64, 16)
    assert run_lengths(True, 5, None, 8) == (5, 64, 8)
    assert run_lengths(False, None, 100, None) == (60, 100, 32)
    help_text = flat(CliRunner().invoke(app, ["mor", "grpo", "--help"], env={"COLUMNS": "500"}).output)
    assert "GRPO optimiser steps (default 60; 20 with --quick)" in help_text


@pytest.mark.parametrize("command, option", [
    (["mor", "grpo", "--mixture", "MIX", "--device", "cuda"], "--device"),
    (["prism", "dpo", "--prefs", "PREFS", "--tiny", "--gpu"], "--gpu"),
    # prism train --preset gpu used to train at the paper's scale on the CPU: nothing moved to CUDA
    (["prism", "train", "--preset", "gpu"], "--preset gpu (its device)"),
    (["prism", "train", "--quick", "--device", "cuda"], "--device"),
])
def test_a_cuda_run_on_a_machine_without_cuda_is_refused_before_any_work(tmp_path, command, option):
    """`mor grpo --device cuda` and `prism dpo --gpu` on a CPU-only machine failed to move the policy only after
    the mixture and the data were read and OUT/tiny_policy was built."""
    if torch_cuda_available():
        pytest.skip("this machine has CUDA")
    (tmp_path / "mixture.json").write_text("{}")
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text('{"prompt": "a", "chosen": "b", "rejected": "c", "prompt_id": 1}\n'
                     '{"prompt": "d", "chosen": "e", "rejected": "f", "prompt_id": 2}\n')
    args = [str(tmp_path) if a == "MIX" else str(prefs) if a == "PREFS" else a for a in command]
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [*args, "--out", str(out)], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert f"{option} 'cuda': torch sees no CUDA device (CPU-only build or no GPU)" in flat(result.output)
    assert not out.exists()


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def test_mor_train_refuses_a_negative_seed_while_parsing(tmp_path):
    """--seed -1 was refused by the split only after the preference data was read."""
    result = CliRunner().invoke(app, ["mor", "train", "--quick", "--seed", "-1", "--out", str(tmp_path / "mix"),
                                      "--data", str(tmp_path / "absent")], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and "Invalid value for '--seed': -1 is not in the range 0<=x<=4294967295" in flat(result.output)
    assert not (tmp_path / "mix").exists()


@pytest.mark.parametrize("args, message", [
    (["--router", "R", "--prior-domain", "alpacaeval"],
     "--prior-domain is for --selector bundles; a router export checks parity on --data"),
    (["--router", "R", "--parity-pairs", "50"], "--parity-pairs is for --selector bundles"),
    (["--selector", "R", "--cache-dir", "C"], "--cache-dir is for router bundles and routed FedPrism runs (a single "
                                              "selector export embeds nothing)"),
])
def test_export_refuses_the_options_of_the_other_bundle_kind(tmp_path, args, message):
    """--prior-domain and --parity-pairs with --router, and --cache-dir with --selector, were ignored without a
    word (as --prices and --precision with --selector are not)."""
    args = [str(tmp_path / a) if a in ("R", "C") else a for a in args]
    result = CliRunner().invoke(app, ["export", *args, "--out", str(tmp_path / "bundle"), "--signing-key",
                                      str(tmp_path / "signing.key")], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert message in flat(result.output)
    assert not (tmp_path / "bundle").exists()


def test_prism_label_given_the_method_folder_names_the_run(tmp_path, monkeypatch, capsys):
    """--run RUN/fedprism_seed0 (the folder the selector export's path goes through) was answered with 'run
    `fedroute prism train --out RUN/fedprism_seed0` first', i.e. train again into the method folder."""
    saved = tmp_path / "run" / "fedprism_seed0"
    saved.mkdir(parents=True)
    (saved / "fedprism_config.json").write_text('{"n_experts": 1}')
    code, err = console(monkeypatch, capsys, ["prism", "label", "--run", str(saved), "--out", str(tmp_path / "phase3")])
    assert code == 2 and err == (f"error: {saved} is a method folder of a run (fedprism_seed0/), not the run: give "
                                 f"--run {tmp_path / 'run'} (the --out of `fedroute prism train`)\n")
    assert not (tmp_path / "phase3").exists()


def test_mor_grpo_refuses_more_prompts_than_the_public_pool(shared_data):
    """--n-prompts above what the alternating AlpacaEval / HH pool holds trained on fewer prompts, silently."""
    from sdk.errors import InvalidInputError
    from trainer.alignment.grpo_cli import public_prompts

    four = public_prompts(shared_data, 4)
    assert len(four) == len(set(four)) == 4
    with pytest.raises(InvalidInputError, match="--n-prompts"):
        public_prompts(shared_data, 10**6)


def test_prism_train_refuses_quick_with_another_preset(tmp_path):
    """--quick --preset gpu trained the quick preset and said nothing about the preset asked for."""
    result = CliRunner().invoke(app, ["prism", "train", "--quick", "--preset", "gpu", "--out", str(tmp_path / "run"),
                                      "--data", str(tmp_path / "absent")], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert "--quick is the small preset; give --quick or --preset gpu, not both" in flat(result.output)
    assert not (tmp_path / "run").exists()


def test_routed_grpo_trainer_refuses_fewer_prompts_than_one_step_takes():
    """RoutedGRPOTrainer with 3 prompts and prompts_per_step=4: TRL ran no step and train() ended in
    'empty GRPO history: no step was logged'."""
    from trainer.alignment.errors import AlignmentConfigError
    from trainer.alignment.grpo import RoutedGRPOConfig, RoutedGRPOTrainer

    config = RoutedGRPOConfig(model="unused", prompts_per_step=4)
    with pytest.raises(AlignmentConfigError, match="prompts_per_step"):
        RoutedGRPOTrainer(config, None, ["a", "b", "c"])


def test_a_grpo_rerun_in_the_other_mode_removes_the_earlier_modes_results(tmp_path):
    """`mor grpo --online compare` then `--online on` into one --out left comparison.* and online/, offline/
    beside the new history.json (and the other way round): results of two runs in one folder. The results
    of either kind go (tests/test_trainer_artefacts_hostile.py: a rerun in the same mode), nothing else."""
    from trainer.alignment.grpo_cli import clear_earlier_results

    out = tmp_path / "grpo"
    (out / "online").mkdir(parents=True)
    (out / "online" / "history.json").write_text("{}")
    (out / "offline").mkdir()
    for name in ("comparison.json", "comparison.md", "comparison.png", "history.json", "grpo.png", "notes.txt"):
        (out / name).write_text("old")
    assert clear_earlier_results(out) == ["history.json", "grpo.png", "comparison.json", "comparison.md",
                                          "comparison.png", "online", "offline"]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert clear_earlier_results(out) == []


def int_options() -> list:
    """A test case per integer option of every ``fedroute`` and ``fedroute-sync`` command."""
    return [pytest.param(root, path, param.opts[0], id=" ".join([*path, param.opts[0]]))
            for root, path, param in command_params() if isinstance(param.type, click.types.IntParamType)]


INT_OPTIONS = int_options()


def test_the_int_option_walk_finds_the_commands_options():
    ids = {c.id for c in INT_OPTIONS}
    assert {"simulate --seeds", "prism train --seeds", "prism train --device-threads", "prism dpo --batch-size",
            "prism dpo --seed", "mor train --seed", "mor train --threads", "mor eval --seeds", "mor grpo --seed",
            "mor grpo --num-generations", "mor export --n-parity", "export --parity-pairs",
            "serve --port", "serve --max-body-bytes", "serve --upload-quota", "serve --max-header-bytes",
            "rounds open --quorum", "rounds open --min-count", "rounds open --seed", "rounds open --min-total-count",
            "rounds close --round", "publish --round", "demo-log --rows", "demo-log --seed", "sync --retries",
            "sync --min-count-floor", "--retries", "--min-count-floor", "proxy --port", "export --bundle-version",
            "mor export --bundle-version"} <= ids


@pytest.mark.parametrize("root, path, option", INT_OPTIONS)
def test_every_int_option_refuses_a_value_out_of_range_while_parsing(tmp_path, monkeypatch, root, path, option):
    """Integer options had a lower bound only: --seeds 99999999999999999999 ended `prism train` in an
    OverflowError traceback after the data were prepared, --device-threads / --threads and `mor train
    --seed` in 'Overflow when unpacking long long' (torch), `prism dpo --batch-size` in islice's
    ValueError after the tiny policy was built, and a --seed above 2**32 - 1 reached TRL's set_seed
    (numpy refuses it); `rounds close --round`, `publish --round` and `rounds open --quorum / --min-count
    / --seed` in SQLite's OverflowError, and serve / demo-log / sync took any count; `export --bundle-version
    2**63` was refused only by the bundle writer, after the other options' checks. Each is now bounded
    (COUNT_MAX, SEED_MAX, 65535 for a port, MAX_BUNDLE_VERSION) while the line is parsed: exit 2, one line
    naming it."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(root, [*path, option, str(2**63)], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert f"Invalid value for '{option}': {2**63} is not in the range" in flat(result.output)
    assert list(tmp_path.iterdir()) == []


def cache_options() -> list:
    """A test case per embedding-cache folder option of every ``fedroute`` command."""
    cases = []

    def walk(command: click.Command, path: list[str]) -> None:
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
            return
        for param in command.params:
            if param.opts[0] in ("--cache-dir", "--cache"):
                cases.append(pytest.param(path, param.opts[0], id=" ".join([*path, param.opts[0]])))

    walk(get_command(app), [])
    return cases


CACHE_OPTIONS = cache_options()


def test_the_cache_option_walk_finds_the_commands_options():
    ids = {c.id for c in CACHE_OPTIONS}
    assert {"simulate --cache-dir", "export --cache-dir", "mor train --cache", "mor eval --cache", "mor grpo --cache-dir",
            "mor export --cache-dir", "prism train --cache-dir", "prism label --cache-dir"} <= ids


@pytest.mark.parametrize("path, option", CACHE_OPTIONS)
@pytest.mark.parametrize("where", ["file", "under a file"])
def test_every_cache_option_refuses_a_folder_it_cannot_write_while_parsing(tmp_path, monkeypatch, path, option, where):
    """--cache-dir naming a file (or a path under one) ended in a FileExistsError traceback when the
    embeddings were first cached: after the data were prepared (`prism train`, `mor eval`), after the run's
    pairs were read and segment-encoded (`prism label`, 25 s) or after the mixture was loaded (`mor grpo`).
    The option is checked while the line is parsed: exit 2, one line naming it, nothing written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not a folder")
    cache = tmp_path / "notes.txt" if where == "file" else tmp_path / "notes.txt" / "cache"
    result = CliRunner().invoke(app, [*path, option, str(cache)], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    message = (f"cache folder {cache} exists and is not a folder" if where == "file" else
               f"cache folder {cache}: {tmp_path / 'notes.txt'} is a file, not a folder, so {cache} cannot be written")
    assert f"Invalid value for '{option}': {message}" in flat(result.output)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
