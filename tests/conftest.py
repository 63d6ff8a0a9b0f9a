"""Shared fixtures: the read-only real data beside the checkout (../shared/data)."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# One torch (OpenMP) thread per test process, set before any test module imports torch: the README's
# `-n 2` runs two workers on two cores, and a worker's default of one thread per core oversubscribed
# them (spinning OpenMP threads: more CPU for the same work). Commands set their own (--threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")
SHARED_DATA = Path(os.environ.get("FEDROUTE_SHARED_DATA", ROOT.parent / "shared" / "data"))


# The heaviest files, longest first, by their summed test time in a `pytest -n 2 --durations=0` profile of
# the suite (2,265 tests): `prism train --quick` alone is ~16 % of it, the README quick starts ~9 %.
# Refresh the list from such a profile when a file's time moves by minutes.
HEAVIEST_FILES = (
    "test_prism_cli.py", "test_readme_quickstart.py", "test_selector_bundle.py", "test_routed_selector_bundle.py",
    "test_reward_export.py", "test_fedprism.py", "test_server_api.py", "test_grpo_routing.py", "test_sync_crash.py",
    "test_mor.py", "test_cli_hostile.py", "test_sync_mlp.py", "test_sync_e2e.py", "test_operator_flows.py",
    "test_router_choose.py", "test_mor_pipeline.py", "test_proxy_hardening.py", "test_flower.py", "test_vpa.py",
)


def pytest_collection_modifyitems(config, items):
    """The heaviest files first (:data:`HEAVIEST_FILES`, longest first), then the other files holding a
    ``slow`` test, then the rest, each file's tests in their own order.

    With ``-n 2`` each worker takes whole files from this order (pyproject: ``--dist loadfile
    --no-loadscope-reorder``): longest first, so that the two workers finish together on short files
    (xdist's default, most tests first, left the few-test long files for the end, one worker running
    them while the other idled)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    rank = {name: i for i, name in enumerate(HEAVIEST_FILES)}

    def key(item) -> tuple[int, int]:
        if item.path.name in rank:
            return 0, rank[item.path.name]
        return (1 if item.path in slow_files else 2), 0

    items.sort(key=key)  # stable: order within each group (and each file) kept


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path of ``../shared/data``; the tests need it (CI lays it beside the clone)."""
    if not (SHARED_DATA / "routerbench" / "train.parquet").exists():
        pytest.fail(f"shared data not found at {SHARED_DATA}; set FEDROUTE_SHARED_DATA")
    return SHARED_DATA


@pytest.fixture(scope="session")
def routerbench_dir(shared_data: Path) -> Path:
    return shared_data / "routerbench"


# --- bundles: a real exported MiniLM encoder and small routers fitted on real RouterBench rows ----

BUNDLE_MAX_TOKENS = 64
N_FIT_PROMPTS = 300
N_PARITY_PROMPTS = 120


def built_once(tmp_path_factory, name: str, build):
    """``build(folder)``'s result, built by one test process into ``<shared tmp>/<name>/`` and reused by the
    others: with ``-n 2`` each xdist worker would otherwise build its own copy of a session artefact
    (pytest-xdist's recipe: the workers' base temp folders share a parent; a file lock orders them). The
    result is pickled beside the files; tests must not change what is in the folder."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    folder, result = root / name, root / f"{name}.pickle"
    with FileLock(f"{folder}.lock"):
        if not result.exists():
            folder.mkdir()
            result.write_bytes(pickle.dumps(build(folder)))
    return pickle.loads(result.read_bytes())


@pytest.fixture(scope="session")
def signing_keys(tmp_path_factory) -> tuple[Path, Path]:
    """(signing.key, signing.pub) of a fresh Ed25519 key pair."""
    from export.signing import generate_keypair

    return generate_keypair(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="session")
def exported_embedder(tmp_path_factory):
    """all-MiniLM-L6-v2 exported by optimum and fused as the ``onnx`` embedder kind ships it
    (:mod:`export.embedder_fusion`; optimum's unfused graph stays beside it as ``model.onnx``), plus
    its int8 variant: (ExportedEmbedder, int8 path)."""
    from export.embedder_onnx import export_embedder, quantize_embedder
    from trainer.embeddings import resolve_model_path

    def build(out: Path):
        exported = export_embedder(resolve_model_path("all-MiniLM-L6-v2"), out, BUNDLE_MAX_TOKENS, "left", fuse=True)
        return exported, quantize_embedder(exported.model, out / "embedder.int8.onnx")

    return built_once(tmp_path_factory, "embedder", build)


def _int8_all(tmp_path_factory, exported_embedder) -> Path:
    """The exported encoder quantised with the ``int8-all`` recipe (every weight MatMul in int8), written
    once (:func:`built_once`)."""
    from export.embedder_onnx import quantize_precision

    return built_once(tmp_path_factory, "embedder-int8-all",
                      lambda out: quantize_precision(exported_embedder[0].model, out / "embedder.int8-all.onnx", "int8-all"))


