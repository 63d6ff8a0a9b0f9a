"""``fedroute mor grpo``: GRPO on a saved MoR mixture with online routing. Registered on the ``mor``
sub-app by :func:`register` (from ``trainer.cli``); heavy imports happen inside the command.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated, Optional

import typer
import numpy as np
from sdk.errors import InvalidInputError
from sdk.finite_option import COUNT_MAX, SEED_MAX, finite_option
from trainer.alignment.errors import AlignmentConfigError
from trainer.alignment.policy_models import build_tiny_causal_lm
from trainer.out_folder import cache_folder_option, check_out_option
from trainer.torch_device import check_torch_device

#: What each kind of run writes into --out: one run (``--online on|off``) or the comparison (``--online compare``).
MODE_OUTPUTS = {"single": ("history.json", "grpo.png"),
                "compare": ("comparison.json", "comparison.md", "comparison.png", "online", "offline")}


def clear_earlier_results(out: Path) -> list[str]:
    """Remove from ``out`` the results an earlier run wrote there, of either kind (:data:`MODE_OUTPUTS`);
    returns the names removed. Called before the run writes anything (its ``grpo_config.json``,
    ``tiny_policy/``): a rerun that stops before its own results (Ctrl-C, a policy that does not load) then
    leaves no earlier ``history.json`` or ``comparison.*`` that reads as this run's, and a rerun with another
    ``--online`` leaves no results of the other kind beside its own. Only those names are touched (files, or
    the comparison's run folders)."""
    removed = []
    for name in (*MODE_OUTPUTS["single"], *MODE_OUTPUTS["compare"]):
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


MixtureOpt = Annotated[Path, typer.Option("--mixture", help="a saved MoR mixture (mixture.json + router + clients)")]
DataOpt = Annotated[Path, typer.Option("--data", help="the shared data folder (alpacaeval/, hh_rlhf_harmless/, routerbench/)")]


def public_prompts(data: Path, n: int, seed: int = 0) -> list[str]:
    """``n`` public GRPO prompts: AlpacaEval instructions and HH-RLHF harmless prompts, alternating,
    shuffled with ``seed`` (the server's public queries ``D^{pub,qry}`` of MoR).

    Raises
    ------
    InvalidInputError
        ``n`` < 1, or more prompts than the alternating pool holds
    """

    from trainer.data.preferences import load_alpacaeval_pairs, load_hh_harmless_pairs  # trainer.data.preferences imports pandas: on use only

    if n < 1:
        raise InvalidInputError(f"n={n} prompts should be >= 1")
    rng = np.random.default_rng(seed)
    pools = []
    for frame in (load_alpacaeval_pairs(data, seed=seed), load_hh_harmless_pairs(data, seed=seed)):
        unique = list(dict.fromkeys(frame["prompt"].tolist()))
        pools.append([unique[i] for i in rng.permutation(len(unique))])
    mixed = [p for pair in zip(*pools) for p in pair]
    if n > len(mixed):
        raise InvalidInputError(f"n={n} prompts (--n-prompts) but {data} holds {len(mixed)} public prompts "
                                f"(AlpacaEval and HH-RLHF alternating): give at most {len(mixed)}")
    return mixed[:n]


#: (steps, prompts, tokens per completion) of a run, and of a --quick run
DEFAULT_LENGTHS, QUICK_LENGTHS = (60, 256, 32), (20, 64, 16)


def run_lengths(quick: bool, steps: Optional[int], n_prompts: Optional[int],
                max_completion_length: Optional[int]) -> tuple[int, int, int]:
    """(steps, n_prompts, max_completion_length): the values given on the line, else the preset's
    (``--quick --steps 5`` runs 5 steps)."""
    preset = QUICK_LENGTHS if quick else DEFAULT_LENGTHS
    given = (steps, n_prompts, max_completion_length)
    return tuple(p if g is None else g for g, p in zip(given, preset))  # type: ignore[return-value]


def grpo(
    mixture: MixtureOpt,
    out: Annotated[Path, typer.Option(help="output folder (history, figures, comparison)")] = Path("results/mor_grpo"),
    model: Annotated[Optional[str], typer.Option(help="policy causal LM: local path or hub id; default: a tiny random "
                                                      "2-layer Llama built offline into OUT/tiny_policy")] = None,
    data: DataOpt = Path("../shared/data"),
    steps: Annotated[Optional[int], typer.Option(min=1, max=COUNT_MAX, help="GRPO optimiser steps (default 60; 20 with --quick)")] = None,
    n_prompts: Annotated[Optional[int], typer.Option(min=1, max=COUNT_MAX, help="public prompts to train on (default 256; 64 with --quick)")] = None,
    num_generations: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="completions per prompt (group size M)")] = 4,
    prompts_per_step: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="prompts per optimiser step")] = 4,
    max_completion_length: Annotated[Optional[int], typer.Option(min=1, max=COUNT_MAX, help="tokens generated per completion (default 32; 16 with --quick)")] = None,
    learning_rate: Annotated[float, typer.Option(callback=finite_option, help="policy learning rate (1e-2 suits the tiny random policy; "
                                                      "use ~1e-6 for a real instruct model)")] = 1e-2,
    beta: Annotated[float, typer.Option(callback=finite_option, help="KL coefficient to the reference policy (> 0)")] = 0.04,
    online: Annotated[str, typer.Option(help="'compare' (run on and off), 'on' or 'off'")] = "compare",
    ts_lambda: Annotated[float, typer.Option("--ts-lambda", callback=finite_option, help="Thompson sampling lambda (prior, pull-back), > 0 and below 4 (2 / the online SGD step 0.5)")] = 1.0,
    ts_nu: Annotated[float, typer.Option("--ts-nu", callback=finite_option, help="Thompson sampling exploration scale nu, 0 to 1e100 (larger can overflow the posterior sample)")] = 1.0,
    device: Annotated[str, typer.Option(help="cpu (float32, 1 thread) or cuda (bfloat16)")] = "cpu",
    quick: Annotated[bool, typer.Option("--quick", help="20 steps, 64 prompts, 16 tokens (a few minutes on CPU); "
                                                         "--steps, --n-prompts and --max-completion-length given on the line win")] = False,
    seed: Annotated[int, typer.Option(min=0, max=SEED_MAX)] = 0,
    cache_dir: Annotated[Optional[Path], typer.Option(callback=cache_folder_option, help="embedding cache folder")] = None,
) -> None:
    """GRPO (TRL) on the routed reward of a MoR mixture, with online routing by neural Thompson sampling."""
    from trainer.alignment.grpo import DEVICES, RoutedGRPOConfig, RoutedGRPOTrainer, compare_online, from_mixture  # trainer.alignment.grpo imports torch: on use only
    from trainer.alignment.thompson_routing import ThompsonConfig  # trainer.alignment.thompson_routing imports torch: on use only
    from trainer.rewards.mixture import load_mixture  # trainer.rewards.mixture imports torch, tqdm: on use only

    if online not in ("compare", "on", "off"):
        raise typer.BadParameter(f"--online must be 'compare', 'on' or 'off', got {online!r}")
    for option, value in (("--learning-rate", learning_rate), ("--beta", beta)):
        if value <= 0:  # NaN and inf: refused by finite_option while parsing
            raise typer.BadParameter(f"{option} must be a finite number > 0, got {value}")
    check_out_option(out)
    if device in DEVICES:  # another value is refused by RoutedGRPOConfig below
        try:  # before the mixture, data and OUT/tiny_policy are built
            check_torch_device("--device", device)
        except InvalidInputError as exc:
            raise typer.BadParameter(str(exc)) from exc
    try:  # checked before OUT/tiny_policy is written
        thompson = ThompsonConfig(enabled=online != "off", lam=ts_lambda, nu=ts_nu, seed=seed)
    except InvalidInputError as exc:
        raise typer.BadParameter(f"--ts-lambda / --ts-nu: {exc}") from exc
    steps, n_prompts, max_completion_length = run_lengths(quick, steps, n_prompts, max_completion_length)
    if n_prompts < prompts_per_step:  # TRL then ran no step and the run ended in "empty GRPO history"
        raise typer.BadParameter(f"--n-prompts {n_prompts} is below --prompts-per-step {prompts_per_step}: one optimiser "
                                 "step needs that many prompts, so no step would run")
    try:  # every setting checked before the mixture and the data are read and OUT/tiny_policy is written
        config = RoutedGRPOConfig(model=str(out / "tiny_policy") if model is None else model, output_dir=out, beta=beta,
                                  learning_rate=learning_rate, num_generations=num_generations,
                                  prompts_per_step=prompts_per_step, max_completion_length=max_completion_length,
                                  max_steps=steps, thompson=thompson, device=device, seed=seed)
    except AlignmentConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    mix = load_mixture(mixture, cache_dir=cache_dir)
    if mix.mode == "soft":
        typer.echo("note: the mixture is saved with soft routing active; GRPO with online routing uses its sparse variant")
        mix = mix.with_mode("sparse")
    typer.echo(f"routing rule (saved with the mixture): {mix.rule.variant}")
    prompts = public_prompts(data, n_prompts, seed)
    out.mkdir(parents=True, exist_ok=True)
    clear_earlier_results(out)  # before this run writes anything
    if model is None:
        build_tiny_causal_lm(out / "tiny_policy", train_texts=prompts, vocab_size=512, seed=seed, overwrite=True)
        typer.echo(f"policy: a tiny random 2-layer Llama with a BPE tokenizer trained on the prompts -> {config.model}")
    config.save(out / "grpo_config.json")
    if online == "compare":
        summary = compare_online(config, lambda t: from_mixture(mix, t), prompts, progress=None)
        for name, s in summary.items():
            typer.echo(f"{name}: reward {s['reward_first_quarter']:+.3f} -> {s['reward_last_quarter']:+.3f}, "
                       f"max KL {s['kl_max']:.4f}, routed away from offline router {s['changed_vs_offline_mean']:.3f}, "
                       f"router argmax changed {s.get('router_argmax_changed', 0.0):.3f}")
        typer.echo(f"wrote {out / 'comparison.json'}, comparison.md, comparison.png")
    else:
        result = RoutedGRPOTrainer(config, from_mixture(mix, thompson), prompts).train()
        s = result.summary
        typer.echo(f"reward {s['reward_first_quarter']:+.3f} -> {s['reward_last_quarter']:+.3f}, max KL {s['kl_max']:.4f}; "
                   f"wrote {out / 'history.json'} and grpo.png")


def register(mor_app: typer.Typer) -> None:
    """Add ``grpo`` to the ``fedroute mor`` sub-app (called by the console-script module, ``trainer.cli``)."""
    mor_app.command("grpo")(grpo)
