"""Which text of a chat conversation the router embeds (docs/openai_proxy.md, "Which text is routed").

The routed text is ``<tail of the earlier user/assistant turns, at most context_chars characters>
"\n" <last user message>``: text parts of a multi-part content joined with newlines (images and audio
ignored), ``system`` / ``developer`` messages and messages after the last user message left out. The
embedder truncates from the left, so a long last user message fills its window alone: the query wins.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import cast

from sdk.errors import InvalidInputError, InvalidQueryError
from sdk.real_numbers import shown

#: Characters of earlier turns prepended to the last user message by default.
DEFAULT_CONTEXT_CHARS = 300
_CONTEXT_ROLES = ("user", "assistant")


def message_text(message: object, position: int) -> str:
    """The text of ``messages[position]`` (``content`` str, or the text parts of a list), "" if none;
    :class:`InvalidQueryError` unless a mapping with a ``role`` str and a str, list or None ``content``."""
    content = message.get("content") if isinstance(message, Mapping) else None
    parts = isinstance(content, Sequence) and not isinstance(content, (str, bytes, bytearray))
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
            or not (content is None or isinstance(content, str) or parts):
        raise InvalidQueryError(f"messages[{position}] must be a mapping with a 'role' str and a 'content' str, list of "
                                f"parts or None, got {message!r:.80}")
    if parts:
        texts = [part.get("text") for part in content or () if isinstance(part, Mapping) and part.get("type") == "text"]
        return "\n".join(t for t in texts if isinstance(t, str))
    return content or ""


def message_texts(messages: object) -> list[str]:
    """The text of each message; :class:`InvalidQueryError` unless a non-empty sequence of chat messages."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or len(messages) == 0:
        raise InvalidQueryError(f"messages must be a non-empty list of chat messages, got {shown(messages)}")
    return [message_text(m, i) for i, m in enumerate(messages)]


def routing_text(messages: object, context_chars: int = DEFAULT_CONTEXT_CHARS) -> str:
    """The non-blank text the router embeds for ``messages`` (OpenAI chat messages), with ``context_chars``
    (int >= 0) characters of earlier turns (module docstring).

    Raises
    ------
    InvalidQueryError
        ``messages`` is not a non-empty sequence of messages, or no user message has text.
    InvalidInputError
        ``context_chars`` is not an int >= 0.
    """
    if isinstance(context_chars, bool) or not isinstance(context_chars, numbers.Integral) or context_chars < 0:
        raise InvalidInputError(f"context_chars must be an int >= 0, got {context_chars!r}")
    texts = message_texts(messages)
    messages = cast(Sequence[Mapping[str, object]], messages)
    last_user = next((i for i in range(len(messages) - 1, -1, -1)
                      if messages[i]["role"] == "user" and texts[i].strip()), None)
    if last_user is None:
        raise InvalidQueryError("messages hold no user message with text; there is nothing to route")
    query = texts[last_user]
    if context_chars == 0:
        return query
    earlier = "\n".join(texts[i] for i in range(last_user) if messages[i]["role"] in _CONTEXT_ROLES and texts[i].strip())
    tail = earlier[-int(context_chars):] if earlier else ""
    return f"{tail}\n{query}" if tail.strip() else query
