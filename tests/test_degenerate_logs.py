"""Degenerate client logs: the log criteria by hand (sdk.log_checks), the shrunk personalisation weights by
hand (sdk.personalisation), the issues' degenerate and near-miss logs and a sweep of small degenerate logs on
real RouterBench routers, an honest log that still personalises, and the upload path."""

import logging

import numpy as np
import pytest

from sdk import EvalLog, interpolation_weights, personalise
from sdk.device_rounds import DeviceRoundContext, KMeansRoundHandler, screen_log
from sdk.log_checks import MIN_CONSTANT_ROWS, check_log
from sdk.personalisation import PRIOR_ROWS, credibility, holdout_split, personalisation_weights
from sdk.protocol import centroids_hash, decode_kmeans_update_msgpack
from sdk.utility import decide

MODELS = ("a", "b", "c")
LAM = 30.0  # USD^-1, the issue's lambda
MAX_EXCESS = 0.05  # a degenerate log may add at most this share of the queries to its model


def test_criteria_by_hand():
    idx = np.array([0] * 30 + [1] * 12 + [2] * 3)
    score = np.concatenate([np.ones(30), np.tile([0.0, 1.0], 6), [1.0, 1.0, 1.0]])
    check = check_log(idx, score, MODELS)
    np.testing.assert_array_equal(check.n_rows, [30, 12, 3])
    np.testing.assert_array_equal(check.constant, [True, False, False])  # 30 rows of 1.0; c's 3 are too few
    assert not check.single_model  # b and c are usable
    np.testing.assert_array_equal(check.uploadable, [False, True, True])
    assert len(check.warnings) == 1 and "'a': all 30 scores are 1" in check.warnings[0]


def test_constant_below_the_threshold_is_not_flagged_and_one_model_is():
    check = check_log(np.zeros(MIN_CONSTANT_ROWS - 1, int), np.ones(MIN_CONSTANT_ROWS - 1), MODELS)
    assert not check.constant.any()
    assert check.single_model and check.uploadable[0] and "covers 1 model" in check.warnings[0]


def test_holdout_split_is_per_model_and_disjoint():
    idx = np.array([0] * 10 + [1] * 5 + [2] * 1)
    fit, held = holdout_split(idx, np.random.default_rng(0))
    assert np.intersect1d(fit, held).size == 0 and np.union1d(fit, held).size == 16
    assert np.bincount(idx[held], minlength=3).tolist() == [2, 1, 0]  # round(0.2 * 10), max(1, 1), none of 1


def test_credibility_by_hand():
    # c = (1/kappa + 1/N) / (1/kappa + 1/N + 1/n); N = inf: n / (n + kappa)
    np.testing.assert_allclose(credibility(np.array([0, 10, 30, 90]), np.inf, 30.0), [0.0, 0.25, 0.5, 0.75])
    # N = kappa = n = 30: (2/30) / (3/30)
    np.testing.assert_allclose(credibility(np.array([30]), np.array([30.0]), 30.0), [2 / 3])


def test_weights_from_held_out_errors_by_hand():
    # two held-out rows of model 0 (truth 1, 0) and one of model 1 (truth 1); kappa = 8, N = inf,
    # fitted on n = 8 and 24 rows -> c = 8/16 = 0.5 and 24/32 = 0.75.
    g_acc = np.array([[0.6, 0.5], [0.6, 0.5], [0.6, 0.5]])
    l_acc = np.array([[0.9, 0.1], [0.3, 0.1], [0.9, 0.8]])
    cost = np.full((3, 2), 0.001)
    w = personalisation_weights((g_acc, cost), (l_acc, cost), np.array([0, 0, 1]), np.array([1.0, 0.0, 1.0]),
                                np.array([0.001, 0.001, 0.001]), np.array([8, 24]), prior_rows=8.0)
    # model 0: posterior local 0.6 + 0.5 * (0.9 - 0.6) = 0.75 and 0.45 -> MAE (0.25 + 0.45) / 2 = 0.35;
    #   global MAE (0.4 + 0.6) / 2 = 0.5 -> w' = 0.5 / 0.85, w = 0.5 w'
    # model 1: posterior local 0.5 + 0.75 * 0.3 = 0.725 -> MAE 0.275; global 0.5 -> w = 0.75 * 0.5 / 0.775
    # costs exact for both -> w' = 0.5, w = c / 2
    np.testing.assert_allclose(w.credibility, [0.5, 0.75])
    np.testing.assert_allclose(w.accuracy, [0.5 * 0.5 / 0.85, 0.75 * 0.5 / 0.775])
    np.testing.assert_allclose(w.cost, [0.25, 0.375])
    np.testing.assert_allclose(w.local_error[:, 0], [0.35, 0.275])
    assert w.warnings == ()


