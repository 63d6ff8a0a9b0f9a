"""Shared parts of the budget benchmarks: federated routers exported as real bundles, query streams
by task, and the replay of a stream through the one-off calibration or the :class:`sdk.BudgetController`.

Used by ``benchmarks/budget_controller_settings.py`` (validation streams from the train split,
picks the controller's constants) and ``benchmarks/budget_control.py`` (test-split streams).

A replay never embeds a query: the bundle's router heads predict once for the pool of distinct
prompts from their cached trainer embeddings (:meth:`sdk.Router.predict_from_embeddings`), and each
stream position looks its row up. The
realised cost of a routed query is the RouterBench cost of the chosen model on that prompt (USD),
its accuracy that model's correctness.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sdk import BudgetController, Router
from sdk.spend_curve import SpendCurve, decision_steps
from sdk.utility import decide

#: Queries per stream.
STREAM_LENGTH = 3000
#: The controller's window, and the warm-up excluded from the post-warm-up figures.
WINDOW = 200
WARM_UP = 200
#: Budgets, as positions t between the predicted spend of the cheapest decisions (t = 0) and of
#: lam = 0 (t = 1) on the calibration sample, geometrically: S_min^(1 - t) * S_max^t.
BUDGET_POSITIONS = (0.25, 0.5, 0.75)


@dataclass(frozen=True)
class Pool:
    """Distinct prompts with their predictions and true outcomes.

    prompts : list of n str. tasks : (n,) object, task names.
    accuracy, cost : (n, n_models) float64, the bundle's predictions (cost USD per query).
    true_accuracy, true_cost : (n, n_models) float64, RouterBench outcomes (cost USD per query).
    """

    prompts: list[str]
    tasks: np.ndarray
    accuracy: np.ndarray
    cost: np.ndarray
    true_accuracy: np.ndarray
    true_cost: np.ndarray


def make_pool(router: Router, table, embeddings: np.ndarray) -> Pool:
    """Predict ``table``'s prompts (a fully labelled :class:`trainer.data.routerbench.EvalTable`) with
    ``router`` from their cached trainer embeddings (``(n, d_emb) float32``, sentence-transformers, the
    same encoder and truncation as the bundle's ONNX one; the export's parity gate bounds the gap)."""
    acc, cost = router.predict_from_embeddings(np.asarray(embeddings, dtype=np.float32))
    return Pool(list(table.prompts), np.asarray(table.tasks), acc, cost,
                np.asarray(table.accuracy, dtype=np.float64), np.asarray(table.cost, dtype=np.float64))


def embed(table) -> np.ndarray:
    """Embeddings of ``table``'s prompts with the main job's embedder config, from the shared cache."""
    from trainer.embeddings import EmbedderConfig, embed_texts  # trainer extra (sentence-transformers)

    return embed_texts(list(table.prompts), EmbedderConfig(), None, show_progress=False)


def train_routers(train, train_embeddings: np.ndarray, kinds: Sequence[str], seed: int, test_source: str) -> dict:
    """Federated routers of the main job's protocol (METRICS.md simulation, one seed) on ``train``.

    Returns dict kind -> trainer router (with the embedder identity and provenance export needs).
    """
    import torch  # trainer extra (torch): the MLP router trains with it

    from trainer import kinds as trainer_kinds  # trainer extra: imports torch
    from trainer.simulation import SimulationConfig, simulate_clients  # trainer extra: imports torch

    torch.set_num_threads(1)
    config = SimulationConfig(routers=tuple(kinds))
    rng = np.random.default_rng(seed)
    clients, _ = simulate_clients(train, train_embeddings, config, rng)
    out = {}
    for kind in kinds:
        router = trainer_kinds.get(kind).fit_federated(clients, train.models, config, np.random.default_rng(seed),
                                                       progress=True)
        router.embedder = {"name": "all-MiniLM-L6-v2", "dim": int(train_embeddings.shape[1]), "max_tokens": 256,
                           "truncation_side": "left", "pooling": "mean", "normalised": True}
        router.provenance = {"train": train.source, "test": test_source, "seed": seed}
        out[kind] = router
    return out


#: Test prompts of the exporter's parity gate (a fidelity check of the ONNX export; a subset keeps it short).
PARITY_PROMPTS = 60


def export_routers(routers: dict, out_dir: Path, data: Path) -> dict[str, Router]:
    """Export each trainer router as a signed bundle (parity-checked on :data:`PARITY_PROMPTS` test
    prompts, :func:`export.pipeline.export_bundle`) under ``out_dir`` and load it with
    :meth:`sdk.Router.load`. Returns dict kind -> sdk Router."""
    import pandas as pd  # trainer extra (pandas): the parity file

    from export.pipeline import export_bundle  # export extra (optimum, onnx), only when exporting
    from export.signing import generate_keypair  # export extra (cryptography), only when exporting

    out_dir = Path(out_dir)
    key, pub = generate_keypair(out_dir / "keys", overwrite=True)
    frame = pd.read_parquet(Path(data) / "test.parquet")
    parity = out_dir / "parity.parquet"
    frame.dropna().sample(PARITY_PROMPTS, random_state=0).to_parquet(parity)
    loaded = {}
    for kind, router in routers.items():
        router.save(out_dir / "routers" / kind)
        export_bundle(out_dir / "routers" / kind, out_dir / "bundles" / kind, key, data=parity, progress=lambda _m: None)
        loaded[kind] = Router.load(out_dir / "bundles" / kind, pub)
    return loaded


def load_bundles(bundles: Path, public_key: Path, kinds: Sequence[str]) -> dict[str, Router]:
    """Routers from existing bundles ``bundles/<kind>``."""
    return {kind: Router.load(Path(bundles) / kind, public_key) for kind in kinds}


def budgets_from_calibration(pool: Pool, rows: np.ndarray) -> list[float]:
    """The budgets (USD per 1,000 queries) at :data:`BUDGET_POSITIONS` of the predicted spend range on ``rows``."""
    curve = SpendCurve.from_steps(decision_steps(pool.accuracy[rows], pool.cost[rows]))
    low, high = float(curve.levels[-1]), float(curve.levels[0])
    return [1000.0 * low ** (1 - t) * high ** t for t in BUDGET_POSITIONS]


def make_streams(tasks: np.ndarray, rows: np.ndarray, length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Streams of pool indices drawn (with replacement) from ``rows``: ``mixed`` (all tasks), one per
    task (``<task> only``), and two shifting ones (the task changes mid-stream).

    Returns dict name -> (length,) int64 indices into the pool.
    """
    names = sorted(set(tasks[rows]))
    by_task = {t: rows[tasks[rows] == t] for t in names}

    def draw(segments: Sequence[tuple[str | None, int]]) -> np.ndarray:
        parts = [rng.choice(rows if t is None else by_task[t], size=n, replace=True) for t, n in segments]
        return np.concatenate(parts).astype(np.int64)

    streams = {"mixed": draw([(None, length)])}
    for t in names:
        streams[f"{t} only"] = draw([(t, length)])
    if {"winogrande", "mbpp", "arc-challenge"} <= set(names):
        half, third = length // 2, length // 3
        streams["winogrande -> mbpp"] = draw([("winogrande", half), ("mbpp", length - half)])
        streams["mbpp -> arc -> winogrande"] = draw([("mbpp", third), ("arc-challenge", third),
                                                     ("winogrande", length - 2 * third)])
    return streams


