"""Artefact kinds as plugins, the SDK side (ARCHITECTURE.md §9).

Every artefact that is trained, exported, shipped in a bundle and run on the device belongs to a
*family* (``router``, ``embedder``; ``selector`` and ``reward_scorer`` are added by their own
modules) and is of one *kind* in it (``router/kmeans``, ``router/mlp``, ``embedder/onnx``). Each
layer keeps one registry keyed by the same ``(family, kind)``, because dependencies run one way
(``export -> trainer -> sdk``, and ``sdk`` never imports the other two):

========================  ==================================================================
``sdk.kinds`` (here)      files a kind reads from a bundle, manifest checks, its runtime
                          (one interface per family: :class:`RouterScorer` for routers,
                          :class:`Embedder` for embedders) and its device round handler
``trainer.kinds``         its trainer (router class, local / federated fitting for the
                          simulation)
``trainer.server.``       its server round kind (open, describe, validate, aggregate,
``round_kinds``           publish), where it is federated over HTTPS (server extra)
``export.kinds``          its export step: bundle files, manifest fields, parity gate
========================  ==================================================================

Nothing outside the registries branches on a kind name: code asks the registry.

Manifest (format_version 1, unchanged for existing bundles): a bundle names the kind of each
artefact family it carries with a top-level ``"<family>_kind"`` key, e.g. ``"router_kind":
"kmeans"``. Every router bundle written so far is therefore already in this form. The embedder
family is the exception that keeps old bundles valid: without ``"embedder_kind"`` the embedder is
``"onnx"``. A bundle must carry at least one family other than the embedder. See
``docs/plugins.md`` for how to add a kind and :func:`manifest_kinds` for the reading rule.

A plugin module registers its kind once at import (``register(MyKind())``); tests that register
a toy kind remove it with :func:`unregister`. The SDK's own ``selector`` and ``reward_scorer``
families live in such modules (:data:`BUILTIN_FAMILY_MODULES`); the registry imports one the first
time a manifest or a look-up names its family, so loading a router imports neither.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sdk.artefact_kind import ArtefactKind, Embedder, LoadContext, RouterScorer
from sdk.builtin_kinds import BUILTIN_KINDS
from sdk.errors import BundleError, InvalidInputError
from sdk.kind_registry import KindRegistry, UnknownKindError
from sdk.static_embedder import StaticEmbedderKind

#: Families whose kind is named in the manifest; the embedder is the only one with a default.
EMBEDDER_FAMILY = "embedder"
ROUTER_FAMILY = "router"
#: Kind of the embedder of a bundle whose manifest has no ``embedder_kind`` (every bundle before §9).
DEFAULT_EMBEDDER_KIND = "onnx"


@dataclass(frozen=True)
class Family:
    """A family of artefacts: its ``name`` and the runtime ``interface`` (a ``Protocol``) its kinds
    return from :meth:`ArtefactKind.load`."""

    name: str
    interface: type
    #: Whether a bundle carrying this family also carries the query embedder and the model table
    #: (``embedder``, ``models``): routers do; a selector has its own backbone and no model table.
    needs_embedder: bool = True
    #: The public method that loads a bundle of this family (``"sdk.Router.load"``), named when a
    #: loader of another family is given such a bundle; None: :func:`load_artefact` is the way.
    loader: str | None = None


_FAMILIES: dict[str, Family] = {}
#: Families the SDK ships in modules that declare the family and register its kinds when imported
#: (as a third-party plugin module would); imported on first use by :func:`import_named_families`.
BUILTIN_FAMILY_MODULES: dict[str, str] = {"selector": "sdk.selector", "reward_scorer": "sdk.reward_scorer"}
#: The SDK layer's kinds.
REGISTRY: KindRegistry[ArtefactKind] = KindRegistry("sdk", ArtefactKind)


def register_family(name: str, interface: type, *, needs_embedder: bool = True, loader: str | None = None) -> Family:
    """Declare an artefact family (idempotent for the same interface).

    ``needs_embedder``: bundles carrying this family also carry ``embedder`` and ``models``
    (see :attr:`Family.needs_embedder`). ``loader``: the public method that loads its bundles, e.g.
    ``"sdk.Selector.load"`` (see :attr:`Family.loader`).

    Raises
    ------
    InvalidInputError
        ``name`` is not a lower-case identifier, or is registered with another interface.
    """
    if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
        raise InvalidInputError(f"family name must be a lower-case identifier, got {name!r}")
    if name in _FAMILIES and _FAMILIES[name].interface is not interface:
        raise InvalidInputError(f"family {name!r} is already registered with interface "
                                f"{_FAMILIES[name].interface.__name__}")
    _FAMILIES.setdefault(name, Family(name, interface, needs_embedder, loader))
    return _FAMILIES[name]


def _import_family(family: object) -> None:
    if isinstance(family, str) and family not in _FAMILIES and family in BUILTIN_FAMILY_MODULES:
        importlib.import_module(BUILTIN_FAMILY_MODULES[family])  # registers the family and its kinds


def import_named_families(manifest: object) -> None:
    """Import the module of each built-in family (:data:`BUILTIN_FAMILY_MODULES`) that ``manifest``
    names with a ``"<family>_kind"`` key and that is not declared yet; anything else is ignored."""
    if isinstance(manifest, Mapping):
        for key in manifest:
            if isinstance(key, str) and key.endswith("_kind"):
                _import_family(key[: -len("_kind")])


def register(kind: ArtefactKind, *, replace: bool = False) -> ArtefactKind:
    """Register an SDK kind (see :meth:`sdk.kind_registry.KindRegistry.register`).

    Raises
    ------
    UnknownKindError
        Its family is not declared (:func:`register_family`).
    InvalidInputError
        Not an :class:`ArtefactKind`, a bad name, or a name already taken (without ``replace``).
    """
    if isinstance(kind, ArtefactKind):
        _import_family(kind.family)
    if isinstance(kind, ArtefactKind) and kind.family not in _FAMILIES:
        raise UnknownKindError(f"unknown artefact family {kind.family!r}; registered: {sorted(_FAMILIES)}")
    return REGISTRY.register(kind, replace=replace)


def unregister(family: str, name: str) -> None:
    """Remove a registered kind (tests); unknown names are ignored."""
    REGISTRY.unregister(family, name)


def unregister_family(name: str) -> None:
    """Remove a family declared by :func:`register_family` and its kinds (tests: a toy family
    would otherwise stay declared for the rest of the process, and be listed in every message that
    lists the families); unknown names are ignored.

    Raises
    ------
    InvalidInputError
        ``name`` is one of the SDK's own families (router, embedder, selector, reward_scorer).
    """
    if name in (ROUTER_FAMILY, EMBEDDER_FAMILY, *BUILTIN_FAMILY_MODULES):
        raise InvalidInputError(f"family {name!r} is built in; it cannot be unregistered")
    for kind in REGISTRY.names(name):
        REGISTRY.unregister(name, kind)
    _FAMILIES.pop(name, None)


def get(family: str, name: str) -> ArtefactKind:
    """The registered SDK kind ``name`` of ``family``; :class:`UnknownKindError` lists the valid ones."""
    _import_family(family)
    return REGISTRY.get(family, name)


def names(family: str) -> tuple[str, ...]:
    """Registered kind names of ``family``, sorted."""
    _import_family(family)
    return REGISTRY.names(family)


def families() -> tuple[str, ...]:
    """Declared family names, sorted."""
    return tuple(sorted(_FAMILIES))


def manifest_key(family: str) -> str:
    """The manifest key naming the kind of ``family``: ``"<family>_kind"``."""
    return f"{family}_kind"


def manifest_kinds(manifest: Mapping) -> dict[str, str]:
    """``{family: kind}`` of every artefact the manifest carries (embedder included, ``"onnx"`` by
    default), without checking that the kinds are registered (see :func:`check_manifest_kinds`)."""
    import_named_families(manifest)
    out = {fam: manifest[manifest_key(fam)] for fam in _FAMILIES if manifest_key(fam) in manifest}
    if needs_embedder(manifest):
        out.setdefault(EMBEDDER_FAMILY, DEFAULT_EMBEDDER_KIND)
    return out


def needs_embedder(manifest: Mapping) -> bool:
    """True unless every declared family the manifest names has ``needs_embedder=False`` (a bundle
    naming no declared family, or only such families as routers, carries ``embedder`` and ``models``)."""
    import_named_families(manifest)
    named = [fam for fam in _FAMILIES if fam != EMBEDDER_FAMILY and manifest_key(fam) in manifest]
    return not named or any(_FAMILIES[fam].needs_embedder for fam in named) or manifest_key(EMBEDDER_FAMILY) in manifest


def check_manifest_kinds(manifest: Mapping) -> dict[str, ArtefactKind]:
    """The registered kinds of a manifest's artefacts, after their own manifest checks.

    Raises
    ------
    BundleError
        No artefact besides the embedder, an unknown kind (the message lists the registered ones),
        a file a kind needs that is not listed, or a kind's own :meth:`ArtefactKind.check_manifest`.
    """
    found = manifest_kinds(manifest)
    if set(found) == {EMBEDDER_FAMILY}:
        keys = [manifest_key(f) for f in sorted({*families(), *BUILTIN_FAMILY_MODULES}) if f != EMBEDDER_FAMILY]
        raise BundleError(f"manifest: names no artefact; expected one of {keys} (e.g. router_kind)")
    out = {}
    for family, name in found.items():
        try:
            kind = get(family, name)
        except UnknownKindError as exc:
            raise BundleError(f"manifest: {manifest_key(family)} {exc}") from None
        kind.check_manifest(dict(manifest))
        out[family] = kind
    return out


def carries_no(family: str, found: Mapping[str, str]) -> BundleError:
    """The error for a bundle that carries no ``family`` artefact: it names the families it carries
    (``found``, from :func:`manifest_kinds`) and the loader each declared (:attr:`Family.loader`)."""
    held = {f: k for f, k in found.items() if f != EMBEDDER_FAMILY}
    loaders = sorted({getattr(_FAMILIES.get(f), "loader", None) or "sdk.kinds.load_artefact" for f in held})
    hint = f"; load it with {' or '.join(loaders)}" if loaders else ""
    return BundleError(f"bundle carries no {family} (it carries {held}){hint}")


def load_artefact(family: str, manifest: dict, files: Mapping[str, bytes], *, options=None,
                  precision: str = "fp32", paths: Mapping[str, Any] | None = None) -> Any:
    """Load the ``family`` artefact of a verified bundle through its kind (``paths``: the verified
    files opened by path, see :attr:`LoadContext.paths`).

    Raises
    ------
    BundleError
        The bundle carries no artefact of ``family``, or the kind's loader refuses the files.
    """
    kinds = manifest_kinds(manifest)
    if family not in kinds:
        raise carries_no(family, kinds)
    kind = get(family, kinds[family])
    runtime = kind.load(LoadContext(manifest, files, tuple(m["id"] for m in manifest.get("models", ())),
                                    manifest.get("embedder", {}), options, precision, dict(paths or {})))
    interface = _FAMILIES[family].interface
    if not isinstance(runtime, interface):
        raise BundleError(f"{family} kind {kind.name!r} loaded a {type(runtime).__name__}, which lacks the "
                          f"{interface.__name__} interface")
    return runtime


# -- the built-in kinds ------------------------------------------------------------------------

register_family(ROUTER_FAMILY, RouterScorer, loader="sdk.Router.load")
register_family(EMBEDDER_FAMILY, Embedder)

for _kind in BUILTIN_KINDS:
    register(_kind)
register(StaticEmbedderKind())  # embedder/static (model2vec table), sdk/static_embedder.py


__all__ = ["ArtefactKind", "Embedder", "Family", "LoadContext", "RouterScorer", "UnknownKindError", "carries_no",
           "check_manifest_kinds",
           "REGISTRY", "families", "get", "import_named_families", "load_artefact", "manifest_key", "manifest_kinds", "names", "needs_embedder", "register",
           "register_family", "unregister", "unregister_family"]
