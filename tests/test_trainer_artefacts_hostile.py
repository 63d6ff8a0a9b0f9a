"""Saved trainer artefacts and bundles a user mixes up, cuts short or hand-edits: FedPrism experts, MoR
mixtures, selector / reward-scorer / router bundles at one path, and the export's parity inputs. Each is
refused with one error naming the file, argument or folder, before any heavy work (no ONNX export here)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")

from export.bundle_writer import write_bundle  # noqa: E402
from export.errors import ExportError  # noqa: E402
from export.signing import load_signing_key  # noqa: E402
from sdk.errors import BundleError, InvalidInputError, ShapeError  # noqa: E402
from sdk.pair_encoding import PairEncodingConfig  # noqa: E402

torch.set_num_threads(1)


# --- FedPrism experts -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_experts(tmp_path_factory):
    """A PairSelector (real MiniLM backbone, top-layer LoRA) and two saved experts with different tensors."""
    from trainer.experts.selector import PairSelector, SelectorConfig

    model = PairSelector(SelectorConfig(), seed=0)
    base = model.expert_state()
    shifted = {k: (v + 0.5).astype(np.float32) for k, v in base.items()}
    root = tmp_path_factory.mktemp("experts")
    model.save_expert(shifted, root / "expert_0")
    model.save_expert(base, root / "expert_1")
    return model, root, shifted, base


def _copy_expert(root: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "expert_1"
    shutil.copytree(root / "expert_1", dst)
    return dst


def test_an_expert_whose_head_file_lacks_a_tensor_is_refused(saved_experts, tmp_path):
    """head.safetensors without length_skip.weight loaded, keeping the previously loaded expert's
    length weights (expert_0's) as if they were this expert's."""
    from safetensors.numpy import load_file, save_file

    model, root, _, _ = saved_experts
    cut = _copy_expert(root, tmp_path)
    head = load_file(str(cut / "head.safetensors"))
    del head["length_skip.weight"]
    save_file(head, str(cut / "head.safetensors"))
    model.load_expert(root / "expert_0")
    with pytest.raises(InvalidInputError, match=r"length_skip\.weight"):
        model.load_expert(cut)


def test_an_expert_whose_adapter_file_is_empty_or_foreign_is_refused(saved_experts, tmp_path):
    """An adapter file without the LoRA tensors loaded leniently (peft): the LoRA of the expert loaded
    before stayed in place, so expert_1 scored as expert_0."""
    from safetensors.torch import load_file, save_file

    model, root, shifted, base = saved_experts
    cut = _copy_expert(root, tmp_path)
    adapter_file = cut / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(adapter_file))
    save_file({}, str(adapter_file))
    model.load_expert(root / "expert_0")
    with pytest.raises(InvalidInputError, match=f"adapter_model.safetensors: not this selector's expert file "
                                                f"\\({len(tensors)} tensor\\(s\\) missing"):
        model.load_expert(cut)
    renamed = {k.replace("lora_A", "lora_Z"): v for k, v in tensors.items()}
    save_file(renamed, str(adapter_file))
    with pytest.raises(InvalidInputError, match="unexpected, e.g."):
        model.load_expert(cut)
    wrong = dict(tensors)
    name = next(iter(wrong))
    wrong[name] = torch.zeros(1, 1)
    save_file(wrong, str(adapter_file))
    with pytest.raises(ShapeError, match=f"tensor '{name}' has shape \\(1, 1\\)"):
        model.load_expert(cut)
    # the complete files still load, each as itself
    state = model.load_expert(root / "expert_1")
    assert all(np.array_equal(state[k], base[k]) for k in base)
    state = model.load_expert(root / "expert_0")
    assert all(np.array_equal(state[k], shifted[k]) for k in shifted)


@pytest.mark.parametrize("where", ["head", "adapter"])
def test_an_expert_with_a_nan_tensor_is_refused_naming_the_file_and_tensor(saved_experts, tmp_path, where):
    """A NaN weight loaded, and `fedroute export --selector` then failed in its parity step with
    "ShapeError: proba_a holds NaN or inf", naming neither the expert nor the tensor."""
    from safetensors.torch import load_file, save_file

    model, root, _, _ = saved_experts
    cut = _copy_expert(root, tmp_path)
    path = cut / "head.safetensors" if where == "head" else cut / "adapter" / "adapter_model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(str(path)).items()}
    name = sorted(tensors)[-1]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(path))
    with pytest.raises(InvalidInputError, match=f"{path.name}: tensor '{name}' holds NaN or inf"):
        model.load_expert(cut)
    from export.selector_export import load_trained_selector
    from trainer.experts.selector import save_selector_config

    save_selector_config(model.config, tmp_path / "selector_config.json")  # as `prism train` writes it
    with pytest.raises(ExportError, match=f"cannot load the selector expert at {cut}: .*tensor '{name}' holds NaN"):
        load_trained_selector(cut)


def test_a_backbone_hub_id_while_offline_is_named_in_one_line(monkeypatch):
    """`prism train --backbone ORG/NAME` with HF_HUB_OFFLINE=1 and nothing cached answered with
    transformers' two-line "We couldn't connect to 'https://huggingface.co' ..." message."""
    from trainer.data.errors import DataUnavailableError
    from trainer.experts.selector import SelectorConfig, selector_for_backbone

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = "fedroute-tests/no-such-backbone"
    with pytest.raises(DataUnavailableError) as info:
        selector_for_backbone(SelectorConfig(), name)
    assert str(info.value) == (f"cannot load the selector backbone {name!r} ({name!r}): {name!r} is not a local folder "
                               "and HF_HUB_OFFLINE is set (no download); give a local model folder (saved with "
                               "save_pretrained) or unset HF_HUB_OFFLINE with network access")


@pytest.mark.parametrize("kind", ["folder without config.json", "file"])
def test_a_backbone_that_is_a_file_or_a_folder_without_config_json_is_named_in_one_short_line(tmp_path, kind):
    """`prism train --backbone` given a folder of weights without config.json answered with transformers'
    'Unrecognized model ... or contain one of the following strings in its name:' and ~400 model names
    (4.8 kB on one line); given a file, with 'the config file ... is not a valid JSON file'."""
    from trainer.data.errors import DataUnavailableError
    from trainer.experts.selector import SelectorConfig, selector_for_backbone

    path = tmp_path / "backbone"
    if kind == "file":
        path.write_text("{}")
        expected = "a file, not a model folder"
    else:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"x")
        expected = "a folder without config.json, not a model saved with save_pretrained"
    with pytest.raises(DataUnavailableError) as info:
        selector_for_backbone(SelectorConfig(), str(path))
    assert str(info.value) == (f"cannot load the selector backbone '{path}' ('{path}'): {expected}; give such a "
                               "folder or a hub id")


