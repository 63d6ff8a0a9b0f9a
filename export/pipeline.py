"""``fedroute export``: trained router -> signed, parity-checked bundle.

Steps: load the router and the signing key; export the router's embedder to ONNX (and int8); write
the router file; stage a signed bundle and load it with the SDK exactly as an app would; check
parity against the trainer on real RouterBench test prompts (:mod:`export.parity`); then write the
final bundle, with the parity figures in its signed ``parity.json``. A failed check raises
:class:`~export.errors.ParityError` and writes nothing at ``out``.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Callable

from export import kinds as export_kinds
from export.bundle_writer import check_replaceable, check_version, next_bundle_version, write_bundle, write_checked_bundle
from export.embedder_onnx import QUANTISED_PRECISIONS, ExportedEmbedder, export_embedder, quantize_precision
from export.errors import ExportError
from export.signing import load_signing_key
from sdk import bundle_manifest as fmt
from trainer.embeddings import EmbedderConfig, embed_texts, resolve_model_path
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
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise ExportError(f"prices[{model!r}].{side} must be a number >= 0 (USD per 1k tokens) or null, got {value!r}")
        out[model] = (None if pair[0] is None else float(pair[0]), None if pair[1] is None else float(pair[1]))
    return out


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
    """The bundle's files and manifest fields (before signing) for ``router`` and an exported embedder.

    ``quantised``: precision -> quantised encoder file (e.g. ``{"int8": p, "int8-all": q}``), a
    single Path (taken as ``int8``) or None (fp32 only); each is shipped as
    ``bundle_manifest.EMBEDDER_FILES[precision]``.

    Returns
    -------
    (files: name -> bytes, fields: manifest fields without format_version/created_utc/files/signature)

    Raises
    ------
    ExportError
        Prices for models the router does not have, a bundle_version < 1, or an embedder whose
        dimension is not the router's input dimension.
    """
    if exported.dim != router.d_emb:
        raise ExportError(f"embedder {embedder_name} has dim {exported.dim}, the router expects {router.d_emb}")
    if bundle_version < 1:
        raise ExportError(f"bundle_version must be >= 1, got {bundle_version}")
    prices = check_prices(prices, router.models)
    files = {fmt.TOKENIZER_FILE: exported.tokenizer.read_bytes(),
             fmt.EMBEDDER_FILES["fp32"]: exported.model.read_bytes()}
    precisions = {"fp32": fmt.EMBEDDER_FILES["fp32"]}
    if quantised is not None and not isinstance(quantised, Mapping):
        quantised = {"int8": quantised}
    for precision, path in (quantised or {}).items():
        if precision not in fmt.EMBEDDER_FILES or precision == "fp32":
            raise ExportError(f"unknown quantised precision {precision!r}; known: {sorted(QUANTISED_PRECISIONS)}")
        files[fmt.EMBEDDER_FILES[precision]] = Path(path).read_bytes()
        precisions[precision] = fmt.EMBEDDER_FILES[precision]
    kind = export_kinds.get(router.kind)
    files.update(kind.files(router))
    fields = {
        "bundle_version": int(bundle_version),
        **kind.manifest_fields(router),
        "models": [
            {"id": m, "price_per_1k_input_usd": prices.get(m, (None, None))[0],
             "price_per_1k_output_usd": prices.get(m, (None, None))[1], "mean_cost_usd": c}
            for m, c in zip(router.models, kind.mean_costs(router))
        ],
        "embedder": {"name": embedder_name, "dim": exported.dim, "max_tokens": int(max_tokens),
                     "truncation_side": truncation_side, "pooling": "mean", "normalised": True,
                     "files": precisions},
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

    Parameters
    ----------
    router_dir : folder written by ``fedroute simulate`` (``results/routers/{mlp,kmeans}``).
    out : bundle directory to create or replace (atomically).
    signing_key : path of ``signing.key`` (see ``fedroute keygen``).
    int8 : also ship ``embedder.int8.onnx`` (same as ``precisions=("int8",)``).
    precisions : quantised encoders to ship besides fp32, keys of
        :data:`export.embedder_onnx.QUANTISED_PRECISIONS` (``"int8"``, ``"int8-all"``); each must
        pass its parity gate. ``Router.load(precision="auto")`` takes the fastest shipped.
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
        Unreadable router or key, router without embedder identity, no test data, an unknown precision.
    ParityError
        An exported part misses a parity threshold (:mod:`export.parity`); nothing is written.
    """
    quantised_names = list(dict.fromkeys([*(["int8"] if int8 else []), *precisions]))
    unknown = [p for p in quantised_names if p not in QUANTISED_PRECISIONS]
    if unknown:
        raise ExportError(f"unknown precision(s) {unknown}; fp32 is always shipped, and the quantised ones "
                          f"are {sorted(QUANTISED_PRECISIONS)}")
    key = load_signing_key(signing_key)
    out = Path(out)
    check_replaceable(out)
    version = bundle_version if bundle_version is not None else next_bundle_version(out)
    check_version(out, version)
    try:
        router = load_router(router_dir)
    except Exception as exc:  # noqa: BLE001 - any unreadable router is one clear error
        raise ExportError(f"cannot load the router at {router_dir}: {exc}") from exc
    emb = router.embedder or {}
    if "name" not in emb:
        raise ExportError(f"{router_dir}/router.json has no embedder entry; retrain with this fedroute version")
    config = EmbedderConfig(model=emb["name"], max_tokens=int(emb.get("max_tokens", 256)),
                            truncation_side=emb.get("truncation_side", "left"))
    prices = check_prices(prices or {}, router.models)
    test = _load_test_table(router, data).with_models(router.models)
    progress(f"parity set: {test.n_queries} fully labelled test prompts from {test.source}")

    with tempfile.TemporaryDirectory(prefix="fedroute-export-") as tmp:
        tmp = Path(tmp)
        progress(f"exporting embedder {config.model} to ONNX with optimum (opset 17)")
        exported = export_embedder(resolve_model_path(config.model), tmp / "embedder", config.max_tokens,
                                   config.truncation_side)
        quantised = {}
        for precision in quantised_names:
            progress(f"quantising the embedder to {precision} (onnxruntime dynamic, per-channel int8 weights)")
            quantised[precision] = quantize_precision(exported.model, tmp / fmt.EMBEDDER_FILES[precision], precision)
        progress(f"exporting the {router.kind} router")
        files, fields = assemble(router, exported, quantised, config.model, config.max_tokens,
                                 config.truncation_side, prices, version)
        staged = tmp / "staged"
        write_bundle(staged, files, fields, key)
        progress("checking parity of the staged bundle against the trainer")
        reference = embed_texts(list(test.prompts), config, cache_dir, show_progress=False)
        report = export_kinds.get(router.kind).parity(staged, key.public_key(), router, reference, test,
                                                      list(fields["embedder"]["files"]), progress=progress)
        manifest = write_checked_bundle(Path(out), files, fields, key, report)
    progress(f"wrote bundle v{manifest['bundle_version']} to {out}")
    return ExportResult(Path(out), manifest, report)
