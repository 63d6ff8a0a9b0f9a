"""Publish the router of a closed federated round as a new signed bundle.

The embedder of a federated round is the one of the bundle the round started from (the centroids and
the MLP's inputs live in its space), so the new bundle reuses that bundle's verified tokenizer and
embedder files byte for byte and replaces the router file through the router's export kind
(:mod:`export.kinds`: ``kmeans.npz``, ``router.onnx``). The manifest is rebuilt, version bumped, and
signed by :func:`export.bundle_writer.write_bundle`. The old bundle's ``parity.json`` is dropped: it
measured the previous router. No embedder export, no torch for K-means: publishing takes about as
long as copying the embedder files.

The aggregation server never imports this module: the console-script module (``trainer/cli.py``)
hands it a :class:`BundlePublisher` (ARCHITECTURE.md §2).
"""

from __future__ import annotations

from pathlib import Path

from export import kinds as export_kinds
from export.bundle_writer import PARITY_FILE, next_bundle_version, write_bundle
from export.signing import load_signing_key
from sdk import bundle_manifest as fmt
from sdk import kinds as sdk_kinds
from trainer.server.errors import PublishRefused

_WRITER_FIELDS = {"format_version", "created_utc", "files", "signature"}


def publish_router(bundle_dir: Path, signing_key: Path, router, provenance: dict, embedder: dict | None = None,
                   base: fmt.VerifiedBundle | None = None) -> dict:
    """Write a new version of the bundle at ``bundle_dir`` with ``router`` (a trainer router of the
    bundle's kind and models, e.g. :class:`~trainer.routers.kmeans_router.KMeansRouter`) in place of
    its router file; return the signed manifest.

    Idempotent per round: if the bundle at ``bundle_dir`` already comes from the round
    ``provenance["round_uid"]`` (a closer that crashed after publishing), its manifest is returned
    and nothing is written. ``embedder`` (name, dim), when given, must be the bundle's: the
    round's centroids and inputs live in that embedder's space. ``base``, when given, is the bundle
    at ``bundle_dir`` already read and verified with the signing key's public key (not read again).

    Raises
    ------
    BundleError
        The current bundle does not verify with the signing key's public key.
    PublishRefused
        It is of another router kind, lists other models, or has another embedder than ``embedder``
        (the bundle changed since the round opened; the aggregate is kept, not published).
    ExportError
        The key is unreadable or the bundle cannot be written.
    """
    key = load_signing_key(signing_key)
    if base is None:
        base = fmt.read_verified(bundle_dir, key.public_key())
    manifest = base.manifest
    held = sdk_kinds.manifest_kinds(manifest).get(sdk_kinds.ROUTER_FAMILY)
    if held != router.kind:
        raise PublishRefused(f"{bundle_dir} holds a {held!r} bundle, the round a {router.kind!r} router")
    if [m["id"] for m in manifest["models"]] != list(router.models):
        raise PublishRefused(f"{bundle_dir} lists other models than the round's router")
    if embedder is not None and (manifest["embedder"]["name"], int(manifest["embedder"]["dim"])) != (
            embedder["name"], int(embedder["dim"])):
        raise PublishRefused(f"{bundle_dir} now holds embedder {manifest['embedder']['name']!r}; the round was opened "
                             f"on {embedder['name']!r}: its router does not fit that bundle")
    if provenance.get("round_uid") and (manifest.get("provenance") or {}).get("round_uid") == provenance["round_uid"]:
        return manifest
    router.embedder = {"name": manifest["embedder"]["name"], "dim": int(manifest["embedder"]["dim"])}
    kind = export_kinds.get(router.kind)
    files = {name: data for name, data in base.files.items() if name != PARITY_FILE}
    files.update(kind.files(router))
    fields = {k: v for k, v in manifest.items() if k not in _WRITER_FIELDS}
    fields.update(kind.manifest_fields(router))
    fields["bundle_version"] = next_bundle_version(Path(bundle_dir))
    fields["models"] = [{**m, "mean_cost_usd": cost} for m, cost in zip(manifest["models"], kind.mean_costs(router))]
    fields["provenance"] = provenance
    return write_bundle(Path(bundle_dir), files, fields, key)


class BundlePublisher:
    """The :class:`trainer.server.round_kind.Publisher` the console-script module hands the server."""

    def public_key(self, signing_key: Path):
        """The public key of ``signing_key`` (ExportError if unreadable)."""
        return load_signing_key(signing_key).public_key()

    def publish(self, bundle_dir: Path, signing_key: Path, router, provenance: dict, embedder: dict | None = None,
                base: fmt.VerifiedBundle | None = None) -> dict:
        """:func:`publish_router`."""
        return publish_router(bundle_dir, signing_key, router, provenance, embedder, base)
