"""Policy loading and the tiny offline causal LM used by the DPO/GRPO tests."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sdk.errors import InvalidInputError  # noqa: E402
from trainer.alignment.errors import PolicyUnavailableError  # noqa: E402
from trainer.alignment.policy_models import (  # noqa: E402
    DEFAULT_CHAT_TEMPLATE,
    build_offline_tokenizer,
    build_tiny_causal_lm,
    load_policy,
)

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "what is two plus two", "four is the answer"] * 5


@pytest.fixture(scope="module")
def tiny_minilm(tmp_path_factory):
    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "minilm", seed=3)


def test_roundtrip_minilm_vocab(tiny_minilm):
    model, tok = load_policy(tiny_minilm)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == len(tok) == 30522
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert next(model.parameters()).dtype == torch.float32
    # the BERT post-processor is gone: no [CLS]/[SEP] around plain text, no token_type_ids
    enc = tok("hello world")
    assert set(enc) == {"input_ids", "attention_mask"}
    assert enc["input_ids"] == tok.convert_tokens_to_ids(["hello", "world"])
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("[CLS]", "[SEP]", "[PAD]")
    assert model.config.eos_token_id == tok.eos_token_id
    batch = tok(["hello world", "a b c"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert tuple(logits.shape) == (2, 3, 30522)


def test_same_seed_same_weights_other_seed_differs(tmp_path, tiny_minilm):
    again = build_tiny_causal_lm(tmp_path / "again", seed=3)
    other = build_tiny_causal_lm(tmp_path / "other", seed=4)
    a, _ = load_policy(tiny_minilm)
    b, _ = load_policy(again)
    c, _ = load_policy(other)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def test_chat_template_prompt_is_a_token_prefix(tiny_minilm):
    _, tok = load_policy(tiny_minilm)
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    prompt = [{"role": "user", "content": "Name a colour."}]
    full = prompt + [{"role": "assistant", "content": "Blue."}]
    p_ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    f_ids = tok.apply_chat_template(full, tokenize=True)
    assert f_ids[: len(p_ids)] == p_ids and len(f_ids) > len(p_ids)
    assert tok.apply_chat_template(full, tokenize=False) == "user: Name a colour.[SEP]assistant: Blue.[SEP]"


def test_trained_bpe_tokenizer(tmp_path):
    out = build_tiny_causal_lm(tmp_path / "bpe", train_texts=TEXTS, vocab_size=300, hidden_size=32, n_heads=2)
    model, tok = load_policy(out)
    assert len(tok) <= 300 and model.config.vocab_size == len(tok)
    ids = tok("the cat sat")["input_ids"]
    assert tok.decode(ids) == "the cat sat"
    assert (tok.pad_token, tok.eos_token) == ("<|pad|>", "<|eos|>")


def test_a_hub_id_while_offline_is_named_in_one_line(monkeypatch):
    """`prism dpo --policy Qwen/Qwen2-0.5B-Instruct` with HF_HUB_OFFLINE=1 and nothing cached answered with
    transformers' two-line "We couldn't connect to 'https://huggingface.co' ... Check your internet
    connection or see how to run the library in offline mode at ..."."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PolicyUnavailableError) as info:
        load_policy("fedroute-tests/no-such-policy")
    assert str(info.value) == ("cannot load a causal LM from 'fedroute-tests/no-such-policy': "
                               "'fedroute-tests/no-such-policy' is not a local folder and HF_HUB_OFFLINE is set (no "
                               "download); give a local model folder (saved with save_pretrained) or unset "
                               "HF_HUB_OFFLINE with network access")


def test_bad_inputs(tmp_path, tiny_minilm):
    with pytest.raises(PolicyUnavailableError, match="cannot load a causal LM"):
        load_policy(tmp_path / "absent")
    with pytest.raises(InvalidInputError, match="dtype='float8'"):
        load_policy(tiny_minilm, dtype="float8")
    with pytest.raises(InvalidInputError, match="exists"):
        build_tiny_causal_lm(tiny_minilm)
    with pytest.raises(InvalidInputError, match="divisible"):
        build_tiny_causal_lm(tmp_path / "x", hidden_size=30, n_heads=4)
    with pytest.raises(InvalidInputError, match="vocab_size=100"):
        build_offline_tokenizer(TEXTS, vocab_size=100)
    with pytest.raises(InvalidInputError, match="no non-empty"):
        build_offline_tokenizer(["  "])
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("kind", ["folder without config.json", "file"])
def test_a_file_or_a_folder_without_config_json_is_named_in_one_short_line(tmp_path, kind):
    """`prism dpo --policy` / `mor grpo --model` given a folder of weights without config.json answered with
    transformers' 'Unrecognized model ... Should have a `model_type` key in its config.json, or contain one of
    the following strings in its name:' and ~400 model names (4.8 kB on one line); given a file, with 'Repo id
    must be in the form 'repo_name' or 'namespace/repo_name''."""
    path = tmp_path / "policy"
    if kind == "file":
        path.write_bytes(b"not a model")
        expected = "a file, not a model folder"
    else:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"x")
        expected = "a folder without config.json, not a model saved with save_pretrained"
    with pytest.raises(PolicyUnavailableError) as info:
        load_policy(path)
    assert str(info.value) == f"cannot load a causal LM from '{path}': {expected}; give such a folder or a hub id"


def test_an_encoder_such_as_minilm_is_refused_as_a_policy_naming_its_type():
    """`prism dpo --policy` / `mor grpo --model` given the MiniLM sentence encoder loaded it as a
    BertLMHeadModel (randomly initialised head, a warning) and refused it only for its tokenizer ('has no
    eos_token; set one before training a causal LM'): an encoder with an EOS token (RoBERTa) went on to
    train as if it were a causal LM."""
    from trainer.embedder_paths import resolve_model_path

    path = resolve_model_path("all-MiniLM-L6-v2")
    with pytest.raises(PolicyUnavailableError) as info:
        load_policy(path)
    assert str(info.value) == (f"cannot load a causal LM from {path!r}: a bert encoder (config.json: is_decoder "
                               "false), not a causal LM; give a decoder-only model such as Llama, Qwen2 or GPT-2")