@pytest.fixture(scope="session")
def int8_all_model(tmp_path_factory, exported_embedder) -> Path:
    """Path of the exported encoder quantised with the ``int8-all`` recipe."""
    return _int8_all(tmp_path_factory, exported_embedder)


@pytest.fixture(scope="session")
def fitted_routers(routerbench_dir: Path, tmp_path_factory):
    """A K-means and an MLP router fitted centrally on real RouterBench train rows (dense labels),
    with the embedder identity and a test file of real prompts recorded for export's parity check.

    Returns dict with ``kmeans``, ``mlp`` (trainer routers), ``test_file`` (parquet, fully labelled
    rows), ``test`` (EvalTable), ``test_embeddings`` (sentence-transformers, (n, 384) float32), ``train`` and
    ``train_embeddings`` (the rows the routers were fitted on).
    """
    from trainer.data.routerbench import load_routerbench_dir
    from trainer.embeddings import EmbedderConfig, embed_texts
    from trainer.data.client_data import ClientData
    from trainer.routers.kmeans_router import KMeansRouterConfig, fit_kmeans_router
    from trainer.routers.mlp_router import MLPRouterConfig, train_mlp_router

    import numpy as np
    import pandas as pd

    train, test = load_routerbench_dir(routerbench_dir)
    rng = np.random.default_rng(0)
    train = train.subset(np.sort(rng.choice(train.n_queries, N_FIT_PROMPTS, replace=False)))
    test = test.complete_rows()
    test = test.subset(np.sort(rng.choice(test.n_queries, N_PARITY_PROMPTS, replace=False)))
    tmp = tmp_path_factory.mktemp("routers")
    config = EmbedderConfig(max_tokens=BUNDLE_MAX_TOKENS)
    cache = tmp / "cache"
    train_emb, test_emb, shared_cache = built_once(tmp_path_factory, "router-embeddings", lambda folder: (
        *(embed_texts(list(t.prompts), config, folder, show_progress=False) for t in (train, test)), folder))
    shutil.copytree(shared_cache, cache)  # this process's own copy: tests add to it (export --cache-dir)
    rows, cols = np.nonzero(train.labelled())
    dense = ClientData(train_emb[rows], cols.astype(np.int64), train.accuracy[rows, cols], train.cost[rows, cols])
    kmeans = fit_kmeans_router(dense, train.models, KMeansRouterConfig(n_clusters=6), seed=0)
    # The MLP never sees the last model: its head must predict NaN (never chosen), in torch and ONNX.
    seen = cols != train.n_models - 1
    partial = ClientData(train_emb[rows[seen]], cols[seen].astype(np.int64), train.accuracy[rows[seen], cols[seen]],
                         train.cost[rows[seen], cols[seen]])
    mlp = train_mlp_router([partial], train.models, MLPRouterConfig(hidden=64, epochs=3, epoch_patience=3),
                           np.random.default_rng(0), federated=False)
    frame = pd.read_parquet(routerbench_dir / "test.parquet")
    test_file = tmp / "test_subset.parquet"
    frame[frame["prompt"].isin(set(test.prompts))].to_parquet(test_file)
    identity = {"name": "all-MiniLM-L6-v2", "dim": 384, "max_tokens": BUNDLE_MAX_TOKENS,
                "truncation_side": "left", "pooling": "mean", "normalised": True}
    for router in (kmeans, mlp):
        router.embedder = dict(identity)
        router.provenance = {"test": str(test_file)}
        router.save(tmp / router.kind)
    return {"kmeans": kmeans, "mlp": mlp, "dir": tmp, "test_file": test_file, "test": test,
            "test_embeddings": test_emb, "train": train, "train_embeddings": train_emb, "cache": cache}


@pytest.fixture(scope="session")
def make_bundle(tmp_path_factory, exported_embedder, fitted_routers, signing_keys):
    """``make_bundle(out, kind="kmeans", int8=True, int8_all=False, **field_overrides) -> Path``: a signed
    bundle of the fitted router, written by the exporter's own assembly and writer (no parity step)."""
    from export.bundle_writer import write_bundle
    from export.pipeline import assemble
    from export.signing import load_signing_key

    exported, int8_path = exported_embedder
    key = load_signing_key(signing_keys[0])

    def build(out: Path, kind: str = "kmeans", int8: bool = True, files: dict | None = None, int8_all: bool = False,
              **overrides) -> Path:
        router = fitted_routers[kind]
        quantised = {"int8": int8_path} if int8 else {}
        if int8_all:  # quantised on first use only
            quantised["int8-all"] = _int8_all(tmp_path_factory, exported_embedder)
        parts, fields = assemble(router, exported, quantised, "all-MiniLM-L6-v2",
                                 BUNDLE_MAX_TOKENS, "left", {}, 1)
        parts.update(files or {})
        fields.update(overrides)
        write_bundle(out, parts, fields, key)
        return out

    return build


@pytest.fixture(scope="module")
def postgres():
    """(a throwaway PostgreSQL server, None) or (None, why none could start) (tests/postgres_server.py),
    one per test module that asks for it."""
    from postgres_server import start

    server, why = start()
    yield server, why
    if server is not None:
        server.stop()
