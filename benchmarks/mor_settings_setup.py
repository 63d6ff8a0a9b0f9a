"""Shared setup of the MoR settings benchmarks (``benchmarks/mor_*_settings.py``): the config and trainer of a
run (default or ``--quick`` pool, every client an MLP: a LoRA candidate costs ~1 s per pair on this CPU and the
settings these scripts choose do not depend on the clients' architecture), the clients' normalised scores of a
set of pairs, the leave-one-category-out folds (:func:`loco_folds`), and the atomic JSON write to
``docs/<stem>[_quick].json``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from sdk.atomic_write import write_atomic
from trainer.rewards.client_router import ClientRouterData
from trainer.rewards.mor_trainer import ClientSplit, MoRConfig, MoRTrainer
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


def loco_categories(bench: MoRBench) -> tuple[int, list[str]]:
    """``(own, folds)``: the helpfulness (AlpacaEval) client's index and the AlpacaEval subsets of the pool that
    serve as validation categories in turn (koala, the test category, is not in the pool's client data)."""
    own = bench.cfg.client_domains.index("alpacaeval")
    pool = bench.trainer.load_pool()
    return own, sorted(set(pool[pool["client"] == bench.names[own]]["subset"]))


@dataclass
class LocoFold:
    """One leave-one-category-out cell: seed x validation category. ``category`` is removed from the
    helpfulness client ``own`` (its train, validation and test pairs); ``rms`` are every client's MLP reward
    model on that data (the other clients' trained once per seed), ``data`` the router's training data (pair
    features of each client's train pairs), ``val`` :func:`normalised_scores` of each client's validation pairs,
    ``cat`` those of the category's pairs (all of them, as ``(s, fc, fr, groups)``)."""

    seed: int
    category: str
    own: int
    clients: list[ClientSplit]
    rms: list[ClientRewardModel]
    data: list[ClientRouterData]
    val: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
    cat: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def loco_folds(bench: MoRBench, seeds=range(3)) -> Iterator[LocoFold]:
    """The leave-one-category-out folds of ``bench`` (seeds x :func:`loco_categories`), built lazily in that
    order (a consumer may change ``bench.trainer.args`` between folds, as before this was shared)."""
    trainer, names = bench.trainer, bench.names
    own, folds = loco_categories(bench)
    pool = trainer.load_pool()
    for seed in tqdm(seeds, desc="seeds"):
        split = trainer.prepare(seed)
        base_rms = {k: trainer.train_reward_model(c, "mlp", seed)[0] for k, c in enumerate(split.clients) if k != own}
        for cat in tqdm(folds, desc=f"seed {seed} folds", leave=False):
            c = split.clients[own]
            keep = lambda f: f[f["subset"] != cat].reset_index(drop=True)  # noqa: E731
            clients = list(split.clients)
            clients[own] = ClientSplit(c.name, c.domain, keep(c.train), keep(c.val), keep(c.test))
            cat_frame = pool[(pool["client"] == names[own]) & (pool["subset"] == cat)].reset_index(drop=True)
            rms = [trainer.train_reward_model(clients[k], "mlp", seed)[0] if k == own else base_rms[k] for k in range(len(names))]
            feats = [trainer.features(cl.pairs("train")) for cl in clients]
            data = [ClientRouterData(fc, fr, k) for k, (fc, fr) in enumerate(feats)]
            val = [normalised_scores(trainer, rms, cl.pairs("val")) for cl in clients]
            cat_scores = normalised_scores(trainer, rms, ClientSplit(c.name, c.domain, cat_frame, cat_frame, cat_frame).pairs("train"))
            yield LocoFold(seed, cat, own, clients, rms, data, val, cat_scores)


def score_table(cells: list[dict], default_of) -> dict[str, dict]:
    """The validation score of every candidate of ``cells`` (LOCO cells, each with ``"val"``: candidate -> per-client
    validation accuracies, and ``"cat"``: candidate -> validation-category accuracy): ``id`` (mean over cells of the
    mean over clients), ``cat``, ``score`` = (id + cat) / 2, and ``score_minus_default`` (``_se``: its standard error),
    the score paired over cells against the candidate ``default_of(name)``."""
    table = {}
    for n in cells[0]["cat"]:
        ids = np.array([np.mean(c["val"][n]) for c in cells])
        cats = np.array([c["cat"][n] for c in cells])
        d = default_of(n)
        diff = np.array([(np.mean(c["val"][n]) + c["cat"][n] - np.mean(c["val"][d]) - c["cat"][d]) / 2 for c in cells])
        table[n] = {"id": float(ids.mean()), "cat": float(cats.mean()), "score": float((ids.mean() + cats.mean()) / 2),
                    "score_minus_default": float(diff.mean()),
                    "score_minus_default_se": float(diff.std(ddof=1) / np.sqrt(len(diff)))}
    return table


def json_path(stem: str, quick: bool) -> Path:
    """``docs/<stem>[_quick].json``."""
    return DOCS / f"{stem}{'_quick' if quick else ''}.json"


def write_json(stem: str, quick: bool, data: dict) -> Path:
    """Write ``data`` atomically to :func:`json_path`; returns the path."""
    path = json_path(stem, quick)
    write_atomic(path, json.dumps(data, indent=1).encode())
    return path


def print_candidates(table: dict[str, dict], name_width: int, extra=lambda v: "") -> None:
    """Print :func:`score_table`'s rows, best score first: ID and category accuracy, score, paired difference
    to the default ± its standard error, then ``extra(row)``."""
    for n, v in sorted(table.items(), key=lambda kv: -kv[1]["score"]):
        print(f"{n:{name_width}s} id {v['id']:.4f} cat {v['cat']:.4f} score {v['score']:.4f} "
              f"vs default {v['score_minus_default']:+.4f} ± {v['score_minus_default_se']:.4f}{extra(v)}")
