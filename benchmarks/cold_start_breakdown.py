"""Where a static-embedder cold start goes (issue 13: <= 0.25 s), measured in fresh processes.

A cold start is a fresh interpreter doing ``Router.load(bundle)`` and a first ``choose()`` (as in
``benchmarks/choose_latency.py``). Three sets of fresh ``python -c`` children, ``--runs`` each, the
checkouts taking turns run by run (so a change in the machine's load hits them alike):

1. **phases**: wall and CPU time (user + sys of the child, ``time.process_time()``) at the first
   line of the child's code (interpreter start, ``site`` and its ``.pth`` hooks), after
   ``from sdk import Router``, after ``Router.load`` (which imports the kinds, cryptography,
   tokenizers as it needs them) and after the first ``choose()``; plus the parent's view: wall from
   spawn to exit and the child's whole CPU (``os.wait4``: includes the interpreter's teardown);
2. **imports**: ``python -X importtime``, self time summed per top-level package (median over runs);
3. **load steps**: with every module already imported, the steps ``Router.load`` takes for a
   static K-means bundle, one by one: manifest signature and schema, reading and hashing the used
   files, building the tokenizer (one ``tokenizer.json``, or the split pipeline JSON + WordPiece
   vocabulary of newer bundles, hashed again here as ``Router.load`` hashes it from its
   descriptor), decoding the table, then ``StaticEmbedder`` (given the tokenizer built above, or
   for a one-JSON bundle parsing it again; the table decoded again: this step repeats work,
   ``Router.load`` does each once) and the router.

With ``--baseline-root DIR`` (a checkout of another commit, e.g. ``git worktree add /tmp/base HEAD~3``
or ``git archive HEAD~3 sdk | tar -x -C /tmp/base``) the same children also run with that
checkout's ``sdk`` first on ``sys.path``: before/after in one run; ``--baseline-bundle`` gives that
checkout its own bundle (one its code can read, e.g. exported by it: a bundle format changed). Children read compiled bytecode
(a private ``PYTHONPYCACHEPREFIX``, filled by one untimed run each), as in ``choose_latency.py``.
CPU time is what other work on the machine inflates least; quote the load average beside it.

    python benchmarks/cold_start_breakdown.py --bundle results/latency-bundles/bundles/static \\
        --public-key results/latency-bundles/keys/signing.pub --out results/benchmarks [--baseline-root /tmp/base]

Writes ``cold_start_breakdown.json`` and ``cold_start_breakdown.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PHASES_CHILD = r"""
import time
marks = [("interpreter start", time.perf_counter(), time.process_time())]
import sys
sys.path.insert(0, sys.argv[1])
from sdk import Router
marks.append(("from sdk import Router", time.perf_counter(), time.process_time()))
router = Router.load(sys.argv[2], sys.argv[3], precision=sys.argv[4], intra_op_threads=1)
marks.append(("Router.load", time.perf_counter(), time.process_time()))
router.choose("What is the capital of France? Answer in one word.", 100.0)
marks.append(("first choose()", time.perf_counter(), time.process_time()))
import json
print(json.dumps({"t0": time.time() - time.perf_counter(), "marks": marks}))
"""

IMPORTS_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
from sdk import Router
Router.load(sys.argv[2], sys.argv[3], precision=sys.argv[4], intra_op_threads=1).choose("What is the capital of France?", 100.0)
"""

STEPS_CHILD = r"""
import sys, time, json, os
sys.path.insert(0, sys.argv[1])
bundle, key, precision = sys.argv[2:5]
import numpy, tokenizers
from sdk import Router, kinds
from sdk import bundle_manifest as fmt
from sdk.embedder import load_tokenizer
from sdk import static_embedder as se
steps = []
def step(name, fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    steps.append((name, time.perf_counter() - w, time.process_time() - c))
    return out
raw = open(os.path.join(bundle, fmt.MANIFEST_FILE), "rb").read()
manifest = step("manifest: signature + schema", lambda: fmt.verify_manifest(raw, key))
emb = manifest["embedder"]
table_name = emb["files"][precision]
split = emb.get("tokenizer_files")  # the WordPiece tokenizer in two files (pipeline + vocab), else tokenizer.json
tok_names = [split["pipeline"], split["vocab"]] if split else ["tokenizer.json"]
names = [*tok_names, table_name, *kinds.get("router", manifest["router_kind"]).files(manifest, precision)]
def read_and_hash():
    files = {}
    for n in names:
        data = open(os.path.join(bundle, n), "rb").read()
        assert fmt.sha256_hex(data) == manifest["files"][n]
        files[n] = data
    return files
files = step("read + sha256 of the used files (MB: %.1f)" % (sum(os.path.getsize(os.path.join(bundle, n)) for n in names) / 2**20), read_and_hash)
tok_json = files[tok_names[0]].decode("utf-8")
if split:
    tok = step("tokenizer: pipeline JSON + WordPiece.from_file (split)",
               lambda: se.load_split_tokenizer(tok_json, fmt.VerifiedFile(os.path.join(bundle, split["vocab"]), manifest["files"][split["vocab"]], 1 << 26)))
else:
    tok = step("tokenizer: tokenizer.json parse (one JSON)", lambda: load_tokenizer(tok_json))
step("table decode (%s + checks)" % table_name.rsplit(".", 1)[-1], lambda: se.decode_table(files[table_name], emb["dim"]))
embedder = step("StaticEmbedder from the two (tokenizer built above; table decoded again)",
                lambda: se.StaticEmbedder(tok if split else tok_json, files[table_name], emb["dim"]))
step("router scorer (kmeans.npz)", lambda: kinds.load_artefact("router", manifest, files, precision=precision))
step("first embed()", lambda: embedder.embed(["What is the capital of France? Answer in one word."]))
print(json.dumps(steps))
"""


