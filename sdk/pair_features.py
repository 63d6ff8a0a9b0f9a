"""Antisymmetric pair features ``f(x, y_A, y_B) = phi(x, y_A) - phi(x, y_B)``: the length prior generalised.

``phi`` describes a response by surface statistics (length, markdown structure, refusal and hedging
phrases, instruction echo...: :data:`FEATURE_NAMES`); swapping A and B negates ``f``, so
``P(A better) = sigmoid(w . f)`` is the Bradley-Terry model (Bradley and Terry 1952) with reward
``w . phi(x, y)``. The first three are :func:`sdk.pair_encoding.length_features`; :data:`DEFAULT_FEATURES`
was chosen on validation pairs by ``benchmarks/pair_features_settings.py``. docs/pair_inputs.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from sdk.errors import InvalidInputError
from sdk.pair_encoding import LENGTH_FEATURE_NAMES

__all__ = ["DEFAULT_FEATURES", "FEATURE_NAMES", "LENGTH_FEATURE_NAMES", "PROMPT_FEATURES", "check_feature_names", "pair_features",
           "pair_features_many", "response_features", "response_features_many"]

_WORD = re.compile(r"\w+")
_LIST_ITEM = re.compile(r"^\s*(?:[-*+\u2022]|\d{1,3}[.)])\s+\S", re.M)
_HEADER = re.compile(r"^\s*#{1,6}\s+\S", re.M)
_EMPHASIS = re.compile(r"\*\*[^*\n]+\*\*|__[^_\n]+__")
_FENCE = re.compile(r"^\s*```", re.M)
_INLINE_CODE = re.compile(r"`[^`\n]+`")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_SENTENCE_END = re.compile(r"[.!?](?:\s|$)")
_URL = re.compile(r"https?://")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)?")
_REFUSAL = re.compile(r"\b(?:i(?:'m| am) (?:not able|unable)|i can(?:not|'t|\u2019t)|i won(?:'t|\u2019t)|i will not|"
                      r"i(?:'m| am) sorry|i apologi[sz]e|as an ai|language model|not (?:appropriate|ethical)|"
                      r"i do(?:n't|\u2019t| not) (?:think i should|feel comfortable)|against my)", re.I)
_APOLOGY = re.compile(r"\b(?:sorry|apologi[sz]e|unfortunately)\b", re.I)
_HEDGE = re.compile(r"\b(?:may|might|could|perhaps|possibly|probably|likely|generally|typically|usually|"
                    r"it depends|not sure|i think|i believe|however)\b", re.I)
_SECOND_PERSON = re.compile(r"\b(?:you|your|you're|yourself)\b", re.I)
_FIRST_PERSON = re.compile(r"\b(?:i|i'm|i've|my|me)\b", re.I)
_OPENER = re.compile(r"^\s*(?:sure|certainly|of course|absolutely|yes|great question|here (?:is|are))\b", re.I)
_ROLE_TAG = re.compile(r"\b(?:human|assistant|user)\s*:", re.I)


def _count_lines(y: str) -> int:
    return y.count("\n") + 1 if y.strip() else 0


def _log(n: float) -> float:
    return math.log1p(n)


def _echo(x: str, y: str) -> float:
    """Share of the prompt's distinct words (lower case, >= 4 characters) that the response repeats."""
    px = {w for w in _WORD.findall(x.lower()) if len(w) >= 4}
    if not px:
        return 0.0
    return len(px & set(_WORD.findall(y.lower()))) / len(px)


def _repetition(y: str) -> float:
    """1 - distinct / total words (lower case): 0 for no repeated word or an empty text."""
    words = _WORD.findall(y.lower())
    return 1.0 - len(set(words)) / len(words) if words else 0.0


def _paragraphs(y: str) -> int:
    return sum(1 for p in _PARAGRAPH_BREAK.split(y) if p.strip())


def _ends_complete(y: str) -> float:
    """1 if the response ends with terminal punctuation, a closing bracket/quote or a code fence (not cut off)."""
    t = y.rstrip()
    return float(bool(t) and t[-1] in ".!?)]}\"'`*:\u201d")


def _mean_word_chars(y: str) -> float:
    words = y.split()
    return math.log1p(sum(map(len, words)) / len(words)) if words else 0.0


def _non_ascii(y: str) -> float:
    return sum(ord(c) > 127 for c in y) / len(y) if y else 0.0


