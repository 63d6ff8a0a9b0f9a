"""The ``static`` (model2vec) embedder kind: device numpy encoder vs model2vec, bundle round trip.

- a hand-computed case: a 3-token vocabulary (+ ``[UNK]``) with known vectors;
- the device encoder (:class:`sdk.static_embedder.StaticEmbedder`, tokenizers + numpy) against
  ``model2vec.StaticModel.encode`` on a table distilled from all-MiniLM-L6-v2 and real RouterBench prompts;
- ``fedroute export`` of a K-means router trained on static embeddings, loaded by ``sdk.Router``;
  a corrupt table refused; bad queries refused.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from sdk.errors import BundleError, InvalidQueryError
from sdk.static_embedder import StaticEmbedder, decode_table, encode_table, quantize_rows, vocab_size

VOCAB = {"[UNK]": 0, "a": 1, "b": 2, "c": 3}
# Exactly representable in float16 and, one non-zero per row, in int8 with per-row scales.
VECTORS = np.array([[9.0, 9.0, 9.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 4.0]], dtype=np.float32)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_tiny_table_gives_the_hand_computed_mean_and_norm(precision):
    enc = StaticEmbedder(tiny_tokenizer().to_str(), encode_table(VECTORS, precision), dim=3)
    out = enc.embed(["a b b", "a zzz", "c"])
    # "a b b": mean ([1,0,0] + 2 * [0,2,0]) / 3 = [1/3, 4/3, 0], norm sqrt(17)/3 -> [1, 4, 0] / sqrt(17)
    # "a zzz": the unknown word is dropped (as model2vec does), so only "a": [1, 0, 0]
    expected = np.array([[1 / math.sqrt(17), 4 / math.sqrt(17), 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)
    assert out.dtype == np.float32 and out.shape == (3, 3)
    assert enc.n_tokens(["a b b", "a zzz"]) == [3, 1]


def test_tiny_table_matches_model2vec_encode():
    from model2vec import StaticModel

    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(4, 5)).astype(np.float16)
    reference = StaticModel(vectors, tiny_tokenizer(), normalize=True)
    texts = ["a b c", "c c a", "b", "a zzz b b"]
    expected = reference.encode(texts, max_length=None).astype(np.float32)
    got = StaticEmbedder(tiny_tokenizer().to_str(), encode_table(vectors, "fp32"), dim=5).embed(texts)
    np.testing.assert_allclose(got, expected, atol=2e-3)  # model2vec averages in float16
    assert float(((got * expected).sum(1) / np.linalg.norm(expected, axis=1)).min()) > 0.99999


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_query_of_unknown_tokens_only_is_embedded_as_the_unk_row(precision):
    """A text with no known token ("zzz qqq" here, "🙂🙂" for MiniLM) was refused (InvalidQueryError: a 400
    from the proxy), while the ONNX embedder embeds it as [UNK] tokens. It now gets the [UNK] row
    [9, 9, 9], normalised; a known token next to an unknown one is still read alone."""
    enc = StaticEmbedder(tiny_tokenizer().to_str(), encode_table(VECTORS, precision), dim=3)
    out = enc.embed(["a", "zzz qqq", "a zzz"])
    np.testing.assert_allclose(out, [[1, 0, 0], [1 / math.sqrt(3)] * 3, [1, 0, 0]], rtol=1e-6)
    assert enc.n_tokens(["zzz qqq", "a zzz"]) == [1, 1]


def test_query_of_unknown_tokens_only_gets_the_same_row_from_the_trainer():
    from model2vec import StaticModel

    from trainer.static_embedder import encode_static

    model = StaticModel(VECTORS.astype(np.float16), tiny_tokenizer(), normalize=True)
    texts = ["zzz qqq", "a b", "a zzz"]
    device = StaticEmbedder(tiny_tokenizer().to_str(), encode_table(VECTORS, "fp32"), dim=3).embed(texts)
    np.testing.assert_allclose(encode_static(model, texts), device, rtol=1e-6)


def test_query_that_gives_no_token_at_all_is_refused():
    enc = StaticEmbedder(tiny_tokenizer().to_str(), encode_table(VECTORS, "fp32"), dim=3)
    with pytest.raises(InvalidQueryError, match="position 1 has no token"):
        enc.embed(["a", " \t "])


def test_int8_rows_round_trip_within_half_a_step():
    rng = np.random.default_rng(1)
    v = rng.normal(size=(50, 16)).astype(np.float32)
    q, scales = quantize_rows(v)
    assert q.dtype == np.int8 and scales.dtype == np.float32 and np.abs(q).max() == 127
    assert np.all(np.abs(q * scales[:, None] - v) <= scales[:, None] / 2 + 1e-7)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_npy_table_is_read_in_place_and_npz_tables_of_older_bundles_still_load(precision):
    """The .npy table is a read-only view of the file's bytes (no copy); an .npz table (bundles
    exported before) decodes to the same arrays."""
    import io

    raw = encode_table(VECTORS, precision)
    assert raw[:6] == b"\x93NUMPY"
    vectors, scales = decode_table(raw, 3)
    assert not vectors.flags.writeable and np.shares_memory(vectors, np.frombuffer(raw, np.uint8))
    buf = io.BytesIO()
    if precision == "fp32":
        # float16 holds these values exactly
        assert scales is None and vectors.dtype == np.float16 and vectors.tolist() == VECTORS.tolist()
        np.savez(buf, vectors=VECTORS.astype(np.float16))
    else:
        # one non-zero entry per row: q = +-127 there, scale = |max| / 127
        assert vectors.dtype == np.int8 and vectors.tolist() == [[127, 127, 127], [127, 0, 0], [0, 127, 0], [0, 0, 127]]
        np.testing.assert_array_equal(scales, np.float32([9, 1, 2, 4]) / np.float32(127))
        np.savez(buf, vectors=np.asarray(vectors), scales=np.asarray(scales))
    old_vectors, old_scales = decode_table(buf.getvalue(), 3)
    np.testing.assert_array_equal(old_vectors, vectors)
    assert (old_scales is None) == (scales is None) and (scales is None or np.array_equal(old_scales, scales))


def wordpiece_tokenizer_json(vocab: list[str], added: list[str]) -> str:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.add_special_tokens(added)
    return tok.to_str()


def test_split_wordpiece_tokenizer_rebuilds_the_same_tokenizer_both_ways(tmp_path):
    from tokenizers import Tokenizer

    from export.embedder_export import split_wordpiece
    from sdk.static_embedder import SPLIT_TOKENIZER_FILES, load_split_tokenizer
    from sdk.verified_file import VerifiedFile

    vocab = ["[PAD]", "[UNK]", "a", "b", "##b", "cat", "##s", "\u00e9t\u00e9"]
    full = wordpiece_tokenizer_json(vocab, ["[PAD]", "[UNK]", "<new>"])  # <new>: an added id beyond the vocab (8)
    split = split_wordpiece(full, tmp_path)
    assert split is not None
    assert split[SPLIT_TOKENIZER_FILES["vocab"]] == "".join(t + "\n" for t in vocab).encode()
    pipeline = json.loads(split[SPLIT_TOKENIZER_FILES["pipeline"]])
    assert pipeline["model"]["vocab"] == {"[PAD]": 0, "[UNK]": 1, "<new>": 8}  # the added tokens only
    original = Tokenizer.from_str(full)
    path = tmp_path / "v.txt"
    path.write_bytes(split[SPLIT_TOKENIZER_FILES["vocab"]])
    import hashlib

    with VerifiedFile(path, hashlib.sha256(path.read_bytes()).hexdigest(), 1 << 20) as opened:
        by_path = load_split_tokenizer(split[SPLIT_TOKENIZER_FILES["pipeline"]].decode(), opened)
    from_bytes = load_split_tokenizer(split[SPLIT_TOKENIZER_FILES["pipeline"]].decode(), split[SPLIT_TOKENIZER_FILES["vocab"]])
    for text in ["A cats b bb", "Été [UNK] <new> [PAD] zzz", "cat\tcats"]:
        want = original.encode(text, add_special_tokens=False).ids
        assert by_path.encode(text, add_special_tokens=False).ids == want == from_bytes.encode(text, add_special_tokens=False).ids
    # hand-checked: "a" 2, "cat" 5 + "##s" 6, "b" 3, "b" 3 + "##b" 4
    assert by_path.encode("A cats b bb", add_special_tokens=False).ids == [2, 5, 6, 3, 3, 4]


@pytest.mark.parametrize("vocab, why", [
    (["[UNK]", "a ", "b"], "trailing whitespace"),
    (["[UNK]", "a\rb", "b"], "a line break"),
])
def test_split_wordpiece_keeps_tokenizer_json_when_a_token_would_not_survive_a_line(vocab, why, tmp_path):
    from export.embedder_export import split_wordpiece

    assert split_wordpiece(wordpiece_tokenizer_json(vocab, ["[UNK]"]), tmp_path) is None, why
    assert split_wordpiece(tiny_tokenizer().to_str(), tmp_path) is None  # WordLevel: not split


def test_split_tokenizer_with_a_mismatched_added_token_id_is_refused():
    from sdk.static_embedder import load_split_tokenizer

    pipeline = wordpiece_tokenizer_json(["[PAD]", "[UNK]"], ["[PAD]", "[UNK]"])
    with pytest.raises(BundleError, match="added token '\\[PAD\\]'"):
        load_split_tokenizer(pipeline, b"[UNK]\n[PAD]\n")
    with pytest.raises(BundleError, match="the model must be WordPiece"):
        load_split_tokenizer(tiny_tokenizer().to_str(), b"[UNK]\n")


@pytest.mark.parametrize("data, match", [
    (b"not a zip", "not a readable .npy or .npz"),
    ("wrong_dim", "dimension 4, the manifest declares 3"),
    ("nan", "NaN or inf"),
    ("zero_scale", "scales must be finite and > 0"),
    ("float32", "expected float16"),
    ("npy_float32", "expected float16"),
    ("npy_truncated", "holds 27 data bytes, its header declares 28"),
    ("npy_trailing", "holds 25 data bytes, its header declares 24"),
    ("npy_nan", "NaN or inf"),
    ("npy_zero_scale", "scales must be finite and > 0"),
    ("npy_records", "expected a 2-D float16 array or 1-D \\(scale, q\\) records"),
    ("npy_fortran", "C-order"),
    ("npy_bad_header", "not a readable .npy"),
])
def test_corrupt_tables_are_refused(data, match):
    import io

    def npz(**arrays):
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()

    def npy(array):
        buf = io.BytesIO()
        np.save(buf, array)
        return buf.getvalue()

    raw = {
        "wrong_dim": lambda: encode_table(np.ones((4, 4)), "fp32"),
        "nan": lambda: npz(vectors=np.array([[np.nan, 0, 0]] * 4, dtype=np.float16)),
        "zero_scale": lambda: npz(vectors=np.ones((4, 3), np.int8), scales=np.zeros(4, np.float32)),
        "float32": lambda: npz(vectors=np.ones((4, 3), np.float32)),
        "npy_float32": lambda: npy(np.ones((4, 3), np.float32)),
        "npy_truncated": lambda: encode_table(np.ones((4, 3)), "int8")[:-1],
        "npy_trailing": lambda: encode_table(np.ones((4, 3)), "fp32") + b"\0",
        "npy_nan": lambda: npy(np.array([[np.nan, 0, 0]] * 4, dtype=np.float16)),
        "npy_zero_scale": lambda: npy(np.zeros(4, dtype=[("scale", "<f4"), ("q", "i1", (3,))])),
        "npy_records": lambda: npy(np.zeros(4, dtype=[("q", "i1", (3,)), ("scale", "<f4")])),
        "npy_fortran": lambda: npy(np.asfortranarray(np.ones((4, 3), np.float16))),
        "npy_bad_header": lambda: b"\x93NUMPY\x01\x00\x04\x00{'x'",
    }.get(data, lambda: data)()
    with pytest.raises(BundleError, match=match):
        decode_table(raw, 3)


def test_table_rows_must_match_the_vocabulary():
    with pytest.raises(BundleError, match="5 rows, the tokenizer 4 tokens"):
        StaticEmbedder(tiny_tokenizer().to_str(), encode_table(np.ones((5, 3)), "fp32"), dim=3)



def test_vocab_size_counts_added_tokens_beyond_the_model_vocabulary():
    tok = tiny_tokenizer()
    assert vocab_size(tok) == 4 == tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens(["[UNK]", "<new>"])  # one already a model token (id 0), one new (id 4)
    tok.add_tokens(["zzz"])  # id 5
    assert vocab_size(tok) == 6 == tok.get_vocab_size(with_added_tokens=True)
    # the table must then cover the added ids too
    with pytest.raises(BundleError, match="4 rows, the tokenizer 6 tokens"):
        StaticEmbedder(tok.to_str(), encode_table(VECTORS, "fp32"), dim=3)
    wider = np.vstack([VECTORS, [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    assert StaticEmbedder(tok.to_str(), encode_table(wider, "fp32"), dim=3).embed(["zzz"]).tolist() == [[0.0, 0.0, 1.0]]

# --- the real distilled table -------------------------------------------------------------------


@pytest.fixture(scope="session")
def static_cache(tmp_path_factory) -> Path:
    """A fresh cache folder with all-MiniLM-L6-v2 distilled by model2vec (PCA 256) into ``static/``.

    Distillation is deterministic (the same table every run), so a table already distilled in the
    user's cache is copied rather than distilled again (~50 s of CPU)."""
    from trainer.embedder_paths import default_cache_dir
    from trainer.static_embedder import StaticEmbedderTrainerKind

    cache = tmp_path_factory.mktemp("static-cache")
    kind = StaticEmbedderTrainerKind()
    done = kind.resolve_path("all-MiniLM-L6-v2", default_cache_dir())
    if done.is_dir():
        shutil.copytree(done, kind.resolve_path("all-MiniLM-L6-v2", cache))
    kind.resolve("all-MiniLM-L6-v2", cache)
    return cache