@dataclass
class Replay:
    """One stream routed by one method.

    costs, correct : (length,) float64, realised USD and correctness per query.
    lams : (length,) float64, the lam in force (the controller's ``lam`` before each choice).
    """

    costs: np.ndarray
    correct: np.ndarray
    lams: np.ndarray

    def summary(self, budget_usd_per_1k: float, warm_up: int) -> dict:
        """Spend per 1k queries and accuracy after ``warm_up`` queries, their ratio to the budget,
        and the largest windowed (``WINDOW``) deviation after the warm-up."""
        c = self.costs[warm_up:]
        spend = 1000.0 * float(c.mean())
        windows = 1000.0 * np.convolve(self.costs, np.ones(WINDOW) / WINDOW, mode="valid")[warm_up:]
        return {"spend_usd_per_1k": spend, "ratio": spend / budget_usd_per_1k,
                "accuracy": float(self.correct[warm_up:].mean()),
                "worst_window_ratio": float(windows[np.argmax(np.abs(windows / budget_usd_per_1k - 1))]
                                            / budget_usd_per_1k) if windows.size else math.nan}


def replay_fixed(pool: Pool, stream: np.ndarray, lam: float) -> Replay:
    """Route every query at one ``lam`` (the one-off calibration, or a lam known in hindsight)."""
    picked = decide(pool.accuracy[stream], pool.cost[stream], lam)
    return Replay(pool.true_cost[stream, picked], pool.true_accuracy[stream, picked], np.full(stream.size, lam))


def replay_controller(router: Router, pool: Pool, stream: np.ndarray, budget: float, seed: int,
                      **settings) -> Replay:
    """Route the stream with a fresh :class:`sdk.BudgetController` (``choose`` then ``record`` of the true cost)."""
    controller = BudgetController(router, budget, window=WINDOW, seed=seed, **settings)
    index = {m: j for j, m in enumerate(router.model_ids)}
    costs, correct, lams = np.zeros(stream.size), np.zeros(stream.size), np.zeros(stream.size)
    for i, q in enumerate(stream):
        lams[i] = controller.lam
        j = index[controller.choose_from_predictions(pool.accuracy[q], pool.cost[q])]
        costs[i], correct[i] = pool.true_cost[q, j], pool.true_accuracy[q, j]
        controller.record(router.model_ids[j], float(costs[i]))
    return Replay(costs, correct, lams)


def calibrated_lam(pool: Pool, rows: np.ndarray, budget: float) -> float:
    """``Router.lam_for_budget``'s rule on the predictions of ``rows``: a lam of the first step of
    ``lam`` whose predicted mean cost fits ``budget`` (USD per 1k), or of the cheapest step if none
    does (``lam_for_budget`` raises there). Same decisions as ``lam_for_budget``'s bisection result."""
    curve = SpendCurve.from_steps(decision_steps(pool.accuracy[rows], pool.cost[rows]))
    return curve.mix_for(budget / 1000.0).lam_high


def scratch_dir() -> Path:
    """A fresh temporary folder (bundles and keys of a run)."""
    return Path(tempfile.mkdtemp(prefix="fedroute-budget-"))
