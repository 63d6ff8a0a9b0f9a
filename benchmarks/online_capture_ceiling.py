"""How much of the validation savings target any one-pass logging policy can reach: the capture share of
``benchmarks/online_settings.py --stage targets`` (never test) when the labels of the cell that decides the
saving go, by oracle, to the pair that decides it.

On the stream split, mbpp's gpt-4 / gpt-3.5 gap (0.049 on 224 queries) is the first step down of a dense cell
table, just ahead of arc -> Yi-34B; a one-pass router saves at gpt-4's accuracy only when its own estimate of
that gap puts the step first. Per seed, the default ``top_two`` run's labels are kept everywhere except in the
cell whose queries are mostly mbpp, where (``pair x``) a share x of its queries, drawn at random, log gpt-4 or
gpt-3.5 (1/2 each) instead (one label per query: an oracle ``first_step`` whose challenger share is x), or (``paired``) every query of
the cell logs both models on top of top_two's label (three labels per query: more than any one-label policy
can log; the information about the gap of a dense table in that cell). The final table is the shrunk cell
table at each ``--final-priors`` strength; reported: resampled capture and never shares (as ``online_settings``)
and the share of seeds whose first step down from gpt-4 is mbpp -> gpt-3.5.
Run: ``PYTHONPATH=. HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/online_capture_ceiling.py [--seeds 60] [--pair-shares 0.25,0.5]``;
writes ``docs/results/online_capture_ceiling.json``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from benchmarks.online_savings_diagnosis import top_of_curve
from benchmarks.online_settings import DATA, TARGETS, _load, resampled_cost_at_best
from sdk.atomic_write import write_atomic
from sdk.cell_statistics import CellStatistics
from trainer import metrics
from trainer.online import OnlineConfig, _seed_cells, run_online_seed
from trainer.routers.shrinkage import shrunk_means

GPT4, GPT35 = 5, 4  # column indices in the RouterBench pool (checked against the model names in main)


def _stats(q: np.ndarray, m: np.ndarray, cells: np.ndarray, stream, n_cells: int) -> CellStatistics:
    out = np.zeros((3, n_cells, stream.accuracy.shape[1]))
    for arr, val in ((out[0], 1.0), (out[1], stream.accuracy[q, m]), (out[2], stream.cost[q, m])):
        np.add.at(arr, (cells[q], m), val)
    return CellStatistics(out[0], np.minimum(out[1], out[0]), out[2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=60)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--final-priors", type=str, default="0,8,32")
    ap.add_argument("--pair-shares", type=str, default="0.25,0.35,0.5,0.75,0.9")
    args = ap.parse_args()
    import benchmarks.online_settings as settings

    _load(args.data)
    stream, vset, _, resamples = settings._DATA
    from trainer.data.routerbench import load_routerbench_dir

    models = load_routerbench_dir(args.data)[0].models
    assert models[GPT4].startswith("gpt-4") and models[GPT35].startswith("gpt-3.5")
    cfg = OnlineConfig(policies=("top_two",))
    refs = (metrics.zero_router_report(vset.accuracy, vset.cost).auc, metrics.oracle_report(vset.accuracy, vset.cost).auc)
    kappas = [float(k) for k in args.final_priors.split(",")]
    shares = [float(x) for x in args.pair_shares.split(",")]
    arms = [(a, k) for a in ("top_two", *(f"pair {x:g}" for x in shares), "paired") for k in kappas]
    cost_at: dict = {arm: [] for arm in arms}
    first: dict = {arm: Counter() for arm in arms}
    for seed in tqdm(range(args.seeds), desc="seeds"):
        _, centroids, cells = _seed_cells(stream, cfg, np.random.default_rng(seed))
        n_cells = centroids.shape[0]
        mbpp_cell = Counter(cells[stream.tasks == "mbpp"].tolist()).most_common(1)[0][0]
        run = run_online_seed(stream, vset, cfg, seed, refs)["top_two"]
        q, m = run.chosen[:, 0], run.chosen[:, 1]
        in_cell = cells[q] == mbpp_cell
        both = stream.available[q, GPT4] & stream.available[q, GPT35]
        rng = np.random.default_rng([seed, 26])
        swap = in_cell & both
        draw, side = rng.random(q.shape[0]), np.where(rng.random(q.shape[0]) < 0.5, GPT4, GPT35)
        logs = {"top_two": (q, m), **{f"pair {x:g}": (q, np.where(swap & (draw < x), side, m)) for x in shares},
                "paired": (np.concatenate([q, q[swap], q[swap]]),
                           np.concatenate([m, np.full(swap.sum(), GPT4), np.full(swap.sum(), GPT35)]))}
        for arm in arms:
            stats = _stats(*logs[arm[0]], cells, stream, n_cells)
            tables = shrunk_means(stats, arm[1], cfg.kmeans.model_prior_strength, cfg.kmeans.prior)
            if arm == ("top_two", cfg.kmeans.prior_strength):  # the rebuilt final table is the run's own
                assert np.allclose(tables[0], run.tables[0]) and np.allclose(tables[1], run.tables[1])
            cost_at[arm].append(resampled_cost_at_best(tables, centroids, vset, resamples))
            all_best, step = top_of_curve(*tables, GPT4)
            first[arm]["mbpp -> gpt-3.5" if all_best and step == (mbpp_cell, GPT35) else "other"] += 1
    rows = []
    for arm in arms:
        c = np.array(cost_at[arm])
        per_seed = (1.0 - c >= TARGETS["saved"]).mean(axis=1)
        rows.append({"labels": arm[0], "final_prior_strength": arm[1],
                     "resampled_capture_share": float(per_seed.mean()),
                     "resampled_capture_share_se": float(per_seed.std(ddof=1) / np.sqrt(args.seeds)),
                     "resampled_never_share": float(np.isinf(c).mean()),
                     "first_step_mbpp_to_gpt35_share": first[arm]["mbpp -> gpt-3.5"] / args.seeds})
        print(rows[-1], flush=True)
    out = Path(__file__).resolve().parents[1] / "docs" / "results" / "online_capture_ceiling.json"
    write_atomic(out, json.dumps({"seeds": args.seeds, "target_capture": TARGETS["capture"], "rows": rows},
                                 indent=1).encode())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
