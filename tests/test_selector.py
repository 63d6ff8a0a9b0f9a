"""trainer.experts.selector on the real MiniLM backbone and real preference pairs: exact cached forward,
position-swap loss, LoRA-only training, expert state round trips; sdk.pair_encoding segments."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from sdk.errors import InvalidInputError, ShapeError
from sdk.pair_encoding import PairEncoder, PairEncodingConfig
from trainer.data.preferences import load_preference_pairs
from trainer.experts.selector import (
    PairSelector,
    SelectorConfig,
    build_segment_store,
    load_selector_config,
    save_selector_config,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pairs(shared_data: Path):
    df = load_preference_pairs(shared_data)
    return df.groupby("domain").sample(8, random_state=0).reset_index(drop=True)


@pytest.fixture(scope="module")
def selector():
    return PairSelector(SelectorConfig(), seed=0)


@pytest.fixture(scope="module")
def store(selector, pairs):
    return build_segment_store(selector, list(pairs.prompt), list(pairs.response_a), list(pairs.response_b),
                               list(pairs.label))


def test_segments_follow_the_template(selector):
    enc = selector.pair_encoder
    tok = enc.tokenizer
    assert tok.truncation is None and tok.padding is None
    out = enc.encode_segments(["a b c " * 30], ["hello world"])
    cfg = enc.config
    ids, mask, types = out["input_ids"][0], out["attention_mask"][0], out["token_type_ids"][0]
    p_ids = tok.encode("a b c " * 30, add_special_tokens=False).ids[-cfg.prompt_tokens:]
    r_ids = tok.encode("hello world", add_special_tokens=False).ids
    cls, sep, pad = (tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
    expect = [cls] + p_ids + [sep] + r_ids + [sep]
    assert ids.shape == (cfg.seq_len,) and list(ids[: len(expect)]) == expect
    assert (ids[len(expect):] == pad).all() and mask.sum() == len(expect)
    assert types.sum() == len(r_ids) + 1 and types[cfg.prompt_tokens + 1] == 0 and types[cfg.prompt_tokens + 2] == 1
    with pytest.raises(InvalidInputError, match="not in the tokenizer"):
        PairEncoder(tok, PairEncodingConfig(sep_token="<nope>"))


def test_cached_lower_layers_forward_equals_full_forward(selector, store):
    idx = np.arange(store.input_ids.shape[0])
    with torch.no_grad():
        cached = store.pooled(selector, idx)
        full = selector.full_pooled(store.input_ids[idx], store.attention_mask[idx], store.token_type_ids[idx])
        plain = selector._base(input_ids=store.input_ids[idx], attention_mask=store.attention_mask[idx],
                               token_type_ids=store.token_type_ids[idx], output_hidden_states=True)
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)
    # the cache itself is the frozen model's hidden state entering layer 5, bit for bit
    assert torch.equal(store.lower, plain.hidden_states[selector.first_lora_layer])


def test_position_swap_loss_and_symmetric_prediction(selector, store):
    pairs = np.arange(store.n_pairs)
    with torch.no_grad():
        ha, hb, f, y = store.batch(selector, pairs)
        per = selector.pair_loss(ha, hb, f, y, reduction="none")
        lab, lba = selector.pair_logits(ha, hb, f), selector.pair_logits(hb, ha, -f)
        p = torch.sigmoid(lab)
        q = torch.sigmoid(lba)
        by_hand = 0.5 * (-(y * torch.log(p) + (1 - y) * torch.log(1 - p)) - ((1 - y) * torch.log(q) + y * torch.log(1 - q)))
        torch.testing.assert_close(per, by_hand, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(selector.pair_proba(ha, hb, f) + selector.pair_proba(hb, ha, -f),
                                   torch.ones(store.n_pairs))


def test_training_changes_lora_and_head_but_not_the_backbone(pairs):
    model = PairSelector(SelectorConfig(), seed=1)
    st = build_segment_store(model, list(pairs.prompt), list(pairs.response_a), list(pairs.response_b), list(pairs.label))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = model.expert_state()
    assert all("lora_" in n or n.startswith(("head.", "length_skip.")) for n in before)
    assert all(".layer.5." in n for n in before if "lora_" in n)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(8):
        ha, hb, f, y = st.batch(model, np.arange(st.n_pairs))
        loss = model.pair_loss(ha, hb, f, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    after = model.expert_state()
    assert losses[-1] < losses[0]
    lora_b = [n for n in after if "lora_B" in n]
    assert lora_b and all(np.abs(after[n] - before[n]).max() > 0 for n in after)
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n


def test_expert_state_and_files_round_trip(selector, tmp_path):
    state = selector.expert_state()
    other = {k: v + 0.01 for k, v in state.items()}
    selector.save_expert(other, tmp_path / "expert_0")
    selector.load_expert_state(state)
    loaded = selector.load_expert(tmp_path / "expert_0")
    for k in state:
        np.testing.assert_array_equal(loaded[k], other[k])
    selector.load_expert_state(state)
    with pytest.raises(ShapeError):
        selector.load_expert_state({k: v for k, v in list(state.items())[1:]})
    cfg = SelectorConfig()
    save_selector_config(cfg, tmp_path / "selector_config.json")
    assert load_selector_config(tmp_path / "selector_config.json") == cfg
    with pytest.raises(InvalidInputError, match="cache_lower_layers"):
        SelectorConfig(lora_layers=None)
    assert SelectorConfig.gpu_preset().lora_layers is None


def test_all_layer_path_on_a_tiny_causal_lm(pairs, tmp_path):
    """The GPU preset's code path (causal LM, LoRA on q/v of every layer, last-token pooling, no
    cache) on a tiny Qwen2 built from a config with random weights and the MiniLM tokenizer."""
    import shutil

    from transformers import Qwen2Config, Qwen2Model

    from trainer.embeddings import resolve_model_path

    folder = tmp_path / "tiny-qwen2"
    Qwen2Model(Qwen2Config(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)).save_pretrained(folder)
    shutil.copy(Path(resolve_model_path("all-MiniLM-L6-v2")) / "tokenizer.json", folder / "tokenizer.json")
    cfg = SelectorConfig(backbone=str(folder), lora_layers=None, cache_lower_layers=False, pooling="last",
                         target_modules=("q_proj", "v_proj"),
                         encoding=PairEncodingConfig(prompt_tokens=16, response_tokens=24, prefix_token=None))
    model = PairSelector(cfg, seed=0)
    names = model.trainable_names()
    assert {n.split(".layers.")[1].split(".")[0] for n in names if "lora_" in n} == {"0", "1"}
    sub = pairs.iloc[:6]
    st = build_segment_store(model, list(sub.prompt), list(sub.response_a), list(sub.response_b), list(sub.label))
    assert st.lower is None and st.input_ids.shape[1] == cfg.encoding.seq_len == 16 + 24 + 2
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = model.expert_state()
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        ha, hb, f, y = st.batch(model, np.arange(st.n_pairs))
        loss = model.pair_loss(ha, hb, f, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = model.expert_state()
    assert all(np.abs(after[n] - before[n]).max() > 0 for n in names if "lora_B" in n)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


def tiny_backbone(folder: Path, kind: str, n_layers: int = 2) -> Path:
    """A GPT-2, Llama or T5 of ``n_layers`` layers built from a config with random weights, with the MiniLM
    tokenizer."""
    import shutil

    from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel, T5Config, T5Model

    from trainer.embeddings import resolve_model_path

    model = {"gpt2": lambda: GPT2Model(GPT2Config(vocab_size=30522, n_embd=32, n_layer=n_layers, n_head=4,
                                                  n_positions=128)),
             "llama": lambda: LlamaModel(LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=n_layers, num_attention_heads=4,
                                                     num_key_value_heads=2, max_position_embeddings=128)),
             "t5": lambda: T5Model(T5Config(vocab_size=30522, d_model=32, d_kv=8, d_ff=64, num_layers=n_layers,
                                            num_heads=4)),
             }[kind]()
    model.save_pretrained(folder)
    shutil.copy(Path(resolve_model_path("all-MiniLM-L6-v2")) / "tokenizer.json", folder / "tokenizer.json")
    return folder


@pytest.mark.parametrize("kind, targets", [("gpt2", ("c_attn",)), ("llama", ("q_proj", "v_proj"))])
def test_the_cpu_preset_fits_lora_to_a_causal_lm_backbone(pairs, tmp_path, kind, targets):
    """`prism train --backbone <GPT-2 or Llama> --preset cpu` ended in peft's NoMatchingPeftModuleError: the
    preset's LoRA targets are BERT's query/value (and peft found no layer 5 in a bare model's "h.5." /
    "layers.5."). selector_for_backbone takes peft's targets for the model type, last-token pooling, no
    prefix token and no cached lower layers, LoRA in the top layer; the selector then trains."""
    from trainer.experts.experiment import PRESETS
    from trainer.experts.selector import selector_for_backbone

    cpu = PRESETS["cpu"][1].selector
    cfg = selector_for_backbone(cpu, str(tiny_backbone(tmp_path / kind, kind)))
    assert (cfg.target_modules, cfg.lora_layers, cfg.pooling, cfg.cache_lower_layers) == (targets, (1,), "last", False)
    assert cfg.encoding == PairEncodingConfig(cpu.encoding.prompt_tokens, cpu.encoding.response_tokens, None)
    model = PairSelector(cfg, seed=0)
    lora = [n for n in model.trainable_names() if "lora_" in n]
    assert len(lora) == 2 * len(targets) and all((".h.1." if kind == "gpt2" else ".layers.1.") in n for n in lora)
    sub = pairs.iloc[:6]
    st = build_segment_store(model, list(sub.prompt), list(sub.response_a), list(sub.response_b), list(sub.label))
    assert st.lower is None
    before = model.expert_state()
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss = model.pair_loss(*st.batch(model, np.arange(st.n_pairs)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = model.expert_state()
    assert all(np.abs(after[n] - before[n]).max() > 0 for n in lora if "lora_B" in n)


def test_selector_for_backbone_keeps_bert_and_refuses_other_architectures(tmp_path):
    from trainer.experts.experiment import PRESETS
    from trainer.experts.selector import selector_for_backbone

    cpu, gpu = PRESETS["cpu"][1].selector, PRESETS["gpu"][1].selector
    assert selector_for_backbone(cpu, "all-MiniLM-L6-v2") == cpu  # a BERT: the preset as it is
    llama = str(tiny_backbone(tmp_path / "llama", "llama"))
    # the GPU preset's q/v targets fit a Llama; its separator <|endoftext|> (Qwen's) is not in this Llama's
    # tokenizer, so sep and pad become the model's end-of-sequence token (the PairEncoder refused the preset's)
    eos = Tokenizer.from_file(str(Path(llama) / "tokenizer.json")).id_to_token(2)
    encoding = replace(gpu.encoding, sep_token=eos, pad_token=eos)
    assert selector_for_backbone(gpu, llama) == SelectorConfig(**{**gpu.__dict__, "backbone": llama, "encoding": encoding})
    PairEncoder(Tokenizer.from_file(str(Path(llama) / "tokenizer.json")), encoding)
    t5 = tiny_backbone(tmp_path / "t5", "t5")
    with pytest.raises(InvalidInputError, match=rf"^--backbone {t5}: a 't5' model is not supported as a selector "
                                                r"backbone; supported: BERT-family encoders \(.*bert.*roberta.*\) and "
                                                r"causal LMs \(.*gpt2.*llama.*qwen2.*\)$"):
        selector_for_backbone(cpu, str(t5))


def test_the_gpu_preset_fits_lora_to_a_bert_backbone():
    """`prism train --preset gpu --backbone all-MiniLM-L6-v2` ended in peft's error: the preset's targets are
    Qwen's q_proj/v_proj. A BERT under that preset gets BERT's query/value, mean pooling and the [CLS] layout
    with the preset's token budget; LoRA stays on every layer as the preset says."""
    from trainer.experts.experiment import PRESETS
    from trainer.experts.selector import selector_for_backbone

    gpu = PRESETS["gpu"][1].selector
    cfg = selector_for_backbone(gpu, "all-MiniLM-L6-v2")
    assert (cfg.target_modules, cfg.pooling, cfg.lora_layers, cfg.cache_lower_layers) == (("query", "value"), "mean",
                                                                                          None, False)
    assert cfg.encoding == PairEncodingConfig(gpu.encoding.prompt_tokens, gpu.encoding.response_tokens)
    assert cfg.encoding.prefix_token == "[CLS]"
    lora = [n for n in PairSelector(cfg, seed=0).trainable_names() if "lora_A" in n]
    assert len(lora) == 2 * 6 and {n.split(".attention.self.")[-1].split(".")[0] for n in lora} == {"query", "value"}


def test_prism_train_with_a_gpt2_backbone_gets_past_the_selector(tmp_path):
    """The command ended in peft's traceback when it built the selector; now it goes on to the data (absent
    here: one error line naming it). Six layers, as the preset's MiniLM: its LoRA layer 5 exists."""
    from typer.testing import CliRunner

    from trainer.cli import app
    from trainer.data.errors import DataUnavailableError

    gpt2 = tiny_backbone(tmp_path / "gpt2", "gpt2", n_layers=6)
    result = CliRunner().invoke(app, ["prism", "train", "--preset", "cpu", "--backbone", str(gpt2), "--out",
                                      str(tmp_path / "run"), "--data", str(tmp_path / "absent")])
    assert isinstance(result.exception, DataUnavailableError), result.exception  # the console script: exit 2, one line
    assert str(result.exception).startswith(f"{tmp_path / 'absent' / 'alpacaeval'}")
