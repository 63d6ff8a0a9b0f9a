"""sdk.pair_features: hand-computed phi values, antisymmetry, the length features as a special case,
and the structure-feature baseline fitted on a tiny frame."""

import math

import numpy as np
import pandas as pd
import pytest

from sdk.errors import InvalidInputError
from sdk.pair_encoding import LENGTH_FEATURE_NAMES, length_features_many
from sdk.pair_features import DEFAULT_FEATURES, FEATURE_NAMES, pair_features, pair_features_many, response_features
from trainer.length_baseline import LengthBaseline

RESPONSE = ("Sure! Here is a list:\n\n# Steps\n- **Boil** water\n- Add `tea`\n\nI'm sorry, I can't do more.\n"
            "```\ncode\n```")


def test_response_features_hand_computed():
    names = ("list_items", "headers", "emphasis", "code_blocks", "inline_code", "paragraphs", "refusal", "apology",
             "exclamations", "opener", "ends_complete", "echo")
    phi = dict(zip(names, response_features("Boil the water quickly", RESPONSE, names)))
    assert phi["list_items"] == pytest.approx(math.log1p(2))
    assert phi["headers"] == pytest.approx(math.log1p(1))
    assert phi["emphasis"] == pytest.approx(math.log1p(1))
    assert phi["code_blocks"] == pytest.approx(math.log1p(1))  # one fenced block = two fences
    assert phi["inline_code"] == pytest.approx(math.log1p(1))
    assert phi["paragraphs"] == pytest.approx(math.log1p(3))  # blocks split by blank lines
    assert (phi["refusal"], phi["apology"], phi["opener"], phi["ends_complete"]) == (1.0, 1.0, 1.0, 1.0)
    assert phi["exclamations"] == pytest.approx(math.log1p(1))
    assert phi["echo"] == pytest.approx(2 / 3)  # prompt words of >= 4 chars: boil, water, quickly; two echoed


def test_pair_features_are_antisymmetric_and_extend_the_length_features():
    a, b = ["Short.", RESPONSE, ""], [RESPONSE, "No", "x y\nz"]
    prompts = ["p", "Boil water", "q"]
    f = pair_features_many(prompts, a, b, FEATURE_NAMES)
    assert f.shape == (3, len(FEATURE_NAMES)) and f.dtype == np.float32
    np.testing.assert_allclose(pair_features_many(prompts, b, a, FEATURE_NAMES), -f)
    np.testing.assert_allclose(pair_features_many(prompts, a, b, LENGTH_FEATURE_NAMES), length_features_many(a, b))
    np.testing.assert_array_equal(pair_features("p", a[0], b[0]), f[0, [FEATURE_NAMES.index(n) for n in DEFAULT_FEATURES]])


@pytest.mark.parametrize("names", [("no_such",), (), ("echo", "echo")])
def test_bad_feature_names_are_refused(names):
    with pytest.raises(InvalidInputError):
        pair_features("p", "a", "b", names)


def test_non_str_text_is_refused():
    with pytest.raises(InvalidInputError):
        pair_features_many(["p"], [None], ["b"])


def test_structure_baseline_learns_what_length_cannot():
    # equal lengths, the refusal always loses: length-only is at chance, the structure model is right
    ok, no = "Sure, here: boil it.", "Sorry, I can't help."  # 20 characters, 4 words, 1 line each
    rows = [{"prompt": "q", "domain": "d", "response_a": (ok if i % 2 else no), "response_b": (no if i % 2 else ok),
             "label": i % 2} for i in range(40)]
    df = pd.DataFrame(rows)
    structure = LengthBaseline(features=("dlog_chars", "refusal")).fit(df)
    assert ((structure.predict_proba(df) > 0.5) == (df.label == 1)).all()
    np.testing.assert_allclose(LengthBaseline().fit(df).predict_proba(df), 0.5)
