"""Graph fusion of the exported encoder (issue 13, :mod:`export.embedder_fusion`): the shipped graphs hold
onnxruntime's fused ops, embed like optimum's unfused graph, run in plain onnxruntime through the SDK,
and a fusion that does not match the model is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest


def _ops(path: Path) -> dict[str, int]:
    import onnx

    out: dict[str, int] = {}
    for node in onnx.load(str(path)).graph.node:
        out[node.op_type] = out.get(node.op_type, 0) + 1
    return out


def test_the_exported_fp32_graph_is_fused(exported_embedder):
    exported, _ = exported_embedder
    assert exported.model.name == "model.fused.onnx"
    # all-MiniLM-L6-v2: 6 layers x (1 Attention, 1 BiasGelu); the residual Add + LayerNormalization
    # pairs are not fused into SkipLayerNormalization (its CPU kernel is the slower one).
    assert exported.fused_ops == {"Attention": 6, "BiasGelu": 6, "SkipLayerNormalization": 0, "QAttention": 0}
    fused, unfused = _ops(exported.model), _ops(exported.model.parent / "model.onnx")
    assert (unfused.get("Softmax"), unfused.get("Erf"), unfused.get("Attention")) == (6, 6, None)
    # Softmax, erf GELU and the per-head Reshape/Transpose chains are gone; the 13 LayerNormalization
    # nodes (the embeddings' and 2 per layer) stay.
    assert "Softmax" not in fused and "Erf" not in fused and "Transpose" not in fused
    assert fused["LayerNormalization"] == 13 and unfused["LayerNormalization"] == 13
    assert sum(fused.values()) < sum(unfused.values()) / 3


def test_the_int8_all_graph_holds_qattention_and_no_float_matmul(int8_all_model, exported_embedder):
    ops = _ops(int8_all_model)
    assert ops["QAttention"] == 6 and ops["MatMulInteger"] == 18 and "MatMul" not in ops and "Attention" not in ops
    assert "SkipLayerNormalization" not in ops and ops["LayerNormalization"] == 13 and ops["BiasGelu"] == 6
    assert 20e6 < int8_all_model.stat().st_size < 26e6  # word-embedding table in int8, as before fusion


def test_fused_fp32_embeds_like_the_unfused_export_batched_with_padding(exported_embedder, fitted_routers):
    """The SDK's OnnxEmbedder on both graphs, one padded batch of real prompts of different lengths
    (the raw 2-D attention mask is kept, so padding is masked as in the unfused graph)."""
    from sdk.embedder import OnnxEmbedder, session_options

    exported, _ = exported_embedder
    tok = exported.tokenizer.read_text()
    prompts = list(fitted_routers["test"].prompts[:24]) + ["Hi", "Is a whale a fish?"]

    def embedder(path: Path) -> OnnxEmbedder:
        return OnnxEmbedder(tok, path.read_bytes(), 384, 32, "left", session_options(1, 1), batched=True)

    fused, unfused = embedder(exported.model), embedder(exported.model.parent / "model.onnx")
    n_tokens = fused.n_tokens(prompts)
    assert min(n_tokens) == 3 and max(n_tokens) == 32  # "Hi" is padded by 29 tokens in the batch
    a, b = fused.embed(prompts), unfused.embed(prompts)
    assert a.shape == (26, 384) and a.dtype == np.float32
    np.testing.assert_allclose(a, b, atol=2e-6)
    # A text's embedding does not depend on the padding its batch adds.
    np.testing.assert_allclose(a[-2:], fused.embed(prompts[-2:]), atol=2e-6)
    np.testing.assert_allclose(a[-2], fused.embed(["Hi"])[0], atol=2e-6)


def test_a_fusion_that_does_not_match_the_model_is_refused(exported_embedder, tmp_path):
    from export.embedder_fusion import fuse_embedder
    from export.errors import ExportError

    exported, _ = exported_embedder
    config = json.loads((exported.model.parent / "config.json").read_text())
    wrong = tmp_path / "config.json"
    wrong.write_text(json.dumps(dict(config, num_hidden_layers=5)))
    out = tmp_path / "fused.onnx"
    with pytest.raises(ExportError, match=r"'Attention': \(6, 5\)"):
        fuse_embedder(exported.model.parent / "model.onnx", out, wrong, exported.tokenizer)
    assert not out.exists() and not list(tmp_path.glob("*.tmp*"))
    # A model type the BERT fusions do not know is shipped unfused: nothing written, None returned.
    wrong.write_text(json.dumps(dict(config, model_type="mpnet")))
    assert fuse_embedder(exported.model.parent / "model.onnx", out, wrong, exported.tokenizer) is None
    assert not out.exists()


def test_the_fused_int8_all_bundle_runs_in_plain_onnxruntime(make_bundle, signing_keys, tmp_path):
    """Router.load and a bare onnxruntime CPU session (standard wheel, CPU execution provider only)
    give the same embedding: the contrib ops need nothing beyond the SDK's dependencies."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    from sdk import Router

    bundle = make_bundle(tmp_path / "bundle", int8=False, int8_all=True)
    router = Router.load(bundle, signing_keys[1], precision="int8-all")
    query = "Write a haiku about the sea."
    choice = router.choose(query, 100.0)
    assert choice.model in router.model_ids
    from sdk.embedder import DISABLED_OPTIMIZERS

    session = ort.InferenceSession(str(bundle / "embedder.int8-all.onnx"), providers=["CPUExecutionProvider"],
                                   disabled_optimizers=list(DISABLED_OPTIMIZERS))
    enc = Tokenizer.from_file(str(bundle / "tokenizer.json")).encode(query)
    (out,) = session.run(["sentence_embedding"], {"input_ids": np.array([enc.ids], dtype=np.int64),
                                                  "attention_mask": np.array([enc.attention_mask], dtype=np.int64)})
    np.testing.assert_allclose(choice.embedding, out[0], atol=1e-6)


def test_the_sdk_session_leaves_add_and_layer_norm_unfused(tmp_path):
    """onnxruntime's own SkipLayerNormFusion would turn a residual Add + LayerNormalization into the
    slower SkipLayerNormalization kernel at session creation; the SDK's sessions leave that optimiser
    out (onnxruntime writes the graph it runs to ``optimized_model_filepath``)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from sdk.embedder import inference_session, session_options

    hidden = 8
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "skip"], ["sum"]),
         helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-12)],
        "residual", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4, hidden]) for n in ("x", "skip")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, hidden])],
        [helper.make_tensor("gamma", TensorProto.FLOAT, [hidden], np.ones(hidden, np.float32)),
         helper.make_tensor("beta", TensorProto.FLOAT, [hidden], np.zeros(hidden, np.float32))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8

    def ops_run(session_factory) -> list[str]:
        options = session_options(1, 1)
        options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        session = session_factory(options)
        x = np.arange(4 * hidden, dtype=np.float32).reshape(1, 4, hidden)
        (y,) = session.run(["y"], {"x": x, "skip": x})
        row = 2 * x[0, 0]
        np.testing.assert_allclose(y[0, 0], (row - row.mean()) / row.std(), rtol=1e-5, atol=1e-5)
        return [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]

    plain = ops_run(lambda o: ort.InferenceSession(model.SerializeToString(), o, providers=["CPUExecutionProvider"]))
    assert plain == ["SkipLayerNormalization"]  # what onnxruntime does on its own
    sdk = ops_run(lambda o: inference_session(model.SerializeToString(), o, "residual"))
    assert sdk == ["Add", "LayerNormalization"]
