"""Cost-aware chat with the drop-in client: ``sdk.routed_chat.RoutedChat`` routes each prompt on the device,
calls the chosen model through an OpenAI-compatible endpoint (falling back to the next-best model on a
timeout, 5xx or 429), records the observed cost, and logs the outcome once you score it.

Build a bundle first (README quick start 0), then, against any OpenAI-compatible endpoint:

    OPENAI_API_KEY=... python examples/cost_aware_chat.py --bundle bundles/kmeans --public-key keys/signing.pub \
        --base-url http://127.0.0.1:8000/v1 --model-map map.json --prices prices.json --score 1

``--model-map`` (JSON ``{router model id: endpoint model name}``) also picks the models called: with it,
only the router's models it names are routed to (without it, all of them, under their own names).
``--prices`` (JSON ``{model: {"input_usd_per_1m": ..., "output_usd_per_1m": ...}}``) prices the answers;
without it the bundle's price table (``fedroute export --prices``) is used, and a model with neither is
an error (the cost is never guessed). Each answer waits for its score (``--score`` or, on a terminal,
you); then ``RoutedChat.feedback`` writes one ``sdk.EvalLog`` row (score in [0, 1], observed cost in
USD, latency in ms, the query embedding, never the text) for the sync job.

``--dry-run`` prints the routing decision instead of calling a model and records the ``--score`` you
give (cost 0) in a separate log, ``chat_log.dry_run.sqlite`` unless ``--log`` says otherwise, so made-up
outcomes never reach the log the sync job reads. Needs ``pip install 'fedroute[proxy]'`` (openai) unless
``--dry-run``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sdk import EvalLog, Router
from sdk.errors import FedrouteError, PriceError

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Which gas do plants absorb from the air for photosynthesis?\nA) oxygen\nB) carbon dioxide\nC) nitrogen\nAnswer:",
    "Prove that the square root of 2 is irrational.",
]


def ask_score(given: float | None) -> float | None:
    if given is not None:
        return given
    if not sys.stdin.isatty():
        return None
    answer = input("score this answer from 0 (useless) to 1 (right), empty to skip: ").strip()
    return float(answer) if answer else None


def build_chat(router: Router, args, log: EvalLog):
    from sdk.routed_chat import RoutedChat, Upstream  # openai: needed for live calls only
    from sdk.token_prices import TokenPrice  # beside RoutedChat

    model_map = json.loads(args.model_map.read_text()) if args.model_map else {m: m for m in router.model_ids}
    prices = {m: TokenPrice(p["input_usd_per_1m"], p["output_usd_per_1m"])
              for m, p in (json.loads(args.prices.read_text()) if args.prices else {}).items()}
    upstreams = {m: Upstream(args.base_url, model=name) for m, name in model_map.items()}
    trade = {"lam": 100.0 if args.lam is None else args.lam} if args.budget is None else {"budget_usd_per_1k": args.budget}
    return RoutedChat(router, upstreams=upstreams, prices=prices, log=log, **trade)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="route prompts on the device, call the chosen model, log the outcomes")
    parser.add_argument("prompts", nargs="*", help="prompts to route (default: three examples)")
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--public-key", type=Path, required=True)
    parser.add_argument("--log", type=Path, default=None,
                        help="EvalLog SQLite file (default chat_log.sqlite, chat_log.dry_run.sqlite with --dry-run)")
    trade = parser.add_mutually_exclusive_group()
    trade.add_argument("--lam", type=float, default=None, help="cost trade-off, 1/USD (default 100)")
    trade.add_argument("--budget", type=float, default=None,
                       help="USD per 1000 queries, kept by sdk.budget.BudgetController (live calls)")
    parser.add_argument("--dry-run", action="store_true", help="print the choice, call nothing")
    parser.add_argument("--score", type=float, default=None, help="outcome score in [0, 1] to record")
    parser.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint (default: OpenAI's)")
    parser.add_argument("--model-map", type=Path, default=None, help="JSON {router model id: endpoint model}")
    parser.add_argument("--prices", type=Path, default=None,
                        help='JSON {model: {"input_usd_per_1m": x, "output_usd_per_1m": y}} (default: the bundle\'s)')
    args = parser.parse_args(argv)

    prompts = args.prompts or PROMPTS
    log_path = args.log or Path("chat_log.dry_run.sqlite" if args.dry_run else "chat_log.sqlite")
    try:
        router = Router.load(args.bundle, args.public_key)
        with EvalLog(log_path, router.model_ids) as log:
            if args.dry_run:
                return dry_run(router, prompts, args, log, log_path)
            chat = build_chat(router, args, log)
            for prompt in prompts:
                result = chat.create_routed(messages=[{"role": "user", "content": prompt}])
                outcome = result.outcome
                fell = "".join(f", {a.model} failed ({a.kind})" for a in outcome.route.failed)
                print(f"\n> {prompt[:70]!r}\n  -> {outcome.route.model}{fell}: {outcome.latency_ms:.0f} ms, "
                      f"cost {outcome.cost_usd:.6f} USD ({outcome.prompt_tokens} + {outcome.completion_tokens} tokens)")
                print(result.completion.choices[0].message.content)
                score = ask_score(args.score)
                if score is None:
                    print("  (no score given: outcome not recorded)")
                    continue
                row = chat.feedback(result.completion.id, score)
                print(f"  recorded evaluation #{row} in {log_path} (score {score}, cost {outcome.cost_usd:.6f} USD)")
            chat.close()
    except PriceError as exc:  # its message names RoutedChat's `prices=` argument; here that is --prices
        print(f"error: {exc}\n(in this example: --prices FILE, see --help)", file=sys.stderr)
        return 2
    except FedrouteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def dry_run(router: Router, prompts: list[str], args, log: EvalLog, log_path: Path) -> int:
    lam = 100.0 if args.lam is None else args.lam
    if args.budget is not None:
        lam = router.lam_for_budget(args.budget, prompts)
        print(f"lam = {lam:.4g} /USD keeps the predicted cost under {args.budget} USD per 1k queries")
    for prompt in prompts:
        choice = router.choose(prompt, lam)
        print(f"\n> {prompt[:70]!r}\n  -> {choice.model}: predicted accuracy {choice.accuracy:.3f}, "
              f"cost {choice.cost_usd * 1000:.4f} USD/1k queries (lam {lam:g}, {router.router_kind} "
              f"bundle v{choice.bundle_version})")
        score = ask_score(args.score)
        if score is None:
            print("  (no score given: outcome not recorded)")
            continue
        row = log.record_choice(choice, score, 0.0, latency_ms=0.0)
        print(f"  recorded evaluation #{row} in {log_path} (score {score}, cost 0.000000 USD) "
              "(dry run: no model was called)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
