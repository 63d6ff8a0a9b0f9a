"""Where the all-int8 ONNX encoder's time goes (issue 13: all-int8 >= 5x sentence-transformers + torch).

One process, one intra-op thread, the same ``--n-prompts`` RouterBench test prompts tokenised as
the bundle's embedder does (``max_tokens``, left truncation), one query per run:

1. **recipes**: the bundle's fp32, int8 and int8-all encoders, and int8-all variants quantised here
   from the bundle's (fused) fp32 graph with ``onnxruntime.quantization.quantize_dynamic``: the
   shipped recipe, per-tensor instead of per-channel weights, ``reduce_range`` (7-bit weights),
   attention left in fp32 (``Attention`` not quantised, only MatMul + Gather), and a static QDQ graph
   (``quantize_static``, activation ranges calibrated on ``--calib`` train prompts); median and p95
   ms per query, the recipes taking turns prompt by prompt, and the cosine of each to the fp32 output;
2. **per-op profile** (onnxruntime ``enable_profiling``) of fp32, int8-all and the fastest variant:
   kernel time summed per operator type, as a share of the summed kernel time and in us per query.

    python benchmarks/int8_all_profile.py --bundle results/latency-bundles/bundles/latency \\
        --data ../shared/data/routerbench --out docs/results

Writes ``int8_all_profile.json`` and ``int8_all_profile.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from sdk.embedder import DISABLED_OPTIMIZERS

OUTPUT = "sentence_embedding"  # the encoder output the SDK reads (sdk.embedder.OUTPUT)


def feeds_for(tokenizer_json: str, prompts: list[str], max_tokens: int, inputs: set[str]) -> list[dict]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    tok.no_padding()
    tok.enable_truncation(max_tokens, direction="left")
    out = []
    for enc in tok.encode_batch(prompts):
        f = {"input_ids": np.array([enc.ids], np.int64), "attention_mask": np.array([enc.attention_mask], np.int64)}
        if "token_type_ids" in inputs:
            f["token_type_ids"] = np.array([enc.type_ids], np.int64)
        out.append(f)
    return out


def session(path: Path, profile_prefix: str | None = None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    # the SDK's sessions (sdk.embedder.inference_session) leave these optimisers out too
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"],
                                disabled_optimizers=list(DISABLED_OPTIMIZERS))


def variants(fp32: Path, scratch: Path, calib: list[dict]) -> dict[str, Path]:
    """int8-all recipes quantised here from the bundle's fused fp32 graph."""
    import onnx
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic,
                                          quantize_static)

    base = dict(weight_type=QuantType.QInt8,
                extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT})
    recipes = {
        "dynamic, per-channel (shipped recipe)": dict(per_channel=True, op_types_to_quantize=["MatMul", "Gather", "Attention"]),
        "dynamic, per-tensor": dict(per_channel=False, op_types_to_quantize=["MatMul", "Gather", "Attention"]),
        "dynamic, per-channel, reduce_range": dict(per_channel=True, reduce_range=True,
                                                   op_types_to_quantize=["MatMul", "Gather", "Attention"]),
        "dynamic, attention in fp32": dict(per_channel=True, op_types_to_quantize=["MatMul", "Gather"]),
    }
    out = {}
    for name, kw in recipes.items():
        path = scratch / f"{len(out)}.onnx"
        quantize_dynamic(str(fp32), str(path), **base, **kw)
        out[name] = path

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(calib)

        def get_next(self):
            return next(self.it, None)

    path = scratch / "qdq.onnx"
    try:
        quantize_static(str(fp32), str(path), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                        extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT})
        out["static QDQ (calibrated), MatMul only"] = path
    except Exception as exc:  # reported, not fatal: the fused graph's contrib ops may not calibrate
        print(f"static QDQ failed: {type(exc).__name__}: {exc}")
    return out


