"""On-device routing benchmark (METRICS.md, issue 13): ``choose()`` latency, cold start, peak RSS and
the bundle load path, for every embedder profile, in one run.

Profiles (:data:`PROFILES`, one function each; ratios are against the first, measured in this run):

- ``torch``: sentence-transformers + torch ``encode([prompt])``, same model, same max tokens and
  truncation side as the bundle, ``torch.set_num_threads(1)`` (encode only: the router's own work
  is not added, which favours the baseline slightly);
- ``onnx-fp32``, ``onnx-int8`` (today's recipe: four FFN output MatMuls in fp32), ``onnx-int8-all``
  (every weight MatMul in int8): ``Router.choose(prompt, lam)`` with that encoder of ``--bundle``
  (graphs fused by the export, :mod:`export.embedder_fusion`);
- ``unfused onnx-int8``, ``unfused onnx-int8-all`` (only with ``--unfused-bundle``, a bundle written by
  ``benchmarks/latency_bundle.py --no-fuse``): the same recipes without graph fusion, to measure the
  fusion in the same run;
- ``static``: ``Router.choose`` on ``--static-bundle`` (a router bundle whose embedder is a static
  model2vec kind). A profile whose bundle, precision or embedder kind is missing is listed as
  "not available in this checkout", with the reason;
- ``model2vec`` (reference, in the ``static`` group): model2vec's own ``StaticModel.from_pretrained`` +
  ``encode`` on the distilled folder of the static bundle's table (:func:`model2vec_profile`), so that a
  model2vec figure (issue 13 quoted a 0.17 s cold start from a prototype) is measured by this script's
  definition in the same run; not checked against the targets.

Latency: single query, warm, one intra-op thread, ``--n-prompts`` real RouterBench test prompts; the
profiles take turns query by query (round-robin), so a change in the machine's load hits them alike.
Median and p95 in ms.

Cold start and peak RSS: a fresh ``python -c`` child per profile (and per repeat): seconds from
just before the child is spawned to its first ``choose()`` (or ``encode``) result, median of
``--cold-repeats``; beside it the child's own CPU time (user + sys, all threads, from its start to
that first result: ``time.process_time()``, the clock behind ``getrusage``), which other work on the
machine inflates far less than wall time (it still grows somewhat with load: shared caches, and
a descheduled process's caches go cold; interpreter teardown after the result is not counted); peak RSS is the child's ``VmHWM`` after 100 queries, the largest over the
repeats. ``VmHWM`` rather than ``getrusage(RUSAGE_SELF).ru_maxrss``: Linux carries ``ru_maxrss``
over ``execve`` from the process that forked the child, so it would report this parent's torch.
The children read compiled bytecode, as an installed package does (``pip install`` compiles it):
they run with a private ``PYTHONPYCACHEPREFIX`` (a temporary folder) and without
``PYTHONDONTWRITEBYTECODE``, after one untimed warm-up child per profile that fills it. Otherwise,
where ``PYTHONDONTWRITEBYTECODE`` is set (this project's shell), every child would compile the
repository's modules from source again (~40 ms of a 0.2 s static cold start).

Load path (issue 13 item 3), fresh child per run: ``Router.load`` as it is now (only the chosen
precision's files hashed, encoder streamed from one descriptor and loaded by onnxruntime from it)
against the previous path (every file hashed and read into memory, session created from bytes,
rebuilt here from ``read_verified`` + ``kinds.load_artefact``): load ms, verify ms, MB hashed and
peak RSS right after loading.

From a clean clone, one command (builds the keys, two K-means routers and their bundles under
``--build-dir`` first, ``benchmarks/choose_latency_bundles.py``, reused by later runs; a few minutes):

    python benchmarks/choose_latency.py --data ../shared/data/routerbench --out results/benchmarks

or with bundles of your own (``--static-bundle`` optional: without it the static row is listed as
not measured):

    python benchmarks/choose_latency.py --bundle bundles/latency --public-key keys/signing.pub \
        --data ../shared/data/routerbench --out results/benchmarks [--static-bundle bundles/static] \
        [--unfused-bundle bundles/latency-unfused]

``--profiles static`` (names, prefixes or groups, comma-separated) measures only those rows (with the
``static`` group's model2vec reference row) and the torch baseline; the load-path table needs an ``onnx-`` row. Writes ``choose_latency.json``,
``choose_latency.md`` and ``choose_latency.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from sdk.kinds import DEFAULT_EMBEDDER_KIND

ROOT = Path(__file__).resolve().parents[1]

#: Targets of issue 13, checked in the report (ratios: baseline median / profile median).
TARGETS = {"static": {"speedup_min": 10.0, "cold_start_s_max": 0.25, "peak_rss_mb_max": 100.0},
           "onnx-int8-all": {"speedup_min": 5.0}}

# A child process: build the profile's choose function, time the first call from the parent's
# spawn time, route the other queries, report VmHWM (see the module docstring).
CHILD = r"""
import json, sys, time
t0 = float(sys.argv[1])
spec = json.loads(sys.argv[2])
prompts = json.loads(sys.stdin.read())
if spec["kind"] == "router":
    from sdk import Router
    router = Router.load(spec["bundle"], spec["public_key"], precision=spec["precision"], intra_op_threads=1)
    run = lambda q: router.choose(q, spec["lam"])
