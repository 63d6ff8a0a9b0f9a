"""Selector export (export.selector_export) and the device runtime sdk.Selector, on a real expert.

The expert is the trainer's PairSelector (frozen all-MiniLM-L6-v2 + LoRA in the top layer + pair head)
trained for 40 AdamW steps on real AlpacaEval and HH-RLHF harmless pairs, so its LoRA matrices are
non-zero and merging them matters. Parity is measured on other real pairs of both sources, through the
SDK as an app loads the bundle. (An expert that has learned nothing puts many pairs at P = 0.5 +- 0.01,
where any int8 rounding flips the decision; the 99 % int8 gate is meant for trained selectors.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from export.errors import ExportError, ParityError  # noqa: E402
from sdk.errors import BundleError, InvalidInputError  # noqa: E402
from sdk.selector import Selector  # noqa: E402

# The shared bundle ships fp32 only: this 40-step expert puts many pairs near P = 0.5, and on an AVX2
# CPU without VNNI (onnxruntime's u8s8 kernels saturate there) its int8 copy agreed on 95-96 % of
# 200 parity pairs, below the 99 % gate, whatever the weight type or reduce_range (both tried).
# test_int8_export_passes_or_refuses_on_its_gate checks the int8 gate itself on any CPU.
N_TRAIN, N_PARITY = 96, 200


@pytest.fixture(scope="module")
def hh_pairs(shared_data):
    """(train, parity) real pairs, half AlpacaEval model-vs-model, half HH harmless; disjoint prompts."""
    import pandas as pd

    from trainer.data.preferences import load_alpacaeval_pairs, load_hh_harmless_pairs

    parts = []
    for df in (load_alpacaeval_pairs(shared_data, include_reference_pairs=False, max_pairs_per_instruction=1),
               load_hh_harmless_pairs(shared_data, seed=0)):
        df = df.drop_duplicates("prompt_id").sample((N_TRAIN + N_PARITY) // 2, random_state=0)
        parts.append((df.iloc[: N_TRAIN // 2], df.iloc[N_TRAIN // 2:]))
    return (pd.concat([p[0] for p in parts], ignore_index=True), pd.concat([p[1] for p in parts], ignore_index=True))


@pytest.fixture(scope="module")
def trained_expert(hh_pairs, tmp_path_factory):
    """RUN/fedprism_seed0/expert_0 (+ selector_config.json) after 40 AdamW steps on real pairs."""
    from trainer.experts.selector import PairSelector, SelectorConfig, build_segment_store, save_selector_config

    torch.set_num_threads(1)
    train, _ = hh_pairs
    model = PairSelector(SelectorConfig(), seed=0)
    store = build_segment_store(model, list(train.prompt), list(train.response_a), list(train.response_b),
                                list(train.label))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    rng = np.random.default_rng(0)
    model.train()
    for _ in range(40):
        ha, hb, f, y = store.batch(model, rng.choice(N_TRAIN, 16, replace=False))
        loss = model.pair_loss(ha, hb, f, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    run = tmp_path_factory.mktemp("run") / "fedprism_seed0"
    model.save_expert(model.expert_state(), run / "expert_0")
    save_selector_config(model.config, run / "selector_config.json")
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(float(p.detach().abs().max()) > 0 for p in lora_b)  # the merge has something to merge
    return run / "expert_0"


@pytest.fixture(scope="module")
def bundle(trained_expert, hh_pairs, signing_keys, tmp_path_factory):
    from export.selector_export import export_selector_bundle

    _, parity = hh_pairs
    out = tmp_path_factory.mktemp("bundles") / "selector"
    result = export_selector_bundle(trained_expert, out, signing_keys[0], parity, int8=False, progress=lambda m: None)
    return out, result


def test_onnx_parity_with_torch(bundle, trained_expert, hh_pairs, signing_keys):
    from export.selector_export import load_trained_selector, torch_logits

    out, result = bundle
    report = result.parity
    assert report["passed"] and report["n_pairs"] == N_PARITY
    assert report["fp32"]["max_abs_logit_diff"] <= 1e-3
    assert "int8" not in report
    manifest = result.manifest
    assert manifest["selector_kind"] == "onnx_pair"
    assert manifest["selector"]["name"] == "fedprism-expert-0" and manifest["selector"]["expert"] == 0
    assert set(manifest["files"]) == {"tokenizer.json", "selector.onnx", "parity.json"}
    assert "embedder" not in manifest and "models" not in manifest
    assert json.loads((out / "parity.json").read_text()) == json.loads(json.dumps(report))

    # the SDK's probabilities equal the trainer's symmetric probability (fp32)
    _, parity = hh_pairs
    selector = load_trained_selector(trained_expert)
    ab, ba = torch_logits(selector, parity.prompt[:8], parity.response_a[:8], parity.response_b[:8])
    expected = 1 / (1 + np.exp(-(ab - ba) / 2))
    sel = Selector.load(out, signing_keys[1], precision="fp32")
    got = sel.prefer_many(list(parity.prompt[:8]), list(parity.response_a[:8]), list(parity.response_b[:8]))
    np.testing.assert_allclose(got, expected, atol=2e-4)
    # and differ from the backbone without the adapter: the merged LoRA is in the graph
    with selector.backbone.disable_adapter():
        ab0, _ = torch_logits(selector, parity.prompt[:8], parity.response_a[:8], parity.response_b[:8])
    assert np.max(np.abs(ab0 - ab)) > 1e-2


def test_int8_export_passes_or_refuses_on_its_gate(trained_expert, hh_pairs, signing_keys, tmp_path):
    """int8 ships only if its decisions agree with torch on >= 99 % of the parity pairs; a refused
    export writes nothing. (Which branch runs depends on the CPU's int8 kernels; both are checked.)"""
    from export.selector_export import export_selector_bundle

    _, parity = hh_pairs
    parity = parity.iloc[::4]  # 50 pairs of both sources: the gate, not the figure (test_onnx_parity_with_torch: 200)
    out = tmp_path / "selector-int8"
    try:
        result = export_selector_bundle(trained_expert, out, signing_keys[0], parity, int8=True, progress=lambda m: None)
    except ParityError as exc:
        agree = exc.report["int8"]["decision_agreement"]
        assert 0.5 < agree < 0.99 and not exc.report["passed"]
        assert exc.report["failures"] == [f"int8 decision agreement {agree:.4f} < 0.99"]
        assert not out.exists()
    else:
        assert result.parity["passed"] and result.parity["int8"]["decision_agreement"] >= 0.99
        assert Selector.load(out, signing_keys[1]).precision == "int8"  # the default when shipped


def test_prefer_is_antisymmetric_and_fp32_loads_when_no_int8_is_shipped(bundle, hh_pairs, signing_keys):
    out, _ = bundle
    _, parity = hh_pairs
    sel = Selector.load(out, signing_keys[1])
    assert sel.precision == "fp32" and sel.kind == "onnx_pair" and sel.bundle_version == 1
    x, a, b = parity.prompt[0], parity.response_a[0], parity.response_b[0]
    p = sel.prefer(x, a, b)
    assert 0.0 < p < 1.0
    assert p + sel.prefer(x, b, a) == pytest.approx(1.0, abs=1e-12)


def test_a_graph_without_logit_ba_is_fed_both_orders_and_gives_the_same_logits(bundle, hh_pairs, signing_keys,
                                                                              tmp_path):
    """The exporter's graph outputs both orders (``logit``, ``logit_ba``) from one encoding of the two segments;
    a graph with ``logit`` only (the contract's required output, as bundles exported before ``logit_ba`` carry
    it) is fed both orders in one batch of 2 and gives the same logits."""
    import onnx

    from export.bundle_writer import write_bundle
    from export.signing import load_signing_key

    src = bundle[0].resolve()
    manifest = json.loads((src / "manifest.json").read_text())
    graph = onnx.load_from_string((src / "selector.onnx").read_bytes())
    assert [o.name for o in graph.graph.output] == ["logit", "logit_ba"]
    kept = [o for o in graph.graph.output if o.name == "logit"]
    del graph.graph.output[:]
    graph.graph.output.extend(kept)
    files = {name: (src / name).read_bytes() for name in manifest["files"]}
    files["selector.onnx"] = graph.SerializeToString()
    fields = {k: v for k, v in manifest.items() if k not in ("format_version", "created_utc", "files", "signature")}
    write_bundle(tmp_path / "logit-only", files, fields, load_signing_key(signing_keys[0]))
    old = Selector.load(tmp_path / "logit-only", signing_keys[1], precision="fp32")
    new = Selector.load(src, signing_keys[1], precision="fp32")
    assert not old._scorer._both_orders and new._scorer._both_orders  # the two feeding paths
    _, parity = hh_pairs
    for x, a, b in zip(parity.prompt[:6], parity.response_a[:6], parity.response_b[:6]):
        np.testing.assert_allclose(old.logits(x, a, b), new.logits(x, a, b), rtol=0, atol=1e-5)
    with pytest.raises(InvalidInputError, match="^y_b has no token"):
        old.prefer("q", "a", "\u200b")


@pytest.mark.parametrize("args, match", [
    (("", "a", "b"), "x is empty"),
    (("q", "   ", "b"), "y_a is empty"),
    (("q", "a", None), "y_b must be a str"),
    ((b"q", "a", "b"), "x must be a str"),
    (("q", "a\ud800", "b"), "y_a is not valid Unicode"),
])
def test_selector_bad_inputs(bundle, signing_keys, args, match):
    sel = Selector.load(bundle[0], signing_keys[1], precision="fp32")
    with pytest.raises(InvalidInputError, match=match):
        sel.prefer(*args)


def test_prefer_many_and_load_argument_errors(bundle, signing_keys):
    sel = Selector.load(bundle[0], signing_keys[1], precision="fp32")
    with pytest.raises(InvalidInputError, match="one length"):
        sel.prefer_many(["q"], ["a", "b"], ["c"])
    with pytest.raises(InvalidInputError, match="list of str"):
        sel.prefer_many("q", ["a"], ["b"])
    with pytest.raises(InvalidInputError, match="precision"):
        Selector.load(bundle[0], signing_keys[1], precision="int4")
    with pytest.raises(BundleError, match="older than min_bundle_version"):
        Selector.load(bundle[0], signing_keys[1], min_bundle_version=2)


def test_prefer_many_names_a_bad_text_by_index_before_scoring(bundle, signing_keys):
    """A blank third response was reported as 'y_b is empty' (which pair?), after the first pairs were scored."""
    sel = Selector.load(bundle[0], signing_keys[1], precision="fp32")
    with pytest.raises(InvalidInputError, match=r"^y_b\[1\] is empty"):
        sel.prefer_many(["q", "r"], ["a", "b"], ["c", "  "])
    with pytest.raises(InvalidInputError, match=r"^x\[0\] must be a str, got NoneType$"):
        sel.prefer_many([None], ["a"], ["b"])
    np.testing.assert_allclose(sel.prefer_many(["q"], ["a"], ["c"]), [sel.prefer("q", "a", "c")])


@pytest.mark.parametrize("args, name", [
    (("q", "\x00\x00", "b"), "y_a"),
    (("q", "a", "\u200b"), "y_b"),
    (("\u200b\x00", "a", "b"), "x"),
])
def test_a_text_with_no_readable_token_is_refused_by_name(bundle, signing_keys, args, name):
    """A text of control or zero-width characters only passed the blank check, the tokenizer dropped every
    character, and the pair was scored as if that text were empty (prefer(x, "\\x00\\x00", "No.") gave 0.018),
    while "" is refused; sdk.RewardScorer refuses such texts too."""
    sel = Selector.load(bundle[0], signing_keys[1], precision="fp32")
    with pytest.raises(InvalidInputError, match=rf"^{name} has no token"):
        sel.prefer(*args)
    with pytest.raises(InvalidInputError, match=rf"^pair 1: {name} has no token"):
        sel.prefer_many(["q", args[0]], ["a", args[1]], ["b", args[2]])
    # one readable token is enough; emoji read as the unknown token
    assert 0.0 < sel.prefer("q\x00", "ok\u200b", "\U0001f642") < 1.0


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src.resolve(), dst)
    return dst


