"""One registry class for artefact kinds, instantiated once per layer: ``sdk.kinds`` (device runtime),
``trainer.kinds`` (trainer, server round kind) and ``export.kinds`` (export step), keyed by the same
``(family, kind name)`` (ARCHITECTURE.md §9)."""

from __future__ import annotations

from typing import Generic, TypeVar

from sdk.errors import InvalidInputError

K = TypeVar("K")


class UnknownKindError(InvalidInputError):
    """A family or kind that is not registered; the message lists the registered ones."""


class KindRegistry(Generic[K]):
    """Kinds of one ``layer`` (named in messages): ``(family, name) -> kind``, each an instance of ``base`` with
    lower-case identifier attributes ``family`` and ``name``."""

    def __init__(self, layer: str, base: type) -> None:
        self.layer = layer
        self.base = base
        self._kinds: dict[str, dict[str, K]] = {}

    def register(self, kind: K, *, replace: bool = False) -> K:
        """Register ``kind`` under ``(kind.family, kind.name)`` and return it.

        Raises
        ------
        InvalidInputError
            ``kind`` is not a ``base``, a name is not a lower-case identifier, or it is taken (without ``replace``).
        """
        family, name = getattr(kind, "family", None), getattr(kind, "name", None)
        bad = [f"{what} must be a lower-case identifier, got {value!r}" for what, value in (("family", family),
               ("kind name", name)) if not isinstance(value, str) or not value.isidentifier() or value != value.lower()]
        if bad or not isinstance(kind, self.base) or (name in self._kinds.get(str(family), {}) and not replace):
            raise InvalidInputError(bad[0] if bad else f"{self.layer}: {family} kind {name!r} is not a "
                                    f"{self.base.__name__} or is already registered")
        self._kinds.setdefault(str(family), {})[str(name)] = kind
        return kind

    def unregister(self, family: str, name: str) -> None:
        """Remove a kind (tests); unknown names are ignored."""
        self._kinds.get(family, {}).pop(name, None)

    def get(self, family: str, name: str) -> K:
        """The kind ``name`` of ``family``. Raises :class:`UnknownKindError` listing the registered ones."""
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
