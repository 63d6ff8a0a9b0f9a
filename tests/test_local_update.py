"""A device's K-means round update from its EvalLog (sdk.local_update), against hand-computed values;
holding small changes between two uploads (differencing), duplicate prompts, empty logs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sdk import EvalLog
from sdk.cell_statistics import CellStatistics
from sdk.errors import ShapeError, SyncError
from sdk.protocol import decode_sent_record, encode_sent_record
from sdk.local_update import (
    KMeansUpdate,
    RoundSpec,
    centroid_threshold,
    centroids_hash,
    hold_small_changes,
    kmeans_update,
)

MODELS = ("cheap", "mid", "strong")
CENTROIDS = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=np.float32)


def spec(min_count: int = 1, centroids=CENTROIDS, models=MODELS, **extra) -> RoundSpec:
    return RoundSpec.from_json({
        "round_id": 7, "kind": "kmeans", "centroids": np.asarray(centroids).tolist(),
        "centroids_hash": centroids_hash(centroids), "models": list(models), "embedder_name": "toy",
        "d_emb": 3, "min_count": min_count, "deadline_utc": "2026-12-01T00:00:00Z", **extra,
    })


def unit(*v) -> np.ndarray:
    x = np.array(v, dtype=np.float32)
    return x / np.linalg.norm(x)


@pytest.fixture
def log(tmp_path):
    rows = [  # (model, score, cost, embedding): cell 0 is near e1, cell 1 near e2
        ("cheap", 1.0, 0.001, unit(1, 0.1, 0)),
        ("cheap", 0.0, 0.002, unit(1, -0.1, 0)),
        ("strong", 1.0, 0.03, unit(1, 0, 0.2)),
        ("mid", 0.5, 0.01, unit(0.1, 1, 0)),
        ("mid", 1.0, 0.01, unit(-0.1, 1, 0)),
        ("mid", 0.0, 0.02, unit(0, 1, 0.1)),
    ]
    with EvalLog(tmp_path / "log.sqlite", MODELS) as eval_log:
        for model, score, cost, emb in rows:
            eval_log.record(model, score, cost, embedding=emb)
        eval_log.record("strong", 1.0, 0.05, cell=0)  # a cell but no embedding: skipped
        yield eval_log, rows


def test_statistics_and_cell_means_match_hand_computation(log):
    eval_log, rows = log
    u = kmeans_update(eval_log.rows(), spec())
    assert u.log_size == 6
    np.testing.assert_array_equal(u.statistics.count, [[2, 0, 1], [0, 3, 0]])
    np.testing.assert_allclose(u.statistics.sum_accuracy, [[1.0, 0, 1.0], [0, 1.5, 0]])
    np.testing.assert_allclose(u.statistics.sum_cost, [[0.003, 0, 0.03], [0, 0.04, 0]])
    np.testing.assert_array_equal(u.centroid_cells, [0, 1])
    np.testing.assert_array_equal(u.local_weights, [3, 3])
    emb = np.stack([r[3] for r in rows]).astype(np.float64)
    np.testing.assert_allclose(u.local_centroids, [emb[:3].mean(0), emb[3:].mean(0)], rtol=1e-6)


def test_each_cost_is_clipped_to_the_rounds_max_cost(log):
    # costs 0.001, 0.002 | 0.03 | 0.01, 0.01, 0.02 clipped at 0.015 USD: cell 1's "mid" sum is
    # 0.01 + 0.01 + 0.015 = 0.035, the "strong" entry 0.015; scores and counts unchanged
    eval_log, _ = log
    u = kmeans_update(eval_log.rows(), spec(max_cost_usd=0.015))
    assert spec(max_cost_usd=0.015).max_cost_usd == 0.015 and spec().max_cost_usd is None
    np.testing.assert_allclose(u.statistics.sum_cost, [[0.003, 0, 0.015], [0, 0.035, 0]])
    np.testing.assert_array_equal(u.statistics.count, [[2, 0, 1], [0, 3, 0]])
    np.testing.assert_allclose(u.statistics.sum_accuracy, [[1.0, 0, 1.0], [0, 1.5, 0]])
    assert kmeans_update(eval_log.rows(), spec(max_cost_usd=None)).statistics.sum_cost[0, 2] == pytest.approx(0.03)


def test_min_count_suppresses_entries_and_cell_means(log):
    eval_log, _ = log
    u = kmeans_update(eval_log.rows(), spec(min_count=3))
    np.testing.assert_array_equal(u.statistics.count, [[0, 0, 0], [0, 3, 0]])
    np.testing.assert_allclose(u.statistics.sum_accuracy, [[0, 0, 0], [0, 1.5, 0]])
    np.testing.assert_array_equal(u.centroid_cells, [0, 1])  # 3 queries each >= max(3, 2)
    u = kmeans_update(eval_log.rows(), spec(min_count=4))
    assert u.statistics.count.sum() == 0 and u.centroid_cells.size == 0


def test_a_single_query_embedding_is_never_reported(tmp_path):
    assert centroid_threshold(1) == 2
    with EvalLog(tmp_path / "one.sqlite", MODELS) as eval_log:
        eval_log.record("cheap", 1.0, 0.001, embedding=unit(1, 0.2, 0))
        u = kmeans_update(eval_log.rows(), spec(min_count=1))
    assert u.statistics.count.sum() == 1  # the statistics are reported (min_count=1) ...
    assert u.centroid_cells.size == 0 and u.local_centroids.shape == (0, 3)  # ... its embedding is not


def test_unknown_models_are_skipped_and_payload_is_json(log):
    eval_log, _ = log
    u = kmeans_update(eval_log.rows(), spec(models=("cheap", "mid")))
    assert u.log_size == 5  # the "strong" row is not summarised
    payload = u.to_payload("dev-1", spec(models=("cheap", "mid")))
    decoded = json.loads(json.dumps(payload, allow_nan=False))
    assert set(decoded) == {"client_id", "round_id", "kind", "centroids_hash", "models", "log_size", "count",
                            "sum_accuracy", "sum_cost", "centroid_cells", "local_centroids", "local_weights"}
    assert decoded["count"] == [[2.0, 0.0], [0.0, 3.0]]


def test_embeddings_of_another_dimension_are_refused(tmp_path):
    with EvalLog(tmp_path / "d4.sqlite", MODELS) as eval_log:
        eval_log.record("cheap", 1.0, 0.001, embedding=np.ones(4, dtype=np.float32) / 2)
        with pytest.raises(ShapeError, match="dimension 4"):
            kmeans_update(eval_log.rows(), spec())


def test_round_spec_refuses_tampered_or_malformed_answers():
    good = {"round_id": 1, "kind": "kmeans", "centroids": CENTROIDS.tolist(), "centroids_hash": centroids_hash(CENTROIDS),
            "models": list(MODELS), "embedder_name": "toy", "d_emb": 3, "min_count": 1, "deadline_utc": "x"}
    assert RoundSpec.from_json(good).round_id == 1
    with pytest.raises(SyncError, match="hash"):
        RoundSpec.from_json({**good, "centroids": (CENTROIDS * 2).tolist()})
    with pytest.raises(SyncError, match="malformed"):
        RoundSpec.from_json({**good, "round_id": True})
    with pytest.raises(SyncError, match="malformed"):
        RoundSpec.from_json([1, 2])
    with pytest.raises(SyncError, match="d_emb"):
        RoundSpec.from_json({**good, "d_emb": 4})
    with pytest.raises(SyncError, match="distinct"):
        RoundSpec.from_json({**good, "models": ["a", "a", "b"]})
    for bad in (0, -1.0, "0.1", True, [0.1], 1e400):  # 1e400 is what json reads as inf
        with pytest.raises(SyncError, match="max_cost_usd"):
            RoundSpec.from_json({**good, "max_cost_usd": bad})
    assert RoundSpec.from_json({**good, "max_cost_usd": None}).max_cost_usd is None


# --- one upload: duplicates, empty logs --------------------------------------------------------


def test_a_prompt_logged_many_times_is_not_reported_as_a_cell_mean(tmp_path):
    with EvalLog(tmp_path / "dup.sqlite", MODELS) as eval_log:
        for _ in range(5):  # one prompt, five times: the cell's mean would be its embedding
            eval_log.record("cheap", 1.0, 0.001, embedding=unit(1, 0.2, 0))
        u = kmeans_update(eval_log.rows(), spec(min_count=1))
        assert u.statistics.count[0, 0] == 5  # its statistics are reported ...
        assert u.centroid_cells.size == 0 and u.local_centroids.shape == (0, 3)  # ... its embedding is not
        eval_log.record("mid", 0.0, 0.002, embedding=unit(1, -0.2, 0))  # a second distinct embedding
        u = kmeans_update(eval_log.rows(), spec(min_count=1))
    np.testing.assert_array_equal(u.centroid_cells, [0])
    np.testing.assert_array_equal(u.local_weights, [6])  # the weight counts every query (Lloyd step)
    np.testing.assert_array_equal(u.local_distinct, [2])
    expected = (5 * unit(1, 0.2, 0).astype(np.float64) + unit(1, -0.2, 0)) / 6
    np.testing.assert_allclose(u.local_centroids[0], expected, rtol=1e-7)


@pytest.mark.parametrize("rows", ["none", "cells_only"])
def test_a_log_with_nothing_usable_gives_an_empty_update(tmp_path, rows):
    with EvalLog(tmp_path / "empty.sqlite", MODELS) as eval_log:
        if rows == "cells_only":
            eval_log.record("cheap", 1.0, 0.001, cell=0)  # no embedding: the log's dimension stays 0
            eval_log.record("mid", 0.0, 0.002, cell=1)
        u = kmeans_update(eval_log.rows(), spec(min_count=2))
    assert u.is_empty() and u.log_size == 0
    assert u.statistics.count.shape == (2, 3) and not u.statistics.count.any()
    assert u.centroid_cells.shape == (0,) and u.local_centroids.shape == (0, 3) and u.local_weights.shape == (0,)
    assert not kmeans_update_of_one_row(tmp_path).is_empty()


def kmeans_update_of_one_row(tmp_path) -> KMeansUpdate:
    with EvalLog(tmp_path / "one_row.sqlite", MODELS) as eval_log:
        eval_log.record("cheap", 1.0, 0.001, embedding=unit(1, 0.2, 0))
        return kmeans_update(eval_log.rows(), spec(min_count=1))


# --- two uploads: hold_small_changes -----------------------------------------------------------


def update(count, sum_acc, sum_cost, cells=(), means=(), weights=(), distinct=None, log_size=None) -> KMeansUpdate:
    """A hand-written update over 2 cells x 2 models, embeddings in 2-d."""
    count = np.asarray(count, dtype=np.float64)
    return KMeansUpdate(CellStatistics(count, sum_acc, sum_cost), np.asarray(cells, dtype=np.int64),
                        np.asarray(means, dtype=np.float64).reshape(-1, 2), np.asarray(weights, dtype=np.float64),
                        int(count.sum()) if log_size is None else log_size,
                        None if distinct is None else np.asarray(distinct, dtype=np.int64))


SENT = update([[30, 0], [0, 10]], [[15.0, 0], [0, 9.0]], [[0.3, 0], [0, 0.5]],
              cells=[0], means=[[0.6, 0.8]], weights=[30], distinct=[30])


def test_an_entry_that_grew_by_one_keeps_its_sent_values():
    new = update([[31, 0], [0, 10]], [[16.0, 0], [0, 9.0]], [[0.31, 0], [0, 0.5]],
                 cells=[0], means=[[0.61, 0.79]], weights=[31], distinct=[31])
    out = hold_small_changes(new, SENT, min_count=5)
    np.testing.assert_array_equal(out.statistics.count, [[30, 0], [0, 10]])  # 30 -> 31: held
    np.testing.assert_array_equal(out.statistics.sum_accuracy, [[15.0, 0], [0, 9.0]])
    np.testing.assert_array_equal(out.statistics.sum_cost, [[0.3, 0], [0, 0.5]])
    np.testing.assert_array_equal(out.centroid_cells, [0])  # 30 -> 31 queries: the sent mean
    np.testing.assert_array_equal(out.local_centroids, [[0.6, 0.8]])
    np.testing.assert_array_equal(out.local_weights, [30])
    assert out.log_size == 41  # the log's size, >= every reported total


def test_an_entry_that_grew_by_min_count_is_sent():
    new = update([[35, 0], [0, 10]], [[18.0, 0], [0, 9.0]], [[0.35, 0], [0, 0.5]],
                 cells=[0], means=[[0.62, 0.78]], weights=[35], distinct=[35])
    out = hold_small_changes(new, SENT, min_count=5)
    np.testing.assert_array_equal(out.statistics.count, [[35, 0], [0, 10]])  # 30 -> 35: sent
    np.testing.assert_array_equal(out.statistics.sum_accuracy, [[18.0, 0], [0, 9.0]])
    np.testing.assert_array_equal(out.statistics.sum_cost, [[0.35, 0], [0, 0.5]])
    np.testing.assert_array_equal(out.local_centroids, [[0.62, 0.78]])
    np.testing.assert_array_equal(out.local_weights, [35])
    np.testing.assert_array_equal(out.local_distinct, [35])


def test_a_cell_mean_that_grew_by_one_query_keeps_its_sent_mean():
    # min_count = 1: entries are sent at every change, but a cell mean needs a change of 2 queries
    sent = update([[3, 0], [0, 0]], [[2.0, 0], [0, 0]], [[0.03, 0], [0, 0]],
                  cells=[0], means=[[0.6, 0.8]], weights=[3], distinct=[3])
    new = update([[4, 0], [0, 0]], [[3.0, 0], [0, 0]], [[0.04, 0], [0, 0]],
                 cells=[0], means=[[0.7, 0.7]], weights=[4], distinct=[4])
    out = hold_small_changes(new, sent, min_count=1)
    np.testing.assert_array_equal(out.statistics.count, [[4, 0], [0, 0]])
    np.testing.assert_array_equal(out.local_centroids, [[0.6, 0.8]])  # (4 mu2 - 3 mu1) would be the query
    np.testing.assert_array_equal(out.local_weights, [3])
    new2 = update([[5, 0], [0, 0]], [[4.0, 0], [0, 0]], [[0.05, 0], [0, 0]],
                  cells=[0], means=[[0.66, 0.74]], weights=[5], distinct=[5])
    out2 = hold_small_changes(new2, out, min_count=1)  # 3 -> 5 queries since what was sent: sent
    np.testing.assert_array_equal(out2.local_centroids, [[0.66, 0.74]])
    np.testing.assert_array_equal(out2.local_weights, [5])


def test_a_cell_whose_new_queries_repeat_one_prompt_keeps_its_sent_mean():
    # weight 30 -> 40, but the 10 new queries are one prompt logged 10 times: 30 -> 31 distinct
    new = update([[30, 0], [0, 10]], [[15.0, 0], [0, 9.0]], [[0.3, 0], [0, 0.5]],
                 cells=[0], means=[[0.65, 0.75]], weights=[40], distinct=[31], log_size=50)
    out = hold_small_changes(new, SENT, min_count=5)
    np.testing.assert_array_equal(out.local_centroids, [[0.6, 0.8]])
    np.testing.assert_array_equal(out.local_weights, [30])


def test_new_cells_are_sent_and_vanished_ones_dropped():
    new = update([[30, 0], [0, 10]], [[15.0, 0], [0, 9.0]], [[0.3, 0], [0, 0.5]],
                 cells=[1], means=[[0.0, 1.0]], weights=[10], distinct=[10], log_size=40)
    out = hold_small_changes(new, SENT, min_count=5)
    np.testing.assert_array_equal(out.centroid_cells, [1])  # cell 0 went 30 -> 0 (>= 5), cell 1 0 -> 10
    np.testing.assert_array_equal(out.local_weights, [10])


def test_held_values_below_a_higher_min_count_are_not_sent():
    sent = update([[3, 0], [0, 0]], [[2.0, 0], [0, 0]], [[0.03, 0], [0, 0]],
                  cells=[0], means=[[0.6, 0.8]], weights=[3], distinct=[3])
    new = update([[4, 0], [0, 0]], [[3.0, 0], [0, 0]], [[0.04, 0], [0, 0]], log_size=4)  # suppressed at 5
    out = hold_small_changes(new, sent, min_count=5)
    assert out.is_empty()  # 3 was sent under min_count 3; under 5 it is not re-sent


def test_nothing_sent_before_or_nothing_changed():
    assert hold_small_changes(SENT, None, min_count=5) is SENT
    out = hold_small_changes(SENT, SENT, min_count=5)
    np.testing.assert_array_equal(out.statistics.count, SENT.statistics.count)
    np.testing.assert_array_equal(out.local_centroids, SENT.local_centroids)
    assert out.log_size == SENT.log_size


@pytest.mark.parametrize("damage", [
    pytest.param({"centroid_cells": [5]}, id="cell-out-of-range"),
    pytest.param({"centroid_cells": [-1]}, id="cell-negative"),
    pytest.param({"centroid_cells": [0, 0], "local_centroids": [[1.0, 0, 0]] * 2, "local_weights": [30, 30],
                  "local_distinct": [30, 30]}, id="cell-repeated"),
    pytest.param({"count": [[1.0]]}, id="count-of-another-shape"),
    pytest.param({"local_centroids": [[1.0, 0.0]]}, id="mean-of-another-dimension"),
])
def test_a_damaged_sent_record_is_a_sync_error(damage):
    """The state file's record of the last sent update is checked when read (hold_small_changes trusts it)."""
    sent = KMeansUpdate(CellStatistics(np.full((2, 3), 30.0), np.full((2, 3), 15.0), np.full((2, 3), 0.3)),
                        np.array([0]), np.array([[1.0, 0.0, 0.0]]), np.array([30.0]), 180, np.array([30]))
    record = {**encode_sent_record(sent, spec()), **damage}
    with pytest.raises(SyncError, match="last sent update is damaged"):
        decode_sent_record(record, spec())


