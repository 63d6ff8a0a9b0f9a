"""Degenerate client logs (sdk.log_checks): criteria by hand, held-out personalisation errors, the
issue's 120-row all-1.0 one-model log on real RouterBench routers, and the upload path."""

import logging

import numpy as np
import pytest

from sdk import EvalLog, interpolation_weights, personalise
from sdk.device_rounds import DeviceRoundContext, KMeansRoundHandler, screen_log
from sdk.errors import InvalidInputError, ShapeError
from sdk.log_checks import MIN_CONSTANT_ROWS, MIN_MODEL_ROWS, check_log
from sdk.personalisation import holdout_split, personalisation_weights
from sdk.protocol import centroids_hash, decode_kmeans_update_msgpack
from sdk.utility import decide

MODELS = ("a", "b", "c")


def test_criteria_by_hand():
    idx = np.array([0] * 30 + [1] * 12 + [2] * 3)
    score = np.concatenate([np.ones(30), np.tile([0.0, 1.0], 6), [1.0, 0.0, 1.0]])
    check = check_log(idx, score, MODELS)
    np.testing.assert_array_equal(check.n_rows, [30, 12, 3])
    np.testing.assert_array_equal(check.constant, [True, False, False])  # 30 rows of 1.0
    np.testing.assert_array_equal(check.few_rows, [False, False, True])  # 3 < MIN_MODEL_ROWS
    assert not check.single_model  # b and c are usable
    np.testing.assert_array_equal(check.personalisable, [False, True, False])
    np.testing.assert_array_equal(check.uploadable, [False, True, True])
    assert check.degenerate and len(check.warnings) == 2 and len(check.upload_warnings) == 1
    assert "'a': all 30 scores are 1" in check.warnings[0]


def test_constant_below_the_threshold_is_not_flagged_and_one_model_is():
    check = check_log(np.zeros(MIN_CONSTANT_ROWS - 1, int), np.ones(MIN_CONSTANT_ROWS - 1), MODELS)
    assert not check.constant.any()
    assert check.single_model and not check.personalisable.any() and check.uploadable[0]
    assert MIN_MODEL_ROWS <= MIN_CONSTANT_ROWS


def test_check_refuses_bad_shapes():
    with pytest.raises(ShapeError):
        check_log(np.zeros(3, int), np.zeros(4), MODELS)


def test_holdout_split_is_per_model_and_disjoint():
    idx = np.array([0] * 10 + [1] * 5 + [2] * 1)
    fit, held = holdout_split(idx, np.random.default_rng(0))
    assert np.intersect1d(fit, held).size == 0 and np.union1d(fit, held).size == 16
    assert np.bincount(idx[held], minlength=3).tolist() == [2, 1, 0]  # round(0.2 * 10), max(1, 1), none of 1
    with pytest.raises(InvalidInputError):
        holdout_split(idx, np.random.default_rng(0), fraction=1.0)


def test_weights_from_held_out_errors_by_hand():
    # two held-out rows of model 0 (truth 1, 0) and one of model 1 (truth 1); models 0, 1 personalisable.
    check = check_log(np.array([0] * 12 + [1] * 12), np.tile([0.0, 1.0], 12), ("m0", "m1"))
    g_acc = np.array([[0.6, 0.5], [0.6, 0.5], [0.6, 0.5]])
    l_acc = np.array([[0.9, 0.1], [0.3, 0.1], [0.9, 0.8]])
    cost = np.full((3, 2), 0.001)
    w = personalisation_weights((g_acc, cost), (l_acc, cost), np.array([0, 0, 1]), np.array([1.0, 0.0, 1.0]),
                                np.array([0.001, 0.001, 0.001]), check)
    # model 0: global MAE (0.4 + 0.6) / 2 = 0.5, local (0.1 + 0.3) / 2 = 0.2 -> w = 0.5 / 0.7
    # model 1: global MAE 0.5, local 0.2 -> w = 0.5 / 0.7 ; costs exact for both -> 0.5
    np.testing.assert_allclose(w.accuracy, [0.5 / 0.7, 0.5 / 0.7])
    np.testing.assert_allclose(w.cost, [0.5, 0.5])
    np.testing.assert_allclose(w.global_error[:, 0], [0.5, 0.5])
    assert w.warnings == ()


