"""How a preference pair ``(x, y_A, y_B)`` becomes model inputs: one definition for trainer and device.

Two segments ``[prefix] prompt_tail [sep] response_head [sep] [pad...]`` of shape ``(seq_len,)`` int64
(the prompt's last ``prompt_tokens`` tokens, the response's first ``response_tokens``), one per
response, and the antisymmetric length features of the full responses; a selector's prediction is
``P(A better) = sigmoid((l(A, B) - l(B, A)) / 2)`` (FedPrism, paper 000 Sec. 3). Details and limits:
docs/pair_inputs.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from sdk.embedder import MAX_QUERY_CHARS
from sdk.errors import InvalidInputError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

#: Number of length features per pair (see :func:`length_features`).
N_LENGTH_FEATURES = 3
#: Names of the length features, in order.
LENGTH_FEATURE_NAMES = ("dlog_chars", "dlog_words", "dlog_lines")


#: Largest ``prompt_tokens`` / ``response_tokens`` (a segment is allocated at that length per pair).
MAX_SEGMENT_TOKENS = 1 << 16


@dataclass(frozen=True)
class PairEncodingConfig:
    """Token budget (``prompt_tokens`` from the prompt's end, ``response_tokens`` from each response's start,
    ints in [1, :data:`MAX_SEGMENT_TOKENS`]) and special tokens (non-empty str; ``prefix_token`` None for
    causal LMs) of a pair encoding; :class:`InvalidInputError` otherwise. The default is MiniLM's 67-token
    ``[CLS] prompt[-24:] [SEP] response[:40] [SEP]``."""

    prompt_tokens: int = 24
    response_tokens: int = 40
    prefix_token: str | None = "[CLS]"
    sep_token: str = "[SEP]"
    pad_token: str = "[PAD]"

    def __post_init__(self) -> None:
        values = {name: getattr(self, name) for name in ("prompt_tokens", "response_tokens", "prefix_token", "sep_token",
                                                         "pad_token")}
        rules = [(name, not isinstance(v, bool) and isinstance(v, int) and 1 <= v <= MAX_SEGMENT_TOKENS,
                  f"an int in [1, {MAX_SEGMENT_TOKENS}]") for name, v in list(values.items())[:2]] + [
                 (name, (isinstance(v, str) and bool(v)) or (name == "prefix_token" and v is None),
                  f"a non-empty str{' or None' if name == 'prefix_token' else ''}") for name, v in list(values.items())[2:]]
        for name, accepted, what in rules:
            if not accepted:
                raise InvalidInputError(f"{name} must be {what}, got {values[name]!r:.40}", param=name)

    @classmethod
    def causal_lm_preset(cls) -> PairEncodingConfig:
        """The GPU preset's encoding for a Qwen2-class causal LM (no prefix token)."""
        return cls(prompt_tokens=128, response_tokens=256, prefix_token=None,
                   sep_token="<|endoftext|>", pad_token="<|endoftext|>")

    @property
    def seq_len(self) -> int:
        """Tokens per segment, padding included."""
        return self.prompt_tokens + self.response_tokens + 2 + (self.prefix_token is not None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _count_words(text: str) -> int:
    return len(text.split())


def _count_lines(text: str) -> int:
    return text.count("\n") + 1 if text.strip() else 0


def length_features(response_a: str, response_b: str) -> np.ndarray:
    """``log1p(n_a) - log1p(n_b)`` of the full responses for n = characters, whitespace words, lines
    (``\\n`` count + 1; 0 for a blank text): shape (3,), float32. :class:`InvalidInputError` for a non-str."""
    for name, r in (("response_a", response_a), ("response_b", response_b)):
        if not isinstance(r, str):
            raise InvalidInputError(f"{name} must be a str, got {type(r).__name__}")
    out = []
    for count in (len, _count_words, _count_lines):
        out.append(math.log1p(count(response_a)) - math.log1p(count(response_b)))
    return np.asarray(out, dtype=np.float32)


def length_features_many(responses_a: Sequence[str], responses_b: Sequence[str]) -> np.ndarray:
    """:func:`length_features` of n pairs: ndarray of shape (n, 3), float32.

    Raises
    ------
    InvalidInputError
        The two sequences differ in length, or an item is not a str.
    """
    if len(responses_a) != len(responses_b):
        raise InvalidInputError(f"{len(responses_a)} responses_a but {len(responses_b)} responses_b")
    if len(responses_a) == 0:
        return np.zeros((0, N_LENGTH_FEATURES), dtype=np.float32)
    return np.stack([length_features(a, b) for a, b in zip(responses_a, responses_b)])


class PairEncoder:
    """Builds the segments of :mod:`sdk.pair_encoding` with a copy of ``tokenizer`` whose own truncation,
    padding and post-processing are off; :class:`InvalidInputError` for a special token of ``config``
    not in its vocabulary."""

    def __init__(self, tokenizer: Tokenizer, config: PairEncodingConfig | None = None) -> None:
        from tokenizers import Tokenizer  # loaded with the bundle, not at import of sdk

        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.config = config or PairEncodingConfig()
        ids = {}
        for name in ("prefix_token", "sep_token", "pad_token"):
            tok = getattr(self.config, name)
            if tok is None:
                continue
            tid = tokenizer.token_to_id(tok)
            if tid is None:
                raise InvalidInputError(f"{name}={tok!r} is not in the tokenizer's vocabulary")
            ids[name] = tid
        self._prefix = ids.get("prefix_token")
        self._sep = ids["sep_token"]
        self._pad = ids["pad_token"]

    def _ids(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def encode_segments(self, prompts: Sequence[str], responses: Sequence[str]) -> dict[str, np.ndarray]:
        """Segments ``[prefix] prompt_tail [sep] response_head [sep] [pad...]`` of n (prompt, response).

        Parameters
        ----------
        prompts, responses : sequences of n str.

        Returns
        -------
        dict with ``input_ids``, ``attention_mask``, ``token_type_ids``: ndarrays of shape
        (n, config.seq_len), int64.

        Raises
        ------
        InvalidInputError
            Lengths differ or an item is not a str.
        """
        bad = [f"{name}[{i}] must be a str, got {type(t).__name__}" for name, seq in (("prompts", prompts),
               ("responses", responses)) for i, t in enumerate(seq) if not isinstance(t, str)]
        if len(prompts) != len(responses) or bad:
            raise InvalidInputError(bad[0] if bad else f"{len(prompts)} prompts but {len(responses)} responses")
        c = self.config
        n, L = len(prompts), c.seq_len
        input_ids = np.full((n, L), self._pad, dtype=np.int64)
        mask = np.zeros((n, L), dtype=np.int64)
        types = np.zeros((n, L), dtype=np.int64)
        # Only a prompt's last and a response's first MAX_QUERY_CHARS characters are tokenised (tokens
        # are kept from those ends): a multi-megabyte text costs what 64 Ki characters cost.
        p_ids = self._ids([p[-MAX_QUERY_CHARS:] for p in prompts])
        r_ids = self._ids([r[:MAX_QUERY_CHARS] for r in responses])
        for i in range(n):
            head = [self._prefix] if self._prefix is not None else []
            p = p_ids[i][-c.prompt_tokens:] if p_ids[i] else []
            r = r_ids[i][: c.response_tokens]
            first = head + p + [self._sep]
            seq = first + r + [self._sep]
            input_ids[i, : len(seq)] = seq
            mask[i, : len(seq)] = 1
            types[i, len(first) : len(seq)] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": types}
