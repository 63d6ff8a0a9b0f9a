"""What a federated round kind supplies to the aggregation server (ARCHITECTURE.md §6, §9).

A round kind (same name as its router kind in :mod:`sdk.kinds` / :mod:`trainer.kinds`) opens a
round from a published bundle, describes it to devices, decodes and validates their uploads, and at
close aggregates them and publishes a new bundle through the ``publisher`` the server was handed
(the server never imports ``export``). The registry is :mod:`trainer.server.round_kinds`; the
server, the store and the operator CLI only ever ask it.

Common pieces live here: :class:`OpenRequest` (the operator's ``rounds open`` options),
:class:`ParsedUpload`, :class:`AcceptedUpload`, :class:`Publisher`, :class:`RoundSettings` (made by
:func:`round_settings`), :class:`RoundOutcome` and :func:`check_round_args`.
"""

from __future__ import annotations

import abc
import datetime as dt
import dataclasses
import math
import numbers
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from sdk.cell_statistics import CellStatistics
from sdk.errors import InvalidInputError

#: Longest round (seconds): deadlines stay representable as dates (a year).
MAX_DEADLINE_S = 366 * 86400.0


def check_round_args(deadline_s: float, quorum: int, min_count: int) -> None:
    """Raise InvalidInputError unless 0 < deadline_s <= MAX_DEADLINE_S, quorum >= 1, min_count >= 1."""
    if not (math.isfinite(deadline_s) and 0 < deadline_s <= MAX_DEADLINE_S) or quorum < 1 or min_count < 1:
        raise InvalidInputError(f"need 0 < deadline_s <= {MAX_DEADLINE_S:.0f} (a year), quorum >= 1, min_count >= 1; "
                                f"got {deadline_s}, {quorum}, {min_count}")


@dataclass(frozen=True)
class PublishTarget:
    """Where a round publishes at close: the bundle folder and the signing key (absolute paths)."""

    bundle_dir: str
    signing_key: str


@dataclass(frozen=True)
class RoundSettings:
    """The settings stored with a round (:meth:`to_json` in the store, :meth:`from_json` back).

    Attributes
    ----------
    aggregation : dict, the fields of the kind's aggregation config (an
        :class:`~trainer.federated.kmeans_aggregation.AggregationConfig` for K-means rounds, an
        :class:`~trainer.federated.mlp_aggregation.MLPAggregationConfig` for MLP rounds).
    seed : int, the DP noise seed (secret by default: whoever knows it can subtract the noise).
    round_uid : str, identifies the round across databases (idempotent publishing).
    prior_strength, model_prior_strength, prior : shrinkage of the published K-means router.
    publish : PublishTarget or None (no publishing at close).
    min_total_count : int, the smallest total count worth publishing.
    prior_statistics : dict or None, statistics already published (``count``, ``sum_accuracy``,
        ``sum_cost`` as lists) merged into every K-means aggregate.
    network : dict or None, the MLP's shape and cost scales (:func:`trainer.server.mlp_rounds.network_settings`).
    continued_from : int or None, the MLP round whose aggregate this round starts from.
    """

    aggregation: dict
    seed: int
    round_uid: str | None = None
    prior_strength: float = 16.0
    model_prior_strength: float = 10.0
    prior: str = "additive"
    publish: PublishTarget | None = None
    min_total_count: int = 1
    prior_statistics: dict | None = None
    network: dict | None = None
    continued_from: int | None = None

    def to_json(self) -> dict:
        """The JSON object stored with the round."""
        out = dataclasses.asdict(self)
        out["publish"] = None if self.publish is None else dataclasses.asdict(self.publish)
        return out

    @classmethod
    def from_json(cls, data: dict) -> RoundSettings:
        """Inverse of :meth:`to_json`; fields missing from older rounds take their defaults.

        Raises
        ------
        InvalidInputError
            Not an object, or no ``aggregation`` / ``seed``.
        """
        if not isinstance(data, dict) or "aggregation" not in data or "seed" not in data:
            raise InvalidInputError("round settings need at least 'aggregation' and 'seed'")
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in names}
        if fields.get("publish") is not None:
            fields["publish"] = PublishTarget(**fields["publish"])
        return cls(**fields)