def test_a_corrupt_segment_cache_file_is_recomputed_and_replaced(tmp_path):
    """`prism train --cache-dir DIR` with a cut-short or foreign DIR/prism/segments-*.pt ended in torch.load's
    'UnpicklingError: Weights only load failed' traceback after the data preparation: a cache file that
    does not load, or holds another shape, is now a cache miss, and the recomputed states replace it."""
    from trainer.experts.selector import PairSelector, SelectorConfig, build_segment_store

    model = PairSelector(SelectorConfig(), seed=0)
    args = (["Is water wet?", "Name a colour."], ["Yes, it is.", "Blue."], ["No.", "A colour."])
    first = build_segment_store(model, *args, cache_dir=tmp_path)
    (cached,) = tmp_path.glob("segments-*.pt")
    for content in (b"garbage, not a torch file", None):
        if content is None:
            torch.save(torch.zeros(3), cached)  # a tensor of another shape
        else:
            cached.write_bytes(content)
        again = build_segment_store(model, *args, cache_dir=tmp_path)
        assert torch.equal(again.lower, first.lower)
        assert torch.equal(torch.load(cached), first.lower)  # replaced by the recomputed states


# --- MoR mixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_mixture(tmp_path_factory):
    """An untrained two-client MLP mixture saved with save_mixture (nothing is embedded)."""
    from trainer.rewards.client_router import ClientRouter
    from trainer.rewards.mixture import RoutedReward, save_mixture
    from trainer.rewards.pair_features import PairEncoder
    from trainer.rewards.reward_models import MLPRewardModel, ScoreNormaliser

    encoder = PairEncoder()
    router = ClientRouter(771, 2, 8, client_names=["helpful", "harmless"])
    models = []
    for _ in range(2):
        rm = MLPRewardModel(encoder, 771, 8)
        rm.normaliser_ = ScoreNormaliser(0.0, 1.0)
        models.append(rm)
    mixture = RoutedReward(router, models, encoder)
    return mixture, save_mixture(mixture, tmp_path_factory.mktemp("mix") / "mixture")


