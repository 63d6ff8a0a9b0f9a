"""Which text of a chat conversation the router embeds.

A router is trained on single prompts, and the on-device embedder keeps the *last* ``max_tokens``
tokens of what it is given (left truncation, see :mod:`sdk.embedder`). For a list of OpenAI chat
``messages`` the routed text is therefore:

    <tail of the earlier turns, at most ``context_chars`` characters> "\n" <last user message>

- the **last user message** (role ``"user"``) is the query; text parts of a multi-part content
  (``{"type": "text", "text": ...}``) are joined with a newline, images and audio are ignored;
- the **context** is the text of the user and assistant messages *before* it, oldest first, joined
  with newlines, of which only the last ``context_chars`` characters are kept (a follow-up such as
  "and in Python?" is routed with what it follows). ``system`` / ``developer`` messages are left out:
  they are often long and the same for every query, so they would drown the query;
- messages after the last user message (an assistant prefill, tool results) are not embedded.

Because the embedder truncates from the left, a last user message longer than its token window
fills the window alone and the context falls away: the query always wins.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

from sdk.errors import InvalidInputError, InvalidQueryError
from sdk.real_numbers import shown

#: Characters of earlier turns prepended to the last user message by default.
DEFAULT_CONTEXT_CHARS = 300
_CONTEXT_ROLES = ("user", "assistant")


def message_text(message: object, position: int) -> str:
    """The text of one chat message (``content`` str, or the text parts of a list), "" if none.

    Raises
    ------
    InvalidQueryError
        ``message`` is not a mapping with a ``role`` str and a ``content`` that is a str, a list of
        parts or None.
    """
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise InvalidQueryError(f"messages[{position}] must be a mapping with a 'role' str, got {message!r:.80}")
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        texts = [part.get("text") for part in content if isinstance(part, Mapping) and part.get("type") == "text"]
        return "\n".join(t for t in texts if isinstance(t, str))
    raise InvalidQueryError(f"messages[{position}]['content'] must be a str, a list of parts or None, "
                            f"got {type(content).__name__}")


def routing_text(messages: object, context_chars: int = DEFAULT_CONTEXT_CHARS) -> str:
    """The text the router embeds for a chat (rules in the module docstring).

    Parameters
    ----------
    messages : non-empty sequence of OpenAI chat messages (mappings with ``role`` and ``content``).
    context_chars : int >= 0, characters of earlier user/assistant turns to prepend (0: the last user
        message alone).

    Returns
    -------
    str, non-blank.

    Raises
    ------
    InvalidQueryError
        ``messages`` is not a non-empty sequence of messages, or no user message has text.
    InvalidInputError
        ``context_chars`` is not an int >= 0.
    """
    if isinstance(context_chars, bool) or not isinstance(context_chars, numbers.Integral) or context_chars < 0:
        raise InvalidInputError(f"context_chars must be an int >= 0, got {context_chars!r}")
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or len(messages) == 0:
        raise InvalidQueryError(f"messages must be a non-empty list of chat messages, got {shown(messages)}")
    texts = [message_text(m, i) for i, m in enumerate(messages)]
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
