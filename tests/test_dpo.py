"""DPO with TRL on a tiny random-weight policy (trainer.alignment.dpo).

The learnable task: prompts name two nouns; the chosen answer joins them with an adverb from GOOD, the
rejected one with an adverb from BAD, otherwise the two answers are identical. Held-out pairs use nouns
that never occur in training, so the policy can only rank them by having learned the adverb preference
(not by memorising prompts). Before DPO the policy equals the reference, so every implicit reward is 0 and
held-out accuracy is exactly 0.5 (ties count 0.5); a working DPO must lower its loss below log 2 and
raise held-out accuracy well above 0.5. A sign error in the loss or in the reward would fail both.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from trainer.alignment.dpo import (  # noqa: E402
    DPOAlignmentTrainer,
    DPORunConfig,
    pairwise_accuracy,
    read_preference_rows,
    sequence_logps,
)
from trainer.alignment.errors import AlignmentConfigError  # noqa: E402
from trainer.alignment.policy_models import build_tiny_causal_lm, load_policy  # noqa: E402

NOUNS = ["river", "apple", "engine", "garden", "window", "planet", "violin", "bridge", "candle", "forest",
         "rocket", "mirror", "pencil", "castle", "island", "spoon", "ladder", "tiger", "cloud", "harbor",
         "lantern", "meadow", "comet", "anchor"]
GOOD = ["clearly", "kindly", "gladly", "happily"]
BAD = ["never", "wrongly", "sadly", "badly"]


def make_rows(nouns, n, seed):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.sample(nouns, 2)
        rows.append({"prompt": f"tell me about the {a} and the {b} {i}",
                     "chosen": f"the {a} {rng.choice(GOOD)} helps the {b}",
                     "rejected": f"the {a} {rng.choice(BAD)} helps the {b}"})
    return rows


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    train = make_rows(NOUNS[:16], 96, seed=0)
    held = make_rows(NOUNS[16:], 32, seed=1)
    texts = [r[k] for r in train + held for k in ("prompt", "chosen", "rejected")] + ["user: assistant:"]
    policy = build_tiny_causal_lm(tmp_path_factory.mktemp("policy") / "tiny", train_texts=texts, vocab_size=300)
    return policy, train, held


def test_pairwise_accuracy_counts_ties_half():
    assert pairwise_accuracy([1.0, 0.0, 2.0, -1.0], [0.0, 0.0, 3.0, -1.0]) == pytest.approx((1 + 0.5 + 0 + 0.5) / 4)
    with pytest.raises(AlignmentConfigError, match="NaN"):
        pairwise_accuracy([float("nan")], [0.0])
    with pytest.raises(AlignmentConfigError, match="one length"):
        pairwise_accuracy([1.0, 2.0], [0.0])


def test_sequence_logps_sums_completion_tokens(task):
    """Hand-computed: the completion's log-probability is the sum over its tokens of the log-softmax at
    the previous position, and the prompt's tokens do not count."""
    policy_dir, train, _ = task
    model, tok = load_policy(policy_dir)
    row = train[0]
    got = sequence_logps(model, tok, [row["prompt"]], [row["chosen"]], chat=True)[0]
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True)
    full_ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]},
                                       {"role": "assistant", "content": row["chosen"]}])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([full_ids])).logits[0].double(), -1)
    expected = sum(logp[t - 1, full_ids[t]].item() for t in range(len(prompt_ids), len(full_ids)))
    assert got == pytest.approx(expected, abs=1e-4)


def test_dpo_lowers_loss_and_raises_heldout_implicit_reward_accuracy(task, tmp_path):
    policy_dir, train, held = task
    args = DPORunConfig(model=str(policy_dir), max_steps=30, learning_rate=1e-3, batch_size=8, beta=0.1)
    result = DPOAlignmentTrainer(args).train(train, held, tmp_path / "run")
    assert len(result.loss_per_step) == 30
    assert result.loss_first == pytest.approx(math.log(2), abs=1e-3)  # policy == reference at step 1
    assert np.mean(result.loss_per_step[-5:]) < 0.45
    assert result.heldout_implicit_reward_accuracy_before == 0.5
    assert result.heldout_implicit_reward_accuracy_after >= 0.9
    assert result.heldout_mean_margin_after > 0
    saved = json.loads((tmp_path / "run" / "dpo_results.json").read_text())
    assert saved["heldout_implicit_reward_accuracy_after"] == result.heldout_implicit_reward_accuracy_after
    assert (tmp_path / "run" / "dpo_loss.png").stat().st_size > 0
    # the saved policy loads back and differs from the reference
    trained, _ = load_policy(tmp_path / "run" / "model")
    ref, _ = load_policy(policy_dir)
    assert not torch.equal(trained.state_dict()["model.embed_tokens.weight"], ref.state_dict()["model.embed_tokens.weight"])


