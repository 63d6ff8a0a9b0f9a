"""End to end on a few hundred real RouterBench rows: the protocol runs, federated beats local,
results.json has the documented keys and the saved routers reload with identical predictions."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from trainer.cli import app
from trainer.data.routerbench import load_routerbench_dir
from trainer.embeddings import EmbedderConfig, embed_texts
from trainer.experiments import run_simulation
from trainer.routers.kmeans_router import KMeansRouter
from trainer.routers.mlp_router import MLPRouter, MLPRouterConfig
from trainer.simulation import SimulationConfig

pytestmark = pytest.mark.slow
# The module's runs embed with the 64-token encoder (the bundles' setting): 700 real prompts at the default
# 256 tokens cost ~60 s CPU, most of the module's time.
EMBEDDER = EmbedderConfig(max_tokens=64)


@pytest.fixture(scope="module")
def small_tables(routerbench_dir):
    train, test = load_routerbench_dir(routerbench_dir)
    rng = np.random.default_rng(0)
    return (train.subset(np.sort(rng.choice(train.n_queries, 500, replace=False))),
            test.subset(np.sort(rng.choice(test.n_queries, 200, replace=False))))


@pytest.fixture(scope="module")
def cache_dir(small_tables, tmp_path_factory):
    """An embedding cache that holds the small tables' prompts (:data:`EMBEDDER`): the module's runs embed
    no prompt twice."""
    cache = tmp_path_factory.mktemp("e2e-cache")
    train, test = small_tables
    embed_texts(list(train.prompts) + list(test.prompts), EMBEDDER, cache, show_progress=False)
    return cache


@pytest.fixture(scope="module")
def run(small_tables, cache_dir, tmp_path_factory):
    train, test = small_tables
    out = tmp_path_factory.mktemp("results")
    config = SimulationConfig(n_clients=5, mlp=MLPRouterConfig(hidden=128, rounds=120, patience=30, epochs=40))
    summary = run_simulation(train, test, out, config, seeds=[0, 1], embedder=EMBEDDER, cache_dir=cache_dir)
    return out, summary


def test_results_json_holds_the_documented_keys(run):
    out, _ = run
    results = json.loads((out / "results.json").read_text())
    assert results["command"] == "simulate"  # trainer.results_owner: another command's --out refuses this folder
    for name in ("oracle", "zero", "random"):
        assert 0.0 <= results["references"][name]["auc"] <= 1.0
    for kind in ("mlp", "kmeans"):
        for setting in ("local", "federated", "centralised"):
            entry = results["routers"][kind][setting]
            assert {"auc_mean", "auc_std", "gain"} <= entry.keys()
    ref = results["references"]
    assert ref["oracle"]["auc"] > ref["zero"]["auc"] > ref["random"]["auc"]
    assert (out / "results.md").read_text().count("\n") == 2 + 2 * 4 + 3 + 5 + 2
    assert (out / "curves.png").stat().st_size > 10_000


@pytest.mark.parametrize("kind", ["kmeans", "mlp"])
def test_federated_beats_local(run, kind):
    _, summary = run
    routers = summary["routers"][kind]
    assert routers["federated"]["auc_mean"] > routers["local"]["auc_mean"] + 0.02


def test_saved_federated_routers_reload_with_identical_predictions(run, small_tables, cache_dir):
    out, _ = run
    _, test = small_tables
    emb = embed_texts(list(test.prompts), EMBEDDER, cache_dir, show_progress=False)
    for cls, kind in ((KMeansRouter, "kmeans"), (MLPRouter, "mlp")):
        router = cls.load(out / "routers" / kind)
        meta = json.loads((out / "routers" / kind / "router.json").read_text())
        assert meta["embedder"]["dim"] == 384 and meta["embedder"]["truncation_side"] == "left"
        acc, cost = router.predict(emb)
        assert acc.shape == cost.shape == (test.n_queries, 11)
        assert np.isfinite(acc).all() and (cost > 0).all()


@pytest.fixture
def torch_threads():
    """torch's CPU threads before the test, restored after it (a command sets them for its process)."""
    import torch

    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_cli_simulate_on_train_and_test_files(small_tables, cache_dir, tmp_path, torch_threads):
    train, test = small_tables
    import pandas as pd
    import torch

    # --train/--test accept any file of the schema: write a CSV and a parquet subset, of rows whose prompts the
    # module's cache holds (the command's embedding pass is a cache read).
    src = pd.read_parquet(train.source)
    src[src["prompt"].isin(set(train.prompts))].iloc[:300].to_csv(tmp_path / "train.csv", index=False)
    src = pd.read_parquet(test.source)
    src[src["prompt"].isin(set(test.prompts))].iloc[:150].to_parquet(tmp_path / "test.parquet")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "simulate", "--train", str(tmp_path / "train.csv"), "--test", str(tmp_path / "test.parquet"),
        "--out", str(out), "--seeds", "1", "--routers", "kmeans", "--n-clients", "4", "--max-tokens", "64", "--cache-dir", str(cache_dir),
    ])
    assert result.exit_code == 0, result.output
    assert "K-means | federated" in result.output
    assert (out / "routers" / "kmeans" / "kmeans.npz").exists()
    assert torch.get_num_threads() == 1  # the small-model default (trainer.torch_device.DEFAULT_CPU_THREADS)