elif spec["kind"] == "model2vec":
    from model2vec import StaticModel
    m2v = StaticModel.from_pretrained(spec["folder"], normalize=True)
    m2v.tokenizer.no_padding()
    m2v.tokenizer.no_truncation()
    run = lambda q: m2v.encode([q], max_length=None, use_multiprocessing=False)
else:
    import torch
    torch.set_num_threads(1)
    from trainer.embeddings import EmbedderConfig, load_sentence_transformer
    st = load_sentence_transformer(EmbedderConfig(model=spec["model"], max_tokens=spec["max_tokens"],
                                                  truncation_side=spec["truncation_side"]))
    run = lambda q: st.encode([q], convert_to_numpy=True, normalize_embeddings=True)
run(prompts[0])
first = time.time() - t0
first_cpu = time.process_time()  # user + sys CPU of this process (all threads) since it was spawned
for q in prompts[1:]:
    run(q)
hwm_kb = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
print(json.dumps({"cold_start_s": first, "cold_start_cpu_s": first_cpu, "peak_rss_mb": hwm_kb / 1024}))
"""

# A child process: load the bundle by the current or the previous path; time it and its verification.
LOAD_CHILD = r"""
import json, os, sys, time
spec = json.loads(sys.argv[1])
from sdk import Router, kinds
from sdk import bundle_manifest as fmt
from sdk.embedder import session_options
import onnxruntime  # imported before timing: both paths need it, the import is not the load path
bundle, key, precision = spec["bundle"], spec["public_key"], spec["precision"]
t0 = time.perf_counter()
options = session_options(1, 1)
manifest = fmt.verify_manifest(open(os.path.join(bundle, fmt.MANIFEST_FILE), "rb").read(), key)
found = kinds.manifest_kinds(manifest)
used = [kinds.get(f, found[f]) for f in (kinds.EMBEDDER_FAMILY, kinds.ROUTER_FAMILY)]
names = [n for k in used for n in k.files(manifest, precision)]
if spec["path"] == "current":  # Router.load's steps, timed
    by_path = [n for k in used for n in k.path_files(manifest, precision)]
    verified = fmt.read_verified(bundle, key, wanted=names, by_path=by_path, verify_unused=False)
    hashed = sum(os.path.getsize(os.path.join(bundle, n)) for n in names)
else:  # the previous Router.load: every file hashed, the used ones read, sessions from bytes
    verified = fmt.read_verified(bundle, key, wanted=names)
    hashed = sum(os.path.getsize(os.path.join(bundle, n)) for n in manifest["files"])
t_verify = time.perf_counter() - t0
with verified:
    emb = kinds.load_artefact(kinds.EMBEDDER_FAMILY, verified.manifest, verified.files, options=options,
                              precision=precision, paths=verified.opened)
    scorer = kinds.load_artefact(kinds.ROUTER_FAMILY, verified.manifest, verified.files, options=options,
                                 precision=precision, paths=verified.opened)
router = Router(verified.manifest, emb, scorer, precision)
t_load = time.perf_counter() - t0
del verified
hwm_kb = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
router.choose("Is a whale a fish?", 100.0)
print(json.dumps({"load_ms": t_load * 1e3, "verify_ms": t_verify * 1e3, "hashed_mb": hashed / 2**20,
                  "peak_rss_after_load_mb": hwm_kb / 1024}))
