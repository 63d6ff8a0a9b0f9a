"""One registry class for artefact kinds, instantiated once per layer (ARCHITECTURE.md §9).

``sdk.kinds`` (device runtime), ``trainer.kinds`` (trainer and server round kind) and
``export.kinds`` (export step) each hold one :class:`KindRegistry`, keyed by the same
``(family, kind name)``; dependencies run one way, so each layer registers what it owns.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from sdk.errors import InvalidInputError

K = TypeVar("K")


class UnknownKindError(InvalidInputError):
    """A family or kind that is not registered; the message lists the registered ones."""


def _check_name(what: str, name: object) -> str:
    if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
        raise InvalidInputError(f"{what} must be a lower-case identifier, got {name!r}")
    return name


class KindRegistry(Generic[K]):
    """Kinds of one layer: ``(family, name) -> kind object``.

    Parameters
    ----------
    layer : str, for messages (``"sdk"``, ``"trainer"``, ``"export"``).
    base : the class every registered kind must be an instance of.

    A kind object has the attributes ``family`` and ``name`` (lower-case identifiers).
    """

    def __init__(self, layer: str, base: type) -> None:
        self.layer = layer
        self.base = base
        self._kinds: dict[str, dict[str, K]] = {}

    def register(self, kind: K, *, replace: bool = False) -> K:
        """Register ``kind`` under ``(kind.family, kind.name)`` and return it (usable as a class
        decorator's inner call: ``register(MyKind())``).

        Raises
        ------
        InvalidInputError
            ``kind`` is not an instance of ``base``, a name is not a lower-case identifier, or the
            name is taken and ``replace`` is False.
        """
        if not isinstance(kind, self.base):
            raise InvalidInputError(f"{self.layer} kinds must be {self.base.__name__} instances, got {type(kind).__name__}")
        family = _check_name("family", getattr(kind, "family", None))
        name = _check_name("kind name", getattr(kind, "name", None))
        by_name = self._kinds.setdefault(family, {})
        if name in by_name and not replace:
            raise InvalidInputError(f"{self.layer}: {family} kind {name!r} is already registered")
        by_name[name] = kind
        return kind

    def unregister(self, family: str, name: str) -> None:
        """Remove a kind (tests); unknown names are ignored."""
        self._kinds.get(family, {}).pop(name, None)

    def get(self, family: str, name: str) -> K:
        """The kind ``name`` of ``family``.

        Raises
        ------
        UnknownKindError
            Not registered; the message lists the registered kinds of the family.
        """
        try:
            return self._kinds[family][name]
        except (KeyError, TypeError):
            known = sorted(self._kinds.get(family, {})) if isinstance(family, str) else []
            raise UnknownKindError(f"unknown {family} kind {name!r}; valid: {known}") from None

    def names(self, family: str) -> tuple[str, ...]:
        """Registered kind names of ``family``, sorted (empty for an unknown family)."""
        return tuple(sorted(self._kinds.get(family, {})))

    def kinds(self, family: str) -> tuple[K, ...]:
        """Registered kinds of ``family``, in registration order."""
        return tuple(self._kinds.get(family, {}).values())

    def families(self) -> tuple[str, ...]:
        """Families with at least one registered kind, sorted."""
        return tuple(sorted(f for f, ks in self._kinds.items() if ks))