#: name -> phi component ``(prompt, response) -> float``; the order is the order of :data:`FEATURE_NAMES`.
_FEATURES: dict[str, Callable[[str, str], float]] = {
    "dlog_chars": lambda x, y: _log(len(y)),
    "dlog_words": lambda x, y: _log(len(y.split())),
    "dlog_lines": lambda x, y: _log(_count_lines(y)),
    "list_items": lambda x, y: _log(len(_LIST_ITEM.findall(y))),
    "headers": lambda x, y: _log(len(_HEADER.findall(y))),
    "emphasis": lambda x, y: _log(len(_EMPHASIS.findall(y))),
    "code_blocks": lambda x, y: _log(len(_FENCE.findall(y)) // 2),
    "inline_code": lambda x, y: _log(len(_INLINE_CODE.findall(y))),
    "paragraphs": lambda x, y: _log(_paragraphs(y)),
    "sentences": lambda x, y: _log(len(_SENTENCE_END.findall(y))),
    "refusal": lambda x, y: float(bool(_REFUSAL.search(y))),
    "apology": lambda x, y: float(bool(_APOLOGY.search(y))),
    "hedges": lambda x, y: _log(len(_HEDGE.findall(y))),
    "questions": lambda x, y: _log(y.count("?")),
    "exclamations": lambda x, y: _log(y.count("!")),
    "numbers": lambda x, y: _log(len(_NUMBER.findall(y))),
    "urls": lambda x, y: _log(len(_URL.findall(y))),
    "second_person": lambda x, y: _log(len(_SECOND_PERSON.findall(y))),
    "first_person": lambda x, y: _log(len(_FIRST_PERSON.findall(y))),
    "opener": lambda x, y: float(bool(_OPENER.search(y))),
    "role_tags": lambda x, y: _log(len(_ROLE_TAG.findall(y))),
    "echo": _echo,
    "repetition": lambda x, y: _repetition(y),
    "ends_complete": lambda x, y: _ends_complete(y),
    "mean_word_chars": lambda x, y: _mean_word_chars(y),
    "non_ascii": lambda x, y: _non_ascii(y),
}

#: The features that read the prompt (the others read the response only).
PROMPT_FEATURES: tuple[str, ...] = ("echo",)

#: Every feature this module computes, in a fixed order.
FEATURE_NAMES: tuple[str, ...] = tuple(_FEATURES)

#: The features the learners use by default: chosen on validation by ``benchmarks/pair_features_settings.py``
#: (forward selection on the per-domain logistic regression's validation log-loss; docs/pair_features_settings.json:
#: test accuracy 0.803 vs 0.786 for length only, +0.017 +- 0.004 paired, 4,376 pairs).
DEFAULT_FEATURES: tuple[str, ...] = ("dlog_chars", "dlog_words", "dlog_lines", "repetition", "emphasis", "mean_word_chars",
                                     "first_person", "refusal", "ends_complete", "headers", "inline_code")


def check_feature_names(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` as a tuple if they are distinct names of :data:`FEATURE_NAMES` (at least one).

    Raises
    ------
    InvalidInputError
        An unknown or repeated name, or none (the message lists the known names).
    """
    names = tuple(names)
    bad = [n for n in names if n not in _FEATURES]
    if bad or not names or len(set(names)) != len(names):
        raise InvalidInputError(f"feature names must be distinct names of {FEATURE_NAMES}, got {names!r:.200}")
    return names


def _phi(x: str, y: str, fns: Sequence[Callable[[str, str], float]]) -> np.ndarray:
    return np.array([f(x, y) for f in fns], dtype=np.float64)


def response_features(prompt: str, response: str, names: Sequence[str] = DEFAULT_FEATURES) -> np.ndarray:
    """``phi(x, y)`` of one response: ndarray of shape (len(names),), float64.

    Raises
    ------
    InvalidInputError
        ``prompt`` or ``response`` is not a str, or a bad name (:func:`check_feature_names`).
    """
    for name, t in (("prompt", prompt), ("response", response)):
        if not isinstance(t, str):
            raise InvalidInputError(f"{name} must be a str, got {type(t).__name__}")
    return _phi(prompt, response, [_FEATURES[n] for n in check_feature_names(names)])


def response_features_many(prompts: Sequence[str], responses: Sequence[str], names: Sequence[str] = DEFAULT_FEATURES) -> np.ndarray:
    """``phi(x, y)`` of n (prompt, response): ndarray of shape (n, len(names)), float64 (a reward model
    ``R(x, y)`` reads these; the Bradley-Terry difference of two of them is :func:`pair_features`).

    Raises
    ------
    InvalidInputError
        The sequences differ in length, an item is not a str, or a bad name.
    """
    return pair_features_many(prompts, responses, [""] * len(responses), names, exact=True)


def pair_features(prompt: str, response_a: str, response_b: str, names: Sequence[str] = DEFAULT_FEATURES) -> np.ndarray:
    """``f = phi(x, y_A) - phi(x, y_B)`` of one pair: ndarray of shape (len(names),), float32.

    Raises
    ------
    InvalidInputError
        A text is not a str, or a bad name.
    """
    row: npt.NDArray[np.float32] = pair_features_many([prompt], [response_a], [response_b], names)[0]
    return row


def pair_features_many(prompts: Sequence[str], responses_a: Sequence[str], responses_b: Sequence[str],
                       names: Sequence[str] = DEFAULT_FEATURES, *, exact: bool = False) -> np.ndarray:
    """:func:`pair_features` of n pairs: ndarray of shape (n, len(names)), float32.

    ``phi`` is computed once per distinct (prompt, response) (a response shared by several pairs, as
    in AlpacaEval, costs one pass); the difference is taken in float64, then rounded to float32
    (``exact=True``: returned in float64).

    Raises
    ------
    InvalidInputError
        The three sequences differ in length, an item is not a str, or a bad name.
    """
    names = check_feature_names(names)
    bad = [f"{label}[{i}] must be a str, got {type(t).__name__}" for label, seq in (("prompts", prompts),
           ("responses_a", responses_a), ("responses_b", responses_b)) for i, t in enumerate(seq) if not isinstance(t, str)]
    equal = len(prompts) == len(responses_a) == len(responses_b)
    if not equal or bad:
        raise InvalidInputError(bad[0] if equal else f"{len(prompts)} prompts, {len(responses_a)} responses_a and "
                                f"{len(responses_b)} responses_b: expected equal lengths")
    fns = [_FEATURES[n] for n in names]
    memo: dict[tuple[str, str], np.ndarray] = {}

    def phi(x: str, y: str) -> np.ndarray:
        key = (x, y)
        if key not in memo:
            memo[key] = _phi(x, y, fns)
        return memo[key]

    out = np.zeros((len(prompts), len(names)), dtype=np.float64)
    for i, (x, a, b) in enumerate(zip(prompts, responses_a, responses_b)):
        out[i] = phi(x, a) - phi(x, b)
    return out if exact else out.astype(np.float32)
