"""How many tokens should the device embedder read? Latency and int8 fidelity per ``max_tokens``.

For each ``max_tokens`` in {32, 64, 128, 256}, on real RouterBench test prompts, in one process:
single-query encode latency (median, ms, one thread) of the bundle's fp32 and int8 encoders and of
sentence-transformers + torch, and the int8 encoder's cosine (mean, min) against
sentence-transformers at that length. The routing quality per length comes from the main job run
with ``--max-tokens`` (see README).

    python benchmarks/max_tokens.py --bundle bundles/latency --data ../shared/data/routerbench \
        --out results/benchmarks

``--bundle``: a router bundle with ONNX encoders (``benchmarks/latency_bundle.py``'s, or
``results/latency-bundles/bundles/latency`` from ``benchmarks/choose_latency_bundles.py``); the README's
``bundles/kmeans`` is a static-embedder bundle.

Writes ``max_tokens.json``, ``max_tokens.md``, ``max_tokens.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from choose_latency import require_onnx_bundle, time_calls

LENGTHS = (32, 64, 128, 256)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("results/benchmarks"))
    parser.add_argument("--n-prompts", type=int, default=300)
    args = parser.parse_args(argv)
    manifest = require_onnx_bundle(parser, "--bundle", args.bundle)

    import torch
    from tqdm.auto import tqdm

    from sdk.embedder import OnnxEmbedder, session_options
    from trainer.data.routerbench import load_routerbench_dir
    from trainer.embeddings import EmbedderConfig, load_sentence_transformer

    torch.set_num_threads(1)
    prompts = list(load_routerbench_dir(args.data)[1].prompts[: args.n_prompts])
    emb = manifest["embedder"]
    tokenizer = (args.bundle / "tokenizer.json").read_text()
    models = {p: (args.bundle / f).read_bytes() for p, f in emb["files"].items()}
    rows = []
    for length in tqdm(LENGTHS, desc="max_tokens"):
        st = load_sentence_transformer(EmbedderConfig(model=emb["name"], max_tokens=length,
                                                      truncation_side=emb["truncation_side"]))
        row = {"max_tokens": length,
               "torch_ms": time_calls(lambda p: st.encode([p], convert_to_numpy=True, normalize_embeddings=True), prompts)["median_ms"]}
        reference = st.encode(prompts, convert_to_numpy=True, normalize_embeddings=True, batch_size=32)
        for precision, model in models.items():
            encoder = OnnxEmbedder(tokenizer, model, emb["dim"], length, emb["truncation_side"], session_options(1, 1),
                                   batched=False)
            row[f"{precision}_ms"] = time_calls(lambda p: encoder.embed([p]), prompts)["median_ms"]
            cos = (encoder.embed(prompts) * reference).sum(1)
            row[f"{precision}_cosine_mean"], row[f"{precision}_cosine_min"] = float(cos.mean()), float(cos.min())
        rows.append(row)
    from trainer.report import write_text  # atomic: a killed run leaves the old file

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "max_tokens.json", json.dumps(rows, indent=2) + "\n")
    lines = ["| max_tokens | torch ms | fp32 ms | int8 ms | int8 speed-up | int8 cosine mean / min |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['max_tokens']} | {r['torch_ms']:.2f} | {r['fp32_ms']:.2f} | {r.get('int8_ms', float('nan')):.2f} | "
                     f"{r['torch_ms'] / r.get('int8_ms', float('nan')):.2f}x | "
                     f"{r.get('int8_cosine_mean', float('nan')):.4f} / {r.get('int8_cosine_min', float('nan')):.4f} |")
    text = "\n".join(lines) + "\n"
    write_text(args.out / "max_tokens.md", text)
    _plot(rows, args.out / "max_tokens.png")
    print(text)
    return {"rows": rows}


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.report import save_figure

    x = [r["max_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for key, label in (("torch_ms", "sentence-transformers + torch"), ("fp32_ms", "ONNX fp32"), ("int8_ms", "ONNX int8")):
        if key in rows[0]:
            ax.plot(x, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("tokens read per query (max_tokens)")
    ax.set_ylabel("median ms per query (1 thread)")
    ax.legend()
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
