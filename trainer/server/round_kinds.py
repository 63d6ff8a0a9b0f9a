"""The server's registry of federated round kinds (ARCHITECTURE.md §9), keyed like :mod:`sdk.kinds`
and :mod:`trainer.kinds` (``family``, ``name``); the base class is
:class:`trainer.server.round_kind.ServerRoundKind`.

Built in: ``router/kmeans`` (:mod:`trainer.server.kmeans_rounds`) and ``router/mlp``
(:mod:`trainer.server.mlp_rounds`). The HTTP API, the store and the operator CLI reach a kind only
through :func:`get`, :func:`for_media_type`, :func:`parse_upload` and :func:`validate_upload`.
"""

from __future__ import annotations

from sdk.errors import InvalidInputError
from sdk.kind_registry import KindRegistry
from trainer.server.errors import UploadRejected
from trainer.server.kmeans_rounds import KMeansRoundKind
from trainer.server.mlp_rounds import MlpRoundKind
from trainer.server.round_kind import AcceptedUpload, ParsedUpload, ServerRoundKind
from trainer.server.validation import media_type

ROUTER_FAMILY = "router"

#: The server's round kinds.
REGISTRY: KindRegistry[ServerRoundKind] = KindRegistry("server", ServerRoundKind)


def register(kind: ServerRoundKind, *, replace: bool = False) -> ServerRoundKind:
    """Register a round kind (see :meth:`sdk.kind_registry.KindRegistry.register`).

    Raises
    ------
    InvalidInputError
        Not a :class:`ServerRoundKind`, a bad name, a name taken (without ``replace``), or a media
        type another kind already takes.
    """
    if isinstance(kind, ServerRoundKind):
        for other in REGISTRY.kinds(kind.family):
            shared = set(other.media_types) & set(kind.media_types)
            if other.name != kind.name and shared:
                raise InvalidInputError(f"round kind {kind.name!r}: media types {sorted(shared)} are {other.name!r}'s")
    return REGISTRY.register(kind, replace=replace)


def get(name: str, family: str = ROUTER_FAMILY) -> ServerRoundKind:
    """The round kind ``name``; :class:`~sdk.kind_registry.UnknownKindError` lists the valid ones."""
    return REGISTRY.get(family, name)


def names(family: str = ROUTER_FAMILY) -> tuple[str, ...]:
    """Registered round kind names, sorted."""
    return REGISTRY.names(family)


def unregister(name: str, family: str = ROUTER_FAMILY) -> None:
    """Remove a kind (tests)."""
    REGISTRY.unregister(family, name)


def for_media_type(content_type: str) -> ServerRoundKind:
    """The round kind whose uploads have this ``Content-Type``.

    Raises
    ------
    UploadRejected
        415 when no kind takes it (the message lists the accepted types).
    """
    media = media_type(content_type)
    accepted = []
    for family in REGISTRY.families():
        for kind in REGISTRY.kinds(family):
            if media in kind.media_types:
                return kind
            accepted.append(f"{' or '.join(kind.media_types)} ({kind.name})")
    raise UploadRejected(415, f"content type must be {', '.join(accepted)}, got {content_type!r}")


def parse_upload(raw: bytes, content_type: str) -> ParsedUpload:
    """Decode an upload with the kind its content type names.

    Raises
    ------
    UploadRejected
        415 another content type; 400 undecodable; 422 a malformed envelope.
    """
    kind = for_media_type(content_type)
    u = kind.parse(raw, content_type)
    return ParsedUpload(u.client_id, u.round_id, u.kind, u.content, u.raw, parsed_by=kind.name)


def validate_upload(upload: ParsedUpload, round_) -> AcceptedUpload:
    """Check a parsed upload against its round through the round's kind.

    Raises
    ------
    UploadRejected
        409 an update of another kind or base than the round's; 415 the round's kind takes another
        content type; 422 an invalid update.
    """
    if upload.kind != round_.kind:
        raise UploadRejected(409, f"round {round_.id} is a {round_.kind!r} round, got a {upload.kind!r} update")
    kind = get(round_.kind)
    if upload.parsed_by != kind.name:
        raise UploadRejected(415, f"round {round_.id} is a {round_.kind!r} round: its uploads are "
                                  f"{' or '.join(kind.media_types)}")
    return kind.validate(upload, round_)


for _kind in (KMeansRoundKind(), MlpRoundKind()):
    register(_kind)

__all__ = ["REGISTRY", "for_media_type", "get", "names", "parse_upload", "register", "unregister", "validate_upload"]