def test_tampered_or_foreign_bundles_are_refused(bundle, signing_keys, tmp_path):
    from export.signing import generate_keypair

    src = bundle[0]
    # a flipped byte in the graph: sha256 mismatch
    bad = _copy(src, tmp_path / "graph")
    data = bytearray((bad / "selector.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "selector.onnx").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="selector.onnx: sha256"):
        Selector.load(bad, signing_keys[1], precision="fp32")
    # an edited manifest: the signature no longer verifies
    bad = _copy(src, tmp_path / "manifest")
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["selector"]["name"] = "someone-else"
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="signature does not verify"):
        Selector.load(bad, signing_keys[1])
    # a corrupt manifest
    bad = _copy(src, tmp_path / "corrupt")
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        Selector.load(bad, signing_keys[1])
    # a missing file
    bad = _copy(src, tmp_path / "missing")
    (bad / "tokenizer.json").unlink()
    with pytest.raises(BundleError, match="tokenizer.json: missing"):
        Selector.load(bad, signing_keys[1])
    # signed by another key
    _, other_pub = generate_keypair(tmp_path / "other")
    with pytest.raises(BundleError, match="signature does not verify"):
        Selector.load(src, other_pub)
    # a selector bundle is not a router bundle
    from sdk.router import Router

    with pytest.raises(BundleError, match="carries no router"):
        Router.load(src, signing_keys[1])


def test_export_refuses_failed_parity_and_writes_nothing(trained_expert, hh_pairs, signing_keys, tmp_path,
                                                        monkeypatch):
    from export import selector_export

    monkeypatch.setattr(selector_export, "FP32_MAX_LOGIT_DIFF", 0.0)  # no float graph meets 0.0 on every pair
    out = tmp_path / "never"
    with pytest.raises(ParityError, match="fp32 max \\|logit diff\\|") as info:
        selector_export.export_selector_bundle(trained_expert, out, signing_keys[0], hh_pairs[1].iloc[:6],
                                               progress=lambda m: None)
    assert info.value.report["fp32"]["max_abs_logit_diff"] > 0.0
    assert not out.exists()
    with pytest.raises(ExportError, match="not a saved selector expert"):
        selector_export.export_selector_bundle(tmp_path, out, signing_keys[0], hh_pairs[1], progress=lambda m: None)


def test_export_folds_a_runs_per_domain_length_prior_or_refuses(trained_expert, tmp_path):
    from export import selector_export

    run = tmp_path / "fedprism_seed0"
    shutil.copytree(trained_expert.parent, run)
    base = selector_export.load_trained_selector(run / "expert_0")
    v = base.length_skip.weight.detach().numpy().copy()
    selector_export._fold_length_prior(base, run / "expert_0", None)  # no length_prior.json: unchanged
    np.testing.assert_array_equal(base.length_skip.weight.detach().numpy(), v)
    (run / "length_prior.json").write_text(json.dumps({"domains": ["alpacaeval", "hh_harmless"],
                                                       "coefs": [[1.5, 0.25, -0.5], [-1.0, 0.0, 0.0]]}))
    selector_export._fold_length_prior(base, run / "expert_0", "alpacaeval")  # v + w_alpacaeval
    np.testing.assert_allclose(base.length_skip.weight.detach().numpy(), v + np.array([[1.5, 0.25, -0.5]]), atol=1e-7)
    with pytest.raises(ExportError, match="--prior-domain"):
        selector_export._fold_length_prior(base, run / "expert_0", None)
    with pytest.raises(ExportError, match="routerbench"):
        selector_export._fold_length_prior(base, run / "expert_0", "routerbench")


def test_a_selector_shared_by_8_threads_gives_the_serial_answers(bundle, hh_pairs, signing_keys):
    """docs/prism_device_and_dpo.md: a Selector may be shared between threads."""
    from concurrent.futures import ThreadPoolExecutor

    _, parity = hh_pairs
    sel = Selector.load(bundle[0], signing_keys[1])
    pairs = list(zip(parity.prompt[:16], parity.response_a[:16], parity.response_b[:16]))
    serial = [sel.prefer(*p) for p in pairs]
    with ThreadPoolExecutor(8) as pool:
        threaded = list(pool.map(lambda p: sel.prefer(*p), pairs * 4))
    assert threaded == serial * 4
    assert Selector.load(bundle[0], signing_keys[1]).prefer(*pairs[0]) == serial[0]  # and across loads


def test_a_bundle_replaced_twice_while_it_loads_says_so_and_a_loaded_selector_keeps_working(bundle, signing_keys,
                                                                                            tmp_path):
    """sdk.bundle_install keeps the previous version only: a load spanning two installs found its version folder
    gone and said "selector.onnx: missing from bundle .../.selector.v1-..." (which reads as a broken bundle)."""
    from sdk import bundle_install
    from sdk import bundle_manifest as fmt

    def install(out: Path) -> None:
        with bundle_install.locked(out):
            target = bundle_install.new_version_dir(out, 1)
            for f in bundle[0].resolve().iterdir():
                shutil.copy(f, target / f.name)
            bundle_install.publish(out, target)

    out = tmp_path / "selector"
    install(out)
    sel = Selector.load(out, signing_keys[1])
    before = sel.prefer("Is a whale a fish?", "No, a whale is a mammal.", "Yes.")

    directory, manifest = fmt.read_manifest(out, signing_keys[1])
    install(out)  # two installs after the manifest verified, before any file is read
    install(out)
    with pytest.raises(BundleError, match="load the bundle again$"):
        fmt.read_files(directory, manifest)
    # the loaded selector holds its graph: it keeps working with its folder gone, and a new load agrees
    assert sel.prefer("Is a whale a fish?", "No, a whale is a mammal.", "Yes.") == before
    assert Selector.load(out, signing_keys[1]).prefer("Is a whale a fish?", "No, a whale is a mammal.", "Yes.") == before


def _edited_expert(trained_expert, tmp_path, edit):
    """A copy of the trained expert (run layout) whose head tensors ``edit`` changes in place."""
    from safetensors.numpy import load_file, save_file

    run = tmp_path / "fedprism_seed0"
    shutil.copytree(trained_expert.parent, run)
    head = load_file(str(run / "expert_0" / "head.safetensors"))
    edit(head)
    save_file(head, str(run / "expert_0" / "head.safetensors"))
    return run / "expert_0"


def test_validation_gate_refuses_an_expert_below_length_only(trained_expert, hh_pairs, signing_keys, tmp_path):
    """An inverted expert (every logit negated: P -> 1 - P) ranks below the label-free length-only
    baseline on validation pairs; the export refuses it and writes nothing."""
    from export.selector_export import check_beats_length_only, export_selector_bundle, load_trained_selector

    train, parity = hh_pairs
    train, val = (df[df.domain == "alpacaeval"] for df in (train, parity))  # length is strong there (longer wins)

    def invert(head):
        for name in ("head.2.weight", "head.2.bias", "length_skip.weight"):
            head[name] = -head[name]

    inverted = _edited_expert(trained_expert, tmp_path, invert)
    gate = check_beats_length_only(load_trained_selector(trained_expert), val, train)
    bad = check_beats_length_only(load_trained_selector(inverted), val, train)
    assert bad["selector_accuracy"] == pytest.approx(1.0 - gate["selector_accuracy"], abs=1e-9)  # a pair at P = 0.5 counts 0.5 both ways
    assert bad["length_only_global"] == gate["length_only_global"] > 0.6
    assert not bad["passed"]
    out = tmp_path / "bundle"
    with pytest.raises(ExportError, match="length-only"):
        export_selector_bundle(inverted, out, signing_keys[0], parity.iloc[:4], validation=(val, train),
                               progress=lambda m: None)
    assert not out.exists()


def test_validation_gate_passes_the_length_only_expert_exactly(trained_expert, hh_pairs, signing_keys, tmp_path):
    """An expert whose content head outputs 0 and whose length path is the global length-only regression's
    coefficients is that baseline (P = sigmoid(v . f)): the gate measures equal accuracies and ships it, and
    parity.json records the figures."""
    from export.selector_export import export_selector_bundle
    from trainer.length_baseline import LengthBaseline

    train, parity = hh_pairs
    train, val = (df[df.domain == "alpacaeval"] for df in (train, parity))
    coef = LengthBaseline(per_domain=False).fit(train).coef_["*"].astype(np.float32)

    def as_length_only(head):
        head["head.2.weight"] = np.zeros_like(head["head.2.weight"])
        head["head.2.bias"] = np.zeros_like(head["head.2.bias"])
        head["length_skip.weight"] = coef[None, :]

    expert = _edited_expert(trained_expert, tmp_path, as_length_only)
    result = export_selector_bundle(expert, tmp_path / "bundle", signing_keys[0], parity.iloc[:4], validation=(val, train),
                                    progress=lambda m: None)
    gate = result.parity["validation"]
    assert gate["passed"] and gate["n_pairs"] == len(val) == N_PARITY // 2
    assert gate["selector_accuracy"] == pytest.approx(gate["length_only_global"], abs=1e-9)
    assert json.loads((tmp_path / "bundle" / "parity.json").read_text())["validation"] == gate
