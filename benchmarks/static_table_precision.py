"""Which static table should a bundle ship by default, float16 or int8? Chosen on validation prompts.

Validation prompts: ``--n-prompts`` rows drawn (seed 0) from the RouterBench **train** split (the
test split is never used to choose a setting). For each table precision, in one process:

- cosine of the device encoder (:class:`sdk.static_embedder.StaticEmbedder`, one query at a time)
  against the trainer's ``model2vec`` embeddings (mean, min), gated as export's parity
  (:func:`export.parity.cosine_failures`);
- routing decisions of each saved router (``--routers``: the folder of ``routers/`` written by
  ``fedroute simulate --embedder static:...``) on the device's vs the trainer's embeddings, over
  the METRICS.md lambda grid (:func:`export.parity.decision_agreement`);
- the table file's size (bytes) and the encoder's median latency (ms, one query at a time).

Rule: int8 is the default when it passes every gate (cosine, decisions >= 0.99) and is smaller;
otherwise float16.

    python benchmarks/static_table_precision.py --data ../shared/data/routerbench \
        --routers results/static/routers --out docs/results

Writes ``static_table_precision.json`` and ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from choose_latency import time_calls


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="RouterBench folder (train.parquet)")
    parser.add_argument("--routers", type=Path, required=True, help="routers/ of a static simulate run")
    parser.add_argument("--embedder", default="static:all-MiniLM-L6-v2")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--n-prompts", type=int, default=500)
    args = parser.parse_args(argv)

    from tqdm.auto import tqdm

    from export.parity import MIN_DECISION_AGREEMENT, cosine_failures, cosine_stats, decision_agreement
    from sdk.static_embedder import STATIC_TABLE_FILES, StaticEmbedder, encode_table
    from trainer import metrics
    from trainer.data.routerbench import load_routerbench_dir
    from trainer.embeddings import EmbedderConfig, default_cache_dir
    from trainer.kinds import load_router
    from trainer.static_embedder import encode_static

    train = load_routerbench_dir(args.data)[0]
    rng = np.random.default_rng(0)
    prompts = [train.prompts[i] for i in np.sort(rng.choice(train.n_queries, args.n_prompts, replace=False))]
    config = EmbedderConfig(model=args.embedder)
    model = config.kind.model(config.spec, default_cache_dir())
    reference = encode_static(model, prompts)
    routers = {d.name: load_router(d) for d in sorted(args.routers.iterdir()) if (d / "router.json").exists()}
    lambdas = metrics.lambda_grid()
    rows = {}
    for precision in tqdm(list(STATIC_TABLE_FILES), desc="table precision"):
        table = encode_table(model.stored_table, precision)
        encoder = StaticEmbedder(model.tokenizer.to_str(), table, model.stored_table.shape[1])
        emb = np.concatenate([encoder.embed([p]) for p in prompts])
        cos = cosine_stats(emb, reference)
        agree = {kind: decision_agreement(r.predict(emb), r.predict(reference), lambdas) for kind, r in routers.items()}
        failures = cosine_failures(precision, cos) + [
            f"{kind} decisions agree {a:.4f} < {MIN_DECISION_AGREEMENT}" for kind, a in agree.items()
            if not a >= MIN_DECISION_AGREEMENT]
        rows[precision] = {"file": STATIC_TABLE_FILES[precision], "bytes": len(table), "cosine": cos,
                           "decision_agreement": agree, "encode_ms": time_calls(lambda p: encoder.embed([p]), prompts),
                           "failures": failures, "passed": not failures}
    smaller = min(rows, key=lambda p: rows[p]["bytes"])
    default = smaller if rows[smaller]["passed"] else "fp32"
    result = {"validation": {"split": "train", "n_prompts": len(prompts), "seed": 0}, "embedder": args.embedder,
              "routers": sorted(routers), "precisions": rows, "default": default,
              "rule": "int8 when it passes every gate and is smaller, else float16"}
    from trainer.report import write_text  # atomic: a killed run leaves the old file

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "static_table_precision.json", json.dumps(result, indent=2) + "\n")
    lines = [f"Static table precision on {len(prompts)} validation prompts (train split, seed 0), device encoder vs "
             "model2vec:", "",
             "| table | file MB | cosine mean | cosine min | decisions agree (" + ", ".join(sorted(routers)) +
             ") | encode ms (median) | gates |", "|---|---|---|---|---|---|---|"]
    for p, r in rows.items():
        agree = ", ".join(f"{r['decision_agreement'][k]:.4f}" for k in sorted(routers))
        lines.append(f"| {'float16' if p == 'fp32' else p} (`{r['file']}`) | {r['bytes'] / 2**20:.1f} | "
                     f"{r['cosine']['mean']:.6f} | {r['cosine']['min']:.6f} | {agree} | "
                     f"{r['encode_ms']['median_ms']:.3f} | {'pass' if r['passed'] else 'fail'} |")
    lines += ["", f"Default: **{'float16' if default == 'fp32' else default}** ({result['rule']})."]
    text = "\n".join(lines) + "\n"
    write_text(args.out / "static_table_precision.md", text)
    print(text)
    return result


if __name__ == "__main__":
    main()
