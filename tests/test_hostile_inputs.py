"""Hostile and malformed input at the SDK's boundaries that used to escape as a raw numpy /
onnxruntime / tokenizers / sqlite exception (or pass unnoticed), each now a typed fedroute error
naming the problem.

Everything here is tiny and built in the test: a 4-token tokenizer, a (4, 3) static table, a
2-cell K-means file, and ONNX graphs of a few nodes (``onnx.helper``), signed with a fresh key by
the exporter's own writer. No test takes more than a fraction of a second.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import sqlite3
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from sdk import EvalLog, Router
from sdk.errors import (BundleError, EvalLogError, InvalidInputError, InvalidLambdaError, PayloadError,
                        ShapeError)

VOCAB = {"[UNK]": 0, "a": 1, "b": 2, "c": 3}
VECTORS = np.array([[9.0, 9.0, 9.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 4.0]], dtype=np.float32)
MODELS = ["cheap", "dear"]
EMBEDDER = {"name": "tiny", "dim": 3, "max_tokens": 16, "truncation_side": "left"}


def tokenizer_json(vocab: dict[str, int] = VOCAB, unk: str = "[UNK]") -> bytes:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str().encode()


def npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def kmeans_npz(**overrides) -> bytes:
    """Cell 0 near [1, 0, 0] (the cheap model wins at lam = 1), cell 1 near [0, 1, 0]."""
    arrays = dict(centroids=np.eye(3, dtype=np.float32)[:2], accuracy=np.array([[0.5, 0.9], [0.6, 0.7]]),
                  cost=np.array([[0.001, 0.01], [0.001, 0.01]]), count=np.ones((2, 2)), models=np.array(MODELS),
                  embedder_name=np.array("tiny"), embedder_dim=np.array(3))
    arrays.update(overrides)
    return npz(**arrays)


@pytest.fixture()
def bundle(signing_keys, tmp_path):
    """``bundle(files=None, **fields) -> Path``: a signed static-embedder K-means bundle (the
    exporter's writer), with files or manifest fields replaced."""
    from export.bundle_writer import write_bundle
    from export.signing import load_signing_key
    from sdk.static_embedder import encode_table

    key = load_signing_key(signing_keys[0])
    count = iter(range(1000))

    def build(files: dict | None = None, **fields) -> Path:
        parts = {"tokenizer.json": tokenizer_json(), "static_table.f16.npy": encode_table(VECTORS, "fp32"),
                 "kmeans.npz": kmeans_npz(), **(files or {})}
        manifest = {"bundle_version": 1, "router_kind": "kmeans", "embedder_kind": "static",
                    "models": [{"id": m, "price_per_1k_input_usd": None, "price_per_1k_output_usd": None,
                                "mean_cost_usd": None} for m in MODELS],
                    "embedder": {**EMBEDDER, "max_tokens": 65536, "files": {"fp32": "static_table.f16.npy"}}}
        manifest.update(fields)
        out = tmp_path / f"b{next(count)}"
        write_bundle(out, parts, manifest, key)
        return out

    return build


def resign(bundle_dir: Path, signing_key: Path, mutate) -> Path:
    """Apply ``mutate`` to the bundle's manifest and sign it again with the right key."""
    from export.signing import load_signing_key, sign_manifest

    path = bundle_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    mutate(manifest)
    signed = sign_manifest(manifest, load_signing_key(signing_key))
    path.unlink()  # the published file is read-only to writers in place; replace it
    path.write_text(json.dumps(signed))
    return bundle_dir


def test_the_tiny_bundle_routes_as_computed_by_hand(bundle, signing_keys):
    router = Router.load(bundle(), signing_keys[1])
    # "a" embeds to [1, 0, 0]: cell 0, utilities 0.5 - 0.001 and 0.9 - 0.01 at lam = 1 -> "dear";
    # at lam = 100: 0.4 vs -0.1 -> "cheap".
    assert router.choose("a", 1.0).model == "dear" and router.choose("a", 100.0).model == "cheap"


# -- 1. bundles ------------------------------------------------------------------------------------

@pytest.mark.parametrize("arrays", [
    {"models": np.array("cheap")}, {"embedder_dim": np.array("three")}, {"embedder_dim": np.array(3.7)},
    {"centroids": np.array([["x"] * 3] * 2)}, {"accuracy": np.array([["x", "y"]] * 2)}, {"cost": np.ones((2, 2)) * 1j},
])
def test_a_kmeans_file_with_arrays_of_the_wrong_dtype_is_a_bundle_error(bundle, signing_keys, arrays):
    with pytest.raises(BundleError, match=f"kmeans.npz {next(iter(arrays))} "):
        Router.load(bundle({"kmeans.npz": kmeans_npz(**arrays)}), signing_keys[1])


def test_an_npy_or_empty_file_named_kmeans_npz_is_a_bundle_error(bundle, signing_keys):
    buf = io.BytesIO()
    np.save(buf, np.ones(3))
    for data in (buf.getvalue(), b""):
        with pytest.raises(BundleError, match="kmeans.npz"):
            Router.load(bundle({"kmeans.npz": data}), signing_keys[1])


@pytest.mark.parametrize("path, value, field", [
    (("embedder", "files", "fp32"), ["static_table.f16.npy"], "embedder file"),
    (("bundle_version",), True, "bundle_version"), (("bundle_version",), 2**63, "bundle_version"),
    (("format_version",), True, "format_version"), (("format_version",), 1.0, "format_version"),
    (("embedder", "dim"), True, "embedder.dim"), (("embedder", "max_tokens"), 10**30, "embedder.max_tokens"),
    (("models", 0, "id"), "cheap\ud800", "model ids"),
])
def test_a_signed_manifest_with_values_of_the_wrong_type_is_a_bundle_error(bundle, signing_keys, path, value, field):
    def mutate(manifest):
        target = manifest
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    with pytest.raises(BundleError, match=f"manifest: {field}"):
        Router.load(resign(bundle(), signing_keys[0], mutate), signing_keys[1])


def test_a_bundle_version_beyond_sqlite_would_have_made_every_logged_row_fail(bundle, signing_keys, tmp_path):
    """Why the cap is 2**63 - 1: the last accepted version is logged like any other."""
    router = Router.load(resign(bundle(), signing_keys[0], lambda m: m.update(bundle_version=2**63 - 1)),
                         signing_keys[1])
    with EvalLog(tmp_path / "log.sqlite", router.model_ids) as log:
        log.record_choice(router.choose("a", 1.0), score=1.0, cost_usd=0.01)
        assert log.rows().bundle_version.tolist() == [2**63 - 1]


@pytest.mark.parametrize("shape, match", [
    ((2**32, 2**32), "holds 0 data bytes, its header declares 36893488147419103232"),  # wrapped to 0 in int64
    ((-4, 3), "declares a negative shape \\(-4, 3\\)"),
])
def test_a_static_table_header_with_an_absurd_shape_is_a_bundle_error(shape, match):
    from numpy.lib import format as npy_format

    from sdk.static_embedder import decode_table

    buf = io.BytesIO()
    npy_format.write_array_header_1_0(buf, {"descr": "<f2", "fortran_order": False, "shape": shape})
    with pytest.raises(BundleError, match=match):
        decode_table(buf.getvalue(), 3)


def test_a_tokenizer_whose_unknown_token_is_not_in_its_vocabulary_is_refused_at_load(bundle, signing_keys):
    broken = bundle({"tokenizer.json": tokenizer_json(unk="[NOPE]")})
    with pytest.raises(BundleError, match="tokenizer.json: .*'\\[NOPE\\]'"):
        Router.load(broken, signing_keys[1])


def test_a_token_id_beyond_the_static_table_is_a_bundle_error_not_an_index_error(bundle, signing_keys):
    # 4 tokens, 4 table rows, but "c" has id 99: the sizes agree, the ids do not.
    router = Router.load(bundle({"tokenizer.json": tokenizer_json({**VOCAB, "c": 99})}), signing_keys[1])
    assert router.choose("a b", 1.0).model == "dear"
    with pytest.raises(BundleError, match="token id 99"):
        router.choose("a c", 1.0)


# -- 1b. ONNX graphs of the wrong contract -----------------------------------------------------------

def embedder_graph(ids_type: str = "INT64", out_rank: int = 2, extra_input: bool = False, nan: bool = False,
                   vocab: int = 8) -> bytes:
    """input_ids, attention_mask (N, L) -> sentence_embedding (N, 3): mean of rows of eye(vocab, 3)."""
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.eye(vocab, 3, dtype=np.float32) + (np.nan if nan else 0.0), "table")
    ids_t = getattr(TensorProto, ids_type)
    inputs = [helper.make_tensor_value_info("input_ids", ids_t, ["N", "L"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["N", "L"])]
    nodes = [helper.make_node("Cast", ["input_ids"], ["ids"], to=TensorProto.INT64),
             helper.make_node("Gather", ["table", "ids"], ["tok"])]
    last, shape = "tok", ["N", "L", 3]
    if out_rank == 2:
        nodes.append(helper.make_node("ReduceMean", ["tok"], ["mean"], axes=[1], keepdims=0))
        last, shape = "mean", ["N", 3]
    if extra_input:
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["N", "L"]))
        nodes += [helper.make_node("Cast", ["position_ids"], ["pf"], to=TensorProto.FLOAT),
                  helper.make_node("ReduceSum", ["pf"], ["ps"], keepdims=0),
                  helper.make_node("Mul", [last, "ps"], ["scaled"])]
        last = "scaled"
    nodes.append(helper.make_node("Identity", [last], ["sentence_embedding"]))
    graph = helper.make_graph(nodes, "embedder", inputs,
                              [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, shape)], [table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def router_graph(meta_models: str = json.dumps(MODELS), in_type: str = "FLOAT", two_inputs: bool = False,
                 accuracy: float = 0.5) -> bytes:
    """embedding (N, 3) -> accuracy, cost (N, 2): constants ``accuracy`` and 0.001."""
    from onnx import TensorProto, helper, numpy_helper

    inputs = [helper.make_tensor_value_info("embedding", getattr(TensorProto, in_type), ["N", 3])]
    if two_inputs:
        inputs.append(helper.make_tensor_value_info("other", TensorProto.FLOAT, ["N", 3]))
    inits = [numpy_helper.from_array(np.zeros((3, 2), np.float32), "W"),
             numpy_helper.from_array(np.full(2, accuracy, np.float32), "A"),
             numpy_helper.from_array(np.full(2, 0.001, np.float32), "C")]
    nodes = [helper.make_node("Cast", ["embedding"], ["x"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["x", "W"], ["xw"]),
             helper.make_node("Add", ["xw", "A"], ["accuracy"]), helper.make_node("Add", ["xw", "C"], ["cost"])]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 2]) for n in ("accuracy", "cost")]
    model = helper.make_model(helper.make_graph(nodes, "router", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    for key, value in {"models": meta_models, "embedder_name": "tiny", "embedder_dim": "3"}.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    return model.SerializeToString()


def wordpiece_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "a": 4, "b": 5, "c": 6, "d": 7}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return tok.to_str()


def onnx_embedder(model: bytes):
    from sdk.embedder import OnnxEmbedder

    return OnnxEmbedder(wordpiece_json(), model, 3, 16, "left", None)


def test_the_tiny_onnx_embedder_gives_the_hand_computed_embedding():
    # "a b" -> [CLS] a b [SEP] = ids 2, 4, 5, 3 -> rows e2, 0, 0, 0 of eye(8, 3): mean [0, 0, 0.25]
    np.testing.assert_allclose(onnx_embedder(embedder_graph()).embed(["a b"]), [[0.0, 0.0, 0.25]])


@pytest.mark.parametrize("graph, field", [
    (dict(ids_type="INT32"), "input_ids"), (dict(ids_type="FLOAT"), "input_ids"),
    (dict(extra_input=True), "position_ids"), (dict(out_rank=3), "sentence_embedding"),
])
def test_an_encoder_graph_onnxruntime_could_not_run_on_our_feeds_is_refused_at_load(graph, field):
    with pytest.raises(BundleError, match=f"^embedder.*'{field}'"):
        onnx_embedder(embedder_graph(**graph))


def test_an_encoder_that_fails_or_returns_nan_on_a_query_is_a_bundle_error():
    small_vocab = onnx_embedder(embedder_graph(vocab=4))  # the tokenizer emits ids up to 7
    with pytest.raises(BundleError, match="embedder: onnxruntime failed"):
        small_vocab.embed(["d"])
    with pytest.raises(BundleError, match="embedder returned NaN"):
        onnx_embedder(embedder_graph(nan=True)).embed(["a b"])


@pytest.mark.parametrize("graph, field", [
    (dict(in_type="DOUBLE"), "input"), (dict(two_inputs=True), "input"),
    (dict(meta_models="5"), "metadata 'models'"), (dict(meta_models="[1, 2]"), "metadata 'models'"),
])
def test_a_router_graph_of_the_wrong_contract_is_refused_at_load(graph, field):
    from sdk.scorers import MlpScorer

    with pytest.raises(BundleError, match=f"^router.onnx.* {field}"):
        MlpScorer(router_graph(**graph), MODELS, {**EMBEDDER}, None)


def test_a_router_graph_predicting_inf_is_a_bundle_error():
    from sdk.scorers import MlpScorer

    x = np.ones((1, 3), np.float32)
    acc, cost, _ = MlpScorer(router_graph(), MODELS, {**EMBEDDER}, None).predict(x)
    np.testing.assert_allclose(acc, [[0.5, 0.5]])
    np.testing.assert_allclose(cost, [[0.001, 0.001]], rtol=1e-6)
    with pytest.raises(BundleError, match="router.onnx predicted an infinite"):
        MlpScorer(router_graph(accuracy=np.inf), MODELS, {**EMBEDDER}, None).predict(x)


# -- 2. SDK API arguments ------------------------------------------------------------------------------

@pytest.mark.parametrize("embeddings", [[["a", "b", "c"]], [[1.0, 2.0, 3.0], [1.0]], [[{}, 1.0, 2.0]], [[1j, 0.0, 0.0]]])
def test_embeddings_that_do_not_convert_to_float32_are_shape_errors(bundle, signing_keys, embeddings):
    router = Router.load(bundle(), signing_keys[1])
    with pytest.raises(ShapeError, match="embeddings"):
        router.predict_from_embeddings(embeddings)


def test_arguments_of_the_wrong_type_get_clear_errors(bundle, signing_keys):
    router = Router.load(bundle(), signing_keys[1])
    with pytest.raises(InvalidInputError, match="usd_per_1k_queries.*401 digits"):
        router.lam_for_budget(10**400, ["a", "b"])
    assert math.copysign(1.0, router.choose("a", -0.0).lam) == 1.0  # -0.0 is 0, reported as +0.0
    with pytest.raises(BundleError, match="bundle path"):
        Router.load(5, signing_keys[1])
    with pytest.raises(InvalidInputError, match="precision"):
        Router.load(bundle(), signing_keys[1], precision=["fp32"])
    with pytest.raises(InvalidInputError, match="intra_op_threads"):
        Router.load(bundle(), signing_keys[1], intra_op_threads=2**40)


def test_check_lambda_normalises_negative_zero():
    from sdk.utility import check_lambda

    assert math.copysign(1.0, check_lambda(-0.0)) == 1.0
    with pytest.raises(InvalidLambdaError):
        check_lambda(-1e-300)



@pytest.mark.parametrize("lam, why", [
    (-1, ">= 0"), (-1.5, ">= 0"), (Fraction(-1, 3), ">= 0"), (np.int64(-2), ">= 0"),
    (10**400, "finite (an integer too large"), (-(10**400), "finite (an integer too large"),
    (float("nan"), "finite, "), ("5", "a real number"),
], ids=["-1", "-1.5", "-1/3", "int64(-2)", "1e400", "-1e400", "nan", "str"])
def test_check_lambda_names_the_actual_problem(lam, why):
    # A negative int or Fraction was refused as "finite (an integer too large for a float)".
    from sdk.utility import check_lambda

    with pytest.raises(InvalidLambdaError, match=f"^lam must be {re.escape(why)}"):
        check_lambda(lam)


def _array_calls():
    from sdk.cell_statistics import CellStatistics
    from sdk.personalisation import interpolation_weights, personalise
    from sdk.spend_curve import decision_steps
    from sdk.utility import decide, utility

    return {
        "strings": (lambda: decide([["a", 0.5]], [[0.1, 0.2]], 1.0), "accuracy"),
        "ragged": (lambda: utility([[0.5, 0.9]], [[0.1], [0.2, 0.3]], 1.0), "cost"),
        "steps": (lambda: decision_steps([[0.5, 0.9]], [["x", 0.2]]), "cost"),
        "errors": (lambda: interpolation_weights(["a"], [0.1]), "global_error"),
        "weights": (lambda: personalise([[0.5]], [[0.5]], [{"w": 1}]), "weights"),
        # numpy dropped the imaginary part with a warning only: decide() answered 0 here
        "complex": (lambda: decide(np.array([[0.5 + 1j, 0.9]]), [[0.1, 0.2]], 1.0), "accuracy"),
        "statistics": (lambda: CellStatistics([[1.0]], [["x"]], [[0.0]]), "sum_accuracy"),
    }


@pytest.mark.parametrize("case", ["strings", "ragged", "steps", "errors", "weights", "complex", "statistics"])
def test_public_array_functions_refuse_values_that_are_not_real_numbers(case):
    call, name = _array_calls()[case]  # were numpy's raw ValueError / TypeError
    with pytest.raises(ShapeError, match=f"{name}"):
        call()


# -- 3. the evaluation log -------------------------------------------------------------------------------

def test_text_sqlite_cannot_store_is_refused_before_anything_is_written(tmp_path):
    with EvalLog(tmp_path / "log.sqlite", MODELS, store_text=True) as log:
        with pytest.raises(InvalidInputError, match="query"):
            log.record("cheap", 1.0, 0.001, cell=0, query="hi\ud800")
        assert len(log) == 0
        log.record("cheap", 1.0, 0.001, cell=0, query="hi")
        assert log.rows().query == ("hi",)
    with EvalLog(tmp_path / "drop.sqlite", MODELS) as log:  # not stored: nothing to encode, nothing refused
        log.record("cheap", 1.0, 0.001, cell=0, query="hi\ud800")
        assert log.rows().query == (None,)
    with pytest.raises(InvalidInputError, match="models"):
        EvalLog(tmp_path / "models.sqlite", ["cheap\ud800"])


def test_a_log_declaring_an_absurd_embedding_dimension_is_damaged(tmp_path):
    path = tmp_path / "log.sqlite"
    with EvalLog(path, MODELS) as log:
        log.record("cheap", 1.0, 0.001, embedding=np.ones(3) / np.sqrt(3))
        with pytest.raises(ShapeError, match="embedding"):
            log.record("cheap", 1.0, 0.001, embedding=np.ones(70_000))
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '99999999999999999999' WHERE key = 'embedding_dim'")
    conn.commit()
    conn.close()
    with pytest.raises(EvalLogError, match="damaged.*embedding_dim"):
        EvalLog(path, MODELS)



@pytest.mark.parametrize("blob, size", [(b"\x00\x11", "2 bytes"), ("abcdabcdabcd", "a str")])
def test_a_row_whose_embedding_is_not_the_logs_float32_vector_is_damaged(tmp_path, blob, size):
    # np.frombuffer raised a raw ValueError (2 bytes: not a multiple of 4) or TypeError (a str) before the check.
    path = tmp_path / "log.sqlite"
    with EvalLog(path, MODELS) as log:
        for _ in range(2):
            log.record("cheap", 1.0, 0.001, embedding=np.ones(3) / np.sqrt(3))
    conn = sqlite3.connect(path)
    conn.execute("UPDATE evaluations SET embedding = ? WHERE id = 2", (blob,))
    conn.commit()
    conn.close()
    with EvalLog(path, MODELS) as log:
        with pytest.raises(EvalLogError, match=f"damaged: row 2 .*{size}"):
            log.rows()
        assert len(log) == 2  # nothing is deleted: the damaged row stays for inspection


# -- 4. wire formats ---------------------------------------------------------------------------------------

def test_an_npy_where_an_npz_update_belongs_is_a_payload_error():
    from sdk.protocol import decode_kmeans_update_npz

    buf = io.BytesIO()
    np.save(buf, np.ones(3))
    with pytest.raises(PayloadError, match="not an .npz K-means update"):
        decode_kmeans_update_npz(buf.getvalue())


@pytest.fixture()
def proxy(bundle, signing_keys):
    """The proxy app (FastAPI's test client, no socket) over the tiny bundle; the upstream is never
    reached by the requests below, which all fail before routing."""
    from fastapi.testclient import TestClient

    from sdk.proxy.app import create_app
    from sdk.routed_chat import RoutedChat, Upstream
    from sdk.token_prices import TokenPrice

    router = Router.load(bundle(), signing_keys[1])
    chat = RoutedChat(router, upstreams={m: Upstream("http://127.0.0.1:9/v1", api_key="k") for m in MODELS},
                      lam=1.0, prices={m: TokenPrice(1.0, 2.0) for m in MODELS})
    with TestClient(create_app(chat, ["tok"], max_body_bytes=65536)) as client:
        client.headers["Authorization"] = "Bearer tok"
        yield client
    chat.close()


@pytest.mark.parametrize("body, status, match", [
    (b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}', 400, "NaN is not a number standard JSON"),
    (b'{"messages": [{"role": "user", "content": "a"}], "x": Infinity}', 400, "Infinity is not a number"),
    (b'{"messages": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", 400, "nested too deeply"),
    (b'{"messages": [{"role": "user", "content": "' + b"a " * 40_000 + b'"}]}', 413, "over the proxy's 65536-byte limit"),
])
def test_proxy_bodies_that_used_to_be_500_or_read_whole_get_4xx(proxy, body, status, match):
    answer = proxy.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == status and match in answer.json()["error"]["message"]


# -- 3b. the sync client against a server answering garbage -------------------------------------------

def sync_client(tmp_path, signing_keys, handler):
    """A SyncClient over ``httpx.MockTransport(handler)`` (no socket, no waits)."""
    import httpx

    from sdk.sync import SyncClient

    log = EvalLog(tmp_path / "log.sqlite", MODELS)
    client = SyncClient("https://fed.test", "fr_token", log, tmp_path / "bundle", signing_keys[1],
                        transport=httpx.MockTransport(handler), sleep=lambda s: None, state_path=tmp_path / "state.json")
    return client, log



UNSENDABLE = "the request holds text that is not valid Unicode (surrogates not allowed: '\\ud800'); nothing was sent"


@pytest.mark.parametrize("body, field", [
    (b'{"messages": [{"role": "user", "content": "a"}], "stream": true, "stream_options": "on"}', "stream_options"),
    (b'{"messages": [{"role": "user", "content": "a"}], "stream_options": [1]}', "stream_options"),
    # JSON escapes of lone surrogates outside the routed text: the openai client's encoder raised UnicodeEncodeError
    (b'{"messages": [{"role": "system", "content": "\\ud800"}, {"role": "user", "content": "a"}]}', "not valid Unicode"),
    (b'{"messages": [{"role": "user", "content": "a"}], "user": "\\ud800"}', "not valid Unicode"),
])
def test_proxy_requests_the_openai_client_cannot_send_are_400_not_500(proxy, body, field):
    answer = proxy.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and field in answer.json()["error"]["message"]


def test_routed_chat_refuses_a_request_it_cannot_send_before_any_fallback(bundle, signing_keys):
    from sdk.routed_chat import RoutedChat, Upstream
    from sdk.token_prices import TokenPrice

    router = Router.load(bundle(), signing_keys[1])
    with RoutedChat(router, upstreams={m: Upstream("http://127.0.0.1:9/v1", api_key="k") for m in MODELS},
                    lam=1.0, prices={m: TokenPrice(1.0, 2.0) for m in MODELS}) as chat:
        with pytest.raises(InvalidInputError, match=re.escape(UNSENDABLE)):
            chat.create(messages=[{"role": "system", "content": "\ud800"}, {"role": "user", "content": "a"}])
        with pytest.raises(InvalidInputError, match="stream_options"):
            chat.create(messages="a", model="cheap", stream=True, stream_options=("include_usage", True))


def test_routed_chat_refuses_at_construction_what_would_fail_later(bundle, signing_keys):
    from sdk.routed_chat import RoutedChat, Upstream
    from sdk.token_prices import TokenPrice

    router = Router.load(bundle(), signing_keys[1])
    upstreams = {m: Upstream("http://127.0.0.1:9/v1", api_key="k") for m in MODELS}
    # a budget the controller would refuse at the first call is refused at construction
    with pytest.raises(InvalidInputError, match="budget_usd_per_1k"):
        RoutedChat(router, upstreams=upstreams, budget_usd_per_1k=1e-310,
                   prices={m: TokenPrice(1.0, 2.0) for m in MODELS})
    # a list where a mapping belongs was dict()'s raw TypeError / ValueError
    with pytest.raises(InvalidInputError, match="prices"):
        RoutedChat(router, upstreams=upstreams, lam=1.0, prices=[TokenPrice(1.0, 2.0)] * 2)
    with pytest.raises(InvalidInputError, match="passthrough"):
        RoutedChat(router, upstreams=upstreams, lam=1.0, passthrough=["gpt-4o"],
                   prices={m: TokenPrice(1.0, 2.0) for m in MODELS})


def test_a_server_answering_deeply_nested_json_is_a_sync_error_not_a_recursion_error(tmp_path, signing_keys):
    import httpx

    from sdk.errors import SyncError, SyncRejectedError

    deep = b"[" * 30_000 + b"]" * 30_000  # 60 KB: within both the answer and the error-detail limits
    status = {"code": 200}

    def handler(request):
        if request.url.path == "/v1/rounds/current":
            return httpx.Response(status["code"], content=deep)
        return httpx.Response(404, json={"detail": "no bundle"})

    client, log = sync_client(tmp_path, signing_keys, handler)
    try:
        with pytest.raises(SyncError, match=r"non-JSON \(200, RecursionError\)"):
            client.run_once()
        status["code"] = 403  # the refusal's detail is read as text when it is not a JSON object
        with pytest.raises(SyncRejectedError) as info:
            client.run_once()
        assert info.value.status == 403 and info.value.detail == deep[:500].decode()
    finally:
        client.close()
        log.close()


@pytest.mark.parametrize("field, value", [("models", "abc"), ("kind", ["kmeans"]), ("deadline_utc", None)])
def test_a_round_description_with_fields_of_the_wrong_type_is_a_sync_error(field, value):
    from sdk.errors import SyncError
    from sdk.protocol import RoundSpec, centroids_hash

    centroids = np.eye(3, dtype=np.float32)[:2]
    good = {"round_id": 1, "kind": "kmeans", "centroids": centroids.tolist(), "centroids_hash": centroids_hash(centroids),
            "models": ["a", "b", "c"], "embedder_name": "toy", "d_emb": 3, "min_count": 1, "deadline_utc": "x"}
    assert RoundSpec.from_json(good).models == ("a", "b", "c")
    with pytest.raises(SyncError, match=f"malformed round description.*{field}"):
        RoundSpec.from_json({**good, field: value})


def test_a_round_of_an_unknown_kind_with_an_infinite_round_id_is_a_sync_error(tmp_path, signing_keys):
    import httpx

    from sdk.errors import SyncError

    def handler(request):
        if request.url.path == "/v1/rounds/current":  # JSON 1e400 parses as inf; int(inf) overflows
            return httpx.Response(200, content=b'{"kind": "svm", "round_id": 1e400}')
        return httpx.Response(404, json={"detail": "no bundle"})

    client, log = sync_client(tmp_path, signing_keys, handler)
    try:
        with pytest.raises(SyncError, match="OverflowError"):
            client.run_once()
    finally:
        client.close()
        log.close()


DISK_FULL = """
import resource, signal, sys
import numpy as np
from sdk import EvalLog
from sdk.errors import EvalLogError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
log = EvalLog(sys.argv[1], ["cheap", "dear"])
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
acked = 0
try:
    for i in range(1000):
        log.record("cheap", 0.5, 0.001, embedding=np.roll(np.eye(1, 384)[0], i))
        acked += 1
except EvalLogError as exc:
    print(acked, "cannot write to evaluation log" in str(exc))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE as a full disk: Linux")
def test_a_full_disk_is_an_eval_log_error_and_every_acknowledged_row_survives(tmp_path):
    import subprocess

    from conftest import ROOT

    path = tmp_path / "log.sqlite"
    out = subprocess.run([sys.executable, "-c", DISK_FULL, str(path)], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    acked, named = out.stdout.split()
    assert int(acked) >= 1 and named == "True", out.stderr
    with EvalLog(path, MODELS) as log:  # reopened without the limit: exactly the acknowledged rows
        rows = log.rows()
        assert rows.id.tolist() == list(range(1, int(acked) + 1))
        assert np.argmax(rows.embedding, axis=1).tolist() == list(range(int(acked)))  # row i: unit vector e_i


# -- 2b. an upstream reporting absurd usage --------------------------------------------------------------

def stubbed_chat(router, answer: dict, **kwargs):
    """A RoutedChat whose upstream (a third-party OpenAI-compatible endpoint, stubbed at the transport)
    answers every call with ``answer["id"]`` and ``answer["usage"]`` (raw JSON bytes, changeable)."""
    import httpx
    import openai

    from sdk.routed_chat import RoutedChat, Upstream
    from sdk.token_prices import TokenPrice

    def upstream(request):
        body = (b'{"id": ' + answer["id"] + b', "object": "chat.completion", "created": 0, "model": "up", "choices": '
                b'[{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}], '
                b'"usage": ' + answer["usage"] + b"}")
        return httpx.Response(200, content=body, headers={"content-type": "application/json"})

    client = openai.OpenAI(base_url="http://up.test/v1", api_key="k", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(upstream)))
    return RoutedChat(router, upstreams={m: Upstream(client=client) for m in MODELS}, lam=1.0,
                      prices={m: TokenPrice(1.0, 2.0) for m in MODELS}, **kwargs)


USAGE = b'{"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}'


@pytest.mark.parametrize("usage", [b'{"prompt_tokens": -5, "completion_tokens": 3, "total_tokens": -2}',
                                   b'{"prompt_tokens": 1' + b"0" * 400 + b', "completion_tokens": 3, "total_tokens": 3}'])
def test_an_answer_with_absurd_usage_is_returned_not_lost_and_its_cost_is_not_observed(bundle, signing_keys, usage):
    chat = stubbed_chat(Router.load(bundle(), signing_keys[1]), {"id": b'"chatcmpl-1"', "usage": usage})
    try:
        result = chat.create_routed(messages=[{"role": "user", "content": "a"}])
        assert result.completion.choices[0].message.content == "hi"
        assert result.outcome.route.model == "dear" and result.outcome.cost_usd is None
    finally:
        chat.close()


def test_an_answer_id_sqlite_cannot_store_neither_loses_the_answer_nor_breaks_the_pending_store(
        bundle, signing_keys, tmp_path):
    from sdk.errors import UnknownResponseError

    router = Router.load(bundle(), signing_keys[1])
    answer = {"id": b'"\\ud800"', "usage": USAGE}  # JSON "\ud800": a lone surrogate
    with EvalLog(tmp_path / "log.sqlite", router.model_ids) as log:
        chat = stubbed_chat(router, answer, log=log, pending=tmp_path / "pending.sqlite")
        try:
            result = chat.create_routed(messages="a")
            assert result.completion.choices[0].message.content == "hi" and not result.outcome.awaiting_score
            answer["id"] = b'"chatcmpl-2"'  # the store still takes the next answer (it used to stay mid-transaction)
            assert chat.create_routed(messages="a").outcome.awaiting_score
            with pytest.raises(UnknownResponseError, match="no routed call awaits a score under id"):
                chat.feedback("\ud800", 0.5)
            assert chat.feedback("chatcmpl-2", 0.5) == 1 and log.rows().cost_usd.tolist() == [(5 + 3 * 2) / 1e6]
        finally:
            chat.close()



def test_feedback_and_calls_after_close_are_fedroute_errors(bundle, signing_keys, tmp_path):
    from sdk.errors import UpstreamError
    from sdk.pending_outcomes import PendingOutcome
    from sdk.routed_chat import RoutedChat, Upstream
    from sdk.token_prices import TokenPrice

    router = Router.load(bundle(), signing_keys[1])
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log:
        chat = RoutedChat(router, upstreams={m: Upstream("http://127.0.0.1:9/v1", api_key="k") for m in MODELS},
                          lam=1.0, prices={m: TokenPrice(1.0, 2.0) for m in MODELS}, log=log)
        chat.close()  # closes the pending store; feedback then met sqlite3.ProgrammingError
        with pytest.raises(EvalLogError, match=r"pending\.sqlite' is closed"):
            chat.feedback("chatcmpl-1", 1.0)
        with pytest.raises(EvalLogError, match="is closed"):
            chat.pending.add(PendingOutcome("chatcmpl-1", time.time(), "cheap", 0.001, 5.0, np.ones(3), 0, 1))
        with pytest.raises(UpstreamError, match="this RoutedChat is closed"):  # was httpx's RuntimeError
            chat.create(messages="a")
        assert len(log) == 0


def test_the_pending_store_refuses_an_unstorable_id_before_writing_and_stays_usable(tmp_path):
    from sdk.pending_outcomes import PendingOutcome, PendingOutcomes

    store = PendingOutcomes(tmp_path / "pending.sqlite")
    try:
        def outcome(rid):
            return PendingOutcome(rid, time.time(), "cheap", 0.001, 5.0, np.ones(3, np.float32), 0, 1)

        with pytest.raises(InvalidInputError, match="cannot be stored"):
            store.add(outcome("a\ud800"))
        store.add(outcome("ok"))
        assert len(store) == 1 and store.get("ok").model == "cheap" and store.get("a\ud800") is None
    finally:
        store.close()


def test_token_prices_refuse_numbers_beyond_the_float_range():
    from sdk.token_prices import TokenPrice

    with pytest.raises(InvalidInputError, match="input_usd_per_1m"):
        TokenPrice(10**400, 1.0)
    with pytest.raises(InvalidInputError, match="float range"):
        TokenPrice(1.0, 2.0).cost_usd(10**400, 0)
    assert TokenPrice(1.0, 2.0).cost_usd(1_000_000, 500_000) == 2.0  # 1 USD in + 1 USD out


def test_the_pair_encoder_tokenises_at_most_64_ki_characters_of_a_megabyte_text():
    from tokenizers import Tokenizer

    from sdk.pair_encoding import PairEncoder

    encoder = PairEncoder(Tokenizer.from_str(wordpiece_json()))
    real, seen = encoder.tokenizer, []

    class Spy:  # records what reaches the third-party tokenizer, then delegates to it
        def encode_batch(self, texts, **kwargs):
            seen.extend(len(t) for t in texts)
            return real.encode_batch(texts, **kwargs)

    encoder.tokenizer = Spy()
    long = encoder.encode_segments(["c " * 500_000 + "a b"], ["d " + "c " * 500_000])  # 1 MB each
    assert max(seen) == 65_536
    # the prompt's last and the response's first tokens are those of any long enough text
    short = PairEncoder(Tokenizer.from_str(wordpiece_json())).encode_segments(["c " * 100 + "a b"], ["d " + "c " * 100])
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        np.testing.assert_array_equal(long[name], short[name])


def test_budget_controller_arguments_beyond_the_float_or_memory_range(bundle, signing_keys):
    from sdk.budget import BudgetController

    router = Router.load(bundle(), signing_keys[1])
    with pytest.raises(InvalidInputError, match="window"):
        BudgetController(router, budget_usd_per_1k=1.0, window=10**30)
    controller = BudgetController(router, budget_usd_per_1k=1.0, seed=0)
    with pytest.raises(InvalidInputError, match="cost_usd"):
        controller.record("cheap", 10**400)
    for accuracy, cost in (([["a", "b"]], [[1, 2]]), ([[0.5], [0.5, 0.1]], [0.1, 0.2])):
        with pytest.raises(ShapeError, match="do not convert to float64"):
            controller.choose_from_predictions(accuracy, cost)
    assert controller.n_chosen == 0 and controller.n_recorded == 0  # nothing half-counted


def test_budget_controller_budgets_and_costs_whose_arithmetic_over_or_underflows(bundle, signing_keys):
    from sdk.budget import BudgetController

    router = Router.load(bundle(), signing_keys[1])
    # 5e-324 USD per 1k is a finite number > 0, but / 1000 is 0.0: math.log raised "math domain error".
    with pytest.raises(InvalidInputError, match="budget_usd_per_1k"):
        BudgetController(router, budget_usd_per_1k=5e-324)
    # Two finite costs whose sum is beyond the float range: math.fsum raised OverflowError, after the cost had
    # entered the window, so every later record (even of 0 USD) raised too.
    controller = BudgetController(router, budget_usd_per_1k=1.0, window=4, seed=0)
    for cost in (1e308, 1e308, 0.0):
        controller.record("cheap", cost)
    assert controller.n_recorded == 3
    assert controller.realised_usd_per_1k == math.inf  # the mean, 2e308 / 3 USD, is 6.7e307: x 1000 is beyond
    controller.record("cheap", 0.0)
    controller.record("cheap", 0.0)  # the window (1e308, 0, 0, 0): mean 2.5e307 USD
    assert controller.realised_usd_per_1k == math.inf and controller.choose("a") in MODELS
    for _ in range(4):
        controller.record("cheap", 0.004)
    assert controller.realised_usd_per_1k == pytest.approx(4.0)  # the huge costs left the window


@pytest.mark.parametrize("token", ["t\u00e9st", "fr_a\nInjected: 1", "fr_a\x00b", "fr_\ud800", "fr_a b"])
def test_a_token_that_cannot_travel_in_an_http_header_is_refused_at_construction(tmp_path, signing_keys, token):
    from sdk.sync import SyncClient

    with EvalLog(tmp_path / "log.sqlite", MODELS) as log:
        with pytest.raises(InvalidInputError, match="token"):
            SyncClient("https://fed.test", token, log, tmp_path / "bundle", signing_keys[1])
        SyncClient("https://fed.test", " fr_AbC-_9 \n", log, tmp_path / "bundle", signing_keys[1]).close()  # stripped


def test_a_public_key_path_naming_a_device_a_fifo_or_a_huge_file_fails_instead_of_blocking(bundle, signing_keys,
                                                                                          tmp_path):
    built = bundle()
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    for path in (tmp_path, "/dev/zero", fifo):  # the folder first: before the fix the other two blocked
        with pytest.raises(BundleError, match="is not a regular file"):
            Router.load(built, path)
    huge = tmp_path / "huge.pub"
    huge.write_bytes(signing_keys[1].read_bytes() + b"\n" * 70_000)
    with pytest.raises(BundleError, match=f"public key {re.escape(str(huge))}: over the 65536-byte limit"):
        Router.load(built, huge)
    link = tmp_path / "link.pub"
    link.symlink_to(signing_keys[1])  # a key file may be a link (it is not a bundle file)
    assert Router.load(built, link).bundle_version == 1


def test_paths_with_a_nul_byte_are_fedroute_errors(bundle, signing_keys, tmp_path):
    from sdk.pending_outcomes import PendingOutcomes

    with pytest.raises(EvalLogError, match="evaluation log"):
        EvalLog(str(tmp_path / "log\x00.sqlite"), MODELS)
    with pytest.raises(EvalLogError, match="pending-outcome store"):
        PendingOutcomes(str(tmp_path / "pending\x00.sqlite"))
    with pytest.raises(BundleError, match="public key"):
        Router.load(bundle(), str(signing_keys[1]) + "\x00")


@pytest.mark.parametrize("garbage, content_type", [(b"<html>busy</html>", "application/json"),
                                                   (b"<html>busy</html>", "text/html"), (b"[1, 2]", "application/json"),
                                                   (b"{}", "application/json"),
                                                   (b'{"x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "application/json")])
def test_an_answer_that_is_not_a_chat_completion_falls_back_like_a_5xx(bundle, signing_keys, garbage, content_type):
    import httpx
    import openai

    from sdk.errors import UpstreamError
    from sdk.routed_chat import RoutedChat, Upstream
    from sdk.token_prices import TokenPrice

    good = (b'{"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "cheap", "choices": [{"index": 0, '
            b'"finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}], "usage": ' + USAGE + b"}")
    broken = {"dear", "cheap"}

    def upstream(request):  # a third-party endpoint whose "dear" (the router's first choice) answers garbage
        if json.loads(request.content)["model"] in broken:
            return httpx.Response(200, content=garbage, headers={"content-type": content_type})
        return httpx.Response(200, content=good, headers={"content-type": "application/json"})

    client = openai.OpenAI(base_url="http://up.test/v1", api_key="k", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(upstream)))
    chat = RoutedChat(Router.load(bundle(), signing_keys[1]), upstreams={m: Upstream(client=client) for m in MODELS},
                      lam=1.0, prices={m: TokenPrice(1.0, 2.0) for m in MODELS})
    try:
        with pytest.raises(UpstreamError, match=r"dear \(invalid_response\), cheap") as info:
            chat.create_routed(messages="a")
        assert info.value.kind == "invalid_response"
        broken.discard("cheap")
        result = chat.create_routed(messages="a")
        assert result.completion.choices[0].message.content == "hi" and result.outcome.route.model == "cheap"
        assert [(a.model, a.kind) for a in result.outcome.route.failed] == [("dear", "invalid_response")]
    finally:
        chat.close()


@pytest.mark.parametrize("bad_event", [b"data: not json\n\n", b"data: [1, 2]\n\n"])
def test_a_stream_event_that_is_not_a_chunk_ends_the_stream_with_an_upstream_error(bundle, signing_keys, bad_event):
    import httpx
    import openai

    from sdk.errors import UpstreamError
    from sdk.routed_chat import RoutedChat, Upstream
    from sdk.token_prices import TokenPrice

    chunk = (b'data: {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "up", "choices": '
             b'[{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": null}]}\n\n')

    def upstream(request):  # a third-party endpoint streaming one chunk, then a broken event
        return httpx.Response(200, content=chunk + bad_event + b"data: [DONE]\n\n",
                              headers={"content-type": "text/event-stream"})

    client = openai.OpenAI(base_url="http://up.test/v1", api_key="k", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(upstream)))
    chat = RoutedChat(Router.load(bundle(), signing_keys[1]), upstreams={m: Upstream(client=client) for m in MODELS},
                      lam=1.0, prices={m: TokenPrice(1.0, 2.0) for m in MODELS})
    try:
        stream = chat.create_routed(messages="a", stream=True)
        got = []
        with pytest.raises(UpstreamError, match="not a chat completion chunk") as info:
            for c in stream:
                got.append(c.choices[0].delta.content)
        assert got == ["hi"] and info.value.kind == "invalid_response"
        assert stream.outcome is not None and stream.outcome.cost_usd is None  # recorded as answered without usage
    finally:
        chat.close()


def test_a_feedback_score_beyond_the_float_range_is_an_invalid_input(bundle, signing_keys, tmp_path):
    router = Router.load(bundle(), signing_keys[1])
    with EvalLog(tmp_path / "log.sqlite", router.model_ids) as log:
        chat = stubbed_chat(router, {"id": b'"chatcmpl-1"', "usage": USAGE}, log=log, pending=tmp_path / "p.sqlite")
        try:
            assert chat.create_routed(messages="a").outcome.awaiting_score
            with pytest.raises(InvalidInputError, match="score.*401 digits"):
                chat.feedback("chatcmpl-1", 10**400)
            assert chat.feedback("chatcmpl-1", 1) == 1  # still awaiting: the bad score recorded nothing
        finally:
            chat.close()


def test_numbers_beyond_the_float_range_are_invalid_inputs_in_the_log_and_the_budget_check(tmp_path):
    from sdk.routed_chat import check_budget

    with EvalLog(tmp_path / "log.sqlite", MODELS) as log:
        for field in ("score", "cost_usd", "latency_ms", "timestamp"):
            kwargs = {"score": 1.0, "cost_usd": 0.001, "latency_ms": 1.0, "timestamp": None, field: 10**400}
            score, cost = kwargs.pop("score"), kwargs.pop("cost_usd")
            # its size, not its first 40 digits (which read as a finite number)
            with pytest.raises(InvalidInputError, match=f"{field}.*401 digits"):
                log.record("cheap", score, cost, cell=0, **kwargs)
        assert len(log) == 0
    with pytest.raises(InvalidInputError, match="budget_usd_per_1k"):
        check_budget(10**400)


@pytest.mark.parametrize("fields", [{"prompt_tokens": 10**12}, {"response_tokens": True}, {"sep_token": ["[SEP]"]},
                                    {"pad_token": ""}])
def test_a_pair_encoding_that_would_allocate_without_bound_or_crash_the_tokenizer_is_refused(fields):
    from sdk.pair_encoding import PairEncodingConfig
    from sdk.selector import OnnxPairSelectorKind

    field = next(iter(fields))
    with pytest.raises(InvalidInputError, match=f"^{field} "):
        PairEncodingConfig(**fields)
    manifest = {"files": {"tokenizer.json": "0" * 64, "selector.onnx": "0" * 64},
                "selector": {"name": "s", "files": {"fp32": "selector.onnx"}, "n_length_features": 3,
                             "pair_encoding": {**PairEncodingConfig().to_dict(), **fields}}}
    with pytest.raises(BundleError, match=f"manifest: selector.pair_encoding.*{field}"):
        OnnxPairSelectorKind().check_manifest(manifest)  # a signed selector bundle carrying it


def test_reward_manifest_numbers_beyond_what_tokenizers_or_floats_take_are_bundle_errors():
    from sdk.reward_scorer import check_lora_reward_manifest

    def manifest(max_tokens=128, length_scale=8.0):
        return {"embedder": {"dim": 3, "files": {"fp32": "embedder.onnx"}}, "clients": ["a", "b"],
                "client": {"index": 0, "name": "a"}, "features": {"length_features": True, "d_in": 9,
                                                                   "length_scale": length_scale},
                "reward": {"arch": "lora", "encoder": {"base_model": "m", "max_tokens": max_tokens,
                                                       "truncation_side": "left", "length_term": False}},
                "files": {n: "0" * 64 for n in ("reward.onnx", "client_router.onnx", "reward_tokenizer.json")}}

    check_lora_reward_manifest(manifest())
    with pytest.raises(BundleError, match="features.length_scale"):
        check_lora_reward_manifest(manifest(length_scale=10**400))
    with pytest.raises(BundleError, match="reward.encoder"):
        check_lora_reward_manifest(manifest(max_tokens=10**30))  # tokenizers' enable_truncation overflowed at load
