"""``fedroute export``: trained router -> signed, parity-checked bundle.

Steps: load the router and the signing key; build the router's embedder through its embedder kind
(:mod:`export.embedder_export`: ONNX (and int8) for a sentence-transformer, the model2vec table
(and int8) for ``static``); write
the router file; stage a signed bundle and load it with the SDK exactly as an app would; check
parity against the trainer on real RouterBench test prompts (:mod:`export.parity`); then write the
final bundle, with the parity figures in its signed ``parity.json``. A failed check raises
:class:`~export.errors.ParityError` and writes nothing at ``out``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from export import kinds as export_kinds
from export.bundle_writer import check_replaceable, check_version, next_bundle_version, write_bundle, write_checked_bundle
from export.embedder_export import BundleEmbedder, check_quantised, onnx_embedder
from export.embedder_onnx import ExportedEmbedder
from export.errors import ExportError
from export.scratch_folder import scratch_folder
from export.signing import load_signing_key
from sdk import kinds as sdk_kinds
from sdk.errors import FedrouteError
from sdk.real_numbers import finite_float
from trainer.embeddings import EmbedderConfig, embed_texts
from trainer.kinds import load_router



@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_bundle` wrote: ``manifest`` (dict) and the ``parity`` report (dict)."""

    out: Path
    manifest: dict
    parity: dict


def check_prices(prices: dict, models) -> dict[str, tuple[float | None, float | None]]:
    """Validate ``{model: (USD per 1k input tokens, USD per 1k output tokens)}``; None = unknown.

    Prices are the app's list prices, written to the manifest for its own cost accounting; the
    router's decisions use its predicted cost per query, not these.

    Raises
    ------
    ExportError
        A model the router does not have, or a price that is not a finite number >= 0 or None.
    """
    unknown = sorted(set(prices) - set(models))
    if unknown:
        raise ExportError(f"prices name models the router does not have: {unknown}")
    out = {}
    for model, pair in prices.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ExportError(f"prices[{model!r}] must be (input, output) USD per 1k tokens, got {pair!r}")
        for side, value in zip(("input", "output"), pair):
            usd = finite_float(value)
            if value is not None and (usd is None or usd < 0):
                raise ExportError(f"prices[{model!r}].{side} must be a number >= 0 (USD per 1k tokens) or null, got {value!r}")
        out[model] = (None if pair[0] is None else float(pair[0]), None if pair[1] is None else float(pair[1]))
    return out


