"""torch CPU threads for the trainer's small models: one thread against torch's default, in one process.

``fedroute simulate`` / ``ablate`` / ``mor ...`` / ``prism ...`` default to ``--threads 1``
(:data:`trainer.torch_device.DEFAULT_CPU_THREADS`). This script measures why: it trains the federated MLP
router (``trainer.routers.mlp_router.train_mlp_router``, the default :class:`MLPRouterConfig` but ``rounds``)
on 10 clients x 200 sparse evaluations of the main job's shape (384-d unit embeddings, 11 models; random values,
as training time does not depend on them), alternating the thread counts ``--reps`` times so that both see the
same machine load, and reports the median seconds of each and their ratio, with the load average (``os.getloadavg``)
before and after. With ``--embed N`` it also times the main job's other torch step, embedding the first N
RouterBench training prompts with all-MiniLM-L6-v2 at 256 tokens (``trainer.embeddings.embed_texts``, an empty
cache folder per run), the same way.

``PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/torch_threads.py [--rounds 20] [--reps 3] [--embed 256]
[--data ../shared/data/routerbench] [--out docs/results]`` writes ``torch_threads.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from trainer.data.client_data import ClientData
from trainer.report import write_text
from trainer.routers.mlp_router import MLPRouterConfig, train_mlp_router

N_MODELS, D_EMB, N_CLIENTS, N_PER_CLIENT = 11, 384, 10, 200


def clients(seed: int = 0) -> list[ClientData]:
    """``N_CLIENTS`` clients of ``N_PER_CLIENT`` sparse evaluations: unit embeddings (n, 384) float32, one model each."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(N_CLIENTS):
        e = rng.normal(size=(N_PER_CLIENT, D_EMB)).astype(np.float32)
        e /= np.linalg.norm(e, axis=1, keepdims=True)
        out.append(ClientData(e, rng.integers(0, N_MODELS, N_PER_CLIENT), rng.integers(0, 2, N_PER_CLIENT).astype(np.float64),
                              rng.uniform(0, 1e-3, N_PER_CLIENT)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="FedAvg rounds per training (default 20)")
    ap.add_argument("--reps", type=int, default=3, help="alternating repetitions of each thread count (default 3)")
    ap.add_argument("--out", type=Path, default=Path("docs/results"), help="output folder (default docs/results)")
    ap.add_argument("--embed", type=int, default=0, help="also time embedding this many prompts (default 0: no)")
    ap.add_argument("--data", type=Path, default=Path("../shared/data/routerbench"), help="RouterBench folder (--embed)")
    args = ap.parse_args()
    if args.rounds < 1 or args.reps < 1 or args.embed < 0:
        ap.error("--rounds and --reps must be >= 1, --embed >= 0")
    default_threads = torch.get_num_threads()
    counts = sorted({1, default_threads})
    data, models = clients(), [f"m{i}" for i in range(N_MODELS)]
    cfg = replace(MLPRouterConfig(), rounds=args.rounds, patience=args.rounds)
    load_before = os.getloadavg()
    seconds: dict[int, list[float]] = {t: [] for t in counts}
    for _ in range(args.reps):
        for t in reversed(counts):
            torch.set_num_threads(t)
            t0 = time.perf_counter()
            train_mlp_router(data, models, cfg, np.random.default_rng(1))
            seconds[t].append(time.perf_counter() - t0)
    embed: dict[int, list[float]] = {t: [] for t in counts}
    if args.embed:
        from trainer.data.routerbench import load_routerbench_dir
        from trainer.embeddings import EmbedderConfig, embed_texts

        prompts = list(load_routerbench_dir(args.data)[0].prompts)[: args.embed]
        for _ in range(args.reps):
            for t in reversed(counts):
                torch.set_num_threads(t)
                with tempfile.TemporaryDirectory() as cache:
                    t0 = time.perf_counter()
                    embed_texts(prompts, EmbedderConfig(max_tokens=256), Path(cache), show_progress=False)
                    embed[t].append(time.perf_counter() - t0)
    torch.set_num_threads(default_threads)
    med = {t: float(np.median(v)) for t, v in seconds.items()}
    result = {"what": "train_mlp_router, 10 clients x 200 evaluations, 384-d, 11 models", "rounds": args.rounds,
              "reps": args.reps, "cpu_count": os.cpu_count(), "torch_default_threads": default_threads,
              "seconds": {str(t): v for t, v in seconds.items()}, "median_seconds": {str(t): v for t, v in med.items()},
              "default_over_one_thread": med[default_threads] / med[1],
              "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())}
    if args.embed:
        emed = {t: float(np.median(v)) for t, v in embed.items()}
        result |= {"embed_prompts": len(prompts), "embed_seconds": {str(t): v for t, v in embed.items()},
                   "embed_median_seconds": {str(t): v for t, v in emed.items()},
                   "embed_default_over_one_thread": emed[default_threads] / emed[1]}
    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "torch_threads.json", json.dumps(result, indent=2) + "\n")
    lines = ["| torch threads | median s (MLP router, %d rounds) | runs (s) |" % args.rounds, "|---|---|---|"]
    lines += [f"| {t} | {med[t]:.2f} | {', '.join(f'{x:.2f}' for x in seconds[t])} |" for t in counts]
    if args.embed:
        lines += ["", f"| torch threads | median s (embed {len(prompts)} prompts, MiniLM, 256 tokens, model load included) | runs (s) |",
                  "|---|---|---|"]
        lines += [f"| {t} | {np.median(embed[t]):.2f} | {', '.join(f'{x:.2f}' for x in embed[t])} |" for t in counts]
        lines += ["", f"embedding, torch's default / one thread: **{result['embed_default_over_one_thread']:.2f}x**"]
    lines += ["", f"torch's default ({default_threads}) / one thread: **{result['default_over_one_thread']:.1f}x**; "
              f"load average before {load_before[0]:.2f}, after {result['loadavg_after'][0]:.2f} ({os.cpu_count()} CPUs)."]
    write_text(args.out / "torch_threads.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
