"""``fedroute prism ...``: the FedPrism commands (a typer sub-app registered by :mod:`trainer.cli`).

``fedroute prism train [--quick | --preset cpu|gpu] --out DIR`` runs every method of the results table
for ``--seeds`` seeds and writes the folder described in :mod:`trainer.experts.experiment`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="FedPrism: federated preference experts with instance-wise routing (paper 000).")


@app.command()
def train(
    out: Annotated[Path, typer.Option(help="output folder (results.json, results.md, PNGs, fedprism_seed0/)")],
    data: Annotated[Path, typer.Option(help="shared data folder with alpacaeval/, hh_rlhf_harmless/, routerbench/")] = Path("../shared/data"),
    quick: Annotated[bool, typer.Option("--quick", help="the small preset (<= 5 min on one CPU core)")] = False,
    preset: Annotated[str, typer.Option(help="cpu (default, scaled down) or gpu (paper settings, Qwen2-0.5B class)")] = "cpu",
    seeds: Annotated[int, typer.Option(min=1, help="number of seeds (0..K-1); >= 3 for the results table")] = 3,
    backbone: Annotated[Optional[str], typer.Option(help="selector backbone path or hub id (default: the preset's)")] = None,
    n_experts: Annotated[Optional[int], typer.Option(min=1, help="M, number of experts (default: the preset's)")] = None,
    methods: Annotated[str, typer.Option(help="comma-separated methods of the table (default: all)")] = "all",
    device_threads: Annotated[int, typer.Option(min=1, help="torch CPU threads")] = 1,
    cache_dir: Annotated[Optional[Path], typer.Option(help="cache folder (embeddings, segment states)")] = None,
) -> None:
    """Train FedPrism and its baselines on the same clients; write results.json, results.md, PNGs."""
    import torch

    from sdk.errors import InvalidInputError
    from trainer.experts.experiment import ALL_METHODS, PRESETS, prepare_data, run_experiment
    from trainer.experts.selector import PairSelector

    name = "quick" if quick else preset
    if name not in PRESETS:
        raise typer.BadParameter(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
    torch.set_num_threads(device_threads)
    data_preset, base = PRESETS[name]
    if backbone is not None:
        try:
            base = replace(base, selector=replace(base.selector, backbone=backbone))
        except InvalidInputError as exc:
            raise typer.BadParameter(str(exc)) from exc
    if n_experts is not None:
        base = replace(base, n_experts=n_experts)
    chosen = ALL_METHODS if methods == "all" else tuple(m.strip() for m in methods.split(",") if m.strip())
    unknown = [m for m in chosen if m not in ALL_METHODS]
    if unknown:
        raise typer.BadParameter(f"--methods: unknown {unknown}; valid: {', '.join(ALL_METHODS)}")
    model = PairSelector(base.selector)
    prep = prepare_data(data, data_preset, model, cache_dir=cache_dir)
    result = run_experiment(prep, model, data_preset, base, range(seeds), out, methods=chosen)
    typer.echo((out / "results.md").read_text())
    typer.echo(f"results: {out / 'results.json'}  ({result['seconds']} s of training)")
