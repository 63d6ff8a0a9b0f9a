"""``fedroute add-model``: a trained router plus one new model, fitted on a calibration file.

The algorithm is :mod:`trainer.routers.add_model` (paper 002; ARCHITECTURE.md §4 "Model pool
changes"); this module reads the router and the calibration file, embeds the calibration prompts
with the router's own embedder (cached), and writes the wider router to a new folder that
``fedroute export`` turns into a signed bundle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer

from sdk.errors import InvalidInputError
from sdk.finite_option import finite_option
from trainer.out_folder import cache_folder_option, check_out_folder

__all__ = ["add_model_to_router", "add_model_command"]


def add_model_to_router(router_dir: Path, model: str, calibration: Path, out: Path, price_usd: float | None = None,
                        cache_dir: Path | None = None):
    """Load the router at ``router_dir``, add ``model`` from the ``calibration`` file, save it at ``out``.

    The price (USD per query) is ``price_usd`` if given, else the mean ``cost_usd`` of the calibration
    rows (:func:`trainer.routers.add_model.resolve_price`); it is the new model's cost prior and is
    recorded in ``router.json`` (``provenance.added_models``).

    Returns
    -------
    The wider trainer Router (also saved at ``out``).

    Raises
    ------
    InvalidInputError
        ``out`` is the router's own folder or an existing file or non-empty folder or cannot be written
        (:func:`trainer.out_folder.check_out_folder`), the router has no embedder identity, or anything the
        calibration checks raise (:func:`trainer.routers.add_model.load_calibration`, ``resolve_price``).
    UnknownModelError
        The calibration file has rows for other models.
    """
    router_dir, out = Path(router_dir), Path(out)
    if out.resolve() == router_dir.resolve():
        raise InvalidInputError(f"--out {out} is the router's own folder: write the wider router to a new folder "
                                "(the old one stays as it was)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidInputError(f"--out {out} already exists and is not an empty folder: write the wider router to a "
                                "new folder (remove this one first to redo an add-model); nothing was written")
    check_out_folder(out)  # before the router is loaded and the calibration prompts embedded

    from trainer import kinds  # trainer extra (torch via the router kinds), imported on use
    from trainer.embeddings import EmbedderConfig, embed_texts  # trainer extra, imported on use
    from trainer.routers.add_model import load_calibration, resolve_price  # trainer extra, imported on use

    router = kinds.load_router(router_dir)
    cal = load_calibration(calibration, model, router.models)
    price = resolve_price(cal, price_usd)
    emb = router.embedder
    if not emb or "name" not in emb:
        raise InvalidInputError(f"{router_dir}/router.json has no 'embedder' entry: the calibration prompts cannot be "
                                "embedded as the router's training prompts were (retrain with this fedroute version)")
    if cal.n:
        x = embed_texts(list(cal.prompts), EmbedderConfig(model=emb["name"], max_tokens=int(emb["max_tokens"]),
                                                          truncation_side=emb.get("truncation_side", "left")),
                        cache_dir, show_progress=False)
    else:
        x = np.zeros((0, router.d_emb), dtype=np.float32)
    wider = kinds.get(router.kind).add_model(router, model, x, cal.accuracy, cal.cost, price)
    added = list((router.provenance or {}).get("added_models", []))
    added.append({"model": model, "price_usd_per_query": price,
                  "price_from": "--price" if price_usd is not None else "calibration mean cost_usd",
                  "n_calibration": cal.n, "calibration": str(calibration),
                  "calibration_mean_score": float(cal.accuracy.mean()) if cal.n else None})
    wider.provenance = {**(router.provenance or {}), "added_models": added}
    wider.save(out)
    return wider


def add_model_command(
    router: Annotated[Path, typer.Option(help="trained router folder (results/routers/kmeans or .../mlp)")],
    model: Annotated[str, typer.Option(help="id of the new model (as the app's LLM client names it)")],
    calibration: Annotated[Path, typer.Option(help="calibration file (.csv/.parquet/.jsonl) with columns prompt, model, "
                                                    "score (in [0, 1]), cost_usd (USD per query)")],
    out: Annotated[Path, typer.Option(help="folder for the wider router (not the --router folder)")],
    price: Annotated[Optional[float], typer.Option(callback=finite_option, help="the new model's price, USD per query (default: the mean "
                                                        "cost_usd of the calibration rows)")] = None,
    cache_dir: Annotated[Optional[Path], typer.Option(callback=cache_folder_option, help="embedding cache folder (default $FEDROUTE_CACHE or "
                                                           "~/.cache/fedroute)")] = None,
) -> None:
    """Add a new model to a trained router without retraining (MLP: a new head, trunk and old heads frozen;
    K-means: a new column of statistics), from a small calibration file."""
    wider = add_model_to_router(router, model, calibration, out, price, cache_dir)
    entry = wider.provenance["added_models"][-1]
    typer.echo(f"{wider.kind} router with {len(wider.models)} models (added {model!r} from {entry['n_calibration']} "
               f"calibration queries, price {entry['price_usd_per_query']:.6g} USD per query) at {out}")
