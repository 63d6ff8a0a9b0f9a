"""The record of a Flower reply a strategy dropped instead of aggregating (:class:`RejectedReply`).

Shared by the Flower strategies (K-means: :mod:`trainer.federated.flower_app`; MoR router:
:mod:`trainer.rewards.flower_router`; FedPrism: :mod:`trainer.experts.flower_strategy`), each of which
lists its dropped replies in ``rejected_``, as the HTTPS server answers 422 to one upload and keeps the
round. A module of its own so that no strategy imports another's module for it. Pure, no Flower import.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RejectedReply:
    """A reply the strategy did not use: ``server_round`` (int, Flower's round number), ``client_id``
    (str, Flower node id) and ``reason`` (str, the check's message, also logged at WARNING)."""

    server_round: int
    client_id: str
    reason: str


__all__ = ["RejectedReply"]
