"""trainer.data.preferences and trainer.length_baseline: hand-made files with known pairs, then the real data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sdk.errors import InvalidInputError, ShapeError
from sdk.pair_encoding import length_features
from trainer.data.errors import DataFormatError, DataUnavailableError
from trainer.data.preferences import (
    PAIR_COLUMNS,
    dirichlet_clients,
    load_alpacaeval_pairs,
    load_hh_harmless_pairs,
    load_preference_pairs,
    load_routerbench_pairs,
    split_by_prompt,
)
from trainer.length_baseline import LengthBaseline, cross_validated_accuracy
from trainer.preference_metrics import expert_utilisation, pairwise_accuracy


def _winner_loser(df: pd.DataFrame) -> set[tuple[str, str]]:
    return {(r.source_a, r.source_b) if r.label == 1 else (r.source_b, r.source_a) for r in df.itertuples()}


@pytest.fixture()
def alpaca_dir(tmp_path: Path) -> Path:
    root = tmp_path / "alpacaeval"
    root.mkdir()
    pd.DataFrame({"instruction_id": [0, 1], "instruction": ["q0", "q1"], "dataset": ["koala", "oasst"]}).to_parquet(
        root / "instructions.parquet")
    rows = []
    prefs = {"m1": (1.9, 1.0), "m2": (1.0, 1.8), "m3": (1.45, 1.35), "NullModel": (2.0, 2.0),
             "gpt4_gamed": (1.0, 2.0), "m1_concise": (2.0, 1.0), "m2_verbose": (1.0, 1.0),
             "gpt4_1106_preview": (1.5, 1.5)}
    for g, (p0, p1) in prefs.items():
        rows += [(0, g, f"{g} says 0", p0, "gpt4_1106_preview"), (1, g, f"{g} says 1", p1, "gpt4_1106_preview")]
    pd.DataFrame(rows, columns=["instruction_id", "generator", "output", "preference", "reference_generator"]).to_parquet(
        root / "judgements.parquet")
    pd.DataFrame({"instruction_id": [0, 1], "reference_output": ["ref 0", "ref 1"],
                  "reference_generator": ["gpt4_1106_preview"] * 2}).to_parquet(root / "reference_outputs.parquet")
    return tmp_path


def test_alpacaeval_model_vs_model_pairs_follow_the_margin_and_exclusions(alpaca_dir: Path):
    df = load_alpacaeval_pairs(alpaca_dir, margin=0.5, max_pairs_per_instruction=None, include_reference_pairs=False)
    assert list(df.columns) == list(PAIR_COLUMNS)
    # instruction 0: m1 1.9, m2 1.0, m3 1.45 -> (m1>m2) gap .9; (m1>m3) gap .45 < .5 dropped; (m3>m2) .45 dropped
    # instruction 1: m1 1.0, m2 1.8, m3 1.35 -> (m2>m1) gap .8 kept; others < .5
    got = {(r.prompt_id, w, l) for r, (w, l) in zip(df.itertuples(), [
        (r.source_a, r.source_b) if r.label == 1 else (r.source_b, r.source_a) for r in df.itertuples()])}
    assert got == {("alpacaeval:0", "m1", "m2"), ("alpacaeval:1", "m2", "m1")}
    assert set(df["subset"]) == {"koala", "oasst"}
    assert df["label"].dtype == np.int8
    win = df.apply(lambda r: r.response_a if r.label == 1 else r.response_b, axis=1)
    assert sorted(win) == ["m1 says 0", "m2 says 1"]


def test_alpacaeval_reference_pairs_use_half_the_margin_around_indifference(alpaca_dir: Path):
    df = load_alpacaeval_pairs(alpaca_dir, margin=0.5, max_pairs_per_instruction=None, include_reference_pairs=True)
    ref = df[(df.source_a == "gpt4_1106_preview") | (df.source_b == "gpt4_1106_preview")]
    # |p - 1.5| >= 0.25: inst 0: m1 (1.9, wins), m2 (1.0, loses); m3 1.45 no.
    # inst 1: m1 (1.0, loses), m2 (1.8, wins); m3 1.35 no.
    got = {(r.prompt_id, *w) for r, w in zip(ref.itertuples(), [
        (r.source_a, r.source_b) if r.label == 1 else (r.source_b, r.source_a) for r in ref.itertuples()])}
    assert got == {("alpacaeval:0", "m1", "gpt4_1106_preview"), ("alpacaeval:0", "gpt4_1106_preview", "m2"),
                   ("alpacaeval:1", "gpt4_1106_preview", "m1"), ("alpacaeval:1", "m2", "gpt4_1106_preview")}
    assert len(ref) == 4


def test_loaders_raise_clear_errors(tmp_path: Path, alpaca_dir: Path):
    with pytest.raises(DataUnavailableError, match="test_parsed.parquet"):
        load_hh_harmless_pairs(tmp_path)
    pd.DataFrame({"instruction_id": [0], "generator": ["m"], "output": ["o"]}).to_parquet(
        alpaca_dir / "alpacaeval" / "judgements.parquet")
    with pytest.raises(DataFormatError, match="preference"):
        load_alpacaeval_pairs(alpaca_dir)
    with pytest.raises(InvalidInputError, match="margin"):
        load_alpacaeval_pairs(alpaca_dir, margin=2.0)
    with pytest.raises(InvalidInputError, match="domains"):
        load_preference_pairs(alpaca_dir, domains=("alpaca",))


def test_hh_and_routerbench_pairs_on_hand_made_files(tmp_path: Path):
    (tmp_path / "hh_rlhf_harmless").mkdir()
    pd.DataFrame({"row_id": [0, 1, 2], "prompt": ["p0", "p1", "p2"], "chosen_response": ["good", "  ", "fine"],
                  "rejected_response": ["bad", "x", "nope"]}).to_parquet(tmp_path / "hh_rlhf_harmless" / "test_parsed.parquet")
    hh = load_hh_harmless_pairs(tmp_path)
    assert len(hh) == 2 and _winner_loser(hh) == {("chosen", "rejected")}
    assert set(hh.apply(lambda r: r.response_a if r.label == 1 else r.response_b, axis=1)) == {"good", "fine"}

    (tmp_path / "routerbench").mkdir()
    cols = {"sample_id": ["a", "b"], "task": ["mbpp", "arc-challenge"], "prompt": ["write f", "which?"],
            "m1|correctness": [1.0, 1.0], "m1|response": ["def f(): pass", "A"],
            "m2|correctness": [0.0, 0.0], "m2|response": ["no", "B"],
            "m3|correctness": [0.0, np.nan], "m3|response": ["def g(): x", "C"]}
    pd.DataFrame(cols).to_parquet(tmp_path / "routerbench" / "train.parquet")
    pd.DataFrame({k: v[:0] for k, v in cols.items()}).astype({"m1|correctness": float, "m2|correctness": float,
                                                            "m3|correctness": float}).to_parquet(tmp_path / "routerbench" / "test.parquet")
    rb = load_routerbench_pairs(tmp_path, max_pairs_per_prompt=None)
    # 'A' vs 'B' has equal length -> dropped; m3 of 'which?' is unlabelled
    assert _winner_loser(rb) == {("m1", "m2"), ("m1", "m3")} and set(rb["subset"]) == {"mbpp"}
    keep = load_routerbench_pairs(tmp_path, max_pairs_per_prompt=None, equal_length="keep")
    assert len(keep) == 3 and set(keep["subset"]) == {"mbpp", "arc-challenge"}


def test_split_by_prompt_and_dirichlet_clients_keep_prompts_whole():
    rng = np.random.default_rng(0)
    n = 400
    df = pd.DataFrame({"prompt_id": [f"p{i // 2}" for i in range(n)],
                       "domain": np.repeat(["d1", "d2"], n // 2),
                       "subset": np.repeat(["s1", "s2", "s3", "s4"], n // 4)})
    tr, va, te = split_by_prompt(df, (0.5, 0.25, 0.25), seed=1)
    sets = [set(x["prompt_id"]) for x in (tr, va, te)]
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    assert len(tr) + len(va) + len(te) == n
    assert (tr.domain == "d1").sum() == 100 and (va.domain == "d2").sum() == 50
    client = dirichlet_clients(df, n_clients=5, alpha=0.1, seed=rng.integers(100))
    assert client.shape == (n,) and client.min() >= 0 and client.max() < 5
    assert (pd.Series(client).groupby(df["prompt_id"]).nunique() == 1).all()
    with pytest.raises(InvalidInputError, match="alpha"):
        dirichlet_clients(df, alpha=0.0)
    with pytest.raises(InvalidInputError, match="fractions"):
        split_by_prompt(df, (0.5, 0.5, 0.5))
    with pytest.raises(DataFormatError, match="prompt_id"):
        split_by_prompt(df.drop(columns="prompt_id"))


def test_length_features_are_antisymmetric_hand_computed():
    f = length_features("ab cd\nef", "x")
    np.testing.assert_allclose(f, [np.log1p(8) - np.log1p(1), np.log1p(3) - np.log1p(1), np.log1p(2) - np.log1p(1)],
                               rtol=1e-6)
    np.testing.assert_allclose(length_features("x", "ab cd\nef"), -f)


def test_length_baseline_learns_opposite_directions_per_domain():
    long, short = "word " * 20, "word"
    rows = []
    for i in range(40):
        a_long = i % 2 == 0
        rows.append(("up", long if a_long else short, short if a_long else long, int(a_long)))
        rows.append(("down", long if a_long else short, short if a_long else long, int(not a_long)))
    df = pd.DataFrame(rows, columns=["domain", "response_a", "response_b", "label"])
    per = LengthBaseline(per_domain=True).fit(df)
    assert pairwise_accuracy(per.predict_proba(df), df["label"].to_numpy()) == 1.0
    glob = LengthBaseline(per_domain=False).fit(df)
    assert pairwise_accuracy(glob.predict_proba(df), df["label"].to_numpy()) == 0.5
    swapped = df.rename(columns={"response_a": "response_b", "response_b": "response_a"})
    np.testing.assert_allclose(per.predict_proba(swapped), 1.0 - per.predict_proba(df))
    with pytest.raises(InvalidInputError, match="not seen"):
        per.predict_proba(df.assign(domain="other"))


def test_pairwise_accuracy_and_utilisation_hand_computed():
    assert pairwise_accuracy(np.array([0.9, 0.2, 0.5, 0.6]), np.array([1, 0, 1, 0])) == pytest.approx(2.5 / 4)
    share, mx, ent = expert_utilisation(np.array([0, 0, 1, 2]), 4)
    np.testing.assert_allclose(share, [0.5, 0.25, 0.25, 0.0])
    assert mx == 0.5 and ent == pytest.approx(-(0.5 * np.log(0.5) + 0.5 * np.log(0.25)) / np.log(4))
    with pytest.raises(ShapeError):
        pairwise_accuracy(np.array([0.5]), np.array([2]))


def test_real_pairs_are_balanced_clean_and_length_only_matches_the_docstring(shared_data: Path):
    df = load_preference_pairs(shared_data)
    assert df.groupby("domain").size().to_dict() == {"alpacaeval": 9696, "hh_harmless": 2303, "routerbench": 9652}
    assert abs(df["label"].mean() - 0.5) < 1e-3 and df["pair_id"].is_unique
    gens = set(df.loc[df.domain == "alpacaeval", "source_a"]) | set(df.loc[df.domain == "alpacaeval", "source_b"])
    assert not {g for g in gens if g in ("NullModel", "gpt4_gamed") or g.endswith(("_concise", "_verbose"))}
    rb = df[df.domain == "routerbench"]
    assert (rb["response_a"].str.len() != rb["response_b"].str.len()).all()
    acc = cross_validated_accuracy(df, per_domain=True)
    assert acc["alpacaeval"] == pytest.approx(0.887, abs=0.0015)
    assert acc["hh_harmless"] == pytest.approx(0.564, abs=0.0015)
    assert acc["routerbench"] == pytest.approx(0.730, abs=0.0015)