def test_a_rerun_whose_save_fails_leaves_no_earlier_metrics_beside_the_folder(saved_mixture, tmp_path, monkeypatch):
    """`mor train` wrote train_metrics.json after save_mixture: a kill (or a failed save) in between left the
    earlier run's metrics beside the new mixture. The metrics are now a record of the save: removed with
    the old mixture.json before the parts are swapped in, written before the new mixture.json."""
    import os

    from trainer.rewards.mixture import save_mixture

    mixture, _ = saved_mixture
    out = tmp_path / "mix"
    save_mixture(mixture, out, records={"train_metrics.json": {"run": 1}})
    assert json.loads((out / "train_metrics.json").read_text()) == {"run": 1}
    real_replace = os.replace

    def replace(src, dst):  # the swap of clients/ fails, after router/ was swapped in
        if Path(dst) == out / "clients":
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        save_mixture(mixture, out, records={"train_metrics.json": {"run": 2}})
    assert not (out / "mixture.json").exists() and not (out / "train_metrics.json").exists()
    monkeypatch.setattr(os, "replace", real_replace)
    save_mixture(mixture, out, records={"train_metrics.json": {"run": 3, "loss": float("nan")}})  # as write_json
    assert json.loads((out / "train_metrics.json").read_text()) == {"run": 3, "loss": "nan"}
    assert (out / "mixture.json").is_file()


def test_a_failed_write_of_mixture_json_leaves_no_temporary_file(saved_mixture, tmp_path, monkeypatch):
    """mixture.json went through a fixed mixture.json.tmp, neither synced nor removed when the rename failed."""
    import os

    from trainer.rewards.mixture import save_mixture

    mixture, _ = saved_mixture
    out = tmp_path / "mix"
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst) == out / "mixture.json":
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        save_mixture(mixture, out)
    assert sorted(p.name for p in out.iterdir()) == ["clients", "router"]


@pytest.mark.parametrize("part, content, error", [
    ("router/router.json", "{", "JSONDecodeError"),
    ("router/router.safetensors", "not safetensors", "SafetensorError"),
    ("clients/harmless/reward_model.json", '{"format_version": 1, "arch": "mlp"}', "KeyError"),
    ("clients/helpful/weights.safetensors", None, "FileNotFoundError"),
])
def test_a_mixture_part_cut_short_is_named(saved_mixture, tmp_path, part, content, error):
    """mixture.json was checked, its parts not: `mor grpo` / `mor export` ended in a JSONDecodeError,
    SafetensorError, KeyError or FileNotFoundError traceback."""
    from trainer.rewards.mixture import load_mixture

    _, saved = saved_mixture
    copy = tmp_path / "mixture"
    shutil.copytree(saved, copy)
    if content is None:
        (copy / part).unlink()
    else:
        (copy / part).write_text(content)
    folder = copy / Path(part).parent
    with pytest.raises(InvalidInputError) as info:
        load_mixture(copy)
    assert str(info.value).startswith(f"{folder}: cannot load this part of the mixture ({error}: ")
    assert str(info.value).endswith("rerun `fedroute mor train`")


