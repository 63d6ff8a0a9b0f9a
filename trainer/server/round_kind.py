"""What a federated round kind supplies to the aggregation server (ARCHITECTURE.md §6, §9).

A round kind (same name as its router kind in :mod:`sdk.kinds` / :mod:`trainer.kinds`) opens a
round from a published bundle, describes it to devices, decodes and validates their uploads, and at
close aggregates them and publishes a new bundle through the ``publisher`` the server was handed
(the server never imports ``export``). The registry is :mod:`trainer.server.round_kinds`; the
server, the store and the operator CLI only ever ask it.

Common pieces live here: :class:`OpenRequest` (the operator's ``rounds open`` options),
:class:`ParsedUpload`, :class:`AcceptedUpload`, :class:`Publisher`, and :func:`check_round_args`.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from sdk.errors import InvalidInputError

#: Longest round (seconds): deadlines stay representable as dates (a year).
MAX_DEADLINE_S = 366 * 86400.0


def check_round_args(deadline_s: float, quorum: int, min_count: int) -> None:
    """Raise InvalidInputError unless 0 < deadline_s <= MAX_DEADLINE_S, quorum >= 1, min_count >= 1."""
    if not (math.isfinite(deadline_s) and 0 < deadline_s <= MAX_DEADLINE_S) or quorum < 1 or min_count < 1:
        raise InvalidInputError(f"need 0 < deadline_s <= {MAX_DEADLINE_S:.0f} (a year), quorum >= 1, min_count >= 1; "
                                f"got {deadline_s}, {quorum}, {min_count}")


class Publisher(Protocol):
    """Publishing handed to the server by the console-script module (``export.publish.publish_router``).

    ``publish(bundle_dir, signing_key, router, provenance, embedder=None, base=None)`` writes a new
    signed version of the bundle at ``bundle_dir`` with the trainer ``router`` in place of its router
    file and returns the signed manifest (dict); idempotent per ``provenance["round_uid"]``.
    Raises :class:`~trainer.server.errors.PublishRefused` when the bundle no longer fits the router.
    """

    def __call__(self, bundle_dir: Path, signing_key: Path, router: Any, provenance: dict,
                 embedder: dict | None = None, base: Any = None) -> dict: ...


@dataclass(frozen=True)
class OpenRequest:
    """The operator's ``fedroute rounds open`` options, common and kind-specific.

    Common: ``bundle_dir`` (the published bundle the round starts from), ``public_key`` (the key it
    must verify with), ``deadline_s``, ``quorum``, ``min_count``, ``publish`` (True: publish a new
    bundle at close, to ``bundle_dir`` with ``signing_key``), ``seed`` (DP noise; None = secret),
    the aggregation options ``clip_count``, ``trim_fraction``, ``noise_multiplier``, ``delta``.
    Kind-specific options are in ``options`` (name -> value, None = not given); a kind refuses the
    ones it does not take (:meth:`ServerRoundKind.open` lists them in :attr:`ServerRoundKind.options`).
    """

    bundle_dir: Path
    public_key: Any
    deadline_s: float
    quorum: int
    min_count: int
    signing_key: Path | None = None
    seed: int | None = None
    clip_count: float | None = 20000.0
    trim_fraction: float = 0.0
    noise_multiplier: float = 0.0
    delta: float = 1e-5
    options: dict[str, Any] = field(default_factory=dict)

    def given(self) -> set[str]:
        """Names of the kind-specific options that were given (not None / False)."""
        return {k for k, v in self.options.items() if v is not None and v is not False}


@dataclass(frozen=True)
class ParsedUpload:
    """A decoded upload before its checks against the round: the envelope (``client_id``,
    ``round_id``, ``kind``) and the kind's decoded ``content`` (its own type)."""

    client_id: str
    round_id: int
    kind: str
    content: Any
    raw: bytes = b""


@dataclass(frozen=True)
class AcceptedUpload:
    """A validated upload: the ``payload`` bytes to store, the device's ``log_size``, and
    ``check_previous(previous payload or None)``, run where the store serialises the read of the
    client's previous update with the insert (None: nothing to check)."""

    payload: bytes
    log_size: int
    check_previous: Callable[[bytes | None], None] | None = None


class ServerRoundKind(abc.ABC):
    """A federated round kind on the server. Subclass, implement every abstract method, register an
    instance in :mod:`trainer.server.round_kinds`.

    Attributes
    ----------
    family, name : registry key (``"router"``, ``"kmeans"``).
    media_types : tuple of str, the ``Content-Type`` values of this kind's uploads (distinct across kinds).
    options : tuple of str, the kind-specific :class:`OpenRequest` options it takes.
    """

    family: ClassVar[str] = "router"
    name: ClassVar[str] = ""
    media_types: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def open(self, store, request: OpenRequest):
        """Open a round from ``request``; return the store's ``Round``.

        Raises
        ------
        InvalidInputError
            Bad or inapplicable options (the message names them).
        BundleError
            The bundle does not verify or does not fit the kind.
        ValueError
            A round is still open.
        """

    @abc.abstractmethod
    def describe(self, round_) -> dict:
        """JSON of ``GET /v1/rounds/current`` for this round (its ``kind`` included); parsed on
        the device by the kind's :class:`sdk.device_rounds.DeviceRoundHandler`."""

    @abc.abstractmethod
    def summary(self, round_) -> dict:
        """The kind's facts printed by ``rounds open`` (e.g. ``{"n_cells": 32}``)."""

    @abc.abstractmethod
    def parse(self, raw: bytes, content_type: str) -> ParsedUpload:
        """Decode an upload of one of :attr:`media_types`.

        Raises
        ------
        UploadRejected
            400 undecodable, 422 a malformed envelope.
        """

    @abc.abstractmethod
    def validate(self, upload: ParsedUpload, round_) -> AcceptedUpload:
        """Check a parsed upload against its round (of this kind).

        Raises
        ------
        UploadRejected
            409 another base than the round's; 422 an invalid update.
        """

    @abc.abstractmethod
    def close(self, store, round_, snapshot: int, owner: str, progress: Callable[[str], None],
              publisher: Publisher | None) -> dict | None:
        """Aggregate the round claimed for closing by ``owner`` (updates up to ``snapshot``), store
        the aggregate, publish through ``publisher`` when the round was opened to publish; return
        the outcome (see :func:`trainer.server.rounds.close_round`), or None if another closer took
        the round over."""

    @abc.abstractmethod
    def publish(self, round_, aggregate: dict, bundle_dir: Path, signing_key: Path, provenance: dict,
                publisher: Publisher) -> dict:
        """Publish a closed round's stored ``aggregate`` (``fedroute publish``); return the manifest.

        Raises
        ------
        PublishRefused
            The aggregate or the bundle does not allow it (the message says why).
        """