def test_one_more_logged_query_cannot_be_recovered_from_two_uploads(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(31, 3)) + np.array([4.0, 0, 0])
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    s = spec(min_count=5)
    with EvalLog(tmp_path / "grow.sqlite", MODELS) as eval_log:
        for i in range(30):
            eval_log.record("cheap", float(i % 2), 0.001 * (1 + i % 3), embedding=x[i])
        first = hold_small_changes(kmeans_update(eval_log.rows(), s), None, s.min_count)
        eval_log.record("cheap", 1.0, 0.0123, embedding=x[30])  # the secret query
        raw = kmeans_update(eval_log.rows(), s)
        second = hold_small_changes(raw, first, s.min_count)
    assert raw.statistics.count[0, 0] == 31 and raw.local_weights[0] == 31  # unheld, it would reveal x[30]
    np.testing.assert_array_equal(second.statistics.count, first.statistics.count)
    np.testing.assert_array_equal(second.statistics.sum_accuracy, first.statistics.sum_accuracy)
    np.testing.assert_array_equal(second.statistics.sum_cost, first.statistics.sum_cost)
    np.testing.assert_array_equal(second.local_centroids, first.local_centroids)
    np.testing.assert_array_equal(second.local_weights, first.local_weights)
    assert second.log_size == 31
