"""How long a tail should left truncation tokenise first? (``sdk.embedder.TAIL_CHARS_PER_TOKEN``)

The ONNX embedder keeps a query's last ``max_tokens`` tokens. It tokenises a tail of
``c * max_tokens`` characters first and uses it only when that is exact (the tail was truncated and
its possibly broken first word is not among the kept tokens, :meth:`sdk.embedder.OnnxEmbedder._encode`);
otherwise it tries the next, longer tail, and last the whole text. So ``c`` trades the cost of one
tokenisation against the chance of a second one. For each ``c`` in :data:`PER_TOKEN`, on real texts
in one process, one thread:

- **exact share**: of the texts longer than the tail, the share whose tail is exact;
- **median ms** to tokenise that tail (the whole text for texts no longer than it).

The rule (applied to the *choosing* sets, RouterBench train prompts and AlpacaEval instructions):
the smallest ``c`` exact for >= 99% of the longer texts in each set. HH-RLHF prompts (a test split)
are reported as a check and not used to choose.

    python benchmarks/tail_tokenisation.py --tokenizer bundles/latency/tokenizer.json \\
        --shared-data ../shared/data --out results/benchmarks

(``tokenizer.json`` of a bundle with the ONNX embedder, e.g. ``benchmarks/latency_bundle.py``'s; the README's
static-embedder ``bundles/kmeans`` has ``static_tokenizer.json`` + ``static_vocab.txt`` instead.)

Writes ``tail_tokenisation.{json,md,png}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

PER_TOKEN = (4, 5, 6, 8, 12, 20)
RULE_MIN_EXACT = 0.99


def texts(shared: Path) -> dict[str, tuple[list[str], bool]]:
    """{set name: (texts, used to choose)}."""
    import pandas as pd

    return {
        "routerbench train prompts": (pd.read_parquet(shared / "routerbench/train.parquet")["prompt"].astype(str).tolist(), True),
        "alpacaeval instructions": (pd.read_parquet(shared / "alpacaeval/instructions.parquet")["instruction"].astype(str).tolist(), True),
        "hh-rlhf harmless prompts (check)": (pd.read_parquet(shared / "hh_rlhf_harmless/test_parsed.parquet")["prompt"].astype(str).tolist(), False),
    }


def measure(tokenizer, items: list[str], limit: int) -> dict:
    """Exact share among texts longer than ``limit`` characters, and median tail tokenisation ms."""
    exact, longer, times = 0, 0, []
    for text in items:
        tail = text[-limit:]
        t0 = time.perf_counter()
        enc = tokenizer.encode(tail)
        times.append(time.perf_counter() - t0)
        if len(text) > limit:
            longer += 1
            exact += bool(enc.overflowing) and 0 not in enc.word_ids
    return {"n_longer": longer, "exact_share": exact / longer if longer else None,
            "median_ms": 1e3 * statistics.median(times)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a bundle's tokenizer.json")
    parser.add_argument("--shared-data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("results/benchmarks"))
    args = parser.parse_args(argv)

    from tokenizers import Tokenizer
    from tqdm.auto import tqdm

    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    tokenizer.no_padding()
    tokenizer.enable_truncation(args.max_tokens, direction="left")
    sets = texts(args.shared_data)
    rows = {}
    for name, (items, _) in tqdm(sets.items(), desc="sets"):
        rows[name] = {c: measure(tokenizer, items, c * args.max_tokens) for c in PER_TOKEN}
    choosing = [name for name, (_, used) in sets.items() if used]
    chosen = next((c for c in PER_TOKEN if all((rows[n][c]["exact_share"] or 1.0) >= RULE_MIN_EXACT for n in choosing)),
                  None)
    result = {"max_tokens": args.max_tokens, "rule": f"smallest c with exact share >= {RULE_MIN_EXACT} on {choosing}",
              "chosen": chosen, "rows": {n: {str(c): v for c, v in r.items()} for n, r in rows.items()},
              "load_average": Path("/proc/loadavg").read_text().split()[:3]}
    from trainer.report import write_text  # atomic: a killed run leaves the old file

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "tail_tokenisation.json", json.dumps(result, indent=2))
    lines = [f"Left truncation to {args.max_tokens} tokens: a tail of c x {args.max_tokens} characters, exact share "
             f"(of the texts longer than it) / median ms to tokenise it; load {' '.join(result['load_average'])}.", "",
             "| set | " + " | ".join(f"c = {c}" for c in PER_TOKEN) + " |", "|---|" + "---|" * len(PER_TOKEN)]
    for name, r in rows.items():
        cells = [f"{v['exact_share']:.4f} / {v['median_ms']:.3f}" if v["exact_share"] is not None else f"- / {v['median_ms']:.3f}"
                 for v in r.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Rule: {result['rule']}: **c = {chosen}**."]
    write_text(args.out / "tail_tokenisation.md", "\n".join(lines) + "\n")
    plot(rows, args.out / "tail_tokenisation.png")
    print("\n".join(lines))
    return result


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.report import save_figure

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in rows.items():
        ax.plot(PER_TOKEN, [v["exact_share"] or 1.0 for v in r.values()], marker="o", label=name)
    ax.axhline(RULE_MIN_EXACT, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("tail length, characters per kept token")
    ax.set_ylabel("exact share of longer texts")
    ax.legend(fontsize=7)
    save_figure(fig, path, dpi=120)  # lays out, writes atomically, closes


if __name__ == "__main__":
    main()
