"""The ``int8-all`` encoder (every weight MatMul in int8, issue 13 item 2): recipe, manifest, loading,
and its parity gate (decisions and AUC gate it; cosine is reported only)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from export.parity import check_bundle, gate_failures, gated_measures
from sdk import Router


@pytest.fixture(scope="module")
def bundle(make_bundle, tmp_path_factory):
    return make_bundle(tmp_path_factory.mktemp("i8a") / "bundle", int8_all=True)


def test_the_recipe_quantises_every_weight_matmul_that_int8_keeps_in_fp32(exported_embedder, int8_all_model):
    import onnx

    from export.embedder_onnx import QUANTISED_PRECISIONS, sensitive_matmuls

    exported, int8_path = exported_embedder
    kept = sensitive_matmuls(exported.model)
    assert len(kept) == 4 and QUANTISED_PRECISIONS["int8-all"](exported.model) == []
    fp32_names = lambda p: {n.name for n in onnx.load(str(p)).graph.node if n.op_type == "MatMul"}  # noqa: E731
    # The graph is fused (export.embedder_fusion): per layer one Attention (Q/K/V packed, quantised as
    # one QAttention) and three weight MatMuls (attention output, FFN in, FFN out). int8 keeps the
    # four FFN output projections as float MatMuls; int8-all has none of them left, and four more
    # integer MatMuls (6 layers x 3 = 18 in all).
    assert set(kept) <= fp32_names(int8_path) and not set(kept) & fp32_names(int8_all_model)
    count = lambda p, op: sum(n.op_type == op for n in onnx.load(str(p)).graph.node)  # noqa: E731
    assert (count(int8_path, "MatMulInteger"), count(int8_all_model, "MatMulInteger")) == (14, 18)
    assert (count(int8_path, "QAttention"), count(int8_all_model, "QAttention")) == (6, 6)
    assert count(int8_all_model, "MatMul") == 0  # the attention's activation x activation products are inside QAttention


def test_the_manifest_lists_int8_all_and_router_load_loads_it(bundle, signing_keys, fitted_routers):
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["embedder"]["files"] == {"fp32": "embedder.onnx", "int8": "embedder.int8.onnx",
                                             "int8-all": "embedder.int8-all.onnx"}
    assert "embedder.int8-all.onnx" in manifest["files"]
    router = Router.load(bundle, signing_keys[1], precision="int8-all")
    assert router.precision == "int8-all" and "int8-all" in repr(router)
    assert Router.load(bundle, signing_keys[1]).precision == "int8-all"  # auto: the fastest shipped
    prompts = list(fitted_routers["test"].prompts[:40])
    emb = router.embed(prompts)
    cos = (emb * fitted_routers["test_embeddings"][:40]).sum(1)
    assert emb.shape == (40, 384) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert 0.95 < cos.min() < 0.9999  # close to sentence-transformers, but not the fp32 graph
    # One query at a time, like int8: a text's embedding does not depend on its batch.
    np.testing.assert_array_equal(emb[:3], np.concatenate([router.embed([p]) for p in prompts[:3]]))
    assert [c.model for c in router.choose_batch(prompts[:5], 50.0)] == [router.choose(p, 50.0).model for p in prompts[:5]]


def test_gate_table_quantised_precisions_are_gated_on_decisions_and_auc_not_cosine():
    entry = {"cosine": {"mean": 0.9, "min": 0.5}, "decision_agreement": 0.995, "decision_agreement_vs_fp32": 0.993,
             "auc": 0.85, "auc_gap": 0.004}
    for precision in ("int8", "int8-all"):
        assert gate_failures(precision, entry, 0.846) == []  # cosine reported, not gating
        assert gate_failures(precision, dict(entry, decision_agreement_vs_fp32=0.98), 0.846) == [
            f"{precision} decisions agree with the fp32 encoder's on 0.9800 < 0.99 of (query, lambda) pairs"]
    # fp32 keeps its cosine gate.
    assert gate_failures("fp32", dict(entry, cosine={"mean": 0.9995, "min": 0.998}), 0.846) == [
        "fp32 min cosine 0.99800 < 0.999"]
    assert gate_failures("int8-all", dict(entry, auc=0.8, auc_gap=0.046), 0.846) == [
        "int8-all AUC 0.8000 is 0.0460 from the trainer's 0.8460 (> 0.005)"]
    assert len(gate_failures("int8-all", dict(entry, decision_agreement=float("nan"), auc_gap=float("nan")), 0.8)) == 2


def test_the_gate_accepts_the_real_quantisation_and_reports_cosine(bundle, signing_keys, fitted_routers):
    test = fitted_routers["test"].with_models(fitted_routers["kmeans"].models)
    report = check_bundle(bundle, signing_keys[1], fitted_routers["kmeans"], fitted_routers["test_embeddings"], test,
                          ["fp32", "int8-all"], progress=lambda _: None)
    assert report["passed"], report["failures"]
    entry = report["precisions"]["int8-all"]
    assert entry["decision_agreement"] >= 0.99 and entry["decision_agreement_vs_fp32"] >= 0.99
    assert entry["auc_gap"] <= 0.005
    assert 0.95 < entry["cosine"]["min"] <= entry["cosine"]["mean"] < 1.0  # reported, not gated
    assert entry["gated"] == ["decision_agreement", "decision_agreement_vs_fp32", "auc_gap"]
    assert gated_measures("int8", {"decision_agreement_vs_fp32": 0.99}) == [
        "decision_agreement", "decision_agreement_vs_fp32", "auc_gap"]
    assert gated_measures("fp32", {}) == ["cosine.min", "decision_agreement", "auc_gap"]
    assert "cosine_gates" in report["thresholds"] and set(report["thresholds"]["cosine_gates"]) == {"fp32"}


def test_the_gate_refuses_a_poisoned_quantisation(exported_embedder, make_bundle, signing_keys, fitted_routers,
                                                   tmp_path):
    """A broken int8-all encoder (the word-embedding table scrambled before quantisation) is refused
    on decisions, even though the gate does not look at its cosine."""
    import onnx
    from onnx import numpy_helper

    from export.embedder_onnx import quantize_precision

    exported, _ = exported_embedder
    model = onnx.load(str(exported.model))
    table = next(t for t in model.graph.initializer if "word_embeddings" in t.name)
    weights = numpy_helper.to_array(table)
    rows = np.random.default_rng(0).permutation(weights.shape[0])  # every token id reads another token's row
    table.CopyFrom(numpy_helper.from_array(weights[rows], table.name))
    poisoned_fp32 = tmp_path / "poisoned.onnx"
    onnx.save(model, str(poisoned_fp32))
    poisoned = quantize_precision(poisoned_fp32, tmp_path / "embedder.int8-all.onnx", "int8-all")
    bundle = make_bundle(tmp_path / "bundle", int8=False, int8_all=True,
                         files={"embedder.int8-all.onnx": poisoned.read_bytes()})
    test = fitted_routers["test"].with_models(fitted_routers["kmeans"].models)
    report = check_bundle(bundle, signing_keys[1], fitted_routers["kmeans"], fitted_routers["test_embeddings"], test,
                          ["fp32", "int8-all"], progress=lambda _: None)
    assert not report["passed"]
    failures = [f for f in report["failures"] if f.startswith("int8-all")]
    assert any("decisions agree on" in f for f in failures)
    assert any("decisions agree with the fp32 encoder's" in f for f in failures)
    assert not any("cosine" in f for f in report["failures"])
    assert report["precisions"]["int8-all"]["cosine"]["mean"] < 0.9  # it is broken; cosine shows it, reported
    assert report["precisions"]["fp32"]["decision_agreement"] == 1.0


def test_export_refuses_an_unknown_precision_before_any_work(fitted_routers, tmp_path, signing_keys):
    from export.errors import ExportError
    from export.pipeline import export_bundle

    with pytest.raises(ExportError, match=r"\['int4'\]"):
        export_bundle(fitted_routers["dir"] / "kmeans", tmp_path / "out", signing_keys[0], precisions=("int4",),
                      progress=lambda _: None)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_fedroute_export_precision_int8_all_end_to_end(fitted_routers, tmp_path, signing_keys):
    from typer.testing import CliRunner

    from trainer.cli import app

    out = tmp_path / "bundle"
    result = CliRunner().invoke(app, [
        "export", "--router", str(fitted_routers["dir"] / "kmeans"), "--out", str(out), "--precision", "int8-all",
        "--signing-key", str(signing_keys[0]), "--cache-dir", str(fitted_routers["cache"])])
    assert result.exit_code == 0, result.output
    assert "embedder ['fp32', 'int8-all']" in result.output and "(not gated)" in result.output
    parity = json.loads((out / "parity.json").read_text())
    entry = parity["precisions"]["int8-all"]
    assert parity["passed"] and entry["decision_agreement"] >= 0.99 and entry["auc_gap"] <= 0.005
    assert Router.load(out, signing_keys[1]).precision == "int8-all"
