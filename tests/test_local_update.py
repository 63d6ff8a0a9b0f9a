"""A device's K-means round update from its EvalLog (sdk.local_update), against hand-computed values."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sdk import EvalLog
from sdk.errors import ShapeError, SyncError
from sdk.local_update import (
    RoundSpec,
    centroid_threshold,
    centroids_hash,
    kmeans_update,
)

MODELS = ("cheap", "mid", "strong")
CENTROIDS = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=np.float32)


def spec(min_count: int = 1, centroids=CENTROIDS, models=MODELS) -> RoundSpec:
    return RoundSpec.from_json({
        "round_id": 7, "kind": "kmeans", "centroids": np.asarray(centroids).tolist(),
        "centroids_hash": centroids_hash(centroids), "models": list(models), "embedder_name": "toy",
        "d_emb": 3, "min_count": min_count, "deadline_utc": "2026-12-01T00:00:00Z",
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
