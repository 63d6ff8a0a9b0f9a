"""FedPrism Phase III labelling (trainer.experts.phase3) on hand-made pairs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sdk.errors import InvalidInputError, ShapeError
from trainer.alignment.dpo import read_preference_rows
from trainer.experts.phase3 import (
    SYNTHETIC_COLUMNS,
    agreement_markdown,
    agreement_table,
    heldout_alpaca_pairs,
    symmetric_proba,
    synthetic_preferences,
    write_preference_set,
)


def _pairs(n=4):
    rows = []
    for i in range(n):
        rows.append({"pair_id": f"alpacaeval:{i}:g1|g2", "prompt_id": f"alpacaeval:{i}", "domain": "alpacaeval",
                     "subset": "koala" if i % 2 else "oasst", "prompt": f"instruction {i}",
                     "response_a": f"answer a{i}", "response_b": f"answer b{i}", "label": i % 2,
                     "source_a": "g1", "source_b": "g2"})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("interrupted", ["os.replace", "to_parquet"])
def test_an_interrupted_preference_set_write_leaves_no_temporary_file(tmp_path, monkeypatch, interrupted):
    """A Ctrl-C in `prism label` while the set was written left synthetic_preferences.jsonl.tmp or
    .parquet.tmp in its output: the temporary file is now removed on any exception, the old files stay."""
    import os

    rows = synthetic_preferences(_pairs(4), np.array([0.9, 0.2, 0.6, 0.7]))
    write_preference_set(rows, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    if interrupted == "os.replace":
        def interrupt(*args, **kwargs):
            raise KeyboardInterrupt
        monkeypatch.setattr(os, "replace", interrupt)
    else:
        def interrupt(self, path, *args, **kwargs):  # half a file written, then Ctrl-C
            Path(path).write_bytes(b"PAR1 half")
            raise KeyboardInterrupt
        monkeypatch.setattr(pd.DataFrame, "to_parquet", interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_preference_set(rows.iloc[:2], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)  # no *.tmp, nothing hidden either
    parquet = "synthetic_preferences.parquet"
    assert (tmp_path / parquet).read_bytes() == before[parquet]  # each file is replaced whole or not at all


def test_symmetric_proba_hand_computed():
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    p = symmetric_proba(np.array([2.0, 0.0, -1.0]), np.array([-1.0, 0.0, 3.0]))
    expected = [sig((2 + 1) / 2), 0.5, sig((-1 - 3) / 2)]
    np.testing.assert_allclose(p, expected, rtol=1e-12)
    # swapping the orders gives the complement
    np.testing.assert_allclose(symmetric_proba(np.array([-1.0]), np.array([2.0])), 1 - p[:1], rtol=1e-12)
    assert symmetric_proba(np.array([800.0]), np.array([-800.0]))[0] == 1.0  # no overflow
    with pytest.raises(ShapeError, match="NaN"):
        symmetric_proba(np.array([np.nan]), np.array([0.0]))


def test_synthetic_preferences_orient_by_labeller_and_check_judge():
    pairs = _pairs(4)  # judge labels 0, 1, 0, 1
    proba = np.array([0.9, 0.2, 0.5, 0.7])
    rows = synthetic_preferences(pairs, proba, expert=np.array([0, 1, 1, 2]))
    assert list(rows.columns) == list(SYNTHETIC_COLUMNS)
    assert rows["chosen"].tolist() == ["answer a0", "answer b1", "answer a2", "answer a3"]
    assert rows["rejected"].tolist() == ["answer b0", "answer a1", "answer b2", "answer b3"]
    np.testing.assert_allclose(rows["p_chosen"], [0.9, 0.8, 0.5, 0.7])
    assert rows["judge_agrees"].tolist() == [False, False, False, True]
    assert rows["expert"].tolist() == [0, 1, 1, 2]
    with pytest.raises(ShapeError, match="in \\[0, 1\\]"):
        synthetic_preferences(pairs, np.array([0.1, 0.2, 1.5, 0.3]))
    with pytest.raises(ShapeError, match="expected \\(4,\\)"):
        synthetic_preferences(pairs, np.array([0.1]))


def test_agreement_table_hand_computed():
    pairs = _pairs(4)  # labels 0, 1, 0, 1; subsets oasst, koala, oasst, koala
    table = agreement_table(pairs, {"x": np.array([0.1, 0.9, 0.5, 0.2]), "always_first": np.full(4, 0.5)})
    assert table["x"]["overall"] == pytest.approx((1 + 1 + 0.5 + 0) / 4)
    assert table["x"]["per_subset"] == {"koala": pytest.approx(0.5), "oasst": pytest.approx(0.75)}
    assert table["always_first"]["overall"] == 0.5
    md = agreement_markdown(table)
    assert "| x | 0.625 | 0.500 | 0.750 |" in md


def test_heldout_alpaca_pairs_drops_reference_and_other_domains():
    pairs = pd.concat([_pairs(3), _pairs(1).assign(domain="hh_harmless"),
                       _pairs(1).assign(source_b="gpt4_1106_preview")], ignore_index=True)
    out = heldout_alpaca_pairs(pairs)
    assert len(out) == 3 and (out["domain"] == "alpacaeval").all()
    with pytest.raises(InvalidInputError, match="no held-out"):
        heldout_alpaca_pairs(pairs[pairs["domain"] != "alpacaeval"])


def test_write_preference_set_roundtrip(tmp_path):
    rows = synthetic_preferences(_pairs(4), np.array([0.9, 0.2, 0.6, 0.7]))
    jsonl, parquet = write_preference_set(rows, tmp_path)
    assert [json.loads(line)["chosen"] for line in jsonl.read_text().splitlines()] == rows["chosen"].tolist()
    pd.testing.assert_frame_equal(pd.read_parquet(parquet), rows)
    # what DPO reads
    back = read_preference_rows(jsonl)
    assert back[1] == {"prompt": "instruction 1", "chosen": "answer b1", "rejected": "answer a1"}
    assert read_preference_rows(parquet) == back
    assert not list(tmp_path.glob("*.tmp"))