def test_dpo_plain_text_rows(task, tmp_path):
    policy_dir, train, held = task
    args = DPORunConfig(model=str(policy_dir), max_steps=15, learning_rate=1e-3, chat=False)
    result = DPOAlignmentTrainer(args).train(train, held, tmp_path / "plain")
    assert np.mean(result.loss_per_step[-5:]) < result.loss_first - 0.1
    assert result.heldout_implicit_reward_accuracy_after > 0.75


@pytest.mark.parametrize("kwargs, match", [
    (dict(beta=0.0), "beta=0.0"),
    (dict(learning_rate=-1.0), "learning_rate=-1.0"),
    (dict(max_steps=0), "max_steps=0"),
    (dict(dtype="float16"), "dtype='float16'"),
    (dict(device="tpu"), "device='tpu'"),
    (dict(dtype="bfloat16"), "CPU runs train in float32"),
    (dict(model=""), "empty"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(AlignmentConfigError, match=match):
        DPORunConfig(**{"model": "m", **kwargs})


def test_gpu_preset():
    cfg = DPORunConfig.gpu_preset("Qwen/Qwen2-0.5B-Instruct")
    assert (cfg.device, cfg.dtype, cfg.gradient_checkpointing, cfg.learning_rate) == ("cuda", "bfloat16", True, 5e-7)


def test_a_policy_that_does_not_load_leaves_no_output_folder(task, tmp_path):
    """The output folder was created before the policy loaded: a bad --policy left an empty folder."""
    from trainer.alignment.errors import PolicyUnavailableError

    _, train, held = task
    trainer = DPOAlignmentTrainer(DPORunConfig(model=str(tmp_path / "no-such-policy")))
    with pytest.raises(PolicyUnavailableError):
        trainer.train(train, held, tmp_path / "dpo")
    assert not (tmp_path / "dpo").exists()


def test_bad_rows(task, tmp_path):
    policy_dir, train, held = task
    trainer = DPOAlignmentTrainer(DPORunConfig(model=str(policy_dir)))
    with pytest.raises(AlignmentConfigError, match="split by prompt"):
        trainer.train(train, train[:4], tmp_path / "x")
    with pytest.raises(AlignmentConfigError, match="row 1 'chosen'"):
        trainer.train([train[0], {**train[1], "chosen": ""}], held, tmp_path / "x")
    with pytest.raises(AlignmentConfigError, match="chosen == rejected"):
        trainer.train([{**train[0], "rejected": train[0]["chosen"]}], held, tmp_path / "x")
    path = tmp_path / "prefs.jsonl"
    path.write_text("\n".join(json.dumps({**r, "p_a": 0.9}) for r in held))
    assert read_preference_rows(path) == held
    with pytest.raises(AlignmentConfigError, match="no 'rejected'"):
        path.write_text(json.dumps({"prompt": "a", "chosen": "b"}))
        read_preference_rows(path)
    with pytest.raises(AlignmentConfigError, match=".jsonl or .parquet"):
        read_preference_rows(tmp_path / "prefs.csv")


def test_prism_dpo_command_on_a_synthetic_set(tmp_path):
    """`fedroute prism dpo --tiny` on a Phase III-style file: held-out rows are oriented by the judge
    (rows with judge_agrees=False are flipped), split by prompt_id."""
    from typer.testing import CliRunner

    from trainer.cli import app

    rows = make_rows(NOUNS[:16], 80, seed=2) + make_rows(NOUNS[16:], 20, seed=3)
    lines = [json.dumps({**r, "prompt_id": f"p{i}", "judge_agrees": True, "p_chosen": 0.9}) for i, r in enumerate(rows)]
    prefs = tmp_path / "synthetic_preferences.jsonl"
    prefs.write_text("\n".join(lines) + "\n")
    out = tmp_path / "dpo"
    result = CliRunner().invoke(app, ["prism", "dpo", "--prefs", str(prefs), "--tiny", "--steps", "30", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "dpo_results.json").read_text())
    assert saved["n_heldout"] == 20 and saved["n_train"] == 80
    assert saved["loss_last"] < saved["loss_first"]
    assert saved["heldout_implicit_reward_accuracy_before"] == 0.5
    assert saved["heldout_implicit_reward_accuracy_after"] > 0.75
    assert (out / "tiny_policy" / "config.json").exists() and (out / "model" / "config.json").exists()
    bad = CliRunner().invoke(app, ["prism", "dpo", "--prefs", str(prefs), "--out", str(out)])
    assert bad.exit_code != 0 and "exactly one of --policy" in bad.output


def test_prism_dpo_names_a_diverged_run_and_keeps_no_results_of_the_replaced_tiny_policy(tmp_path, monkeypatch, capsys):
    """`prism dpo --tiny --lr 1e308` ended in 'Invalid value: scores hold NaN or inf', naming neither the
    policy's divergence nor the learning rate; and a --tiny rerun into an earlier run's --out rebuilt
    tiny_policy/ (the reference the earlier dpo_results.json was measured against) before it failed or was
    stopped, leaving that dpo_results.json beside another reference policy."""
    from trainer.cli import main

    rows = make_rows(NOUNS[:8], 12, seed=4)
    prefs = tmp_path / "synthetic_preferences.jsonl"
    prefs.write_text("".join(json.dumps({**r, "prompt_id": f"p{i}"}) + "\n" for i, r in enumerate(rows)))
    out = tmp_path / "dpo"
    out.mkdir()
    for name in ("dpo_results.json", "dpo_loss.png"):
        (out / name).write_text('{"earlier": true}')
    monkeypatch.setattr("sys.argv", ["fedroute", "prism", "dpo", "--prefs", str(prefs), "--tiny", "--steps", "1",
                                     "--lr", "1e308", "--out", str(out)])
    monkeypatch.setenv("COLUMNS", "500")
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert exit_info.value.code == 2
    assert ("the policy's log-probabilities are NaN or inf after training: the run diverged (learning_rate=1e+308, "
            "beta=0.1); lower --lr or --beta") in err
    assert not (out / "dpo_results.json").exists() and not (out / "dpo_loss.png").exists()


def test_a_max_length_that_every_prompt_fills_is_named(task, tmp_path):
    """TRL drops the pairs whose prompt alone fills max_length; when that was every pair (`prism dpo --tiny
    --max-length 16` on chat-templated prompts), training ended in torch's 'num_samples should be a positive
    integer value, but got num_samples=0' traceback."""
    policy_dir, train, held = task
    args = DPORunConfig(model=str(policy_dir), max_steps=1, learning_rate=1e-3, batch_size=8, max_length=4)
    with pytest.raises(AlignmentConfigError, match="--max-length"):
        DPOAlignmentTrainer(args).train(train, held, tmp_path / "run")
    assert not (tmp_path / "run" / "dpo_results.json").exists()


def test_pairs_dropped_for_their_prompt_length_are_counted(task, tmp_path):
    """TRL drops the pairs whose prompt alone fills max_length; dpo_results.json still gave n_train as the
    number of rows passed in, so a run that trained on a few of them read as one on all."""
    policy_dir, train, held = task
    long_prompt = "tell me about " + " and ".join(f"the {noun}" for noun in NOUNS) + " in detail"
    rows = train[:8] + [{**r, "prompt": f"{long_prompt} {i}"} for i, r in enumerate(train[8:12])]
    args = DPORunConfig(model=str(policy_dir), max_steps=1, learning_rate=1e-3, batch_size=4, max_length=48)
    result = DPOAlignmentTrainer(args).train(rows, held[:4], tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "dpo_results.json").read_text())
    assert (result.n_train, result.n_train_dropped) == (saved["n_train"], saved["n_train_dropped"]) == (8, 4)
