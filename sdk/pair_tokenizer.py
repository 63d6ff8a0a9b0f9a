"""``PairTokenizer``: (prompt, response) pairs -> one truncated, padded ``[CLS] x [SEP] y [SEP]`` sequence each.

The same output as ``tokenizers``' ``longest_first`` pair truncation to ``max_tokens`` (trainer and
device both use this class), at a cost linear in the texts: each text is tokenised alone, cut at the
word holding its last kept token and tokenised again, the cut checked against the full encoding
(docs/pair_inputs.md, docs/mor_grpo_and_device.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from sdk.embedder import MAX_QUERY_CHARS
from sdk.errors import InvalidInputError

if TYPE_CHECKING:
    from tokenizers import Encoding, Tokenizer

#: Tokens the cut steps back before the word start on each retry (doubled per retry).
_RETRY_MARGIN = 8


def longest_first_lengths(n_first: int, n_second: int, budget: int) -> tuple[int, int]:
    """Tokens kept of each text by ``longest_first`` truncation of a pair to ``budget`` tokens.

    The rule of ``tokenizers``' ``TruncationStrategy::LongestFirst``: with ``n1 <= n2`` (swapped back
    after), ``n2`` keeps ``max(n1, budget - n1)`` (all of it if that is more), and when both texts are
    longer than half the budget each keeps ``budget // 2``, the longer one (the second on a tie) one more
    when ``budget`` is odd. Examples (budget 10): (3, 20) -> (3, 7); (20, 3) -> (7, 3); (8, 9) -> (5, 5);
    (9, 8) -> (5, 5); (12, 12) -> (5, 5); with budget 11, (12, 12) -> (5, 6) and (13, 12) -> (6, 5).

    Parameters
    ----------
    n_first, n_second : tokens of each text, special tokens excluded (>= 0).
    budget : tokens the pair may hold, special tokens excluded (>= 0).

    Returns
    -------
    (k_first, k_second), each at most its text's length; their sum is at most ``budget`` whenever the
    texts had to be truncated.
    """
    if n_first + n_second <= budget:
        return n_first, n_second
    swap = n_first > n_second
    n1, n2 = (n_second, n_first) if swap else (n_first, n_second)
    k2 = n1 if n1 > budget else max(n1, budget - n1)
    k1 = n1
    if k1 + k2 > budget:
        k1 = budget // 2
        k2 = k1 + budget % 2
    k1, k2 = min(k1, n1), min(k2, n2)
    return (k2, k1) if swap else (k1, k2)


class PairTokenizer:
    """``longest_first`` pair tokenisation to ``max_tokens`` in all, with cost linear in the texts' length.

    Parameters
    ----------
    tokenizer : a ``tokenizers.Tokenizer`` with a pair template (``[CLS] $A [SEP] $B [SEP]`` for BERT);
        it is copied, and its own truncation and padding settings are ignored.
    max_tokens : int >= number of special tokens a pair gets + 2; tokens per pair, special tokens included.
    truncation_side : ``"left"`` (keep each text's end) or ``"right"`` (keep its start).
    pad_token : the padding token (its id from the vocabulary; 0 if absent).

    Raises
    ------
    InvalidInputError
        ``truncation_side`` is neither, or ``max_tokens`` leaves no room for a token of each text.
    """

    def __init__(self, tokenizer: Tokenizer, max_tokens: int, truncation_side: str, pad_token: str = "[PAD]") -> None:
        from tokenizers import Tokenizer  # native library: loaded with the first bundle, not by `import sdk`

        self._tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.budget = int(max_tokens) - self._tokenizer.num_special_tokens_to_add(True)
        if truncation_side not in ("left", "right") or self.budget < 2:
            raise InvalidInputError(f"truncation_side must be 'left' or 'right', got {truncation_side!r:.40}"
                                    if truncation_side not in ("left", "right") else
                                    f"max_tokens={max_tokens} leaves {self.budget} tokens for the two texts (need >= 2)")
        self.max_tokens, self.side = int(max_tokens), truncation_side
        pad_id = self._tokenizer.token_to_id(pad_token)
        self._pad_id, self._pad_token = (0 if pad_id is None else pad_id), pad_token

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> list[Encoding]:
        """``tokenizers.Encoding`` per pair, truncated and padded to the longest pair of the batch.

        Raises
        ------
        InvalidInputError
            The two lists differ in length.
        """
        if len(prompts) != len(responses):
            raise InvalidInputError(f"{len(prompts)} prompts but {len(responses)} responses")
        firsts, seconds = [self._cap(t) for t in prompts], [self._cap(t) for t in responses]
        full_a = self._tokenizer.encode_batch(firsts, add_special_tokens=False)
        full_b = self._tokenizer.encode_batch(seconds, add_special_tokens=False)
        out = []
        for text_a, text_b, enc_a, enc_b in zip(firsts, seconds, full_a, full_b):
            k_a, k_b = longest_first_lengths(len(enc_a.ids), len(enc_b.ids), self.budget)
            pair = self._tokenizer.post_process(self._kept(text_a, enc_a, k_a), self._kept(text_b, enc_b, k_b),
                                                add_special_tokens=True)
            out.append(pair)
        longest = max((len(e.ids) for e in out), default=0)
        for e in out:
            e.pad(longest, pad_id=self._pad_id, pad_token=self._pad_token)
        return out

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> dict[str, np.ndarray]:
        """``input_ids``, ``attention_mask``, ``token_type_ids``: each ``(n_pairs, seq) int64``, ``seq <= max_tokens``."""
        enc = self.encode(prompts, responses)
        return {"input_ids": np.array([e.ids for e in enc], dtype=np.int64).reshape(len(enc), -1),
                "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64).reshape(len(enc), -1),
                "token_type_ids": np.array([e.type_ids for e in enc], dtype=np.int64).reshape(len(enc), -1)}

    def _cap(self, text: str) -> str:
        if len(text) <= MAX_QUERY_CHARS:
            return text
        return text[-MAX_QUERY_CHARS:] if self.side == "left" else text[:MAX_QUERY_CHARS]

    def _kept(self, text: str, full: Encoding, k: int) -> Encoding:
        """The encoding of ``text`` truncated to its ``k`` kept tokens, from a re-tokenised cut of the
        text (few overflowing tokens), checked against the full encoding ``full``."""
        n = len(full.ids)
        if k >= n:
            return full
        want = full.ids[n - k:] if self.side == "left" else full.ids[:k]
        margin = 0
        while True:
            piece = self._cut(text, full, k, margin)
            if piece is None:  # the cut reached the whole text
                full.truncate(k, direction=self.side)
                return full
            enc = self._tokenizer.encode(piece, add_special_tokens=False)
            got = enc.ids[len(enc.ids) - k:] if self.side == "left" else enc.ids[:k]
            if len(enc.ids) >= k and got == want:
                enc.truncate(k, direction=self.side)
                return enc
            margin = max(_RETRY_MARGIN, 2 * margin)

    def _cut(self, text: str, full: Encoding, k: int, margin: int) -> str | None:
        """``text`` cut at the word boundary outside its ``k`` kept tokens (``margin`` tokens further
        out), or None when that boundary is the text's own start or end."""
        n, words, offsets = len(full.ids), full.word_ids, full.offsets
        if self.side == "left":
            i = n - k - margin
            if i <= 0:
                return None
            while i > 0 and words[i - 1] == words[i]:
                i -= 1
            return None if i == 0 else text[offsets[i][0]:]
        j = k - 1 + margin
        if j >= n - 1:
            return None
        while j < n - 1 and words[j + 1] == words[j]:
            j += 1
        return None if j == n - 1 else text[: offsets[j][1]]