def test_issue_case_one_model_all_ones_no_longer_dominates(fitted_routers, caplog):
    """The issue: 120 rows of one model, every score 1.0. In-sample errors gave the local estimator
    weight 1 and predicted accuracy 1.000 for that model; now the global estimate stands."""
    from trainer import kinds
    from trainer.data.client_data import ClientData
    from trainer.simulation import SimulationConfig

    glob = fitted_routers["kmeans"]
    test, emb = fitted_routers["test"], fitted_routers["test_embeddings"]  # 120 real prompts
    models = list(test.models)
    m = models.index("mistralai/mixtral-8x7b-chat")
    n = emb.shape[0]
    log = ClientData(emb, np.full(n, m), np.ones(n), test.cost[:, m].copy())
    config, rng = SimulationConfig(), np.random.default_rng(0)
    kind = kinds.get("kmeans")
    g_acc, g_cost = glob.predict(emb)

    # The old path: local estimator on every row, errors in-sample -> weight 1, accuracy 1.000.
    local_all = kind.fit_local(log, models, config, rng)
    l_acc, l_cost = local_all.predict(emb)
    rows = np.arange(n)
    w_old = interpolation_weights(np.abs(g_acc[rows, m] - 1.0).mean(keepdims=True).repeat(len(models)),
                                  np.abs(l_acc[rows, m] - 1.0).mean(keepdims=True).repeat(len(models)))
    old = personalise(g_acc, l_acc, w_old)
    # ~1 rather than exactly 1: the local estimate of a mean of ones can come out 1 - 1e-16 (on an
    # AVX-512 machine it did), which leaves the local error at ~1e-16 instead of 0.
    assert w_old[m] == pytest.approx(1.0, abs=1e-12) and np.allclose(old[:, m], 1.0)
    lam = 30.0
    old_share = float(np.mean(decide(old, personalise(g_cost, l_cost, w_old), lam) == m))

    # The new path: held-out errors and the degenerate-log check.
    check = check_log(log.model, log.accuracy, models)
    assert check.constant[m] and check.single_model
    fit, held = holdout_split(log.model, rng)
    local = kind.fit_local(log.subset(fit), models, config, rng)
    with caplog.at_level(logging.WARNING, logger="fedroute.log_checks"):
        w = personalisation_weights(glob.predict(emb[held]), local.predict(emb[held]), log.model[held],
                                    log.accuracy[held], log.cost[held], check)
    assert w.accuracy[m] == 0.0 and (w.accuracy == 0).all() and (w.cost == 0).all()
    assert any("all 120 scores are 1" in r.getMessage() for r in caplog.records)
    la, lc = local.predict(emb)
    new_acc, new_cost = personalise(g_acc, la, w.accuracy), personalise(g_cost, lc, w.cost)
    np.testing.assert_allclose(new_acc, g_acc)  # the global estimate, unchanged
    new_share = float(np.mean(decide(new_acc, new_cost, lam) == m))
    global_share = float(np.mean(decide(g_acc, g_cost, lam) == m))
    assert new_share == global_share
    print(f'share routed to the all-1.0 model: in-sample {old_share:.3f}, now {new_share:.3f}; real accuracy '
          f'{test.accuracy[:, m].mean():.3f}, predicted mean before {old[:, m].mean():.3f}, now {new_acc[:, m].mean():.3f}')
    assert old_share > new_share + 0.2  # the old path sent far more queries to the all-1.0 model


def _round(models=MODELS) -> dict:
    centroids = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=np.float32)
    return {"round_id": 1, "kind": "kmeans", "client_id": "dev-1", "centroids": centroids.tolist(),
            "centroids_hash": centroids_hash(centroids), "models": list(models), "embedder_name": "toy",
            "d_emb": 3, "min_count": 1, "deadline_utc": "2026-12-01T00:00:00Z"}


def test_upload_withholds_a_constant_model(tmp_path):
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(60, 3)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log:
        for k in range(40):
            log.record("a", 1.0, 0.002, embedding=emb[k])  # constant over 40 rows
        for k in range(40, 60):
            log.record("b", float(k % 2), 0.001, embedding=emb[k])
        rows = log.rows()
    kept, check = screen_log(rows)
    assert len(kept) == 20 and set(kept.model) == {"b"} and check.constant.tolist() == [True, False]
    context = DeviceRoundContext("dev-1", lambda: rows, None, 1, False, lambda p, n: b"")
    prepared = KMeansRoundHandler().prepare(_round(), context)
    assert prepared.content_type == "application/msgpack"  # the default wire format
    count = np.asarray(decode_kmeans_update_msgpack(prepared.payload)[1].statistics.count)
    assert count[:, 0].sum() == 0 and count[:, 1].sum() == 20  # nothing of "a", all of "b"
    # "a" withheld; "b" is then the only model: warned about, still sent (see sdk.log_checks, criterion 3)
    assert len(prepared.warnings) == 2 and "'a': all 40 scores are 1" in prepared.warnings[0]
    assert "covers 1 model" in prepared.warnings[1]