def _embedder_config(emb: dict, router_dir: Path) -> EmbedderConfig:
    """The trainer's embedder settings from ``router.json``'s ``embedder`` entry; ExportError naming a bad value."""
    where = f"{router_dir}/router.json"
    name, max_tokens, side = emb["name"], emb.get("max_tokens", 256), emb.get("truncation_side", "left")
    if not isinstance(name, str) or not name.strip():
        raise ExportError(f"{where}: embedder.name must name the embedder the router was trained on, got {name!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 8:
        raise ExportError(f"{where}: embedder.max_tokens must be an integer >= 8, got {max_tokens!r}")
    if side not in ("left", "right"):
        raise ExportError(f"{where}: embedder.truncation_side must be 'left' or 'right', got {side!r}")
    return EmbedderConfig(model=name, max_tokens=max_tokens, truncation_side=side)


def _load_test_table(router, data: Path | None):
    from trainer.data.routerbench import load_eval_file, load_routerbench_dir  # pandas, on use

    if data is not None:
        data = Path(data)
        if not data.exists():
            raise ExportError(f"--data {data} does not exist (give a RouterBench folder or a test file)")
        table = load_routerbench_dir(data)[1] if data.is_dir() else load_eval_file(data)
    else:
        source = (getattr(router, "provenance", None) or {}).get("test")
        if not source or not Path(source).exists():
            raise ExportError("parity needs real test prompts: pass --data (RouterBench dir or test file); "
                              f"router.json names {source!r}")
        table = load_eval_file(source)
    return table.complete_rows()


def assemble(router, exported: ExportedEmbedder, quantised: Mapping[str, Path] | Path | None, embedder_name: str,
             max_tokens: int, truncation_side: str, prices: dict[str, tuple[float | None, float | None]],
             bundle_version: int) -> tuple[dict[str, bytes], dict]:
    """:func:`assemble_bundle` with an ONNX embedder exported by optimum and its quantised variants
    (precision -> ONNX file, e.g. ``{"int8": ..., "int8-all": ...}``; a single path means ``int8``)."""
    embedder = onnx_embedder(exported, quantised, embedder_name, max_tokens, truncation_side)
    return assemble_bundle(router, embedder, prices, bundle_version)


def assemble_bundle(router, embedder: BundleEmbedder, prices: dict[str, tuple[float | None, float | None]],
                    bundle_version: int) -> tuple[dict[str, bytes], dict]:
    """The bundle's files and manifest fields (before signing) for ``router`` and a bundle embedder
    of any registered embedder kind (:mod:`export.embedder_export`).

    Returns
    -------
    (files: name -> bytes, fields: manifest fields without format_version/created_utc/files/signature)

    Raises
    ------
    ExportError
        Prices for models the router does not have, a bundle_version < 1, or an embedder whose
        dimension is not the router's input dimension.
    """
    if embedder.dim != router.d_emb:
        raise ExportError(f"embedder {embedder.entry['name']} has dim {embedder.dim}, the router expects {router.d_emb}")
    if bundle_version < 1:
        raise ExportError(f"bundle_version must be >= 1, got {bundle_version}")
    prices = check_prices(prices, router.models)
    files = dict(embedder.files)
    kind = export_kinds.get(router.kind)
    files.update(kind.files(router))
    embedder_kind = export_kinds.get(embedder.kind, family="embedder")
    fields = {
        "bundle_version": int(bundle_version),
        **kind.manifest_fields(router),
        **embedder_kind.manifest_fields(embedder),
        "models": [
            {"id": m, "price_per_1k_input_usd": prices.get(m, (None, None))[0],
             "price_per_1k_output_usd": prices.get(m, (None, None))[1], "mean_cost_usd": c}
            for m, c in zip(router.models, kind.mean_costs(router))
        ],
        "embedder": dict(embedder.entry),
    }
    return files, fields


def export_bundle(
    router_dir: Path,
    out: Path,
    signing_key: Path,
    *,
    int8: bool = False,
    precisions: Sequence[str] = (),
    data: Path | None = None,
    bundle_version: int | None = None,
    prices: dict[str, tuple[float | None, float | None]] | None = None,
    cache_dir: Path | None = None,
    progress: Callable[[str], None] = print,
) -> ExportResult:
    """Export the router saved at ``router_dir`` as a signed bundle at ``out``.

    The work (embedder export, staged bundle for the parity check) happens in a scratch folder beside
    ``out``, ``.<name>.export-<host>-<pid>-<random>``, removed when the export ends or fails; one left by
    a killed export (its process gone) is removed by the next export to ``out``
    (:mod:`export.scratch_folder`).

    Parameters
    ----------
    router_dir : folder written by ``fedroute simulate`` (``results/routers/{mlp,kmeans}``).
    out : bundle directory to create or replace (atomically).
    signing_key : path of ``signing.key`` (see ``fedroute keygen``).
    int8 : also ship the int8 embedder (``embedder.int8.onnx``, or ``static_table.int8.npy`` for a
        static embedder); same as ``precisions=("int8",)``.
    precisions : quantised precisions to ship besides fp32: for an ONNX embedder keys of
        :data:`export.embedder_onnx.QUANTISED_PRECISIONS` (``"int8"``, ``"int8-all"``), for a static
        one ``"int8"``; each must pass its parity gate. ``Router.load(precision="auto")`` takes the
        fastest shipped.
    data : RouterBench folder or test file for the parity checks; default: the test file recorded
        in ``router.json`` at training time.
    bundle_version : default: 1 + the version at ``out``, or 1.
    prices : optional model id -> (USD per 1k input tokens, USD per 1k output tokens).
    cache_dir : embedding cache of the trainer (reused for the sentence-transformers side).
    progress : callable receiving one-line progress messages.

    Returns
    -------
    ExportResult

    Raises
    ------
    ExportError
        Unreadable router or key, router without embedder identity, no test data, a precision the
        router's embedder kind does not have, a scratch folder that cannot be created beside ``out``.
    ParityError
        An exported part misses a parity threshold (:mod:`export.parity`); nothing is written.
    """
    quantised = list(dict.fromkeys([*(["int8"] if int8 else []), *precisions]))
    key = load_signing_key(signing_key)
    out = Path(out)
    check_replaceable(out, sdk_kinds.ROUTER_FAMILY)  # a selector bundle at --out is not replaced by a router
    version = bundle_version if bundle_version is not None else next_bundle_version(out)
    check_version(out, version)
    try:
        router = load_router(router_dir)
    except Exception as exc:  # noqa: BLE001 - any unreadable router is one clear error
        raise ExportError(f"cannot load the router at {router_dir}: {exc}") from exc
    emb = router.embedder or {}
    if not isinstance(emb, dict) or "name" not in emb:
        raise ExportError(f"{router_dir}/router.json has no embedder entry; retrain with this fedroute version")
    config = _embedder_config(emb, router_dir)
    embedder_kind = export_kinds.get(config.kind.name, family="embedder")
    check_quantised(embedder_kind, quantised)  # before any work
    prices = check_prices(prices or {}, router.models)
    table = _load_test_table(router, data)
    labelled = [m for m in router.models if m in table.models]
    if len(labelled) < 2:
        raise ExportError(f"parity needs test labels of at least 2 of the router's models; {table.source} has {labelled}")
    if len(labelled) < len(router.models):  # a model added with `fedroute add-model` has no test labels
        progress(f"parity: no test labels for {[m for m in router.models if m not in labelled]}; the AUC gate "
                 "compares bundle and trainer on the other models' columns, decisions on all")
    test = table.with_models(labelled)
    progress(f"parity set: {test.n_queries} fully labelled test prompts from {test.source}")

    with scratch_folder(out) as tmp:  # beside out; a killed export's is removed by the next (export.scratch_folder)
        try:
            embedder = embedder_kind.build(emb, config, tmp, quantised, cache_dir, progress=progress)
        except FedrouteError:
            raise
        except Exception as exc:  # noqa: BLE001 - optimum / transformers / huggingface_hub: one clear line
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise ExportError(f"cannot export the embedder {config.model!r} named in {router_dir}/router.json "
                              f"(not a sentence-transformer folder, or a hub id not cached here): "
                              f"{type(exc).__name__}: {first}") from exc
        progress(f"exporting the {router.kind} router")
        files, fields = assemble_bundle(router, embedder, prices, version)
        staged = tmp / "staged"
        write_bundle(staged, files, fields, key)
        progress("checking parity of the staged bundle against the trainer")
        reference = embed_texts(list(test.prompts), config, cache_dir, show_progress=False)
        report = export_kinds.get(router.kind).parity(staged, key.public_key(), router, reference, test,
                                                      list(fields["embedder"]["files"]), progress=progress)
        manifest = write_checked_bundle(Path(out), files, fields, key, report)
    progress(f"wrote bundle v{manifest['bundle_version']} to {out}")
    return ExportResult(Path(out), manifest, report)
