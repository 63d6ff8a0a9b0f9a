"""The record of a Flower reply a strategy dropped instead of aggregating (:class:`RejectedReply`), and
:func:`reject`, which logs and lists it: every Flower strategy keeps its dropped replies in ``rejected_``, as
the HTTPS server answers 422 to one upload and keeps the round. No Flower import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sdk.errors import InvalidInputError

#: What reading or checking a reply raises: our checks' errors (message kept), or a malformed record's.
REPLY_ERRORS = (InvalidInputError, KeyError, TypeError, ValueError)


@dataclass(frozen=True)
class RejectedReply:
    """A reply the strategy did not use: ``server_round`` (int, Flower's round number), ``client_id``
    (str, Flower node id) and ``reason`` (str, the check's message, also logged at WARNING)."""

    server_round: int
    client_id: str
    reason: str


def reply_reason(exc: Exception) -> str:
    """The reason listed for a reply whose check raised ``exc`` (one of :data:`REPLY_ERRORS`)."""
    return str(exc) if isinstance(exc, InvalidInputError) else f"malformed reply: {type(exc).__name__} {exc}"


def reject(rejected: list[RejectedReply], server_round: int, node: object, reason: str, part: str = "reply") -> None:
    """Log (Flower's logger, WARNING) and append to ``rejected`` the ``part`` of ``node``'s reply dropped for ``reason``."""
    logging.getLogger("flwr").warning("aggregate_train: round %d, %s of node %s dropped: %s", server_round, part,
                                      node, reason)
    rejected.append(RejectedReply(server_round, str(node), reason))


__all__ = ["REPLY_ERRORS", "RejectedReply", "reject", "reply_reason"]