def round_settings(
    *,
    aggregation,
    prior_strength: float = 16.0,
    model_prior_strength: float = 10.0,
    prior: str = "additive",
    bundle_dir: Path | None = None,
    signing_key: Path | None = None,
    seed: int | None = None,
    min_total_count: int = 1,
    prior_statistics: CellStatistics | None = None,
) -> RoundSettings:
    """The :class:`RoundSettings` of a new round: ``aggregation`` is the kind's aggregation config
    (a dataclass); shrinkage defaults are those of :class:`trainer.routers.kmeans_router.KMeansRouterConfig`;
    ``prior_statistics`` (e.g. the shipped router's; without them the first round's router knows only
    that round's clients) are merged into every aggregate; the noise seed is secret by default
    (random, kept on the server).

    Raises
    ------
    InvalidInputError
        Only one of ``bundle_dir`` and ``signing_key`` is given, or a ``seed`` that is not an int >= 0.
    """
    if (bundle_dir is None) != (signing_key is None):
        raise InvalidInputError("publishing needs both a bundle dir and a signing key")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
        # numpy's seed sequence (the DP noise, seeded with (seed, round id) at close) takes no negative number
        raise InvalidInputError(f"seed must be an integer >= 0, got {seed!r}")
    return RoundSettings(
        aggregation=dataclasses.asdict(aggregation),
        seed=secrets.randbits(63) if seed is None else int(seed),
        round_uid=secrets.token_hex(8),
        prior_strength=float(prior_strength), model_prior_strength=float(model_prior_strength), prior=prior,
        publish=None if bundle_dir is None else PublishTarget(str(Path(bundle_dir).absolute()),
                                                              str(Path(signing_key).absolute())),
        min_total_count=int(min_total_count),
        prior_statistics=None if prior_statistics is None else {
            "count": prior_statistics.count.tolist(), "sum_accuracy": prior_statistics.sum_accuracy.tolist(),
            "sum_cost": prior_statistics.sum_cost.tolist()},
    )


