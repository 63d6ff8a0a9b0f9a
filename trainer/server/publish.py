"""Publish the router of a closed round as a new signed bundle (through :mod:`export`).

The embedder of a federated round is the one of the bundle the round started from (the centroids and
the MLP's inputs live in its space), so the new bundle reuses that bundle's verified tokenizer and
embedder files byte for byte and replaces the router file (``kmeans.npz`` by
:func:`export.router_export.kmeans_to_npz`, ``router.onnx`` by :func:`~export.router_export.mlp_to_onnx`).
The manifest is rebuilt, version bumped, and signed by :func:`export.bundle_writer.write_bundle`.
The old bundle's ``parity.json`` is dropped: it measured the previous router. No embedder export,
no torch: publishing takes about as long as copying the embedder files.
"""

from __future__ import annotations

from pathlib import Path

from export.bundle_writer import next_bundle_version, write_bundle
from export import kinds as export_kinds
from export.signing import load_signing_key
from sdk import bundle_manifest as fmt
from sdk.cell_statistics import CellStatistics
from trainer.routers.kmeans_router import KMeansRouter

KMEANS_FILE = "kmeans.npz"
_WRITER_FIELDS = {"format_version", "created_utc", "files", "signature"}


class PublishRefused(Exception):
    """The aggregate is not published (the message says why); the round's aggregate is still stored."""
PARITY_FILE = "parity.json"


def read_base_bundle(bundle_dir: Path, public_key) -> fmt.VerifiedBundle:
    """The verified K-means bundle at ``bundle_dir`` (all files).

    Raises
    ------
    BundleError
        The bundle does not verify or is not a K-means bundle.
    """
    from sdk.errors import BundleError

    bundle = fmt.read_verified(bundle_dir, public_key)
    if bundle.manifest["router_kind"] != "kmeans":
        raise BundleError(f"{bundle_dir} holds a {bundle.manifest['router_kind']!r} bundle; federated rounds "
                          "over HTTPS start from a K-means bundle")
    return bundle


def publish_router(bundle_dir: Path, signing_key: Path, router, provenance: dict, embedder: dict | None = None,
                   base: fmt.VerifiedBundle | None = None) -> dict:
    """Write a new version of the bundle at ``bundle_dir`` with ``router`` (a trainer
    :class:`~trainer.routers.kmeans_router.KMeansRouter` or :class:`~trainer.routers.mlp_router.MLPRouter`
    of the bundle's kind and models) in place of its router file; return the signed manifest.

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
    if manifest["router_kind"] != router.kind:
        raise PublishRefused(f"{bundle_dir} holds a {manifest['router_kind']!r} bundle, the round a {router.kind!r} router")
    if [m["id"] for m in manifest["models"]] != list(router.models):
        raise PublishRefused(f"{bundle_dir} lists other models than the round's router")
    if embedder is not None and (manifest["embedder"]["name"], int(manifest["embedder"]["dim"])) != (
            embedder["name"], int(embedder["dim"])):
        raise PublishRefused(f"{bundle_dir} now holds embedder {manifest['embedder']['name']!r}; the round was opened "
                          f"on {embedder['name']!r}: its router does not fit that bundle")
    if provenance.get("round_uid") and (manifest.get("provenance") or {}).get("round_uid") == provenance["round_uid"]:
        return manifest
    router.embedder = {"name": manifest["embedder"]["name"], "dim": int(manifest["embedder"]["dim"])}
    files = {name: data for name, data in base.files.items() if name != PARITY_FILE}
    kind = export_kinds.get(router.kind)
    files.update(kind.files(router))
    fields = {k: v for k, v in manifest.items() if k not in _WRITER_FIELDS}
    fields.update(kind.manifest_fields(router))
    fields["bundle_version"] = next_bundle_version(Path(bundle_dir))
    fields["models"] = [{**m, "mean_cost_usd": cost} for m, cost in zip(manifest["models"], kind.mean_costs(router))]
    fields["provenance"] = provenance
    return write_bundle(Path(bundle_dir), files, fields, key)


def publish_kmeans(
    bundle_dir: Path,
    signing_key: Path,
    centroids,
    statistics: CellStatistics,
    *,
    prior_strength: float,
    model_prior_strength: float,
    prior: str,
    provenance: dict,
    embedder: dict | None = None,
    min_total_count: float = 1,
) -> dict:
    """:func:`publish_router` of the K-means router built from ``statistics`` over ``centroids``.

    Refused (:class:`PublishRefused`) when the statistics hold fewer than ``min_total_count``
    evaluations, or no evaluation of a model that the current bundle has data for: devices would
    stop routing to that model for good (it would never be chosen, so never observed again).

    Parameters
    ----------
    centroids : ndarray of shape (n_cells, d_emb), float32, the round's partition.
    statistics : merged CellStatistics of shape (n_cells, n_models).
    prior_strength, model_prior_strength, prior : shrinkage of the cell means
        (:meth:`sdk.CellStatistics.means`).
    provenance : JSON-able facts recorded in the manifest (round id, clients).
    """
    import io

    import numpy as np

    key = load_signing_key(signing_key)
    base = read_base_bundle(bundle_dir, key.public_key())
    models = [m["id"] for m in base.manifest["models"]]
    total = float(statistics.count.sum())
    if total < min_total_count:
        raise PublishRefused(f"{total:.0f} evaluations, below min_total_count={min_total_count:g}")
    with np.load(io.BytesIO(base.files[KMEANS_FILE]), allow_pickle=False) as z:
        had = z["count"].sum(axis=0) > 0
    lost = [m for m, h, n in zip(models, had, statistics.count.sum(axis=0)) if h and n == 0]
    if lost:
        raise PublishRefused(f"no evaluation of {lost} (the current bundle has some): open the round with the "
                             "shipped statistics merged in (--prior-router) or wait for more clients")
    router = KMeansRouter(centroids, statistics, models, prior_strength, model_prior_strength, prior)
    return publish_router(bundle_dir, signing_key, router, provenance, embedder, base=base)