@pytest.mark.parametrize("command", ["simulate", "ablate"])
def test_cli_threads_sets_torch_threads_before_any_work(tmp_path, torch_threads, command):
    import torch

    torch.set_num_threads(2)
    # an absent --data fails after the threads are set and before anything is read or trained
    result = CliRunner().invoke(app, [command, "--data", str(tmp_path / "absent"), "--out", str(tmp_path / "out"), "--threads", "1"])
    assert result.exit_code != 0
    assert torch.get_num_threads() == 1
    result = CliRunner().invoke(app, [command, "--data", str(tmp_path / "absent"), "--out", str(tmp_path / "out2"), "--threads", "0"])
    assert result.exit_code == 2 and "--threads" in result.output


def test_cli_rejects_an_unknown_router_kind(tmp_path, routerbench_dir):
    result = CliRunner().invoke(app, ["simulate", "--data", str(routerbench_dir), "--routers", "mlp,forest",
                                      "--out", str(tmp_path)])
    assert result.exit_code != 0
    assert "valid: ['mlp', 'kmeans']" in result.output


def _write_pair(tmp_path, routerbench_dir, mutate_test=None, mutate_train=None, n=40):
    import pandas as pd

    train = pd.read_parquet(routerbench_dir / "train.parquet").iloc[:n]
    test = pd.read_parquet(routerbench_dir / "test.parquet").iloc[:n]
    if mutate_train:
        train = mutate_train(train)
    if mutate_test:
        test = mutate_test(test)
    train.to_parquet(tmp_path / "train.parquet")
    test.to_parquet(tmp_path / "test.parquet")
    return ["--train", str(tmp_path / "train.parquet"), "--test", str(tmp_path / "test.parquet")]


def _drop_model(df, model="claude-v2"):
    return df.drop(columns=[c for c in df.columns if c.startswith(model + "|")])


def _unlabel(df, model="claude-v2"):
    df = df.copy()
    df[model + "|correctness"] = float("nan")
    return df


def _only_one_model(df):
    keep = [c for c in df.columns if "|" not in c or c.startswith("claude-v2|")]
    return df[keep]


@pytest.mark.parametrize(
    "mutate_train, mutate_test, message",
    [
        (None, _drop_model, "test.parquet lacks ['claude-v2']"),
        (None, _unlabel, "no row has labels for every model (0 of 40 scorable)"),
        (_only_one_model, _only_one_model, "routing needs at least 2 models"),
        (lambda df: df.iloc[:0], None, "no row has any labelled model (0 rows)"),
    ],
)
def test_unscorable_inputs_fail_before_any_work(tmp_path, routerbench_dir, mutate_train, mutate_test, message):
    args = _write_pair(tmp_path, routerbench_dir, mutate_test, mutate_train)
    result = CliRunner().invoke(app, ["simulate", *args, "--out", str(tmp_path / "out"), "--routers", "kmeans"])
    assert result.exit_code != 0
    assert message in str(result.exception) or message in result.output


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--routers", ""], "no router kind given"),
        (["--device", "banana"], "is not a torch device"),
    ],
)
def test_bad_options_are_refused_with_one_line(tmp_path, routerbench_dir, extra, message):
    result = CliRunner().invoke(app, ["simulate", "--data", str(routerbench_dir), "--out", str(tmp_path), *extra])
    assert result.exit_code == 2
    assert message in result.output


def test_out_must_be_a_folder(tmp_path, routerbench_dir):
    args = _write_pair(tmp_path, routerbench_dir)
    (tmp_path / "taken").write_text("x")
    result = CliRunner().invoke(app, ["simulate", *args, "--out", str(tmp_path / "taken"), "--routers", "kmeans"])
    assert result.exit_code != 0
    assert "exists and is not a folder" in str(result.exception)