def op_profile(path: Path, feeds: list[dict], scratch: Path) -> dict[str, float]:
    """Summed kernel time per op type over one pass on ``feeds``, us per query (the first run's
    one-off costs included: a fresh profiling session)."""
    sess = session(path, str(scratch / f"prof-{path.stem}"))
    for f in feeds:
        sess.run(None, f)
    trace = json.loads(Path(sess.end_profiling()).read_text())
    per_op: dict[str, float] = defaultdict(float)
    for ev in trace:
        if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time"):
            per_op[ev["args"]["op_name"]] += ev["dur"]
    return {k: v / len(feeds) for k, v in sorted(per_op.items(), key=lambda kv: -kv[1])}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, required=True, help="bundle with fp32, int8 and int8-all ONNX encoders")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--n-prompts", type=int, default=300)
    parser.add_argument("--calib", type=int, default=64, help="train prompts calibrating the static QDQ variant")
    parser.add_argument("--out", type=Path, default=Path("results/benchmarks"))
    args = parser.parse_args(argv)
    from tqdm.auto import tqdm

    from trainer.data.routerbench import load_routerbench_dir

    manifest = json.loads((args.bundle / "manifest.json").read_text())
    emb = manifest["embedder"]
    train, test = load_routerbench_dir(args.data)
    prompts = list(test.prompts[: args.n_prompts])
    tok_json = (args.bundle / "tokenizer.json").read_text()
    fp32 = args.bundle / emb["files"]["fp32"]
    inputs = {i.name for i in session(fp32).get_inputs()}
    feeds = feeds_for(tok_json, prompts, emb["max_tokens"], inputs)
    calib = feeds_for(tok_json, list(train.prompts[: args.calib]), emb["max_tokens"], inputs)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        paths = {f"bundle {p}": args.bundle / f for p, f in emb["files"].items()}
        paths.update(variants(fp32, scratch, calib))
        sessions = {name: session(p) for name, p in paths.items()}
        ref = np.concatenate([sessions["bundle fp32"].run([OUTPUT], f)[0] for f in feeds])
        times: dict[str, list[float]] = {name: [] for name in sessions}
        cos: dict[str, list[float]] = {name: [] for name in sessions}
        for f in feeds[:20]:
            for s in sessions.values():
                s.run(None, f)
        for i, f in enumerate(tqdm(feeds, desc="recipes, round-robin", unit="prompt")):
            for name, s in sessions.items():
                t = time.perf_counter()
                out = s.run([OUTPUT], f)[0]
                times[name].append(time.perf_counter() - t)
                cos[name].append(float(out[0] @ ref[i] / (np.linalg.norm(out[0]) * np.linalg.norm(ref[i]))))
        rows = {name: {"median_ms": statistics.median(t) * 1e3, "p95_ms": float(np.percentile(t, 95)) * 1e3,
                       "cosine_mean": float(np.mean(cos[name])), "cosine_min": float(np.min(cos[name])),
                       "file_mb": paths[name].stat().st_size / 2**20} for name, t in times.items()}
        fastest = min((n for n in rows if n not in ("bundle fp32", "bundle int8", "bundle int8-all")),
                      key=lambda n: rows[n]["median_ms"])
        profiles = {n: op_profile(paths[n], feeds[:100], scratch) for n in ("bundle fp32", "bundle int8-all", fastest)}
    results = {"bundle": str(args.bundle), "n_prompts": len(prompts), "max_tokens": emb["max_tokens"],
               "intra_op_threads": 1, "load_avg_1min": {"before": load_before, "after": os.getloadavg()[0]},
               "cpu_flags": sorted(f for f in open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
                                   if "avx" in f or "vnni" in f or f in ("fma", "f16c", "amx_int8")),
               "recipes": rows, "op_profile_us_per_query": profiles, "fastest_variant": fastest}
    from trainer.report import write_text  # atomic: a killed run leaves the old file

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "int8_all_profile.json", json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    write_text(args.out / "int8_all_profile.md", text)
    print(text)
    return results


def markdown(r: dict) -> str:
    base = r["recipes"]["bundle int8-all"]["median_ms"]
    lines = [f"ONNX encoder recipes, {r['n_prompts']} RouterBench test prompts, last {r['max_tokens']} tokens, one query "
             f"per run, 1 intra-op thread, recipes taking turns; load average {r['load_avg_1min']['before']:.1f} before / "
             f"{r['load_avg_1min']['after']:.1f} after. CPU flags: {', '.join(r['cpu_flags'])} "
             f"({'VNNI' if any('vnni' in f for f in r['cpu_flags']) else 'no VNNI'}).", "",
             "| recipe | median ms | p95 ms | vs shipped int8-all | cosine to fp32 mean / min | file MB |",
             "|---|---|---|---|---|---|"]
    for name, row in r["recipes"].items():
        lines.append(f"| {name} | {row['median_ms']:.3f} | {row['p95_ms']:.3f} | {base / row['median_ms']:.2f}x | "
                     f"{row['cosine_mean']:.4f} / {row['cosine_min']:.4f} | {row['file_mb']:.1f} |")
    for name, ops in r["op_profile_us_per_query"].items():
        total = sum(ops.values())
        lines += ["", f"**{name}**: kernel time per op type (onnxruntime profile, 100 queries), {total:.0f} us per query:", "",
                  "| op | us per query | share |", "|---|---|---|"]
        for op, us in list(ops.items())[:12]:
            lines.append(f"| {op} | {us:.1f} | {us / total:.1%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
