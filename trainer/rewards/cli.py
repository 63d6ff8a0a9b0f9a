"""``fedroute mor``: train, evaluate and audit the mixture of client reward models (MoR, paper 001).

``train`` saves a routed reward (``save_mixture`` layout, :mod:`trainer.rewards.mixture`) that
``fedroute mor grpo`` and the exporter load; ``eval`` writes the Table 4 analogue (results.json,
results.md, results.png); ``audit`` the membership-inference and communication tables (audit.json,
audit.md, audit.png). ``--quick`` is the small preset of :meth:`MoRConfig.quick`. Heavy imports
happen inside the commands.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from dataclasses import replace
from sdk.cli_paths import PathCheckedGroup
from sdk.finite_option import COUNT_MAX, SEED_MAX, finite_option
from trainer.out_folder import cache_folder_option, check_out_option
from trainer.results_owner import OWNER_KEY, claim_results
from trainer.torch_device import DEFAULT_CPU_THREADS, set_cpu_threads
from trainer.rewards.mor_report import write_eval
from trainer.rewards.mor_report import write_audit

app = typer.Typer(cls=PathCheckedGroup, add_completion=False, no_args_is_help=True, help="MoR: client reward models, federated router, audit.")

OutOpt = Annotated[Path, typer.Option(help="output folder")]
QuickOpt = Annotated[bool, typer.Option("--quick", help="small preset (<= 5 min on a 2-core CPU)")]
FullOpt = Annotated[bool, typer.Option("--full", help="every pair of each client's domain, all-MLP clients (MoRConfig.full)")]
DataOpt = Annotated[Path, typer.Option(help="shared data folder (alpacaeval/, hh_rlhf_harmless/, routerbench/)")]
SeedsOpt = Annotated[Optional[int], typer.Option(min=1, max=COUNT_MAX, help="number of seeds (default 3)")]
CacheOpt = Annotated[Optional[Path], typer.Option(callback=cache_folder_option, help="embedding cache folder (default $FEDROUTE_CACHE or ~/.cache/fedroute)")]
ThreadsOpt = Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="torch CPU threads")]


def _config(quick: bool, data: Path, seeds: Optional[int], cache: Optional[Path], full: bool = False):
    from trainer.rewards.mor_trainer import MoRConfig  # trainer.rewards.mor_trainer imports pandas, torch: on use only

    if quick and full:
        raise typer.BadParameter("--quick and --full are two presets: give one")
    over = {"data_dir": str(data), "cache_dir": str(cache) if cache else None}
    if seeds is not None:
        over["seeds"] = seeds
    return MoRConfig.quick(**over) if quick else MoRConfig.full(**over) if full else MoRConfig(**over)


@app.command()
def train(out: OutOpt, quick: QuickOpt = False, data: DataOpt = Path("../shared/data"),
          seed: Annotated[int, typer.Option(min=0, max=SEED_MAX, help="seed of the split by prompt and of the training")] = 0,
          mode: Annotated[str, typer.Option(help="active routed reward: sparse | soft (both variants are saved)")] = "sparse",
          weighting: Annotated[Optional[str], typer.Option(help="router FedAvg weighting: equal | samples "
                                                                  "(default: chosen on validation)")] = None,
          dp: Annotated[bool, typer.Option("--dp", help="train every client's reward model with DP-SGD (Opacus; all "
                                                   "clients MLP); reports (epsilon, delta) and the accuracy it costs")] = False,
          cache: CacheOpt = None, threads: ThreadsOpt = DEFAULT_CPU_THREADS, full: FullOpt = False) -> None:
    """Train the clients' reward models and the federated router on one seed's split, choose the router's
    weighting and the sparse / soft routing variants on VALIDATION pairs, and save that mixture."""

    from trainer.rewards.evaluation import evaluate_seed  # trainer.rewards.evaluation imports pandas, torch: on use only
    from trainer.rewards.mor_trainer import DP_RM, MoRTrainer  # trainer.rewards.mor_trainer imports pandas, torch: on use only

    check_out_option(out)  # before training
    set_cpu_threads(threads)
    if mode not in ("sparse", "soft") or weighting not in (None, "equal", "samples"):
        raise typer.BadParameter(f"--mode must be sparse|soft and --weighting equal|samples, got {mode!r}, {weighting!r}")
    cfg = replace(_config(quick, data, None, cache, full), mode=mode, dp_rm=DP_RM if dp else None)
    trainer = MoRTrainer(cfg)
    t0 = time.perf_counter()
    split = trainer.prepare(seed)
    models = trainer.train(split)
    ev = evaluate_seed(trainer, split, models)
    evaluation = {k: v for k, v in ev.items() if k != "pair_correct"}  # per-pair arrays: for mor eval's paired SEs
    metrics = {"seed": seed, "seconds": time.perf_counter() - t0, "evaluation": evaluation, "history": models.history}
    if dp:
        from trainer.rewards.audit import dp_cost  # trainer.rewards.audit imports pandas, torch: on use only

        metrics["privacy"] = dp_cost(trainer, split, models)
        for name, p in metrics["privacy"].items():
            typer.echo(f"{name}: DP-SGD (epsilon {p['epsilon']:.1f}, delta {p['delta']:.1e}), test accuracy "
                       f"{p['test_acc_dp']:.3f} vs {p['test_acc_non_dp']:.3f} without DP ({p['cost']:+.3f})")
    # written by the save, before mixture.json: a kill between the two left an earlier run's metrics beside this mixture
    trainer.save(models, out, weighting=weighting, routing=ev["routing"], mode=mode,
                 records={"train_metrics.json": metrics})
    w = weighting or ev["routing"]["weighting"]
    typer.echo(f"saved the mixture to {out}: {w} router, sparse {ev['routing']['sparse']}, soft {ev['routing']['soft']} "
               f"(chosen on validation), active {mode}; test ID accuracy sparse {ev['id']['router_rm_sparse']:.3f}, "
               f"soft {ev['id']['router_rm_soft']:.3f}, oracle {ev['id']['oracle_client']:.3f}")


@app.command("eval")
def eval_(out: OutOpt, quick: QuickOpt = False, data: DataOpt = Path("../shared/data"), seeds: SeedsOpt = None,
          cache: CacheOpt = None, threads: ThreadsOpt = DEFAULT_CPU_THREADS, full: FullOpt = False) -> None:
    """MoR Table 4 analogue over seeds: results.json, results.md, results.png in OUT."""
    from trainer.rewards.evaluation import run_evaluation  # trainer.rewards.evaluation imports pandas, torch: on use only
    from trainer.rewards.mor_trainer import MoRTrainer  # trainer.rewards.mor_trainer imports pandas, torch: on use only

    check_out_option(out)  # before training
    cfg = _config(quick, data, seeds, cache, full)  # refuses --quick --full before the folder is claimed
    claim_results(out, "mor eval")
    set_cpu_threads(threads)
    trainer = MoRTrainer(cfg)

    def progress(seed, ev):
        typer.echo(f"seed {seed}: ID sparse {ev['id']['router_rm_sparse']:.3f}, AvgRM {ev['id']['avg_rm']:.3f}, "
                   f"oracle {ev['id']['oracle_client']:.3f}, weighting {ev['weighting']}")

    res = run_evaluation(trainer, progress)
    res["config"] = cfg.to_json()
    res["quick"] = quick
    res[OWNER_KEY] = "mor eval"
    write_eval(res, out)
    typer.echo((out / "results.md").read_text())


@app.command()
def audit(out: OutOpt, quick: QuickOpt = False, data: DataOpt = Path("../shared/data"), seeds: SeedsOpt = None,
          clip: Annotated[float, typer.Option(callback=finite_option, min=0.01, help="clip of normalised scores in the clipped variant")] = 1.0,
          members: Annotated[Optional[int], typer.Option(min=10, max=COUNT_MAX, help="grow each client's pool so that it has at least this "
                                                         "many members and non-members (500: AUC SE <= 0.02)")] = None,
          lora: Annotated[bool, typer.Option("--lora", help="also attack the shipped LoRA client (slow on a CPU)")] = False,
          settings: Annotated[str, typer.Option(help="comma-separated settings: shipped, shipped_dp, naive")] = "shipped,shipped_dp,naive",
          cache: CacheOpt = None, threads: ThreadsOpt = DEFAULT_CPU_THREADS) -> None:
    """Membership inference on reward margins of the shipped reward models (with and without DP-SGD, and a
    naive worst case) and communication."""
    from trainer.rewards.audit import run_audit  # trainer.rewards.audit imports pandas, torch: on use only
    from trainer.rewards.mor_trainer import MoRTrainer  # trainer.rewards.mor_trainer imports pandas, torch: on use only

    check_out_option(out)  # before training
    set_cpu_threads(threads)
    cfg = _config(quick, data, seeds, cache)
    if members is not None:
        cfg = cfg.with_members(members)
    t0 = time.perf_counter()
    chosen = tuple(s.strip() for s in settings.split(",") if s.strip())
    if not chosen or set(chosen) - {"shipped", "shipped_dp", "naive"}:
        raise typer.BadParameter(f"--settings {settings!r}: give a comma-separated subset of shipped, shipped_dp, naive")

    def write(res: dict) -> None:  # after every seed: a run stopped early keeps the seeds it finished
        write_audit(res | {"seconds": time.perf_counter() - t0, "quick": quick}, out)

    res = run_audit(MoRTrainer(cfg), clip=clip, include_lora=lora, settings=chosen, on_seed=write)
    write(res)
    typer.echo((out / "audit.md").read_text())