def common_description(r) -> dict:
    """The fields of ``GET /v1/rounds/current`` that every round kind sends."""
    deadline = dt.datetime.fromtimestamp(r.deadline_unix, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {"round_id": r.id, "kind": r.kind, "status": r.status, "models": list(r.models),
            "embedder_name": r.embedder["name"], "d_emb": int(r.embedder["dim"]),
            "min_count": r.min_count, "quorum": r.quorum, "deadline_utc": deadline}


#: Values of :attr:`RoundOutcome.result`.
RESULTS = ("aggregated", "no-op", "failed")


@dataclass
class RoundOutcome:
    """What closing a round did; stored as JSON with the round (:meth:`to_json`, :meth:`from_json`).

    Attributes
    ----------
    result : ``"aggregated"``, ``"no-op"`` (no update arrived) or ``"failed"`` (closing kept failing).
    on_time_updates, late_updates_counted, stale_updates : int, updates counted in the round, late
        ones carried into it, and late ones that could not be (another base).
    total_count : float or None, evaluations (K-means) or samples (MLP) aggregated.
    epsilon : float or None, the (epsilon, delta) of one release under DP noise, None without noise.
    bundle_version : int or None, the version published, None when nothing was.
    clients : list of str or None, the clients aggregated (None under DP noise: membership would leak).
    publish_skipped : str or None, why a round opened to publish did not.
    error : str or None, the last error of a failed close.
    """

    result: str
    on_time_updates: int = 0
    late_updates_counted: int = 0
    stale_updates: int = 0
    total_count: float | None = None
    epsilon: float | None = None
    bundle_version: int | None = None
    clients: list[str] | None = None
    publish_skipped: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if self.result not in RESULTS:
            raise InvalidInputError(f"result must be one of {RESULTS}, got {self.result!r}")

    @property
    def published(self) -> bool:
        """True if the aggregate was published or publishing was not asked (not refused or skipped)."""
        return self.result == "aggregated" and self.publish_skipped is None

    def published_note(self) -> str:
        """``"bundle vN"``, or ``"nothing published (why)"`` for the operator's progress line."""
        if self.bundle_version is not None:
            return f"bundle v{self.bundle_version}"
        return f"nothing published ({self.publish_skipped or 'round opened without --signing-key'})"

    def to_json(self) -> dict:
        """The stored JSON: ``result``; the update counts unless failed; ``total_count``,
        ``epsilon`` and ``bundle_version`` (null when none) when aggregated, ``clients`` and
        ``publish_skipped`` when set; ``error`` when failed."""
        if self.result == "failed":
            return {"result": self.result, "error": self.error}
        out = {"on_time_updates": self.on_time_updates, "late_updates_counted": self.late_updates_counted,
               "stale_updates": self.stale_updates, "result": self.result}
        if self.result == "aggregated":
            out.update(total_count=self.total_count, epsilon=self.epsilon, bundle_version=self.bundle_version)
            if self.clients is not None:
                out["clients"] = list(self.clients)
            if self.publish_skipped is not None:
                out["publish_skipped"] = self.publish_skipped
        return out

    @classmethod
    def from_json(cls, data: dict) -> RoundOutcome:
        """Inverse of :meth:`to_json` (unknown keys ignored).

        Raises
        ------
        InvalidInputError
            Not an outcome (no valid ``result``).
        """
        if not isinstance(data, dict):
            raise InvalidInputError(f"a round outcome is a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class Publisher(Protocol):
    """Publishing, handed to the server by the console-script module (:class:`export.publish.BundlePublisher`);
    the server never imports ``export``."""

    def public_key(self, signing_key: Path):
        """The Ed25519 public key of the private key at ``signing_key`` (raises ExportError if unreadable)."""
        ...

    def publish(self, bundle_dir: Path, signing_key: Path, router: Any, provenance: dict,
                embedder: dict | None = None, base: Any = None) -> dict:
        """Write a new signed version of the bundle at ``bundle_dir`` with the trainer ``router`` in
        place of its router file; return the signed manifest (dict). Idempotent per
        ``provenance["round_uid"]``. ``base``: the bundle already read and verified.

        Raises :class:`~trainer.server.errors.PublishRefused` when the bundle no longer fits the router."""
        ...


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
    ``round_id``, ``kind``), the kind's decoded ``content`` (its own type), the ``raw`` body and
    ``parsed_by``, the round kind whose content type it had (set by
    :func:`trainer.server.round_kinds.parse_upload`)."""

    client_id: str
    round_id: int
    kind: str
    content: Any
    raw: bytes = b""
    parsed_by: str = ""


@dataclass(frozen=True)
class AcceptedUpload:
    """A validated upload: the ``payload`` bytes to store, the device's ``log_size``, and
    ``check_previous(previous memo or None)``, run serialised with the insert for the client
    (None: nothing to check). ``memo`` is what the server keeps in memory as the client's previous
    upload for the next one's check (:meth:`ServerRoundKind.memo_of` rebuilds it from a stored
    payload after a restart)."""

    payload: bytes
    log_size: int
    check_previous: Callable[[Any], None] | None = None
    memo: Any = None


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

    def memo_of(self, payload: bytes) -> Any:
        """The memo (see :class:`AcceptedUpload`) of a stored ``payload``, for ``check_previous``;
        kinds without ``check_previous`` need not override it."""
        return payload

    @abc.abstractmethod
    def close(self, store, round_, snapshot: int, owner: str, progress: Callable[[str], None],
              publisher: Publisher | None) -> RoundOutcome | None:
        """Aggregate the round claimed for closing by ``owner`` (updates up to ``snapshot``), store
        the aggregate and the :class:`RoundOutcome` (``store.finish_close``), publish through
        ``publisher`` when the round was opened to publish (without one: ``publish_skipped``);
        return the outcome, or None if another closer took the round over."""

    @abc.abstractmethod
    def publish(self, round_, aggregate: dict, bundle_dir: Path, signing_key: Path, provenance: dict,
                publisher: Publisher) -> dict:
        """Publish a closed round's stored ``aggregate`` (``fedroute publish``); return the manifest.

        Raises
        ------
        PublishRefused
            The aggregate or the bundle does not allow it (the message says why).
        """
