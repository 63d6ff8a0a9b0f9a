"""Hold a budget in USD per 1,000 queries with ``sdk.BudgetController``, offline, on RouterBench prompts.

Build a bundle first (README, quick start 0: ``fedroute simulate`` + ``fedroute keygen`` +
``fedroute export``), then:

    python examples/budget_controller.py --bundle bundles/kmeans --public-key keys/signing.pub \
        --data ../shared/data/routerbench --budget 0.4 --task winogrande

Each prompt of a stream drawn from the RouterBench test split (one ``--task``, or all) is routed by
``controller.choose(prompt)``; instead of calling the model, the example records the cost RouterBench
measured for that model on that prompt (``controller.record(model, cost_usd)``), as an app records
what its LLM call cost. Every 100 queries it prints the controller's ``lam`` and the realised spend
over its window; at the end, the spend after the warm-up (the first ``--window`` queries) against
the budget, and the controller's drift events. Needs pandas + pyarrow to read the parquet file
(the ``trainer`` extra); the routing itself needs only the SDK.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np

from sdk import BudgetController, Router
from sdk.errors import FedrouteError


def load_stream(data: Path, task: str | None, n: int, seed: int) -> tuple[list[str], list[dict[str, float]]]:
    """``n`` test prompts (drawn with replacement, one task or all) and, per prompt, model -> cost in USD."""
    import pandas as pd  # trainer extra (pandas, pyarrow): reads the RouterBench parquet file

    frame = pd.read_parquet(Path(data) / "test.parquet")
    if task is not None:
        if task not in set(frame["task"]):
            raise SystemExit(f"--task {task!r} is not in {sorted(set(frame['task']))}")
        frame = frame[frame["task"] == task]
    picks = np.random.default_rng(seed).integers(0, len(frame), n)
    cost_columns = [c for c in frame.columns if c.endswith("|cost_usd")]
    rows = frame.iloc[picks]
    costs = [{c.split("|")[0]: float(r[c]) for c in cost_columns} for _, r in rows.iterrows()]
    return list(rows["prompt"]), costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--public-key", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=Path("../shared/data/routerbench"))
    parser.add_argument("--budget", type=float, default=0.4, help="USD per 1,000 queries")
    parser.add_argument("--task", default=None, help="arc-challenge, mbpp or winogrande (default: all tasks)")
    parser.add_argument("--queries", type=int, default=600)
    parser.add_argument("--window", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    try:
        router = Router.load(args.bundle, args.public_key)
        controller = BudgetController(router, args.budget, window=args.window, seed=args.seed)
    except FedrouteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts, costs = load_stream(args.data, args.task, args.queries, args.seed)
    realised = []
    for i, (prompt, cost_of) in enumerate(zip(prompts, costs), start=1):
        model = controller.choose(prompt)
        cost = cost_of[model]  # what the call would have cost (RouterBench's measurement)
        controller.record(model, cost)
        realised.append(cost)
        if i % 100 == 0:
            print(f"{i:5d} queries  lam {controller.lam:10.4g} /USD  realised {controller.realised_usd_per_1k:.4f} "
                  f"USD per 1k over the last {min(i, args.window)}")
    after = 1000.0 * float(np.mean(realised[args.window:])) if len(realised) > args.window else float("nan")
    print(f"budget {args.budget:.4f} USD per 1k; realised after the warm-up of {args.window}: {after:.4f} "
          f"USD per 1k ({after / args.budget - 1:+.1%})")
    for event in controller.events:
        print(f"event {event.kind} at query {event.n_recorded}: {event.message}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