def _env(pycache: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("PYTHONPATH", None)  # each child puts its checkout first on sys.path itself
    env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def _spawn(args: list[str], env: dict) -> tuple[str, str, float, float]:
    """(stdout, stderr, wall s from spawn to exit, child CPU s from os.wait4)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args[:3]} failed: {err[-2000:]}")
    return out, err, time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def phases(root: Path, bundle: Path, key: Path, precision: str, env: dict) -> dict:
    """One child: per-phase wall and CPU ms, and the totals seen from the parent."""
    spawned = time.time()
    out, _, wall, cpu = _spawn(["-c", PHASES_CHILD, str(root), str(bundle), str(key), precision], env)
    rec = json.loads(out.strip().splitlines()[-1])
    marks = rec["marks"]
    row = {"spawn -> interpreter start (wall)": (rec["t0"] + marks[0][1] - spawned) * 1e3}
    row["interpreter start (CPU)"] = marks[0][2] * 1e3
    for (_, w0, c0), (name, w1, c1) in zip(marks, marks[1:]):
        row[f"{name} (wall)"] = (w1 - w0) * 1e3
        row[f"{name} (CPU)"] = (c1 - c0) * 1e3
    row["spawn -> first choose (wall)"] = (rec["t0"] + marks[-1][1] - spawned) * 1e3
    row["start -> first choose (CPU)"] = marks[-1][2] * 1e3
    row["whole child incl. teardown (wall)"] = wall * 1e3
    row["whole child incl. teardown (CPU, wait4)"] = cpu * 1e3
    return row


def import_self_times(root: Path, bundle: Path, key: Path, precision: str, env: dict) -> Counter:
    """One ``-X importtime`` child: self time (ms) summed per top-level package."""
    _, err, _, _ = _spawn(["-X", "importtime", "-c", IMPORTS_CHILD, str(root), str(bundle), str(key), precision], env)
    out: Counter = Counter()
    for line in err.splitlines():
        if line.startswith("import time:") and "self [us]" not in line:
            self_us, _, name = line[len("import time:"):].split("|")
            out[name.strip().split(".")[0]] += int(self_us) / 1e3
    return out


def load_steps(root: Path, bundle: Path, key: Path, precision: str, env: dict) -> dict:
    out, _, _, _ = _spawn(["-c", STEPS_CHILD, str(root), str(bundle), str(key), precision], env)
    rec = json.loads(out.strip().splitlines()[-1])
    return {name: {"wall_ms": w * 1e3, "cpu_ms": c * 1e3} for name, w, c in rec}


def _load() -> str:
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, required=True, help="a static-embedder router bundle")
    parser.add_argument("--public-key", type=Path, required=True)
    parser.add_argument("--precision", default="int8", help="table precision to load (default: int8, the device default)")
    parser.add_argument("--runs", type=int, default=15, help="fresh children per set and checkout (median)")
    parser.add_argument("--baseline-root", type=Path, default=None,
                        help="another checkout (a folder holding sdk/) measured in the same run, as 'baseline'")
    parser.add_argument("--baseline-bundle", type=Path, default=None,
                        help="the bundle the baseline checkout loads (default: --bundle)")
    parser.add_argument("--out", type=Path, default=Path("results/benchmarks"))
    args = parser.parse_args(argv)
    if args.runs < 3:
        parser.error("--runs must be >= 3")
    roots = {"current": ROOT}
    if args.baseline_root is not None:
        if not (args.baseline_root / "sdk" / "__init__.py").exists():
            parser.error(f"--baseline-root {args.baseline_root} holds no sdk/ package")
        roots = {"baseline": args.baseline_root.resolve(), "current": ROOT}
    bundle, key = args.bundle.resolve(), args.public_key.resolve()
    bundles = {name: bundle for name in roots}
    if args.baseline_bundle is not None:
        if "baseline" not in roots:
            parser.error("--baseline-bundle goes with --baseline-root")
        bundles["baseline"] = args.baseline_bundle.resolve()
    from tqdm.auto import tqdm

    load_before = _load()
    with tempfile.TemporaryDirectory(prefix="fedroute-pycache-") as pycache:
        env = _env(pycache)
        for name, root in roots.items():  # untimed: fills the bytecode cache
            phases(root, bundles[name], key, args.precision, env)
        ph = {name: [] for name in roots}
        imp = {name: [] for name in roots}
        steps = {name: [] for name in roots}
        for _ in tqdm(range(args.runs), desc="cold-start children", unit="round"):
            for name, root in roots.items():
                ph[name].append(phases(root, bundles[name], key, args.precision, env))
                imp[name].append(import_self_times(root, bundles[name], key, args.precision, env))
                steps[name].append(load_steps(root, bundles[name], key, args.precision, env))
    results: dict = {"bundle": str(args.bundle), "bundles": {k: str(v) for k, v in bundles.items()},
                     "precision": args.precision, "runs": args.runs,
                     "roots": {k: str(v) for k, v in roots.items()},
                     "load_avg_1min": {"before": load_before, "after": _load()}, "checkouts": {}}
    for name in roots:
        packages = sorted({p for c in imp[name] for p in c}, key=lambda p: -statistics.median(c[p] for c in imp[name]))
        results["checkouts"][name] = {
            "phases_ms": {k: statistics.median(r[k] for r in ph[name]) for k in ph[name][0]},
            "phases_min_ms": {k: min(r[k] for r in ph[name]) for k in ph[name][0]},
            "import_self_ms": {p: statistics.median(c[p] for c in imp[name]) for p in packages},
            "import_self_total_ms": statistics.median(sum(c.values()) for c in imp[name]),
            "load_steps_ms": {k: {m: statistics.median(r[k][m] for r in steps[name]) for m in ("wall_ms", "cpu_ms")}
                              for k in steps[name][0]},
        }
    from trainer.report import write_text  # atomic: a killed run leaves the old file

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "cold_start_breakdown.json", json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    write_text(args.out / "cold_start_breakdown.md", text)
    print(text)
    return results


def markdown(r: dict, top: int = 14) -> str:
    names = list(r["checkouts"])
    head = "| | " + " | ".join(names) + " |"
    rule = "|---" * (len(names) + 1) + "|"
    lines = [f"Static cold start ({r['precision']} table), median of {r['runs']} fresh processes per checkout, "
             f"checkouts taking turns; load average {r['load_avg_1min']['before']} before / "
             f"{r['load_avg_1min']['after']} after. ms.", "",
             "**Phases**, median (min) of the runs (CPU: the child's user + sys time; under load the minimum is "
             "the least disturbed run):", "", head, rule]
    first = r["checkouts"][names[0]]
    for key in first["phases_ms"]:
        lines.append(f"| {key} | " + " | ".join(
            f"{r['checkouts'][n]['phases_ms'][key]:.1f} ({r['checkouts'][n]['phases_min_ms'][key]:.1f})" for n in names) + " |")
    lines += ["", "**Import self time per top-level package** (`python -X importtime`, wall; the largest "
              f"{top}, then the rest):", "", head, rule]
    packages = list(r["checkouts"][names[-1]]["import_self_ms"])
    shown = packages[:top]
    for p in shown:
        lines.append(f"| {p} | " + " | ".join(f"{r['checkouts'][n]['import_self_ms'].get(p, 0.0):.1f}" for n in names) + " |")
    lines.append("| other | " + " | ".join(
        f"{r['checkouts'][n]['import_self_total_ms'] - sum(r['checkouts'][n]['import_self_ms'].get(p, 0.0) for p in shown):.1f}"
        for n in names) + " |")
    lines.append("| all imports | " + " | ".join(f"{r['checkouts'][n]['import_self_total_ms']:.1f}" for n in names) + " |")
    lines += ["", "**Router.load's steps, one by one** (modules already imported; wall / CPU; n/a: a step "
              "the other checkout's bundle format does not have):", "", head, rule]
    step_names = list(dict.fromkeys(k for n in names for k in r["checkouts"][n]["load_steps_ms"]))
    for key in step_names:
        lines.append(f"| {key} | " + " | ".join(
            f"{r['checkouts'][n]['load_steps_ms'][key]['wall_ms']:.1f} / {r['checkouts'][n]['load_steps_ms'][key]['cpu_ms']:.1f}"
            if key in r["checkouts"][n]["load_steps_ms"] else "n/a" for n in names) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
