"""``fedroute prism ...``: the FedPrism commands (a typer sub-app registered by :mod:`trainer.cli`).

``fedroute prism train [--quick | --preset cpu|gpu] --out DIR`` runs every method of the results table
for ``--seeds`` seeds and writes the folder described in :mod:`trainer.experts.experiment`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from sdk.cli_paths import PathCheckedGroup
from sdk.errors import InvalidInputError
from sdk.finite_option import COUNT_MAX, SEED_MAX, finite_option
import numpy as np
from trainer.alignment.dpo import DPOAlignmentTrainer, DPORunConfig, validate_preference_rows
from trainer.alignment.errors import AlignmentConfigError
from trainer.alignment.policy_models import build_tiny_causal_lm
from trainer.out_folder import cache_folder_option, check_out_option
from trainer.results_owner import claim_results
from trainer.torch_device import DEFAULT_CPU_THREADS, check_torch_device, set_cpu_threads

app = typer.Typer(cls=PathCheckedGroup, add_completion=False, no_args_is_help=True,
                  help="FedPrism: federated preference experts with instance-wise routing (paper 000).")


@app.command()
def train(
    out: Annotated[Path, typer.Option(help="output folder (results.json, results.md, PNGs, fedprism_seed0/)")],
    data: Annotated[Path, typer.Option(help="shared data folder with alpacaeval/, hh_rlhf_harmless/, routerbench/")] = Path("../shared/data"),
    quick: Annotated[bool, typer.Option("--quick", help="the small preset (<= 5 min on one CPU core)")] = False,
    preset: Annotated[str, typer.Option(help="cpu (default, scaled down) or gpu (paper settings, Qwen2-0.5B class)")] = "cpu",
    seeds: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="number of seeds (0..K-1); >= 3 for the results table")] = 3,
    backbone: Annotated[Optional[str], typer.Option(help="selector backbone path or hub id (default: the preset's); a BERT-family encoder or a causal LM (LoRA targets by architecture)")] = None,
    n_experts: Annotated[Optional[int], typer.Option(min=1, max=COUNT_MAX, help="M, number of experts (default: the preset's)")] = None,
    methods: Annotated[str, typer.Option(help="comma-separated methods of the table (default: all)")] = "all",
    device_threads: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="torch CPU threads")] = DEFAULT_CPU_THREADS,
    cache_dir: Annotated[Optional[Path], typer.Option(callback=cache_folder_option, help="cache folder (embeddings, segment states)")] = None,
    device: Annotated[Optional[str], typer.Option(help="torch device of the experts (default: the preset's, cpu; cuda for --preset gpu)")] = None,
) -> None:
    """Train FedPrism and its baselines on the same clients; write results.json, results.md, PNGs."""
    from trainer.experts.experiment import ALL_METHODS, PRESETS, prepare_data, run_experiment  # trainer.experts.experiment imports pandas, torch: on use only
    from trainer.experts.selector import PairSelector, selector_for_backbone  # trainer.experts.selector imports torch: on use only

    check_out_option(out)  # before any work
    if quick and preset != "cpu":  # --quick --preset gpu ran the quick preset without a word
        raise typer.BadParameter(f"--quick is the small preset; give --quick or --preset {preset}, not both")
    claim_results(out, "prism train")
    name = "quick" if quick else preset
    if name not in PRESETS:
        raise typer.BadParameter(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
    set_cpu_threads(device_threads)
    data_preset, base = PRESETS[name]
    try:  # --preset gpu needs CUDA
        base = base if device is None else replace(base, device=device)
        check_torch_device("--device" if device is not None else f"--preset {name} (its device)", base.device)
    except InvalidInputError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if backbone is not None:
        try:
            # LoRA targets, pooling and the cache fitted to the backbone's architecture: the preset's BERT
            # targets (query/value) ended a GPT-2 or Llama backbone in peft's NoMatchingPeftModuleError
            base = replace(base, selector=selector_for_backbone(base.selector, backbone))
        except InvalidInputError as exc:
            raise typer.BadParameter(str(exc)) from exc
    if n_experts is not None:
        if n_experts > data_preset.n_public:  # else refused by the router's K-means start after the data preparation
            raise typer.BadParameter(f"--n-experts {n_experts}: the {name} preset holds {data_preset.n_public} public prompts "
                                     "and the router's K-means start needs at least one per expert")
        base = replace(base, n_experts=n_experts)
    chosen = ALL_METHODS if methods == "all" else tuple(m.strip() for m in methods.split(",") if m.strip())
    unknown = [m for m in chosen if m not in ALL_METHODS]
    if unknown:
        raise typer.BadParameter(f"--methods: unknown {unknown}; valid: {', '.join(ALL_METHODS)}")
    if not chosen or len(set(chosen)) != len(chosen):
        raise typer.BadParameter(f"--methods {methods!r}: give each method once, at least one; valid: {', '.join(ALL_METHODS)}")
    model = PairSelector(base.selector)
    prep = prepare_data(data, data_preset, model, cache_dir=cache_dir)
    result = run_experiment(prep, model, data_preset, base, range(seeds), out, methods=chosen)
    typer.echo((out / "results.md").read_text())
    typer.echo(f"results: {out / 'results.json'}  ({result['seconds']} s of training)")


@app.command()
def label(
    run: Annotated[Path, typer.Option(help="the --out folder of `fedroute prism train` (fedprism_seed0/, fedbis_seed0/)")],
    out: Annotated[Path, typer.Option(help="output folder: phase3.json, phase3.md, phase3_agreement.png, synthetic_preferences.jsonl/.parquet")],
    data: Annotated[Path, typer.Option(help="shared data folder with alpacaeval/")] = Path("../shared/data"),
    max_pairs: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="held-out AlpacaEval pairs to label (seeded sample)")] = 600,
    device_threads: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="torch CPU threads")] = DEFAULT_CPU_THREADS,
    cache_dir: Annotated[Optional[Path], typer.Option(callback=cache_folder_option, help="embedding cache folder")] = None,
) -> None:
    """Phase III: routed experts label held-out AlpacaEval pairs; agreement with the judge; synthetic set."""
    from trainer.experts.phase3 import agreement_markdown, run_phase3  # trainer.experts.phase3 imports pandas: on use only

    check_out_option(out)  # before any work
    set_cpu_threads(device_threads)
    result = run_phase3(run, data, out, max_pairs=max_pairs, cache_dir=cache_dir)
    typer.echo(agreement_markdown(result["agreement"]))
    typer.echo(f"synthetic preference set: {result['synthetic_set']['jsonl']} ({result['synthetic_set']['n_rows']} rows)")


def _dpo_config(policy: str, *, gpu: bool, tiny: bool, steps: Optional[int], beta: float, lr: Optional[float],
                batch_size: Optional[int], max_length: Optional[int], seed: int) -> DPORunConfig:
    """The CPU defaults or ``DPORunConfig.gpu_preset``, with every option given taking precedence; AlignmentConfigError when out of range."""
    given = {k: v for k, v in (("max_steps", steps), ("learning_rate", lr), ("batch_size", batch_size),
                               ("max_length", max_length)) if v is not None}
    if gpu:
        return DPORunConfig.gpu_preset(policy, beta=beta, seed=seed, **given)
    defaults = {"max_steps": 120, "learning_rate": 1e-3 if tiny else 1e-5, "batch_size": 8, "max_length": 256}
    return DPORunConfig(model=policy, beta=beta, seed=seed, **{**defaults, **given})


@app.command()
def dpo(
    prefs: Annotated[Path, typer.Option(help="synthetic_preferences.jsonl or .parquet written by `prism label`")],
    out: Annotated[Path, typer.Option(help="output folder: model/, dpo_results.json, dpo_loss.png")],
    policy: Annotated[Optional[str], typer.Option(help="causal LM path or hub id (e.g. Qwen/Qwen2-0.5B-Instruct)")] = None,
    tiny: Annotated[bool, typer.Option("--tiny", help="build a tiny random-weight policy (2 layers, BPE trained on the set) instead of --policy: a CPU smoke run")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="--tiny with 40 steps")] = False,
    steps: Annotated[Optional[int], typer.Option(min=1, max=COUNT_MAX, help="optimiser steps (default 120; 300 with --gpu; at most 40 with --quick)")] = None,
    beta: Annotated[float, typer.Option(callback=finite_option, help="DPO beta")] = 0.1,
    lr: Annotated[Optional[float], typer.Option(callback=finite_option, help="learning rate (default 1e-5; 5e-7 with --gpu; 1e-3 with --tiny)")] = None,
    batch_size: Annotated[Optional[int], typer.Option(min=1, max=COUNT_MAX, help="pairs per batch (default 8; 8 x 4 accumulation with --gpu)")] = None,
    max_length: Annotated[Optional[int], typer.Option(min=16, max=COUNT_MAX, help="tokens per prompt + response (default 256; 1024 with --gpu)")] = None,
    heldout_fraction: Annotated[float, typer.Option(callback=finite_option, help="share of prompts held out for the implicit-reward accuracy")] = 0.2,
    gpu: Annotated[bool, typer.Option("--gpu", help="the GPU preset: cuda, bf16, gradient checkpointing (DPORunConfig.gpu_preset)")] = False,
    seed: Annotated[int, typer.Option(min=0, max=SEED_MAX)] = 0,
) -> None:
    """Phase III step 2: DPO (TRL) of a policy on the synthetic set; held-out accuracy against the judge."""
    import pandas as pd  # pandas: optional heavy dependency, imported on use


    tiny = tiny or quick
    if quick:
        steps = min(steps or 40, 40)
    if (policy is None) == (not tiny):
        raise typer.BadParameter("give exactly one of --policy PATH_OR_ID and --tiny/--quick")
    if not 0.0 < heldout_fraction < 1.0:  # NaN and inf: refused by finite_option while parsing
        raise typer.BadParameter(f"--heldout-fraction must lie in (0, 1) (at least one prompt is held out for "
                                 f"the accuracy), got {heldout_fraction}")
    check_out_option(out)  # before any work
    if gpu:  # before OUT/tiny_policy is built
        try:
            check_torch_device("--gpu", "cuda")
        except InvalidInputError as exc:
            raise typer.BadParameter(str(exc)) from exc
    try:
        rows = pd.read_parquet(prefs) if prefs.suffix == ".parquet" else pd.read_json(prefs, lines=True)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid and pandas' JSON errors are ValueErrors
        raise typer.BadParameter(f"--prefs {prefs}: not a preference set written by `fedroute prism label` "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    for col in ("prompt", "chosen", "rejected", "prompt_id"):
        if col not in rows.columns:
            raise typer.BadParameter(f"--prefs {prefs} has no column {col!r}; write it with `fedroute prism label`")
    missing = np.flatnonzero(rows.prompt_id.isna().to_numpy())
    if missing.size:
        raise typer.BadParameter(f"--prefs {prefs}: row {int(missing[0])} has no prompt_id (the held-out split is by prompt)")
    # ids of mixed types (1 and "1", hand-edited files) are sorted by type, then text: sorting them as
    # they are raised a TypeError traceback
    prompts = np.array(sorted(rows.prompt_id.unique(), key=lambda v: (type(v).__name__, str(v))), dtype=object)
    held = set(np.random.default_rng(seed).permutation(prompts)[: max(1, int(round(heldout_fraction * len(prompts))))])
    train_df, held_df = rows[~rows.prompt_id.isin(held)], rows[rows.prompt_id.isin(held)]
    if train_df.empty:
        raise typer.BadParameter(f"--prefs {prefs} holds {len(prompts)} prompt(s) and all are held out "
                                 f"(--heldout-fraction {heldout_fraction}): no pair is left to train on")
    train_rows = train_df[["prompt", "chosen", "rejected"]].to_dict("records")
    # held-out pairs are oriented by the judge: the accuracy says whether the policy learned the judge's
    # preference through the experts' labels
    agrees = held_df["judge_agrees"].to_numpy(bool) if "judge_agrees" in held_df else np.ones(len(held_df), bool)
    held_rows = [{"prompt": r.prompt, "chosen": r.chosen if a else r.rejected, "rejected": r.rejected if a else r.chosen}
                 for r, a in zip(held_df.itertuples(), agrees)]
    if tiny:
        policy = str(out / "tiny_policy")
    try:  # every row and setting is checked before anything is written to --out
        train_rows = validate_preference_rows(train_rows, what="train rows")
        held_rows = validate_preference_rows(held_rows, what="held-out rows")
        args = _dpo_config(policy, gpu=gpu, tiny=tiny, steps=steps, beta=beta, lr=lr, batch_size=batch_size,
                           max_length=max_length, seed=seed)
    except AlignmentConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if tiny:  # otherwise DPOAlignmentTrainer.train creates --out once the policy has loaded
        out.mkdir(parents=True, exist_ok=True)
        # an earlier run's results were measured against the tiny_policy/ rebuilt here: they go first, so a
        # rerun that fails or is stopped leaves none beside another reference policy
        for name in ("dpo_results.json", "dpo_loss.png"):
            (out / name).unlink(missing_ok=True)
        texts = [t for r in train_rows for t in (r["prompt"], r["chosen"], r["rejected"])]
        build_tiny_causal_lm(out / "tiny_policy", train_texts=texts, vocab_size=2000, overwrite=True,
                             seed=seed, max_positions=max(512, args.max_length))
    try:
        result = DPOAlignmentTrainer(args).train(train_rows, held_rows, out)
    except AlignmentConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"DPO loss {result.loss_first:.4f} -> {result.loss_last:.4f} over {len(result.loss_per_step)} steps; "
               f"held-out implicit-reward accuracy vs the judge {result.heldout_implicit_reward_accuracy_before:.3f} -> "
               f"{result.heldout_implicit_reward_accuracy_after:.3f} ({result.n_heldout} pairs); {out / 'dpo_results.json'}")
    if result.n_train_dropped:
        typer.echo(f"note: {result.n_train_dropped} of {result.n_train + result.n_train_dropped} training pairs were left "
                   f"out (their prompt alone fills --max-length {args.max_length} tokens)")
