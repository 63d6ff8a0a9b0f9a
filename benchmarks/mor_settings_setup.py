"""Shared setup of the MoR settings benchmarks (``benchmarks/mor_*_settings.py``): the config and trainer of a
run (default or ``--quick`` pool, every client an MLP: a LoRA candidate costs ~1 s per pair on this CPU and the
settings these scripts choose do not depend on the clients' architecture), the clients' normalised scores of a
set of pairs, and the atomic JSON write to ``docs/<stem>[_quick].json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from sdk.atomic_write import write_atomic
from trainer.rewards.mor_trainer import MoRConfig, MoRTrainer
from trainer.rewards.reward_models import ClientRewardModel, PreferencePairs

DOCS = Path(__file__).resolve().parents[1] / "docs"


@dataclass
class MoRBench:
    """One settings run: ``quick`` (the ``--quick`` pool), ``cfg`` (every client an MLP), ``trainer`` (no
    progress bars), ``names`` (client names in order)."""

    quick: bool
    cfg: MoRConfig
    trainer: MoRTrainer
    names: list[str]


def setup(argv: list[str], **overrides) -> MoRBench:
    """The run of ``argv`` (``--quick`` selects :meth:`MoRConfig.quick`); one torch thread (the machine is shared).
    ``overrides`` replace MoRConfig fields (after the all-MLP archs)."""
    torch.set_num_threads(1)
    quick = "--quick" in argv
    cfg = MoRConfig.quick() if quick else MoRConfig()
    cfg = replace(cfg, client_archs=tuple("mlp" for _ in cfg.client_names), **overrides)
    return MoRBench(quick, cfg, MoRTrainer(cfg, show_progress=False), list(cfg.client_names))


def normalised_scores(trainer: MoRTrainer, rms: list[ClientRewardModel], pairs: PreferencePairs,
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every client RM's normalised scores of ``pairs`` (MLP reward models: from the cached pair features).

    Returns (s (2, n, K) float64 over (chosen, rejected), features of chosen and of rejected (n, d_in) float32,
    prompt groups (n,) int64: pairs of one prompt share an id)."""
    fc, fr = trainer.features(pairs)
    s = np.stack([np.stack([rm.normaliser_(rm.raw_scores_from_features(fc)), rm.normaliser_(rm.raw_scores_from_features(fr))])
                  for rm in rms], -1).astype(np.float64)
    groups = np.unique(np.asarray(pairs.prompts), return_inverse=True)[1]
    return s, fc, fr, groups


def json_path(stem: str, quick: bool) -> Path:
    """``docs/<stem>[_quick].json``."""
    return DOCS / f"{stem}{'_quick' if quick else ''}.json"


def write_json(stem: str, quick: bool, data: dict) -> Path:
    """Write ``data`` atomically to :func:`json_path`; returns the path."""
    path = json_path(stem, quick)
    write_atomic(path, json.dumps(data, indent=1).encode())
    return path