def test_well_supported_estimates_give_paper_002_weights():
    # n, N >> kappa: c -> 1, and w -> e_global / (e_global + e_local) of the raw local estimator
    rng = np.random.default_rng(0)
    g, loc = rng.uniform(size=(40, 3)), rng.uniform(size=(40, 3))
    model, truth, cost = rng.integers(0, 3, 40), rng.integers(0, 2, 40).astype(float), np.full((40, 3), 0.002)
    w = personalisation_weights((g, cost), (loc, cost), model, truth, np.full(40, 0.002), np.full(3, 10**9),
                                np.full(3, 10**9), prior_rows=1.0)
    rows = np.arange(40)
    eg, el = (np.array([np.abs(p[rows, model] - truth)[model == m].mean() for m in range(3)]) for p in (g, loc))
    np.testing.assert_allclose(w.accuracy, interpolation_weights(eg, el), rtol=1e-6)


def _personalised_share(fx: dict, log, m: int, rng, check=None, prior_rows: float = PRIOR_ROWS):
    """Share of the fixture's 120 test queries routed to model ``m`` at LAM by the fixture's K-means
    router personalised on ``log`` (the simulation's path: local K-means on 80% of the log, errors on
    the other 20%), the weights, and the personalised accuracy predictions."""
    from trainer import kinds
    from trainer.simulation import SimulationConfig

    glob, models, emb = fx["kmeans"], list(fx["test"].models), fx["test_embeddings"]
    fit, held = holdout_split(log.model, rng)
    local = kinds.get("kmeans").fit_local(log.subset(fit), models, SimulationConfig(), rng)
    w = personalisation_weights(glob.predict(log.embeddings[held]), local.predict(log.embeddings[held]),
                                log.model[held], log.accuracy[held], log.cost[held],
                                np.bincount(log.model[fit], minlength=len(models)), prior_rows=prior_rows, check=check)
    (g_acc, g_cost), (l_acc, l_cost) = glob.predict(emb), local.predict(emb)
    acc, cost = personalise(g_acc, l_acc, w.accuracy), personalise(g_cost, l_cost, w.cost)
    return float(np.mean(decide(acc, cost, LAM) == m)), w, acc


def _global_share(fx: dict) -> np.ndarray:
    """(n_models,) share of the fixture's test queries the global K-means router sends to each model at LAM."""
    g_acc, g_cost = fx["kmeans"].predict(fx["test_embeddings"])
    return np.bincount(decide(g_acc, g_cost, LAM), minlength=fx["test"].n_models) / len(g_acc)


def _log(fx: dict, m: int, scores: np.ndarray, other: int = 0, n_other: int = 0):
    """A log of the fixture's train prompts: ``len(scores)`` rows sent to ``m`` with those scores, then
    ``n_other`` rows sent to ``other`` with their real RouterBench scores; real costs throughout."""
    from trainer.data.client_data import ClientData

    train, emb = fx["train"], fx["train_embeddings"]
    n = len(scores)
    rows = np.arange(n + n_other)
    model = np.r_[np.full(n, m), np.full(n_other, other)].astype(np.int64)
    accuracy = np.r_[scores, train.accuracy[rows[n:], other]].astype(np.float64)
    return ClientData(emb[rows], model, accuracy, train.cost[rows, model])