def test_device_encoder_matches_model2vec_on_real_prompts(static_cache, routerbench_dir):
    from trainer import kinds
    from trainer.data.routerbench import load_routerbench_dir
    from trainer.static_embedder import encode_static

    model = kinds.get("static", family="embedder").model("all-MiniLM-L6-v2", static_cache)
    prompts = list(load_routerbench_dir(routerbench_dir)[1].prompts[:60]) + ["Is a whale a fish?", "🙂🙂"]
    reference = encode_static(model, prompts)  # model2vec StaticModel.encode
    assert model.stored_table.shape == (model.tokenizer.get_vocab_size(True), 256)
    assert vocab_size(model.tokenizer) == model.tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer = model.tokenizer.to_str()
    for precision, floor in (("fp32", 0.99999), ("int8", 0.995)):
        enc = StaticEmbedder(tokenizer, encode_table(model.stored_table, precision), dim=256)
        got = np.concatenate([enc.embed([p]) for p in prompts])
        cos = (got * reference).sum(1)
        assert cos.min() >= floor, (precision, cos.min())
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # the whole prompt is read: a RouterBench prompt has hundreds of tokens, more than MiniLM's 256
    assert max(enc.n_tokens(prompts)) > 256


def router_model_unk_row(cache: Path) -> np.ndarray:
    """The [UNK] row of the distilled MiniLM table, L2-normalised (float32)."""
    from trainer import kinds

    model = kinds.get("static", family="embedder").model("all-MiniLM-L6-v2", cache)
    row = model.embedding[model.unk_token_id].astype(np.float32)
    return row / np.linalg.norm(row)


