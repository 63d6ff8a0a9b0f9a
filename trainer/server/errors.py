"""Errors of the aggregation server; they extend the one hierarchy of :mod:`sdk.errors`::

    FedrouteError
    └── ServerError
        ├── UploadRejected              an upload the server refuses (``status``: the HTTP 4xx or 503, ``detail``)
        ├── IdempotencyKeyReused        an Idempotency-Key already stored with another body (HTTP 422)
        └── PublishRefused              an aggregate that is not published (stored all the same)
"""

from __future__ import annotations

from sdk.errors import FedrouteError


class ServerError(FedrouteError):
    """Base class of the aggregation server's errors."""


class UploadRejected(ServerError):
    """An upload the server refuses; ``status`` is the HTTP status (4xx; 503 when the store cannot
    take it), ``detail`` the reason, ``headers`` extra answer headers (e.g. ``Retry-After``) or None."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers


class IdempotencyKeyReused(ServerError):
    """A client sent an ``Idempotency-Key`` it already used, with a different body."""


class PublishRefused(ServerError):
    """The aggregate is not published (the message says why); the round's aggregate is still stored."""