def test_issue_case_one_model_all_ones_no_longer_dominates(fitted_routers, caplog):
    """The first issue: 120 rows of one model, every score 1.0. In-sample errors gave the local estimator
    weight 1 and predicted accuracy 1.000 for that model; now its 96 fitted rows move it by at most c."""
    from trainer import kinds
    from trainer.data.client_data import ClientData
    from trainer.simulation import SimulationConfig

    fx = fitted_routers
    glob, models, global_share = fx["kmeans"], list(fx["test"].models), _global_share(fx)
    test, emb = fx["test"], fx["test_embeddings"]  # 120 real prompts
    m = models.index("mistralai/mixtral-8x7b-chat")
    n = emb.shape[0]
    log = ClientData(emb, np.full(n, m), np.ones(n), test.cost[:, m].copy())
    g_acc, g_cost = glob.predict(emb)

    # The old path: local estimator on every row, errors in-sample -> weight 1, accuracy 1.000.
    local_all = kinds.get("kmeans").fit_local(log, models, SimulationConfig(), np.random.default_rng(0))
    l_acc, l_cost = local_all.predict(emb)
    rows = np.arange(n)
    w_old = interpolation_weights(np.abs(g_acc[rows, m] - 1.0).mean(keepdims=True).repeat(len(models)),
                                  np.abs(l_acc[rows, m] - 1.0).mean(keepdims=True).repeat(len(models)))
    old = personalise(g_acc, l_acc, w_old)
    # ~1 rather than exactly 1: the local estimate of a mean of ones can come out 1 - 1e-16 (on an
    # AVX-512 machine it did), which leaves the local error at ~1e-16 instead of 0.
    assert w_old[m] == pytest.approx(1.0, abs=1e-12) and np.allclose(old[:, m], 1.0)
    old_share = float(np.mean(decide(old, personalise(g_cost, l_cost, w_old), LAM) == m))

    check = check_log(log.model, log.accuracy, models)
    with caplog.at_level(logging.WARNING, logger="fedroute.log_checks"):
        share, w, new_acc = _personalised_share(fx, log, m, np.random.default_rng(0), check)
    assert any("all 120 scores are 1" in r.getMessage() for r in caplog.records) and w.warnings == check.warnings
    assert 0 < w.accuracy[m] <= credibility(np.array([96]))[0]  # 96 fitted rows
    assert share <= global_share[m] + MAX_EXCESS
    print(f"share routed to the all-1.0 model: in-sample {old_share:.3f}, now {share:.3f} at weight "
          f"{w.accuracy[m]:.4f} (global "
          f"{global_share[m]:.3f}); real accuracy {test.accuracy[:, m].mean():.3f}, predicted mean before "
          f"{old[:, m].mean():.3f}, now {new_acc[:, m].mean():.3f} (global {g_acc[:, m].mean():.3f})")
    assert old_share > share + 0.2  # the old path sent far more queries to the all-1.0 model


@pytest.mark.parametrize("scores", [np.r_[np.ones(119), 0.0], np.ones(29)], ids=["119-ones-one-zero", "29-ones"])
def test_issue_near_misses_do_not_dominate(fitted_routers, scores):
    """The issue's near misses, beside 40 honest rows of another model (so no log criterion hits): under
    paper 002's weights alone (c = 1) they take most queries; under the shrunk weights no more than 5 points
    above the global router's share."""
    fx = fitted_routers
    models = list(fx["test"].models)
    m, other = models.index("mistralai/mixtral-8x7b-chat"), models.index("gpt-3.5-turbo-1106")
    log = _log(fx, m, scores, other, 40)
    assert not check_log(log.model, log.accuracy, models).warnings
    share, w, _ = _personalised_share(fx, log, m, np.random.default_rng(0))
    share_002, _, _ = _personalised_share(fx, log, m, np.random.default_rng(0), prior_rows=1e-300)
    global_share = _global_share(fx)[m]
    print(f"share to the near-miss model: {share:.3f} (paper 002 alone {share_002:.3f}, global {global_share:.3f})")
    assert share <= global_share + MAX_EXCESS and share_002 >= 0.5


def test_sweep_of_small_degenerate_logs(fitted_routers):
    """One model, n from 5 to 200 rows, one class but 0-2 exceptions, every model: never more than the
    global router's share + 5 points routed to it at LAM."""
    fx = fitted_routers
    global_share = _global_share(fx)
    worst = []
    for m in range(fx["test"].n_models):
        for n in (5, 10, 20, 29, 50, 100, 119, 200):
            for k in (0, 1, 2):
                for value in (1.0, 0.0):
                    scores = np.full(n, value)
                    scores[:k] = 1.0 - value
                    share, _, _ = _personalised_share(fx, _log(fx, m, scores), m, np.random.default_rng([m, n, k]))
                    worst.append((share - global_share[m], m, n, k, value))
    print("worst excess shares:", sorted(worst, reverse=True)[:3])
    assert max(worst)[0] <= MAX_EXCESS


def test_honest_log_of_200_rows_still_personalises(fitted_routers):
    """200 rows of real RouterBench outcomes of one model: the weight is positive and the predictions
    move from the global router's toward the log's own accuracy."""
    fx = fitted_routers
    models = list(fx["test"].models)
    m = models.index("gpt-3.5-turbo-1106")
    log = _log(fx, m, fx["train"].accuracy[:200, m])
    g = fx["kmeans"].predict(fx["test_embeddings"])[0][:, m].mean()
    _, w, acc = _personalised_share(fx, log, m, np.random.default_rng(0))
    own = log.accuracy.mean()
    print(f"honest log: own accuracy {own:.3f}, global mean prediction {g:.3f}, personalised {acc[:, m].mean():.3f}, "
          f"weight {w.accuracy[m]:.4f}")
    assert w.accuracy[m] > 0 and abs(acc[:, m].mean() - own) < abs(g - own)


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
