"""``fedroute demo-log``: a device log made from real RouterBench rows through the bundle's own Router."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from sdk import EvalLog, Router
from sdk.errors import InvalidInputError, InvalidLambdaError
from sdk.local_update import RoundSpec, centroids_hash, kmeans_update
from trainer.demo_log import write_demo_log

N_ROWS = 40


@pytest.fixture(scope="module")
def bundle(make_bundle, tmp_path_factory):
    return make_bundle(tmp_path_factory.mktemp("demo") / "bundle", kind="kmeans")


@pytest.fixture(scope="module")
def router(bundle, signing_keys) -> Router:
    return Router.load(bundle, signing_keys[1])


@pytest.fixture(scope="module")
def train(routerbench_dir):
    from trainer.data.routerbench import load_routerbench_dir

    table = load_routerbench_dir(routerbench_dir)[0]
    return table.subset(np.arange(120))


def _sampled_rows(table, n_rows, seed):
    # The documented sample: rows drawn without replacement by default_rng(seed), in file order.
    return np.sort(np.random.default_rng(seed).choice(table.n_queries, size=n_rows, replace=False))


def test_without_exploration_each_row_is_the_routers_choice_and_its_labelled_outcome(router, train, tmp_path):
    lam = 100.0
    with EvalLog(tmp_path / "log.sqlite", router.model_ids) as log:
        result = write_demo_log(router, train, log, n_rows=N_ROWS, lam=lam, explore=0.0, seed=3)
        logged = log.rows()
    rows = _sampled_rows(train, N_ROWS, 3)
    expected = []
    for i in rows:
        choice = router.choose(train.prompts[i], lam)
        j = train.models.index(choice.model)
        if not math.isnan(train.accuracy[i, j]):
            expected.append((i, choice, train.accuracy[i, j], train.cost[i, j]))
    assert result.n_recorded == len(logged) == len(expected) and result.skipped == N_ROWS - len(expected)
    assert result.explored == 0
    assert list(logged.model) == [c.model for _, c, _, _ in expected]
    np.testing.assert_array_equal(logged.score, [s for _, _, s, _ in expected])
    np.testing.assert_array_equal(logged.cost_usd, [c for _, _, _, c in expected])
    np.testing.assert_array_equal(logged.cell, [c.cell for _, c, _, _ in expected])
    np.testing.assert_array_equal(logged.bundle_version, [router.bundle_version] * len(expected))
    # The device's own (int8, one query at a time) embeddings: what its sync job will read.
    np.testing.assert_array_equal(logged.embedding, router.embed([train.prompts[i] for i, _, _, _ in expected]))
    assert all(q is None for q in logged.query)  # no text stored
    assert result.per_model == {m: list(logged.model).count(m) for m in set(logged.model)}
    assert result.mean_score == pytest.approx(float(np.mean(logged.score)))
    assert result.total_cost_usd == pytest.approx(float(np.sum(logged.cost_usd)))


def test_a_row_whose_chosen_model_is_unlabelled_is_skipped(router, train, tmp_path):
    rows = _sampled_rows(train, 10, 0)
    picked = [train.models.index(router.choose(train.prompts[i], 0.0).model) for i in rows]
    accuracy = np.array(train.accuracy)
    accuracy[rows[0], picked[0]] = np.nan  # the first sampled row loses its chosen model's label
    accuracy[rows[1], picked[1]] = np.nan
    from trainer.data.routerbench import EvalTable

    table = EvalTable(train.prompts, train.tasks, train.sample_ids, train.models, accuracy, train.cost, "edited")
    unlabelled = sum(math.isnan(accuracy[i, j]) for i, j in zip(rows, picked))
    assert unlabelled >= 2
    with EvalLog(tmp_path / "log.sqlite", router.model_ids) as log:
        result = write_demo_log(router, table, log, n_rows=10, lam=0.0, seed=0)
        assert len(log) == 10 - unlabelled
    assert result.skipped == unlabelled and result.n_recorded == 10 - unlabelled


def test_full_exploration_logs_only_labelled_models_and_the_same_seed_gives_the_same_log(router, train, tmp_path):
    logs = []
    for name in ("a", "b"):
        with EvalLog(tmp_path / f"{name}.sqlite", router.model_ids) as log:
            result = write_demo_log(router, train, log, n_rows=N_ROWS, lam=100.0, explore=1.0, seed=7)
            logs.append(log.rows())
    a, b = logs
    assert a.model == b.model
    np.testing.assert_array_equal(a.score, b.score)
    rows = _sampled_rows(train, N_ROWS, 7)
    assert result.skipped == 0 and result.n_recorded == N_ROWS
    for i, model, score in zip(rows, a.model, a.score):
        assert train.accuracy[i, train.models.index(model)] == score
    assert len(set(a.model)) > 3  # random models, not the router's few favourites


def test_the_log_feeds_a_kmeans_update(router, train, tmp_path, bundle):
    """What the sync job computes from the demo log: every recorded row lands in a cell."""
    centroids = np.load(bundle / "kmeans.npz")["centroids"].astype(np.float32)
    spec = RoundSpec(1, "kmeans", centroids, centroids_hash(centroids), router.model_ids, "all-MiniLM-L6-v2",
                     router.d_emb, 1, "2030-01-01T00:00:00Z")
    with EvalLog(tmp_path / "log.sqlite", router.model_ids) as log:
        result = write_demo_log(router, train, log, n_rows=N_ROWS, lam=100.0, explore=0.5, seed=1)
        update = kmeans_update(log.rows(), spec)
    assert update.log_size == result.n_recorded
    assert update.statistics.count.sum() == result.n_recorded


@pytest.mark.parametrize("kwargs, error", [
    ({"n_rows": 0}, InvalidInputError),
    ({"explore": 1.5}, InvalidInputError),
    ({"explore": -0.1}, InvalidInputError),
    ({"lam": -1.0}, InvalidLambdaError),
    ({"lam": float("nan")}, InvalidLambdaError),
])
def test_bad_arguments_raise(router, train, tmp_path, kwargs, error):
    args = {"n_rows": 5, "lam": 1.0, **kwargs}
    with EvalLog(tmp_path / "log.sqlite", router.model_ids) as log:
        with pytest.raises(error):
            write_demo_log(router, train, log, **args)
        assert len(log) == 0


def test_a_table_without_the_bundles_models_is_refused(router, train, tmp_path):
    other = train.with_models(train.models[:1])
    from trainer.data.routerbench import EvalTable

    renamed = EvalTable(other.prompts, other.tasks, other.sample_ids, ("not-a-model",), other.accuracy, other.cost, "x")
    with EvalLog(tmp_path / "log.sqlite", router.model_ids) as log, pytest.raises(InvalidInputError, match="none of"):
        write_demo_log(router, renamed, log, n_rows=5, lam=1.0)


def test_command_appends_to_the_log_and_prints_a_summary(bundle, signing_keys, routerbench_dir, tmp_path):
    from typer.testing import CliRunner

    from trainer.cli import app

    out = tmp_path / "device" / "eval_log.sqlite"  # the folder does not exist yet
    args = ["demo-log", "--bundle", str(bundle), "--public-key", str(signing_keys[1]), "--data", str(routerbench_dir),
            "--out", str(out), "--rows", "12", "--seed", "2"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    summary = json.loads(first.output.strip().splitlines()[-1])
    assert summary["rows_in_log"] == summary["n_recorded"] == 12 - summary["skipped"]
    again = CliRunner().invoke(app, args)
    assert json.loads(again.output.strip().splitlines()[-1])["rows_in_log"] == 2 * summary["n_recorded"]