@pytest.mark.parametrize("part", ["router/router.safetensors", "clients/harmless/weights.safetensors"])
def test_a_mixture_part_with_a_nan_weight_is_named(saved_mixture, tmp_path, part):
    """It loaded, and `fedroute mor export` failed after its ONNX export with 'parity check failed:
    graphs: reward_max_abs_diff nan > 0.001', naming neither the folder nor the tensor."""
    from safetensors.numpy import load_file, save_file
    from trainer.rewards.mixture import load_mixture

    _, saved = saved_mixture
    copy = tmp_path / "mixture"
    shutil.copytree(saved, copy)
    tensors = {k: v.copy() for k, v in load_file(str(copy / part)).items()}
    name = sorted(tensors)[0]
    tensors[name].flat[0] = np.nan
    save_file(tensors, str(copy / part))
    with pytest.raises(InvalidInputError, match=f"^{re.escape(str(copy / Path(part).parent))}: tensor {name!r} holds "
                                                "NaN or inf; a corrupt copy or a diverged training run"):
        load_mixture(copy)


@pytest.mark.parametrize("part", ["router/router.safetensors", "clients/harmless/weights.safetensors"])
def test_a_tensor_of_another_shape_is_named_with_its_folder(saved_mixture, tmp_path, part):
    """The router's ShapeError ('router parameter 'trunk.0.weight' has shape (9, 771), expected (8, 771)') passed
    through without the folder: which of the mixture's parts was wrong was left to guess. A client reward model's
    message kept only torch's first line ('Error(s) in loading state_dict for _MLP:'), naming no tensor."""
    from safetensors.numpy import load_file, save_file
    from trainer.rewards.mixture import load_mixture

    _, saved = saved_mixture
    copy = tmp_path / "mixture"
    shutil.copytree(saved, copy)
    tensors = {k: v.copy() for k, v in load_file(str(copy / part)).items()}
    name = sorted(tensors)[-1]
    tensors[name] = np.zeros((tensors[name].shape[0] + 1, *tensors[name].shape[1:]), dtype=tensors[name].dtype)
    save_file(tensors, str(copy / part))
    with pytest.raises(InvalidInputError) as info:
        load_mixture(copy)
    message = str(info.value)
    assert message.startswith(f"{copy / Path(part).parent}: ") and name in message, message
    assert message.endswith("rerun `fedroute mor train`"), message


def test_a_mixture_whose_length_features_do_not_fit_its_router_is_named(saved_mixture, tmp_path):
    """mixture.json with length_features false beside a router of 2 * 384 + 3 inputs (hand-edited, or parts
    of two saves) loaded, and `mor grpo` ended in torch's 'mat1 and mat2 shapes cannot be multiplied (16x768
    and 771x128)' traceback at its first reward, after the tiny policy was built."""
    from trainer.rewards.mixture import load_mixture

    _, saved = saved_mixture
    copy = tmp_path / "mixture"
    shutil.copytree(saved, copy)
    meta = json.loads((copy / "mixture.json").read_text())
    meta["length_features"] = False
    (copy / "mixture.json").write_text(json.dumps(meta))
    with pytest.raises(InvalidInputError, match=f"^{re.escape(str(copy / 'mixture.json'))}: length_features false "
                                                r"gives the router 2 \* d_emb inputs \(an even number\), but "
                                                r"router/router.json has d_in 771; rerun `fedroute mor train`$"):
        load_mixture(copy)


def test_the_saved_mixture_itself_still_loads(saved_mixture):
    from trainer.rewards.mixture import load_mixture

    mixture, saved = saved_mixture
    loaded = load_mixture(saved)
    assert loaded.client_names == ["helpful", "harmless"]
    for name, value in mixture.router.get_parameters().items():
        np.testing.assert_array_equal(loaded.router.get_parameters()[name], value)


def test_reward_export_refuses_parity_texts_that_are_not_str_before_any_export(saved_mixture, signing_keys, tmp_path):
    """A None among the parity responses was refused by the trainer's encoder after the embedder's ONNX
    export (a minute or more)."""
    from export.reward_export import export_reward_bundle

    mixture, _ = saved_mixture
    with pytest.raises(ExportError, match=r"responses\[1\]"):
        export_reward_bundle(mixture, "harmless", tmp_path / "bundle", signing_keys[0], ["p", "q"], ["r", None],
                             progress=lambda _: None)
    assert not (tmp_path / "bundle").exists()


