"""Talk to a running ``fedroute proxy`` with the official ``openai`` client: route, stream, budget, pass-through,
score an answer, read the metrics. Walk-through (stub upstream, proxy, this script): docs/openai_proxy.md.

    FEDROUTE_PROXY_TOKEN=$(cat proxy_tokens) python examples/proxy_client.py --base-url http://127.0.0.1:8080/v1 --score 1

Any OpenAI client works the same way: point its base URL at the proxy, use a proxy token as the API
key, and ask for ``model="fedroute"`` (or ``"fedroute:lam=300"``, ``"fedroute:budget=0.5"``, or a model id
to call it directly).
"""

from __future__ import annotations

import argparse
import os
import sys

import httpx
import openai

QUESTION = "Prove that the square root of 2 is irrational."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="use fedroute proxy through the openai client")
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1", help="the proxy's /v1 URL")
    parser.add_argument("--token", default=os.environ.get("FEDROUTE_PROXY_TOKEN"),
                        help="a proxy caller token (default $FEDROUTE_PROXY_TOKEN)")
    parser.add_argument("--passthrough", default=None, help="a model id to call directly (e.g. gpt-4o)")
    parser.add_argument("--score", type=float, default=None, help="score in [0, 1] to send for the first answer")
    args = parser.parse_args(argv)
    if not args.token:
        parser.error("give --token or set FEDROUTE_PROXY_TOKEN")
    root = args.base_url.rstrip("/").removesuffix("/v1")
    try:  # one plain request first: a proxy that is not (yet) listening is one clear line, not a traceback
        httpx.get(f"{root}/health", timeout=10.0).raise_for_status()
    except httpx.HTTPError as exc:
        print(f"error: no fedroute proxy answers at {root}/health ({exc}); start `fedroute proxy` first and wait "
              "until its /health answers (it loads the bundle for a few seconds)", file=sys.stderr)
        return 2
    client = openai.OpenAI(base_url=args.base_url, api_key=args.token)
    messages = [{"role": "user", "content": QUESTION}]

    print("models:", [m.id for m in client.models.list()])
    raw = client.chat.completions.with_raw_response.create(model="fedroute", messages=messages)
    reply = raw.parse()
    print(f"routed -> {raw.headers['x-fedroute-model']} (fallbacks {raw.headers['x-fedroute-fallbacks']}, "
          f"routing {raw.headers['x-fedroute-routing-ms']} ms): {reply.choices[0].message.content!r}")

    cheap = client.chat.completions.create(model="fedroute:lam=100000", messages=messages)
    print(f"lam=100000 (cost first) -> {cheap.model}")
    print("streamed: ", end="")
    for chunk in client.chat.completions.create(model="fedroute", messages=messages, stream=True):
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()
    budget = client.chat.completions.with_raw_response.create(model="fedroute:budget=0.5", messages=messages)
    print(f"budget 0.5 USD per 1k queries -> {budget.headers['x-fedroute-model']}")
    if args.passthrough:
        direct = client.chat.completions.create(model=args.passthrough, messages=messages)
        print(f"pass-through {args.passthrough} -> {direct.model}")

    headers = {"Authorization": f"Bearer {args.token}"}
    if args.score is not None:  # the app's judgement of the answer, later: appended to the device's EvalLog
        r = httpx.post(f"{root}/v1/fedroute/feedback", json={"id": reply.id, "score": args.score}, headers=headers)
        r.raise_for_status()
        print(f"scored {reply.id}: EvalLog row {r.json()['recorded']}")
    metrics = httpx.get(f"{root}/metrics", headers=headers).text
    print("\n".join(line for line in metrics.splitlines()
                    if line.startswith(("fedroute_proxy_requests_total", "fedroute_proxy_spend_usd_total"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
