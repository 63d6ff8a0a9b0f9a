"""Artefact kinds as plugins, the SDK side, and the one bundle loader (ARCHITECTURE.md §9, docs/plugins.md).

Every artefact shipped in a bundle belongs to a *family* (``router``, ``embedder``; ``selector``,
``reward_scorer`` and ``personal_reward`` are declared by their own modules, imported when a manifest names them) and is of one
*kind* in it, named in the manifest by a top-level ``"<family>_kind"`` key (an embedder without ``embedder_kind`` is
``"onnx"``). ``sdk.kinds``, ``trainer.kinds`` and ``export.kinds`` each keep one registry keyed by the same
``(family, kind)``; nothing outside the registries branches on a kind name.

:func:`load_bundle` is the loader of every family: verify (signature, format, kinds) -> plan (the kinds name
the files of the chosen precision) -> read (sha256-checked; files of >= 1 MiB on a worker thread, awaited at first
use) -> load (each kind's runtime).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from sdk import bundle_manifest as fmt
from sdk.artefact_kind import ArtefactKind, Embedder, LoadContext, RouterScorer
from sdk.builtin_kinds import BUILTIN_KINDS
from sdk.embedder import SessionThreads
from sdk.errors import BundleError, InvalidInputError
from sdk.kind_registry import KindRegistry, UnknownKindError
from sdk.static_embedder import StaticEmbedderKind

EMBEDDER_FAMILY = "embedder"
ROUTER_FAMILY = "router"
#: Kind of the embedder of a bundle whose manifest has no ``embedder_kind``.
DEFAULT_EMBEDDER_KIND = "onnx"
#: :func:`load_bundle` reads and hashes used files of at least this many bytes (a static table) on a worker thread
#: while the kinds build the rest (the tokenizer): wall time saved where a second core is free (docs/benchmarks.md).
BACKGROUND_BYTES = 1 << 20


@dataclass(frozen=True)
class Family:
    """A family: its runtime ``interface`` (a ``Protocol``); whether its bundles also carry the query embedder
    and model table (``needs_embedder``); the public method that loads them (``loader``, named in errors)."""

    name: str
    interface: type
    needs_embedder: bool = True
    loader: str | None = None


@dataclass(frozen=True)
class LoadedBundle:
    """What :func:`load_bundle` returns: the verified manifest, the precision loaded, family -> runtime."""

    manifest: dict[str, Any]
    precision: str
    runtimes: dict[str, Any]


class _Files(dict[str, bytes]):
    """Verified bytes by file name; a file read and hashed on a worker is waited for at its first lookup, which
    raises its BundleError: no byte of it is used before its sha256 matched the manifest."""

    def __init__(self, files: dict[str, bytes], pending: dict[str, Future[fmt.VerifiedBundle]]) -> None:
        super().__init__(files)
        self.pending = pending

    def __missing__(self, name: str) -> bytes:
        self[name] = self.pending[name].result().files[name]
        return self[name]


_FAMILIES: dict[str, Family] = {}
#: Families the SDK declares in their own modules, imported on first use (as a plugin module would be).
BUILTIN_FAMILY_MODULES: dict[str, str] = {"selector": "sdk.selector", "reward_scorer": "sdk.reward_scorer",
                                          "personal_reward": "sdk.personal_reward"}
REGISTRY: KindRegistry[ArtefactKind] = KindRegistry("sdk", ArtefactKind)


def register_family(name: str, interface: type, *, needs_embedder: bool = True, loader: str | None = None) -> Family:
    """Declare an artefact family (idempotent for the same interface). Raises InvalidInputError for a name that is
    not a lower-case identifier or is registered with another interface."""
    if not name.isidentifier() or name != name.lower() or _FAMILIES.get(name, Family(name, interface)).interface \
            is not interface:
        raise InvalidInputError(f"family name must be a new lower-case identifier, got {name!r}")
    return _FAMILIES.setdefault(name, Family(name, interface, needs_embedder, loader))


def _import_family(family: str) -> None:
    if family not in _FAMILIES and family in BUILTIN_FAMILY_MODULES:
        importlib.import_module(BUILTIN_FAMILY_MODULES[family])  # registers the family and its kinds


def register(kind: ArtefactKind, *, replace: bool = False) -> ArtefactKind:
    """Register an SDK kind (:meth:`sdk.kind_registry.KindRegistry.register`). Raises UnknownKindError for an
    undeclared family, InvalidInputError for a kind that is not an :class:`ArtefactKind`, a bad or taken name."""
    _import_family(getattr(kind, "family", ""))
    if getattr(kind, "family", None) not in _FAMILIES:
        raise UnknownKindError(f"unknown artefact family {getattr(kind, 'family', None)!r}; registered: "
                               f"{sorted(_FAMILIES)}")
    return REGISTRY.register(kind, replace=replace)


def unregister(family: str, name: str) -> None:
    """Remove a registered kind (tests); unknown names are ignored."""
    REGISTRY.unregister(family, name)


def unregister_family(name: str) -> None:
    """Remove a family and its kinds (tests); unknown names are ignored. Raises InvalidInputError for a built-in one."""
    if name in (ROUTER_FAMILY, EMBEDDER_FAMILY, *BUILTIN_FAMILY_MODULES):
        raise InvalidInputError(f"family {name!r} is built in; it cannot be unregistered")
    for kind in REGISTRY.names(name):
        REGISTRY.unregister(name, kind)
    _FAMILIES.pop(name, None)


def get(family: str, name: str) -> ArtefactKind:
    """The registered kind ``name`` of ``family``; :class:`UnknownKindError` lists the valid ones."""
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


def manifest_kinds(manifest: Mapping[str, Any]) -> dict[str, str]:
    """``{family: kind name}`` of every artefact the manifest names (the embedder ``"onnx"`` by default)."""
    for key in manifest:
        if isinstance(key, str) and key.endswith("_kind"):
            _import_family(key[: -len("_kind")])
    out = {fam: manifest[manifest_key(fam)] for fam in _FAMILIES if manifest_key(fam) in manifest}
    if needs_embedder(manifest):
        out.setdefault(EMBEDDER_FAMILY, DEFAULT_EMBEDDER_KIND)
    return out


def needs_embedder(manifest: Mapping[str, Any]) -> bool:
    """True unless every declared family the manifest names (the embedder aside) has ``needs_embedder=False``."""
    named = [fam for fam in _FAMILIES if fam != EMBEDDER_FAMILY and manifest_key(fam) in manifest]
    return not named or any(_FAMILIES[fam].needs_embedder for fam in named) or manifest_key(EMBEDDER_FAMILY) in manifest


def check_manifest_kinds(manifest: dict[str, Any]) -> dict[str, ArtefactKind]:
    """The registered kinds of a (format-checked) manifest's artefacts, after their own manifest checks.

    Raises
    ------
    BundleError
        No artefact besides the embedder, an unknown kind (the message lists the registered ones), the embedder
        or model table missing where the family needs them, or a kind's :meth:`ArtefactKind.check_manifest`.
    """
    found = manifest_kinds(manifest)
    if set(found) == {EMBEDDER_FAMILY}:
        keys = [manifest_key(f) for f in sorted({*families(), *BUILTIN_FAMILY_MODULES}) if f != EMBEDDER_FAMILY]
        raise BundleError(f"manifest: names no artefact; expected one of {keys} (e.g. router_kind)")
    fmt.need(EMBEDDER_FAMILY not in found or isinstance(manifest.get("embedder"), dict), "embedder must be an object")
    fmt.need(ROUTER_FAMILY not in found or manifest.get("models"), "models must be a non-empty list of objects")
    out = {}
    for family, name in found.items():
        try:
            out[family] = get(family, name)
        except UnknownKindError as exc:
            raise BundleError(f"manifest: {manifest_key(family)} {exc}") from None
        out[family].check_manifest(manifest)
    return out


def carries_no(family: str, found: Mapping[str, str]) -> BundleError:
    """The error for a bundle carrying no ``family`` artefact: it names what it carries and their loaders."""
    held = {f: k for f, k in found.items() if f != EMBEDDER_FAMILY}
    loaders = sorted({getattr(_FAMILIES.get(f), "loader", None) or "sdk.kinds.load_bundle" for f in held})
    hint = f"; load it with {' or '.join(loaders)}" if loaders else ""
    return BundleError(f"bundle carries no {family} (it carries {held}){hint}")


def load_artefact(family: str, manifest: dict[str, Any], files: Mapping[str, bytes], *,
                  options: SessionThreads | None = None, precision: str = "fp32",
                  paths: Mapping[str, Any] | None = None) -> Any:
    """The ``family`` runtime of a verified bundle, loaded by its kind (``paths``: files opened by path). Raises
    BundleError when the bundle carries no ``family`` artefact or the kind refuses its files."""
    found = manifest_kinds(manifest)
    if family not in found:
        raise carries_no(family, found)
    kind = get(family, found[family])
    runtime = kind.load(LoadContext(manifest, files, tuple(m["id"] for m in manifest.get("models", ())),
                                    manifest.get("embedder", {}), options, precision, dict(paths or {})))
    if not isinstance(runtime, _FAMILIES[family].interface):
        raise BundleError(f"{family} kind {kind.name!r} loaded a {type(runtime).__name__}, which lacks the "
                          f"{_FAMILIES[family].interface.__name__} interface")
    return runtime


def load_bundle(bundle_dir: str | os.PathLike[str], public_key: fmt.PublicKey, family: str, *,
                precision: str = "auto", preference: Sequence[str] = ("fp32",), intra_op_threads: int = 1,
                inter_op_threads: int = 1, min_bundle_version: int = 1) -> LoadedBundle:
    """Verify and load the ``family`` artefact (and the query embedder, where the family needs it) of a bundle.

    ``precision``: one of ``preference`` (the precisions this family's loader offers, preferred first), or
    ``"auto"``: the first of them the bundle ships. Verification covers the signature, the schema and the sha256
    of every file loaded; the other precisions' files are checked at install (:mod:`sdk.sync`) and by
    :func:`sdk.bundle_manifest.verify_all`.

    Raises
    ------
    BundleError
        Signature, schema or a used file's sha256 does not verify, a file is missing or unloadable, the bundle
        carries no ``family`` artefact, lacks the precision, or is older than ``min_bundle_version``.
    InvalidInputError
        ``precision``, a thread count or ``min_bundle_version`` is not valid.
    """
    options = SessionThreads(intra_op_threads, inter_op_threads)
    for param, value, accepted, what in (
            ("precision", precision, precision == "auto" or precision in preference, f"'auto' or one of {sorted(preference)}"),
            ("min_bundle_version", min_bundle_version, not isinstance(min_bundle_version, bool)
             and isinstance(min_bundle_version, int), "an int")):
        if not accepted:
            raise InvalidInputError(f"{param} must be {what}, got {value!r:.80}", param=param)
    directory, manifest = fmt.read_manifest(bundle_dir, public_key)  # verify
    found = check_manifest_kinds(manifest)
    if manifest["bundle_version"] < min_bundle_version:
        raise BundleError(f"bundle version {manifest['bundle_version']} is older than min_bundle_version "
                          f"{min_bundle_version} (a superseded bundle)")
    if family not in found:
        raise carries_no(family, {f: k.name for f, k in found.items()})
    used = {f: found[f] for f in (EMBEDDER_FAMILY, family) if f in found}  # plan
    first = next(iter(used))
    available = used[first].precisions(manifest)
    want = next((p for p in preference if p in available), preference[-1]) if precision == "auto" else precision
    if want not in available:
        raise BundleError(f"bundle has no {want} {first} (it has {sorted(available)})")
    wanted = {name for kind in used.values() for name in kind.files(manifest, want)}
    by_path = [name for kind in used.values() for name in kind.path_files(manifest, want)]
    try:
        sizes = {e.name: e.stat(follow_symlinks=False).st_size for e in os.scandir(directory)}
    except OSError:  # the folder went (a newer install): read_files says so
        sizes = {}
    large = {name for name in wanted if sizes.get(name, 0) >= BACKGROUND_BYTES}
    with ThreadPoolExecutor(1) as pool:  # read: the large files on a worker, the rest here
        pending = {name: pool.submit(fmt.read_files, directory, manifest, [name], verify_unused=False)
                   for name in large}
        with fmt.read_files(directory, manifest, wanted - large, by_path, verify_unused=False) as bundle:
            files = _Files(bundle.files, pending)
            runtimes = {f: load_artefact(f, manifest, files, options=options, precision=want, paths=bundle.opened)
                        for f in used}  # load
            for name in large:
                files[name]  # a used file no kind looked up is refused all the same if it does not verify
    return LoadedBundle(manifest, want, runtimes)


register_family(ROUTER_FAMILY, RouterScorer, loader="sdk.Router.load")
register_family(EMBEDDER_FAMILY, Embedder)
for _kind in (*BUILTIN_KINDS, StaticEmbedderKind()):
    register(_kind)

__all__ = ["ArtefactKind", "Embedder", "Family", "LoadContext", "LoadedBundle", "RouterScorer", "UnknownKindError",
           "carries_no", "check_manifest_kinds", "REGISTRY", "families", "get", "load_artefact", "load_bundle",
           "manifest_key", "manifest_kinds", "names", "needs_embedder", "register", "register_family", "unregister",
           "unregister_family"]