def test_static_bundle_round_trip(static_cache, routerbench_dir, signing_keys, tmp_path):
    """Train a K-means router on static embeddings, export it (float16 + int8 tables, parity
    gated), load it with sdk.Router and route; a corrupted table file is refused."""
    import pandas as pd

    from export.pipeline import export_bundle
    from sdk import Router
    from trainer.data.client_data import ClientData
    from trainer.data.routerbench import load_routerbench_dir
    from trainer.embeddings import EmbedderConfig, embed_texts
    from trainer.routers.kmeans_router import KMeansRouterConfig, fit_kmeans_router

    train, test = load_routerbench_dir(routerbench_dir)
    rng = np.random.default_rng(0)
    train = train.subset(np.sort(rng.choice(train.n_queries, 400, replace=False)))
    test = test.complete_rows()
    test = test.subset(np.sort(rng.choice(test.n_queries, 150, replace=False)))
    config = EmbedderConfig(model="static:all-MiniLM-L6-v2")
    train_emb = embed_texts(list(train.prompts), config, static_cache, show_progress=False)
    assert train_emb.shape == (400, 256)
    rows, cols = np.nonzero(train.labelled())
    dense = ClientData(train_emb[rows], cols.astype(np.int64), train.accuracy[rows, cols], train.cost[rows, cols])
    router = fit_kmeans_router(dense, train.models, KMeansRouterConfig(n_clusters=6), seed=0)
    test_file = tmp_path / "test.parquet"
    frame = pd.read_parquet(routerbench_dir / "test.parquet")
    frame[frame["prompt"].isin(set(test.prompts))].to_parquet(test_file)
    router.embedder = config.router_entry(router.d_emb, static_cache)
    router.provenance = {"test": str(test_file)}
    router.save(tmp_path / "router")

    result = export_bundle(tmp_path / "router", tmp_path / "bundle", signing_keys[0], int8=True,
                           cache_dir=static_cache, progress=lambda _: None)
    manifest = result.manifest
    assert manifest["embedder_kind"] == "static" and manifest["router_kind"] == "kmeans"
    assert manifest["embedder"]["files"] == {"fp32": "static_table.f16.npy", "int8": "static_table.int8.npy"}
    assert manifest["embedder"]["tokenizer_files"] == {"pipeline": "static_tokenizer.json", "vocab": "static_vocab.txt"}
    assert "tokenizer.json" not in manifest["files"]
    assert manifest["embedder"]["dim"] == 256 and manifest["embedder"]["table_sha256"] == router.embedder["table_sha256"]
    assert result.parity["passed"] and result.parity["precisions"]["fp32"]["cosine"]["min"] > 0.99999
    assert json.loads((tmp_path / "bundle" / "parity.json").read_text())["passed"]

    for precision in ("fp32", "int8"):
        bundle = Router.load(tmp_path / "bundle", signing_keys[1], precision=precision)
        choice = bundle.choose("Prove that the square root of 2 is irrational.", lam=100.0)
        assert choice.model in router.models
        emb = bundle.embed(list(test.prompts[:20]))
        expected_cells = router.decide(emb, 100.0)
        assert [bundle.choose(p, lam=100.0).model for p in test.prompts[:20]] == [router.models[i] for i in expected_cells]
        with pytest.raises(InvalidQueryError):
            bundle.choose("   ", lam=1.0)
        with pytest.raises(InvalidQueryError):
            bundle.choose(17, lam=1.0)
        with pytest.raises(InvalidQueryError):
            bundle.choose("\u200b\u200b", lam=1.0)  # no token at all (the normaliser drops zero-width characters)
        # only emoji (no token MiniLM knows): routed by the [UNK] row, as the ONNX embedder reads [UNK]
        unk = router_model_unk_row(static_cache)
        assert bundle.choose("🙂🙂", lam=100.0).model == router.models[router.decide(unk[None, :], 100.0)[0]]

    # the embedder kind's own gate: passes against the trainer's embeddings, fails against other rows
    from export import kinds as export_kinds

    kind = export_kinds.get("static", family="embedder")
    reference = embed_texts(list(test.prompts[:30]), config, static_cache, show_progress=False)
    subset = test.subset(np.arange(30))
    report = kind.parity(tmp_path / "bundle", signing_keys[1], None, reference, subset, ["fp32", "int8"], progress=lambda _: None)
    assert report["passed"] and report["precisions"]["int8"]["cosine"]["min"] > 0.9999
    shuffled = kind.parity(tmp_path / "bundle", signing_keys[1], None, reference[::-1], subset, ["fp32"], progress=lambda _: None)
    assert not shuffled["passed"] and "fp32 min cosine" in shuffled["failures"][0]

    # a table changed after signing: refused by its sha256; re-signed but malformed: refused by the loader
    copy = tmp_path / "tampered"
    shutil.copytree((tmp_path / "bundle").resolve(), copy)
    table = copy / "static_table.f16.npy"
    table.write_bytes(table.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(BundleError, match="sha256"):
        Router.load(copy, signing_keys[1], precision="fp32")

    from export.bundle_writer import write_bundle
    from export.signing import load_signing_key

    files = {n: (tmp_path / "bundle" / n).read_bytes() for n in manifest["files"]}
    files["static_table.f16.npy"] = b"PK\x03\x04 truncated"
    fields = {k: v for k, v in manifest.items() if k not in ("format_version", "created_utc", "files", "signature")}
    fields["bundle_version"] = manifest["bundle_version"] + 1
    write_bundle(tmp_path / "bundle", files, fields, load_signing_key(signing_keys[0]))
    with pytest.raises(BundleError, match="static table"):
        Router.load(tmp_path / "bundle", signing_keys[1], precision="fp32")


def test_export_refuses_a_table_other_than_the_trained_one(static_cache, tmp_path):
    from export.embedder_export import StaticEmbedderExportKind
    from export.errors import ExportError
    from trainer.embeddings import EmbedderConfig

    config = EmbedderConfig(model="static:all-MiniLM-L6-v2")
    trained = config.router_entry(256, static_cache)
    trained["table_sha256"] = "0" * 64
    with pytest.raises(ExportError, match="not the one the router trained on"):
        StaticEmbedderExportKind().build(trained, config, tmp_path, (), static_cache, progress=lambda _: None)
