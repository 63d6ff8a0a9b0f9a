"""``fedroute vpa train``: FedVPA-GP and its baselines on users who disagree (issue 28, docs/vpa.md).

Writes results.json, results.md, accuracy_vs_context.png, latent.png and ``personal_reward/`` (seed 0's FedVPA-GP,
:mod:`trainer.vpa.artefact`; ``fedroute vpa export`` ships it) into ``--out``. ``--quick`` is
:meth:`trainer.vpa.trainer.VPAConfig.quick`. Every run checks the monolithic gap (the oracle told the user's type
beats the monolithic reward by at least :data:`MIN_MONOLITHIC_GAP` at the largest C) and exits 1 when it fails.
Heavy imports happen inside the command.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from sdk.cli_paths import PathCheckedGroup
from sdk.finite_option import COUNT_MAX
from trainer.out_folder import cache_folder_option, check_out_option
from trainer.results_owner import OWNER_KEY, claim_results
from trainer.torch_device import DEFAULT_CPU_THREADS, set_cpu_threads

app = typer.Typer(cls=PathCheckedGroup, add_completion=False, no_args_is_help=True,
                  help="FedVPA-GP: personalised preference models with a federated mixture prior.")

#: Smallest oracle_type - monolithic_bt accuracy gap (largest C) a run must show.
MIN_MONOLITHIC_GAP = 0.03


@app.command()
def train(out: Annotated[Path, typer.Option(help="output folder")],
          quick: Annotated[bool, typer.Option("--quick", help="small preset (<= 5 min CPU time)")] = False,
          data: Annotated[Path, typer.Option(help="shared data folder (hh_rlhf_harmless/)")] = Path("../shared/data"),
          seeds: Annotated[Optional[int], typer.Option(min=1, max=COUNT_MAX, help="number of seeds (default 3; quick 1)")] = None,
          cache: Annotated[Optional[Path], typer.Option(callback=cache_folder_option,
                                                        help="embedding cache folder (default $FEDROUTE_CACHE or ~/.cache/fedroute)")] = None,
          threads: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="torch CPU threads")] = DEFAULT_CPU_THREADS,
          jobs: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="seeds run in parallel processes (one thread each)")] = 1) -> None:
    """Train FedVPA-GP, VPL and the baselines on the same simulated clients; settings chosen on validation users."""
    from trainer.vpa.experiment import run_experiment  # torch, pandas: on use only
    from trainer.vpa.artefact import ARTEFACT_DIR
    from trainer.vpa.report import write_results
    from trainer.vpa.trainer import VPAConfig

    check_out_option(out)
    claim_results(out, "vpa train")
    set_cpu_threads(threads)
    over = {"data_dir": str(data), "cache_dir": str(cache) if cache else None}
    if seeds is not None:
        over["seeds"] = seeds
    cfg = VPAConfig.quick(**over) if quick else VPAConfig(**over)
    t0 = time.perf_counter()
    res = run_experiment(cfg, log=typer.echo, jobs=jobs, save_to=out / ARTEFACT_DIR)
    c_max = str(max(cfg.contexts))
    gap = res["methods"]["oracle_type"][c_max]["acc_mean"] - res["methods"]["monolithic_bt"][c_max]["acc_mean"]
    res["monolithic_gap"] = {"C": int(c_max), "gap": gap, "min": MIN_MONOLITHIC_GAP, "holds": gap >= MIN_MONOLITHIC_GAP}
    cpu = os.times()  # this process and the finished --jobs workers
    res.update(quick=quick, seconds=time.perf_counter() - t0,
               cpu_seconds=cpu.user + cpu.system + cpu.children_user + cpu.children_system)
    res[OWNER_KEY] = "vpa train"
    write_results(res, out)
    typer.echo((out / "results.md").read_text())
    if not res["monolithic_gap"]["holds"]:
        typer.echo(f"monolithic gap {gap:.3f} < {MIN_MONOLITHIC_GAP} at C = {c_max}", err=True)
        raise typer.Exit(1)
