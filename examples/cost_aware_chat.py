"""Cost-aware chat: route each prompt on the device, call the chosen model, log the outcome.

Build a bundle from the main job first (see README), then:

    python examples/cost_aware_chat.py --bundle bundles/kmeans --public-key keys/signing.pub \
        --log chat_log.sqlite --dry-run --score 1

``--dry-run`` prints the choice instead of calling a model and records the ``--score`` you give (cost 0)
in a separate log, ``chat_log.dry_run.sqlite`` unless ``--log`` says otherwise, so made-up outcomes
never reach the log the sync job reads. Without it the prompt goes to the chosen
model through an OpenAI-compatible client (``pip install openai``; ``--base-url`` / ``OPENAI_BASE_URL``
and ``OPENAI_API_KEY``; ``--model-map`` maps router model ids to the endpoint's model names).
Each outcome (score in [0, 1], cost in USD, latency in ms) is recorded in an ``sdk.EvalLog``; the
query text is not stored. The score comes from ``--score`` or, on a terminal, from you.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sdk import EvalLog, Router
from sdk.errors import FedrouteError

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Which gas do plants absorb from the air for photosynthesis?\nA) oxygen\nB) carbon dioxide\nC) nitrogen\nAnswer:",
    "Prove that the square root of 2 is irrational.",
]


def call_model(model: str, prompt: str, base_url: str | None) -> tuple[str, int, int]:
    """Answer text and (prompt, completion) token counts from an OpenAI-compatible endpoint."""
    from openai import OpenAI  # optional dependency of this example only

    client = OpenAI(base_url=base_url) if base_url else OpenAI()
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}])
    usage = reply.usage
    return reply.choices[0].message.content or "", usage.prompt_tokens, usage.completion_tokens


def ask_score(given: float | None) -> float | None:
    if given is not None:
        return given
    if not sys.stdin.isatty():
        return None
    answer = input("score this answer from 0 (useless) to 1 (right), empty to skip: ").strip()
    return float(answer) if answer else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="route prompts on the device and log the outcomes")
    parser.add_argument("prompts", nargs="*", help="prompts to route (default: three examples)")
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--public-key", type=Path, required=True)
    parser.add_argument("--log", type=Path, default=None,
                        help="EvalLog SQLite file (default chat_log.sqlite, chat_log.dry_run.sqlite with --dry-run)")
    trade = parser.add_mutually_exclusive_group()
    trade.add_argument("--lam", type=float, default=None, help="cost trade-off, 1/USD (default 100)")
    trade.add_argument("--budget", type=float, default=None, help="USD per 1000 queries; lam is derived")
    parser.add_argument("--dry-run", action="store_true", help="print the choice, call nothing")
    parser.add_argument("--score", type=float, default=None, help="outcome score in [0, 1] to record")
    parser.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint")
    parser.add_argument("--model-map", type=Path, default=None, help="JSON {router model id: endpoint model}")
    args = parser.parse_args(argv)

    prompts = args.prompts or PROMPTS
    log_path = args.log or Path("chat_log.dry_run.sqlite" if args.dry_run else "chat_log.sqlite")
    try:
        router = Router.load(args.bundle, args.public_key)
        lam = 100.0 if args.lam is None else args.lam
        if args.budget is not None:
            lam = router.lam_for_budget(args.budget, prompts)
            print(f"lam = {lam:.4g} /USD keeps the predicted cost under {args.budget} USD per 1k queries")
        model_map = json.loads(args.model_map.read_text()) if args.model_map else {}
        prices = {m.id: m for m in router.models}
        with EvalLog(log_path, router.model_ids) as log:
            for prompt in prompts:
                choice = router.choose(prompt, lam)
                print(f"\n> {prompt[:70]!r}\n  -> {choice.model}: predicted accuracy {choice.accuracy:.3f}, "
                      f"cost {choice.cost_usd * 1000:.4f} USD/1k queries (lam {lam:g}, {router.router_kind} "
                      f"bundle v{choice.bundle_version})")
                if args.dry_run:
                    cost, latency_ms = 0.0, 0.0
                else:
                    start = time.perf_counter()
                    text, n_in, n_out = call_model(model_map.get(choice.model, choice.model), prompt, args.base_url)
                    latency_ms = (time.perf_counter() - start) * 1e3
                    info = prices[choice.model]
                    if info.price_per_1k_input_usd is not None and info.price_per_1k_output_usd is not None:
                        cost = (n_in * info.price_per_1k_input_usd + n_out * info.price_per_1k_output_usd) / 1000
                    else:
                        cost = choice.cost_usd  # no price table entry: log the predicted cost
                    print(text)
                score = ask_score(args.score)
                if score is None:
                    print("  (no score given: outcome not recorded)")
                    continue
                row = log.record_choice(choice, score, cost, latency_ms=latency_ms)
                note = " (dry run: no model was called)" if args.dry_run else ""
                print(f"  recorded evaluation #{row} in {log_path} (score {score}, cost {cost:.6f} USD){note}")
    except FedrouteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
