"""Route a few prompts with a router trained by the main job, at several values of lam.

    HF_HUB_OFFLINE=1 fedroute simulate --data ../shared/data/routerbench --out results/
    HF_HUB_OFFLINE=1 python examples/route_with_trained_router.py results/routers/kmeans

Prints, per prompt and lam (1/USD), the chosen model with its predicted accuracy and cost (USD).
This uses the trainer's Python routers (torch); the on-device path is ``fedroute export`` +
``sdk.Router`` (see ``examples/cost_aware_chat.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from sdk.errors import FedrouteError
from trainer.embeddings import EmbedderConfig, embed_texts
from trainer.kinds import load_router

PROMPTS = [
    "Write a function to find the longest common prefix of a list of strings.",
    "The trophy didn't fit in the suitcase because the _ was too big.\nA) trophy\nB) suitcase\nAnswer:",
    "Which process moves water from the leaves of a plant into the air?\nA) transpiration\nB) condensation\n"
    "C) precipitation\nD) infiltration\nAnswer:",
]
LAMBDAS = (0.0, 30.0, 300.0, 3000.0)


def main(router_dir: Path) -> int:
    try:
        router = load_router(router_dir)
    except FedrouteError as exc:  # a wrong path, or the main job not run yet: one line, not a traceback
        print(f"error: {exc}\n(train a router first: the main job writes results/routers/kmeans and .../mlp)",
              file=sys.stderr)
        return 2
    spec = router.embedder or {}
    config = EmbedderConfig(model=spec.get("name", "all-MiniLM-L6-v2"), max_tokens=spec.get("max_tokens", 256),
                            truncation_side=spec.get("truncation_side", "left"))
    emb = embed_texts(PROMPTS, config, show_progress=False)
    acc, cost = router.predict(emb)
    for lam in LAMBDAS:
        choice = router.decide(emb, lam)
        print(f"\nlam = {lam:g} / USD")
        for i, prompt in enumerate(PROMPTS):
            m = int(choice[i])
            print(f"  {router.models[m]:<36} acc~{acc[i, m]:.2f}  cost~${cost[i, m]:.5f}  | {prompt.splitlines()[0][:50]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "results/routers/kmeans")))
