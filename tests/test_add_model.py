"""``fedroute add-model``: a new model without retraining (trainer/routers/add_model.py).

Bad calibration inputs are clear errors; the K-means column equals the hand-computed shrunk
estimate; the MLP's trunk and old heads stay bit-identical; the result exports to a signed bundle
that ``sdk.Router`` loads and routes to the new model.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from sdk import CellStatistics
from sdk.errors import InvalidInputError, UnknownModelError
from tests.test_routers import MODELS, two_topic_clients
from trainer.add_model_cli import add_model_to_router
from trainer.cli import app
from trainer.kinds import load_router
from trainer.routers.add_model import (
    add_model_kmeans,
    add_model_mlp,
    calibration_from_frame,
    load_calibration,
    resolve_price,
)
from trainer.routers.kmeans_router import KMeansRouter
from trainer.routers.mlp_router import MLPRouter, MLPRouterConfig, train_mlp_router

POOL = ("cheap", "strong")


def frame(**overrides):
    base = {"prompt": ["What is 2+2?", "Name a prime."], "model": ["new", "new"], "score": [1.0, 0.0],
            "cost_usd": [0.001, 0.002]}
    base.update(overrides)
    return pd.DataFrame(base)


# --------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("overrides, error, message", [
    ({"model": ["new", "mystery-llm"]}, UnknownModelError, "unknown models ['mystery-llm']"),
    ({"model": ["new", "strong"]}, UnknownModelError, "pool models ['strong'] (their heads are frozen"),
    ({"score": [1.0, float("nan")]}, InvalidInputError, "row 1: score must be a number in [0, 1]"),
    ({"score": [1.5, 0.0]}, InvalidInputError, "row 0: score must be a number in [0, 1], got 1.5"),
    ({"score": [1.0, "yes"]}, InvalidInputError, "row 1: score must be a number in [0, 1], got 'yes'"),
    ({"cost_usd": [-0.001, 0.002]}, InvalidInputError, "row 0: cost_usd must be a finite number of USD per query"),
    ({"cost_usd": [0.001, float("inf")]}, InvalidInputError, "row 1: cost_usd must be a finite number"),
    ({"cost_usd": [0.001, 1000.5]}, InvalidInputError, "row 1: cost_usd must be a finite number of USD per query, "
                                                       ">= 0 and <= 1000, got 1000.5"),
    ({"prompt": ["What is 2+2?", "   "]}, InvalidInputError, "row 1: prompt must be non-empty text"),
    ({"prompt": [None, "x"]}, InvalidInputError, "row 0: prompt must be non-empty text"),
])
def test_bad_calibration_rows_are_clear_errors(overrides, error, message):
    with pytest.raises(error) as info:
        calibration_from_frame(frame(**overrides), "new", POOL, "cal.csv")
    assert message in str(info.value) and "cal.csv" in str(info.value)


@pytest.mark.parametrize("column", ["prompt", "model", "score", "cost_usd"])
def test_a_missing_column_is_named(column):
    with pytest.raises(InvalidInputError, match=f"missing column\\(s\\) \\['{column}'\\]"):
        calibration_from_frame(frame().drop(columns=[column]), "new", POOL)


def test_a_model_already_in_the_pool_or_an_empty_id_is_refused():
    with pytest.raises(InvalidInputError, match="'strong' is already in the router's pool"):
        calibration_from_frame(frame(model=["strong", "strong"]), "strong", POOL)
    with pytest.raises(InvalidInputError, match="non-empty model id"):
        calibration_from_frame(frame(), " ", POOL)


def test_price_comes_from_the_option_or_the_calibration_mean_and_a_model_without_one_is_refused():
    cal = calibration_from_frame(frame(), "new", POOL)
    assert resolve_price(cal, None) == pytest.approx(0.0015)
    assert resolve_price(cal, 0.01) == 0.01
    empty = calibration_from_frame(frame().iloc[:0], "new", POOL)
    with pytest.raises(InvalidInputError, match="'new' has no price.*give --price"):
        resolve_price(empty, None)
    for bad in (-1.0, float("nan"), float("inf"), 10**400, True):  # 10**400 was an OverflowError traceback
        with pytest.raises(InvalidInputError, match="--price must be a finite number >= 0"):
            resolve_price(cal, bad)
    assert resolve_price(cal, 1000.0) == 1000.0


@pytest.mark.parametrize("price", [1000.5, 1e300, 1e308])
def test_a_price_above_what_a_log_records_is_refused_before_it_overflows_the_cost_table(price):
    """``--price 1e308`` wrote a K-means router whose new cost column was inf (the shrinkage's
    ``kappa0 * price`` overflowed; a RuntimeWarning only); a device log and the sync server refuse
    costs above 1000 USD per query, so such a price is refused, naming it."""
    cal = calibration_from_frame(frame(), "new", POOL)
    with pytest.raises(InvalidInputError, match=f"--price must be at most 1000 USD per query.*got {re.escape(repr(price))}"):
        resolve_price(cal, price)
    with pytest.raises(InvalidInputError, match="price_usd"):
        add_model_kmeans(small_kmeans(), "new", np.zeros((0, 3), np.float32), np.zeros(0), np.zeros(0), price)


def test_calibration_files_of_each_format_load_and_bad_files_are_refused(tmp_path):
    f = frame(prompt=["NA", "Name a prime."])  # "NA" is a prompt, not a missing value
    f.to_csv(tmp_path / "c.csv", index=False)
    f.to_parquet(tmp_path / "c.parquet")
    f.to_json(tmp_path / "c.jsonl", orient="records", lines=True)
    for name in ("c.csv", "c.parquet", "c.jsonl"):
        cal = load_calibration(tmp_path / name, "new", POOL)
        assert cal.prompts == ("NA", "Name a prime.")
        np.testing.assert_array_equal(cal.accuracy, [1.0, 0.0])
        np.testing.assert_array_equal(cal.cost, [0.001, 0.002])
    (tmp_path / "blank.csv").write_text("prompt,model,score,cost_usd\nq,new,,0.1\n")
    with pytest.raises(InvalidInputError, match="row 0: score must be"):
        load_calibration(tmp_path / "blank.csv", "new", POOL)
    with pytest.raises(InvalidInputError, match="unknown suffix '.txt'"):
        load_calibration(tmp_path / "c.txt", "new", POOL)
    with pytest.raises(InvalidInputError, match="cannot read it"):
        load_calibration(tmp_path / "missing.csv", "new", POOL)


# --------------------------------------------------------------------------- K-means: hand-computed values


def small_kmeans(prior="model"):
    centroids = np.eye(2, 3, dtype=np.float32)
    stats = CellStatistics(np.array([[4.0, 2.0], [2.0, 4.0]]), np.array([[3.0, 1.0], [1.0, 2.0]]),
                           np.array([[0.4, 0.2], [0.2, 0.4]]))
    return KMeansRouter(centroids, stats, POOL, prior_strength=2.0, model_prior_strength=4.0, prior=prior)


def test_kmeans_new_column_is_the_hand_computed_shrunk_estimate_of_the_prior():
    router = small_kmeans()
    x = np.array([[1, 0, 0], [0.9, 0.1, 0], [1, 0.05, 0]], dtype=np.float32)  # all three in cell 0
    wider = add_model_kmeans(router, "new", x, np.array([1.0, 1.0, 0.0]), np.array([0.01, 0.02, 0.03]), 0.05)
    assert wider.models == ("cheap", "strong", "new")
    np.testing.assert_array_equal(wider.centroids_, router.centroids_)
    np.testing.assert_array_equal(wider.statistics_.count[:, :2], router.statistics_.count)
    np.testing.assert_array_equal(wider.statistics_.sum_accuracy[:, :2], router.statistics_.sum_accuracy)
    np.testing.assert_array_equal(wider.statistics_.count[:, 2], [3.0, 0.0])
    # Pool mean accuracy (the pool's 12 observations, 7 correct): 7 / 12. Model level with kappa0 = 4:
    # accuracy (2 + 4 * 7 / 12) / (3 + 4); cost (0.06 + 4 * 0.05) / 7 = 0.26 / 7.
    a_m, c_m = (2 + 4 * 7 / 12) / 7, 0.26 / 7
    # Cells with kappa = 2: cell 0 has the 3 observations, cell 1 none (the model-level value).
    np.testing.assert_allclose(wider.accuracy_[:, 2], [(2 + 2 * a_m) / 5, a_m], rtol=1e-12)
    np.testing.assert_allclose(wider.cost_[:, 2], [(0.06 + 2 * c_m) / 5, c_m], rtol=1e-12)
    np.testing.assert_allclose(wider.model_costs()[2], c_m, rtol=1e-12)
    # The pool's columns are exactly what they were (their prior comes from the pool alone).
    np.testing.assert_array_equal(wider.accuracy_[:, :2], router.accuracy_)
    np.testing.assert_array_equal(wider.cost_[:, :2], router.cost_)


def test_kmeans_additive_prior_fits_the_new_model_against_the_pools_cell_effects():
    router = small_kmeans("additive")
    # Pool cell effects: cell 0 holds 4/6 correct, cell 1 3/6, so b = (+1/12, -1/12) around 7/12.
    x = np.array([[1, 0, 0], [0, 1, 0]], dtype=np.float32)
    wider = add_model_kmeans(router, "new", x, np.array([1.0, 0.0]), np.array([0.01, 0.01]), 0.01)
    np.testing.assert_array_equal(wider.accuracy_[:, :2], router.accuracy_)
    from trainer.routers.shrinkage import additive_effects

    _, b = additive_effects(router.statistics_)
    effect = ((1 - b[0]) + (0 - b[1])) / 2  # least squares with b fixed
    model = (2 * effect + 4 * 7 / 12) / (2 + 4)
    prior_k = np.clip(model + b, 0, 1)
    np.testing.assert_allclose(wider.accuracy_[:, 2], [(1 + 2 * prior_k[0]) / 3, (0 + 2 * prior_k[1]) / 3],
                               rtol=1e-12)


def test_kmeans_without_observations_predicts_the_pool_mean_accuracy_and_the_price():
    router = small_kmeans()
    wider = add_model_kmeans(router, "new", np.zeros((0, 3), np.float32), np.zeros(0), np.zeros(0), 0.05)
    np.testing.assert_allclose(wider.accuracy_[:, 2], [7 / 12, 7 / 12], rtol=1e-12)  # 7 correct of 12
    np.testing.assert_allclose(wider.cost_[:, 2], [0.05, 0.05], rtol=1e-12)
    # Old columns: the statistics, hence the shrunk means, are those of the pool alone.
    np.testing.assert_array_equal(wider.accuracy_[:, :2], router.accuracy_)
    np.testing.assert_array_equal(wider.cost_[:, :2], router.cost_)
    # The additive prior adds each cell's difficulty to the same pool mean.
    additive = add_model_kmeans(small_kmeans("additive"), "new", np.zeros((0, 3), np.float32), np.zeros(0),
                                np.zeros(0), 0.05)
    assert np.isfinite(additive.accuracy_[:, 2]).all()
    assert additive.accuracy_[0, 2] > additive.accuracy_[1, 2]  # cell 0 is the easier one (4/6 vs 3/6)


def test_kmeans_added_router_round_trips_with_its_price(tmp_path):
    wider = add_model_kmeans(small_kmeans(), "new", np.zeros((0, 3), np.float32), np.zeros(0), np.zeros(0), 0.05)
    wider.save(tmp_path / "r")
    back = KMeansRouter.load(tmp_path / "r")
    np.testing.assert_array_equal(back.price_prior_, wider.price_prior_)
    np.testing.assert_array_equal(back.accuracy_, wider.accuracy_)
    np.testing.assert_array_equal(back.cost_, wider.cost_)
    with pytest.raises(InvalidInputError, match="already in the router's pool"):
        add_model_kmeans(back, "new", np.zeros((0, 3), np.float32), np.zeros(0), np.zeros(0), 0.05)


# --------------------------------------------------------------------------- MLP: frozen trunk and heads


@pytest.fixture(scope="module")
def mlp_two_topics():
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    clients, x_test, topic = two_topic_clients(rng)
    router = train_mlp_router(clients, MODELS, MLPRouterConfig(hidden=16, rounds=30, patience=10), rng)
    return router, x_test, topic


def separable_calibration(rng, n=60, d=8):
    """Queries of the two topics; the new model is right on topic 1 only and costs 2e-5 USD."""
    centres = np.zeros((2, d), dtype=np.float32)
    centres[0, 0], centres[1, 1] = 1.0, 1.0
    topic = rng.integers(0, 2, n)
    x = (centres[topic] + 0.05 * rng.normal(size=(n, d))).astype(np.float32)
    return x, (topic == 1).astype(float), np.full(n, 2e-5)


def test_mlp_trunk_and_old_heads_are_bit_identical_and_old_predictions_unchanged(mlp_two_topics):
    router, x_test, _ = mlp_two_topics
    x, acc, cost = separable_calibration(np.random.default_rng(1))
    wider = add_model_mlp(router, "new", x, acc, cost, 2e-5)
    before, after = router.state(), wider.state()
    assert set(before) == set(after)
    for name, value in before.items():
        old_rows = after[name] if value.shape == after[name].shape else after[name][: value.shape[0]]
        np.testing.assert_array_equal(old_rows, value, err_msg=name)
    assert after["accuracy_head.weight"].shape == (3, 16) and after["cost_head.bias"].shape == (3,)
    a0, c0 = router.predict(x_test)
    a1, c1 = wider.predict(x_test)
    np.testing.assert_array_equal(a1[:, :2], a0)
    np.testing.assert_array_equal(c1[:, :2], c0)
    np.testing.assert_array_equal(wider.cost_scale_[:2], router.cost_scale_)


def test_mlp_new_head_fitted_on_a_separable_calibration_set_predicts_it(mlp_two_topics):
    router, x_test, topic = mlp_two_topics
    x, acc, cost = separable_calibration(np.random.default_rng(1))
    wider = add_model_mlp(router, "new", x, acc, cost, 2e-5)
    a, c = wider.predict(x_test)
    assert a[topic == 1, 2].min() > 0.8 and a[topic == 0, 2].max() < 0.2
    np.testing.assert_allclose(c[:, 2], 2e-5, rtol=0.05)  # price and observed mean agree
    # Topic 1: the new model is right and 50x cheaper than 'strong', so any lam > 0 picks it there.
    choice = wider.decide(x_test, 10.0)
    assert (choice[topic == 1] == 2).all() and (choice[topic == 0] == 0).all()


def test_mlp_without_observations_predicts_the_pool_mean_and_the_price(mlp_two_topics):
    router, x_test, _ = mlp_two_topics
    wider = add_model_mlp(router, "new", np.zeros((0, 8), np.float32), np.zeros(0), np.zeros(0), 3e-4)
    a, c = wider.predict(x_test)
    np.testing.assert_allclose(a[:, 2], a[:, :2].mean(axis=1), atol=1e-6)
    _, c_norm = wider.network(torch.from_numpy(x_test))
    expected = c_norm.detach().numpy()[:, :2].mean(axis=1) * 3e-4  # the old cost heads' mean, priced
    np.testing.assert_allclose(c[:, 2], expected, rtol=1e-5)
    assert wider.cost_scale_[2] == pytest.approx(3e-4)


def test_mlp_added_router_round_trips(mlp_two_topics, tmp_path):
    router, x_test, _ = mlp_two_topics
    x, acc, cost = separable_calibration(np.random.default_rng(2))
    wider = add_model_mlp(router, "new", x, acc, cost, 2e-5)
    wider.save(tmp_path / "mlp")
    back = MLPRouter.load(tmp_path / "mlp")
    assert back.models == ("cheap", "strong", "new")
    np.testing.assert_array_equal(back.predict(x_test)[0], wider.predict(x_test)[0])


# --------------------------------------------------------------------------- end to end: CLI -> export -> sdk


def write_calibration(fitted_routers, path, n=40):
    prompts = list(fitted_routers["test"].prompts[:n])
    pd.DataFrame({"prompt": prompts, "model": "budget-genius", "score": 1.0, "cost_usd": 1e-7}).to_csv(path, index=False)
    return path


def test_add_model_cli_refuses_bad_inputs_with_one_line(fitted_routers, tmp_path):
    cal = write_calibration(fitted_routers, tmp_path / "cal.csv", n=3)
    router_dir = fitted_routers["dir"] / "kmeans"
    existing = fitted_routers["kmeans"].models[0]
    for args, message in (
        (["--model", existing], f"model {existing!r} is already in the router's pool"),
        (["--model", "budget-genius", "--price", "-1"], "--price must be a finite number >= 0"),
        (["--model", "other-model"], "unknown models ['budget-genius']"),
    ):
        result = CliRunner().invoke(app, ["add-model", "--router", str(router_dir), "--calibration", str(cal),
                                          "--out", str(tmp_path / "out"), *args])
        assert result.exit_code != 0 and message in str(result.exception), result.output
        assert not (tmp_path / "out").exists()
    with pytest.raises(InvalidInputError, match="is the router's own folder"):
        add_model_to_router(router_dir, "budget-genius", cal, router_dir)


def test_add_model_refuses_an_out_folder_that_holds_files_before_any_work(fitted_routers, tmp_path):
    """An --out that is a results folder or another router's folder is never written into (it used to get
    router.json and kmeans.npz over its own files), nor is a file."""
    cal = write_calibration(fitted_routers, tmp_path / "cal.csv", n=3)
    router_dir = fitted_routers["dir"] / "kmeans"
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "results.json").write_text("{}")
    result = CliRunner().invoke(app, ["add-model", "--router", str(router_dir), "--calibration", str(cal),
                                      "--out", str(taken), "--model", "budget-genius"])
    assert result.exit_code != 0 and isinstance(result.exception, InvalidInputError)
    assert str(result.exception).startswith(f"--out {taken} already exists and is not an empty folder")
    assert sorted(p.name for p in taken.iterdir()) == ["results.json"] and (taken / "results.json").read_text() == "{}"
    with pytest.raises(InvalidInputError, match="not an empty folder"):
        add_model_to_router(router_dir, "budget-genius", cal, cal)  # a file


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kmeans", "mlp"])
def test_add_model_then_export_then_the_sdk_routes_to_the_new_model(kind, fitted_routers, tmp_path):
    from sdk import Router

    runner = CliRunner()
    cal = write_calibration(fitted_routers, tmp_path / "cal.csv")
    wider_dir = tmp_path / "wider"
    result = runner.invoke(app, ["add-model", "--router", str(fitted_routers["dir"] / kind), "--model", "budget-genius",
                                 "--calibration", str(cal), "--out", str(wider_dir),
                                 "--cache-dir", str(fitted_routers["cache"])])
    assert result.exit_code == 0, result.output
    assert "added 'budget-genius' from 40 calibration queries, price 1e-07 USD per query" in result.output
    wider = load_router(wider_dir)
    assert wider.models == (*fitted_routers[kind].models, "budget-genius")
    meta = json.loads((wider_dir / "router.json").read_text())
    assert meta["provenance"]["added_models"][0]["price_from"] == "calibration mean cost_usd"
    keys = tmp_path / "keys"
    assert runner.invoke(app, ["keygen", "--out", str(keys)]).exit_code == 0
    out = tmp_path / "bundle"
    result = runner.invoke(app, ["export", "--router", str(wider_dir), "--out", str(out),
                                 "--signing-key", str(keys / "signing.key"), "--cache-dir", str(fitted_routers["cache"])])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["models"][-1]
    assert entry["id"] == "budget-genius"
    assert entry["mean_cost_usd"] == pytest.approx(1e-7, rel=1e-3)  # the price table carries its price
    router = Router.load(out, keys / "signing.pub")
    assert router.model_ids[-1] == "budget-genius"
    choices = router.choose_batch(list(fitted_routers["test"].prompts[40:80]), 1000.0)
    # Right on every calibration query at a 1e-7 USD price: at lam = 1000 / USD it wins almost everywhere.
    assert np.mean([c.model == "budget-genius" for c in choices]) >= 0.9