def test_a_grpo_rerun_leaves_no_earlier_results_beside_its_own_settings(saved_mixture, shared_data, tmp_path,
                                                                       monkeypatch, capsys):
    """`mor grpo` into the --out of an earlier run removed only the *other* mode's results: a rerun in the same
    mode wrote the new grpo_config.json (and rebuilt tiny_policy/), and when it stopped before its results
    (Ctrl-C, or here a policy that does not load) the earlier run's history.json, grpo.png and online/history.json
    stayed beside them, read as this run's. The earlier results go before the new run writes anything."""
    from trainer.cli import main

    _, saved = saved_mixture
    out = tmp_path / "grpo"
    (out / "online").mkdir(parents=True)
    (out / "online" / "history.json").write_text('{"earlier": true}')
    for name in ("history.json", "grpo.png", "comparison.json", "grpo_config.json"):
        (out / name).write_text('{"earlier": true}')
    policy = tmp_path / "not_a_model"
    policy.mkdir()
    (policy / "weights.bin").write_bytes(b"x")
    monkeypatch.setattr("sys.argv", ["fedroute", "mor", "grpo", "--mixture", str(saved), "--out", str(out),
                                     "--online", "on", "--model", str(policy), "--n-prompts", "4", "--steps", "1",
                                     "--data", str(shared_data)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"error: cannot load a causal LM from '{policy}'")
    assert json.loads((out / "grpo_config.json").read_text())["model"] == str(policy)  # this run's settings
    assert sorted(p.name for p in out.iterdir()) == ["grpo_config.json"]  # and no earlier run's results


# --- bundles of one family at another's path ---------------------------------------------------------


def _selector_fields(version: int = 1) -> dict:
    return {"bundle_version": version, "selector_kind": "onnx_pair",
            "selector": {"name": "fedprism-expert-0", "backbone": "b", "method": "fedprism", "expert": 0,
                         "files": {"fp32": "selector.onnx"}, "pair_encoding": PairEncodingConfig().to_dict(),
                         "n_length_features": 3, "pooling": "mean", "lora": {}}}


@pytest.fixture()
def selector_bundle(signing_keys, tmp_path) -> Path:
    """A signed bundle with a selector manifest (its graph is never loaded by these tests)."""
    out = tmp_path / "bundles" / "selector"
    write_bundle(out, {"tokenizer.json": b"{}", "selector.onnx": b"x"}, _selector_fields(),
                 load_signing_key(signing_keys[0]))
    return out


def test_a_reward_scorer_given_a_selector_bundle_names_sdk_selector(selector_bundle, signing_keys):
    """The message sent the user to sdk.Router for a selector bundle."""
    from sdk.reward_scorer import RewardScorer

    with pytest.raises(BundleError) as info:
        RewardScorer.load(selector_bundle, public_key=signing_keys[1])
    assert str(info.value) == ("bundle carries no reward_scorer (it carries {'selector': 'onnx_pair'}); "
                               "load it with sdk.Selector.load")


@pytest.fixture()
def reward_bundle(signing_keys, tmp_path) -> Path:
    """A signed bundle with a reward-scorer manifest (its graphs are never loaded by these tests)."""
    fields = {"bundle_version": 1, "reward_scorer_kind": "mor", "clients": ["helpful", "harmless"],
              "client": {"name": "helpful", "index": 0}, "features": {"length_features": False, "d_in": 8},
              "reward": {"arch": "mlp"},
              "embedder": {"name": "e", "dim": 4, "max_tokens": 16, "truncation_side": "left",
                           "files": {"fp32": "embedder.onnx"}}}
    out = tmp_path / "bundles" / "reward"
    write_bundle(out, {name: b"x" for name in ("tokenizer.json", "embedder.onnx", "reward.onnx", "client_router.onnx")},
                 fields, load_signing_key(signing_keys[0]))
    return out


@pytest.mark.parametrize("family, held, loader", [("selector", "{'selector': 'onnx_pair'}", "sdk.Selector.load"),
                                                  ("reward", "{'reward_scorer': 'mor'}", "sdk.RewardScorer.load")])
def test_router_load_given_another_familys_bundle_names_the_loader_of_that_family(
        selector_bundle, reward_bundle, signing_keys, family, held, loader):
    """It said 'bundle carries no router (it carries {...})' and left the user to find the class that loads it;
    the loader comes from the family's registration (sdk.kinds.register_family(..., loader=...))."""
    from sdk.router import Router

    bundle = {"selector": selector_bundle, "reward": reward_bundle}[family]
    with pytest.raises(BundleError) as info:
        Router.load(bundle, signing_keys[1])
    assert str(info.value) == f"bundle carries no router (it carries {held}); load it with {loader}"


def test_a_bundle_of_another_family_is_not_replaced(selector_bundle, signing_keys, tmp_path):
    """Exporting a router (or a reward scorer) to the folder of a selector bundle replaced it, and the other
    way round: the app or `fedroute serve --bundle-dir` reading that path then got a bundle it cannot load."""
    from export.selector_export import export_selector_bundle

    key = load_signing_key(signing_keys[0])
    router_fields = {"bundle_version": 2, "router_kind": "kmeans"}
    with pytest.raises(ExportError, match=f"{selector_bundle} holds a selector bundle; refusing to replace it with a "
                                          "router bundle"):
        write_bundle(selector_bundle, {"kmeans.npz": b"x"}, router_fields, key)
    assert json.loads((selector_bundle / "manifest.json").read_text())["selector_kind"] == "onnx_pair"
    router_bundle = tmp_path / "bundles" / "kmeans"
    write_bundle(router_bundle, {"kmeans.npz": b"x"}, {"bundle_version": 1, "router_kind": "kmeans"}, key)
    pairs = pd.DataFrame({"prompt": ["p"], "response_a": ["a"], "response_b": ["b"], "label": [1]})
    with pytest.raises(ExportError, match=f"{router_bundle} holds a router bundle; refusing to replace it with a "
                                          "selector bundle"):
        export_selector_bundle(tmp_path / "no_expert", router_bundle, signing_keys[0], pairs, progress=lambda _: None)
    # a bundle of the same family is replaced by a newer version, as before
    write_bundle(selector_bundle, {"tokenizer.json": b"{}", "selector.onnx": b"y"}, _selector_fields(2), key)
    assert json.loads((selector_bundle / "manifest.json").read_text())["bundle_version"] == 2


def test_the_selector_export_checks_its_parity_pairs_and_prior_domain_first(signing_keys, tmp_path):
    """Pairs without a 'label' column failed with a KeyError in the parity check, after the ONNX export;
    --prior-domain for an expert of a label-free run was ignored (the bundle served every domain)."""
    from export.selector_export import export_selector_bundle

    no_label = pd.DataFrame({"prompt": ["p"], "response_a": ["a"], "response_b": ["b"]})
    with pytest.raises(ExportError, match=r"parity_pairs lacks columns \['label'\]"):
        export_selector_bundle(tmp_path / "run" / "expert_0", tmp_path / "out", signing_keys[0], no_label,
                               progress=lambda _: None)
    pairs = no_label.assign(label=1)
    with pytest.raises(ExportError, match="--prior-domain"):
        export_selector_bundle(tmp_path / "run" / "expert_0", tmp_path / "out", signing_keys[0], pairs,
                               prior_domain="alpacaeval", progress=lambda _: None)
    assert not (tmp_path / "out").exists()


# --- arrays the device is given ------------------------------------------------------------------------


def test_feature_rows_refuse_complex_numbers():
    """finite_rows (RewardScorer.scores_from_features, Router.choose_batch's embeddings) dropped the imaginary
    part with a ComplexWarning only, as its docstring says it refuses."""
    from sdk.arrays import finite_rows

    with pytest.raises(ShapeError, match="^features"):
        finite_rows(np.array([[1.0 + 2.0j, 0.5]]), 2, "features")
    np.testing.assert_array_equal(finite_rows([[1.0, 0.5]], 2, "features"), np.array([[1.0, 0.5]], np.float32))


@pytest.mark.parametrize("value, message", [
    (None, r"got NoneType that does not convert to float32 \(None\)"),  # was "must have shape (n >= 1, 2), got (1,)"
    (np.array([["1", "2"]]), r"got ndarray that does not convert to float32 \(text, dtype <U1\)"),  # was scored
    ([["0.5", "2"]], r"got list that does not convert to float32 \(text"),
    (3.0, r"must have shape \(n >= 1, 2\), got \(\)$"),  # was "got (1,)"
])
def test_feature_rows_name_none_text_and_scalars_as_given(value, message):
    """RewardScorer.scores_from_features(None) said "features must have shape (n >= 1, 771), got (1,)" (numpy read
    None as a NaN and made it 1-d), and an array of numeric strings was scored as numbers."""
    from sdk.arrays import finite_rows

    with pytest.raises(ShapeError, match=message):
        finite_rows(value, 2, "features")


@pytest.mark.parametrize("content, message", [
    ('{"domains": ["alpacaeval"]', "not the length_prior.json of `fedroute prism train` (JSONDecodeError"),
    ('{"coefs": [[1, 2, 3]]}', "not the length_prior.json of `fedroute prism train` (KeyError: 'domains')"),
    ('{"domains": ["alpacaeval"], "coefs": [[1, 2]]}', "got domains ['alpacaeval'] and weights of shape (1, 2)"),
    ('{"domains": ["alpacaeval"], "coefs": [[1, NaN, 3]]}', "one row of finite weights per domain"),
])
def test_a_hand_edited_length_prior_is_named(tmp_path, content, message):
    """RUN/fedprism_seed0/length_prior.json truncated or edited: `prism label` and `export --selector
    --prior-domain` ended in a JSONDecodeError / KeyError traceback, or folded a (2,) or NaN prior in."""
    from trainer.experts.length_init import read_length_prior, saved_length_prior

    (tmp_path / "length_prior.json").write_text(content)
    for read in (lambda: read_length_prior(tmp_path), lambda: saved_length_prior(tmp_path, "alpacaeval")):
        with pytest.raises(InvalidInputError) as info:
            read()
        assert str(info.value).startswith(f"{tmp_path / 'length_prior.json'}: ") and message in str(info.value)
    (tmp_path / "length_prior.json").write_text('{"domains": ["alpacaeval", "hh_harmless"], '
                                                '"coefs": [[1.5, 0.25, -0.5], [-1, 0, 0]]}')
    np.testing.assert_array_equal(saved_length_prior(tmp_path, "hh_harmless"), np.array([-1, 0, 0], np.float32))
    assert read_length_prior(tmp_path / "absent") is None


def test_a_rerun_without_fedbis_removes_the_earlier_runs_fedbis_folder(tmp_path):
    """`prism train --methods fedprism --out RUN` over a full run kept RUN/fedbis_seed0/ (and the old
    utilisation plot when FedPrism was left out), so `prism label` compared the new experts with another
    run's FedBis. The staged folder of a method that ran replaces the old one whole, as before."""
    from trainer.experts.experiment import publish_saved_methods

    for name in ("fedprism_seed0/expert_5", "fedbis_seed0/expert_0", ".fedprism_seed0.partial/expert_0"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "utilisation_per_round.png").write_bytes(b"old")
    publish_saved_methods(tmp_path, ("fedprism", "length_only"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fedprism_seed0", "utilisation_per_round.png"]
    assert [p.name for p in (tmp_path / "fedprism_seed0").iterdir()] == ["expert_0"]
    (tmp_path / ".fedbis_seed0.partial" / "expert_0").mkdir(parents=True)
    publish_saved_methods(tmp_path, ("fedbis",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fedbis_seed0"]