"""


@dataclass
class Profile:
    """One row of the benchmark: ``run(prompt)`` in this process and ``child`` (the CHILD spec) for
    cold start and RSS; ``unavailable`` says why the row could not be measured (then both are None)."""

    name: str
    label: str
    run: Callable[[str], object] | None = None
    child: dict | None = None
    unavailable: str | None = None
    group: str | None = None  # ``--profiles`` selects a reference row by its group too (e.g. "static")


def torch_profile(args, emb: dict) -> Profile:
    """The baseline: sentence-transformers + torch, one thread, same model / tokens as the bundle."""
    import torch

    from trainer.embeddings import EmbedderConfig, load_sentence_transformer

    torch.set_num_threads(1)
    spec = {"kind": "torch", "model": emb["name"], "max_tokens": emb["max_tokens"],
            "truncation_side": emb["truncation_side"]}
    st = load_sentence_transformer(EmbedderConfig(model=emb["name"], max_tokens=emb["max_tokens"],
                                                  truncation_side=emb["truncation_side"]))
    return Profile("torch", "sentence-transformers + torch (encode only)",
                   lambda p: st.encode([p], convert_to_numpy=True, normalize_embeddings=True), spec)


def router_profile(name: str, label: str, bundle: Path | None, public_key: Path, precision: str, lam: float,
                   missing: str) -> Profile:
    """``Router.choose`` with ``precision`` of ``bundle``; unavailable (with the reason) when the bundle,
    its precision or its embedder kind is not there."""
    from sdk import Router, kinds
    from sdk.errors import BundleError, InvalidInputError

    if bundle is None:
        return Profile(name, label, unavailable=missing)
    try:
        router = Router.load(bundle, public_key, precision=precision, intra_op_threads=1)
    except (BundleError, InvalidInputError) as exc:
        known = ", ".join(kinds.names(kinds.EMBEDDER_FAMILY))
        return Profile(name, label, unavailable=f"{exc} (embedder kinds in this checkout: {known})")
    spec = {"kind": "router", "bundle": str(bundle), "public_key": str(public_key), "precision": router.precision,
            "lam": lam}
    return Profile(name, label, lambda p: router.choose(p, lam), spec)


def static_profiles(args) -> list[Profile]:
    """The static (model2vec) embedder rows, ``static <precision>`` for each precision of
    ``--static-bundle``; the static embedder's branch plugs in here (e.g. a default bundle path)."""
    if args.static_bundle is None:
        return [Profile("static", "fedroute `choose()`, static embedder",
                        unavailable="no --static-bundle given (run without --bundle to build both bundles)")]
    try:
        files = json.loads((args.static_bundle / "manifest.json").read_text())["embedder"]["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [Profile("static", "fedroute `choose()`, static embedder", unavailable=f"unreadable --static-bundle ({exc})")]
    return [router_profile(f"static {p}", f"fedroute `choose()`, static embedder {p}", args.static_bundle,
                           args.public_key, p, args.lam, "") for p in files]


def model2vec_profile(args) -> list[Profile]:
    """Reference row for the static rows (issue 13 quoted a 0.17 s cold start from a model2vec
    prototype): model2vec's own ``StaticModel.from_pretrained`` on the distilled folder the static
    bundle's table came from, then ``encode([prompt])`` (normalised, no padding or truncation, no
    multiprocessing, as ``trainer.static_embedder`` runs it; encode only, no routing), measured by the same
    child protocol. The folder: ``--model2vec-folder``, else the trainer's cache entry for the static
    bundle's embedder (``static:all-MiniLM-L6-v2`` -> ``<cache>/static/...``, written when the bundle
    was built). In the ``static`` group of ``--profiles``; not checked against issue 13's targets."""
    name, label = "model2vec", "model2vec `StaticModel.encode` (reference: from_pretrained + encode, no routing)"
    folder = args.model2vec_folder
    if folder is None and args.static_bundle is not None:
        try:
            spec = json.loads((args.static_bundle / "manifest.json").read_text())["embedder"]["name"]
            from trainer.embedder_paths import default_cache_dir
            from trainer.static_embedder import StaticEmbedderTrainerKind

            folder = StaticEmbedderTrainerKind().resolve_path(spec.split(":", 1)[1], default_cache_dir())
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            return [Profile(name, label, unavailable=f"no model2vec folder found ({exc})", group="static")]
    if folder is None:
        return [Profile(name, label, unavailable="no --static-bundle or --model2vec-folder given", group="static")]
    try:
        from model2vec import StaticModel
    except ImportError as exc:
        return [Profile(name, label, unavailable=f"model2vec is not installed ({exc})", group="static")]
    from trainer.static_embedder import is_model2vec_folder

    if not is_model2vec_folder(Path(folder)):
        return [Profile(name, label, unavailable=f"{folder} is not a model2vec folder", group="static")]
    model = StaticModel.from_pretrained(str(folder), normalize=True)
    model.tokenizer.no_padding()
    model.tokenizer.no_truncation()
    return [Profile(name, label, lambda p: model.encode([p], max_length=None, use_multiprocessing=False),
                    {"kind": "model2vec", "folder": str(Path(folder).resolve())}, group="static")]


def unfused_profiles(args) -> list[Profile]:
    """Same-run check of the graph fusion (:mod:`export.embedder_fusion`): the int8 and int8-all encoders
    of ``--unfused-bundle`` (``benchmarks/latency_bundle.py --no-fuse``), named ``unfused onnx-...`` so
    that issue 13's targets stay on the shipped (fused) rows; no rows without that option."""
    if args.unfused_bundle is None:
        return []
    return [router_profile(f"unfused onnx-{p}", f"fedroute `choose()`, ONNX {p}, graph not fused (before issue 13)",
                           args.unfused_bundle, args.public_key, p, args.lam, "") for p in ("int8", "int8-all")]


#: The rows, in table order; each is a function of (args, the bundle's embedder entry) returning
#: one Profile or a list of them. The first is the baseline.
PROFILES: list[Callable] = [
    torch_profile,
    lambda a, e: router_profile("onnx-fp32", "fedroute `choose()`, ONNX fp32", a.bundle, a.public_key, "fp32", a.lam,
                                "no --bundle"),
    lambda a, e: router_profile("onnx-int8", "fedroute `choose()`, ONNX int8 (today's recipe)",
                                a.bundle, a.public_key, "int8", a.lam, "no --bundle"),
    lambda a, e: router_profile("onnx-int8-all", "fedroute `choose()`, ONNX int8-all (every MatMul int8)",
                                a.bundle, a.public_key, "int8-all", a.lam, "no --bundle"),
    lambda a, e: unfused_profiles(a),
    lambda a, e: static_profiles(a),
    lambda a, e: model2vec_profile(a),
]


def _percentiles(samples_s: list[float]) -> dict:
    ms = np.asarray(samples_s) * 1e3
    return {"median_ms": float(np.median(ms)), "p95_ms": float(np.percentile(ms, 95)), "n": int(len(ms))}


def time_calls(fn, prompts: list[str], warmup: int = 20) -> dict:
    """Median and p95 (ms) of ``fn(prompt)`` over ``prompts``, after ``warmup`` untimed calls (one
    profile alone; ``benchmarks/max_tokens.py`` uses it)."""
    for p in prompts[:warmup]:
        fn(p)
    samples = []
    for p in prompts:
        start = time.perf_counter()
        fn(p)
        samples.append(time.perf_counter() - start)
    return _percentiles(samples)


def time_round_robin(profiles: list[Profile], prompts: list[str], warmup: int = 20) -> dict[str, dict]:
    """Median and p95 (ms) of each profile's ``run(prompt)`` over ``prompts``, the profiles taking
    turns on each prompt, after ``warmup`` untimed prompts each."""
    from tqdm.auto import tqdm

    for p in prompts[:warmup]:
        for prof in profiles:
            prof.run(p)
    samples: dict[str, list[float]] = {prof.name: [] for prof in profiles}
    for p in tqdm(prompts, desc="choose() latency, round-robin", unit="prompt"):
        for prof in profiles:
            start = time.perf_counter()
            prof.run(p)
            samples[prof.name].append(time.perf_counter() - start)
    return {name: _percentiles(s) for name, s in samples.items()}


#: Bytecode cache of the cold-start children (see the module docstring); set by :func:`main`.
PYCACHE_PREFIX: str | None = None


def _child_env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if PYCACHE_PREFIX is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = PYCACHE_PREFIX
    return env


def cold_start(spec: dict, prompts: list[str]) -> dict:
    """``{"cold_start_s", "cold_start_cpu_s", "peak_rss_mb"}`` of one fresh child running ``spec`` on ``prompts``."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(time.time()), json.dumps(spec)], input=json.dumps(prompts),
                         capture_output=True, text=True, cwd=ROOT, env=_child_env())
    if out.returncode != 0:
        raise RuntimeError(f"child for {spec} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_path(bundle: Path, public_key: Path, precision: str, path: str) -> dict:
    """One fresh child loading ``bundle`` by the ``"current"`` or ``"previous"`` load path."""
    spec = {"bundle": str(bundle.resolve()), "public_key": str(public_key), "precision": precision, "path": path}
    out = subprocess.run([sys.executable, "-c", LOAD_CHILD, json.dumps(spec)], capture_output=True, text=True,
                         cwd=ROOT, env=_child_env())
    if out.returncode != 0:
        raise RuntimeError(f"load child {spec} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _uptime() -> str:
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "n/a"


def require_onnx_bundle(parser: argparse.ArgumentParser, option: str, bundle: Path) -> dict:
    """The manifest of ``bundle``, a router bundle with the ONNX encoders these benchmarks time; else the
    parser's error (exit 2) naming ``option``: no readable ``manifest.json``, or a bundle of another embedder
    kind (the README's ``bundles/kmeans`` is on the static embedder: no encoder, no ``tokenizer.json``)."""
    try:
        manifest = json.loads((bundle / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"{option} {bundle}: no readable manifest.json ({exc})")
    kind = manifest.get("embedder_kind", DEFAULT_EMBEDDER_KIND)
    if kind != DEFAULT_EMBEDDER_KIND:
        parser.error(f"{option} {bundle} is a bundle of the {kind!r} embedder, with no ONNX encoder to time; give one "
                     "written by benchmarks/latency_bundle.py (or results/latency-bundles/bundles/latency, built by "
                     "benchmarks/choose_latency_bundles.py)")
    return manifest


def main(argv: list[str] | None = None) -> dict:
    global PYCACHE_PREFIX
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, default=None,
                        help="router bundle with the ONNX encoders (default: build it and --static-bundle, "
                             "see --build-dir)")
    parser.add_argument("--public-key", type=Path, default=None, help="signing.pub of the bundles (with --bundle)")
    parser.add_argument("--data", type=Path, required=True, help="RouterBench folder (train.parquet, test.parquet)")
    parser.add_argument("--static-bundle", type=Path, default=None, help="router bundle with a static embedder")
    parser.add_argument("--unfused-bundle", type=Path, default=None,
                        help="the same router's bundle with unfused encoders (latency_bundle.py --no-fuse)")
    parser.add_argument("--model2vec-folder", type=Path, default=None,
                        help="model2vec folder of the reference row (default: the trainer's distilled copy of the "
                             "static bundle's embedder, if present)")
    parser.add_argument("--build-dir", type=Path, default=Path("results/latency-bundles"),
                        help="without --bundle: where benchmarks/choose_latency_bundles.py builds (or finds) the "
                             "keys, routers and both bundles")
    parser.add_argument("--out", type=Path, default=Path("results/benchmarks"))
    parser.add_argument("--n-prompts", type=int, default=500)
    parser.add_argument("--cold-repeats", type=int, default=5)
    parser.add_argument("--load-repeats", type=int, default=5)
    parser.add_argument("--lam", type=float, default=100.0)
    parser.add_argument("--profiles", default=None,
                        help="comma-separated profile names or name prefixes to measure (e.g. 'static' for the "
                             "static rows); the baseline (torch) is always measured, the speed-ups need it; the "
                             "load-path table only with an onnx profile. Default: every profile")
    args = parser.parse_args(argv)
    if args.n_prompts < 100:
        parser.error("--n-prompts must be >= 100 (METRICS.md asks for >= 500)")
    if args.bundle is None:
        if args.public_key is not None or args.static_bundle is not None:
            parser.error("--public-key and --static-bundle go with --bundle (without it both bundles are built)")
        from choose_latency_bundles import build  # benchmarks/ is on sys.path: this script's folder

        built = build(args.data, args.build_dir)
        args.bundle, args.static_bundle, args.public_key = built.bundle, built.static_bundle, built.public_key
    elif args.public_key is None:
        parser.error("--bundle needs --public-key")
    manifest = require_onnx_bundle(parser, "--bundle", args.bundle)
    pycache = tempfile.TemporaryDirectory(prefix="fedroute-pycache-")
    PYCACHE_PREFIX = pycache.name

    from tqdm.auto import tqdm

    from trainer.data.routerbench import load_routerbench_dir

    test = load_routerbench_dir(args.data)[1]
    prompts = list(test.prompts[: args.n_prompts])
    if len(prompts) < args.n_prompts:
        parser.error(f"{args.data} has only {len(prompts)} test prompts")
    emb = manifest["embedder"]
    load_before = _uptime()
    profiles = []
    for make in PROFILES:
        made = make(args, emb)
        profiles.extend(made if isinstance(made, list) else [made])
    if args.profiles is not None:
        wanted = [w.strip() for w in args.profiles.split(",") if w.strip()]
        profiles = profiles[:1] + [p for p in profiles[1:]
                                   if any(p.name == w or p.name.startswith(w) or p.group == w for w in wanted)]
        if len(profiles) == 1:
            parser.error(f"--profiles {args.profiles!r} selects no profile besides the baseline")
    measured = [p for p in profiles if p.unavailable is None]
    results: dict = {
        "n_prompts": len(prompts), "lam": args.lam, "bundle_version": manifest["bundle_version"],
        "router_kind": manifest["router_kind"], "embedder": {k: emb[k] for k in ("name", "max_tokens", "truncation_side")},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "intra_op_threads": 1, "baseline": profiles[0].name, "profiles_selected": args.profiles, "profiles": {},
        "targets": TARGETS,
    }
    from sdk import Router

    tokens = Router.load(args.bundle, args.public_key, intra_op_threads=1).token_counts(prompts)
    results["tokens_per_prompt"] = {"median": float(np.median(tokens)), "max": int(max(tokens))}
    timing = time_round_robin(measured, prompts)
    for prof in profiles:
        row: dict = {"label": prof.label}
        if prof.unavailable is not None:
            row["unavailable"] = prof.unavailable
        else:
            cold_start(prof.child, prompts[:100])  # warm-up, untimed: fills the bytecode cache
            runs = [cold_start(prof.child, prompts[:100]) for _ in tqdm(range(args.cold_repeats),
                                                                          desc=f"cold start {prof.name}", leave=False)]
            row.update(timing[prof.name], cold_start_s=statistics.median(r["cold_start_s"] for r in runs),
                       cold_start_cpu_s=statistics.median(r["cold_start_cpu_s"] for r in runs),
                       peak_rss_mb=max(r["peak_rss_mb"] for r in runs))
        results["profiles"][prof.name] = row
    base = results["profiles"][profiles[0].name]["median_ms"]
    for row in results["profiles"].values():
        if "median_ms" in row:
            row["speedup"] = base / row["median_ms"]
    results["load_path"] = {}
    with_onnx = any(p.name.startswith("onnx-") for p in measured)
    for precision in [p for p in ("int8", "int8-all") if p in emb["files"] and with_onnx]:
        entry = {}
        for path in ("previous", "current"):
            runs = [load_path(args.bundle, args.public_key, precision, path) for _ in range(args.load_repeats)]
            entry[path] = {k: statistics.median(r[k] for r in runs) for k in ("load_ms", "verify_ms", "hashed_mb")}
            entry[path]["peak_rss_after_load_mb"] = max(r["peak_rss_after_load_mb"] for r in runs)
        results["load_path"][precision] = entry
    pycache.cleanup()
    PYCACHE_PREFIX = None
    results["targets_met"] = targets_met(results)
    results["load_avg_1min"] = {"before": load_before, "after": _uptime()}
    results["cold_start_bytecode"] = "compiled (private PYTHONPYCACHEPREFIX, one warm-up child per profile)"
    from trainer.report import write_text  # atomic: a killed run leaves the old file

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "choose_latency.json", json.dumps(results, indent=2) + "\n")
    write_text(args.out / "choose_latency.md", markdown(results))
    plot(results, args.out / "choose_latency.png")
    print(markdown(results))
    return results


def targets_met(r: dict) -> dict:
    """``{profile: {target: bool}}`` for the measured profiles of :data:`TARGETS` (missing rows: None)."""
    out = {}
    for key, targets in TARGETS.items():
        rows = {name: row for name, row in r["profiles"].items() if name == key or name.startswith(key + " ")}
        if not any("median_ms" in row for row in rows.values()):
            out[key] = None
        for name, row in rows.items():
            if "median_ms" in row:
                checks = {"speedup_min": row["speedup"] >= targets.get("speedup_min", 0),
                          "cold_start_s_max": row["cold_start_s"] <= targets.get("cold_start_s_max", float("inf")),
                          "peak_rss_mb_max": row["peak_rss_mb"] <= targets.get("peak_rss_mb_max", float("inf"))}
                out[name] = {k: bool(checks[k]) for k in targets}
    return out


def markdown(r: dict) -> str:
    lines = [
        f"`choose()` on {r['n_prompts']} RouterBench test prompts ({r['embedder']['name']}, last "
        f"{r['embedder']['max_tokens']} tokens, median {r['tokens_per_prompt']['median']:.0f} tokens), "
        f"1 intra-op thread, {r['machine']['cores']} cores, load average {r['load_avg_1min']['before']} before / "
        f"{r['load_avg_1min']['after']} after; speed-up = torch median / row median, same run:",
        "",
        "| profile | median ms | p95 ms | speed-up vs torch | cold start s | cold start CPU s | peak RSS MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["profiles"].values():
        if "median_ms" not in row:
            lines.append(f"| {row['label']} | not available in this checkout: {row['unavailable']} | | | | | |")
            continue
        lines.append(f"| {row['label']} | {row['median_ms']:.2f} | {row['p95_ms']:.2f} | {row['speedup']:.2f}x | "
                     f"{row['cold_start_s']:.2f} | {row['cold_start_cpu_s']:.2f} | {row['peak_rss_mb']:.0f} |")
    if r.get("load_path"):
        lines += ["", "`Router.load` (fresh process each, median of runs; peak RSS right after loading):", "",
                  "| precision | load path | load ms | verify ms | MB hashed | peak RSS MB |", "|---|---|---|---|---|---|"]
        for precision, entry in r["load_path"].items():
            for path, what in (("previous", "every file hashed, session from bytes"),
                               ("current", "used files hashed, session from the verified descriptor")):
                e = entry[path]
                lines.append(f"| {precision} | {path}: {what} | {e['load_ms']:.0f} | {e['verify_ms']:.0f} | "
                             f"{e['hashed_mb']:.0f} | {e['peak_rss_after_load_mb']:.0f} |")
    met = [f"{name}: " + (", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in checks.items())
                          if checks is not None else "not measured")
           for name, checks in r["targets_met"].items()]
    lines += ["", "Issue 13 targets: " + "; ".join(met) + "."]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.report import save_figure

    rows = [(name, row) for name, row in r["profiles"].items() if "median_ms" in row]
    names = [name for name, _ in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ax = axes[0]
    ax.bar(x - 0.2, [row["median_ms"] for _, row in rows], 0.4, label="median")
    ax.bar(x + 0.2, [row["p95_ms"] for _, row in rows], 0.4, label="p95")
    for i, (_, row) in enumerate(rows):
        ax.annotate(f"{row['speedup']:.1f}x", (i, row["p95_ms"]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per query (1 thread)")
    ax.set_title(f"choose() latency, {r['n_prompts']} RouterBench prompts")
    ax.legend()
    axes[1].bar(x - 0.2, [row["cold_start_s"] for _, row in rows], 0.4, color="tab:green", label="wall")
    axes[1].bar(x + 0.2, [row["cold_start_cpu_s"] for _, row in rows], 0.4, color="tab:olive", label="CPU (user + sys)")
    for i, (_, row) in enumerate(rows):
        axes[1].annotate(f"{row['cold_start_s']:.2f}", (i - 0.2, row["cold_start_s"]), ha="center", va="bottom", fontsize=7)
        axes[1].annotate(f"{row['cold_start_cpu_s']:.2f}", (i + 0.2, row["cold_start_cpu_s"]), ha="center", va="bottom",
                         fontsize=7)
    axes[1].set_yscale("log")  # torch's seconds and the static profile's tenths on one axis
    axes[1].set_ylabel("s, process start to first result (log)")
    axes[1].set_title("cold start (fresh process)")
    axes[1].legend(fontsize=8)
    axes[2].bar(x, [row["peak_rss_mb"] for _, row in rows], color="tab:red")
    axes[2].set_ylabel("MB (VmHWM)")
    axes[2].set_title("peak RSS, 100 queries")
    for ax in axes:
        ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    missing = [name for name, row in r["profiles"].items() if "median_ms" not in row]
    if missing:
        fig.text(0.01, 0.01, "not available in this checkout: " + ", ".join(missing), fontsize=8)
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
