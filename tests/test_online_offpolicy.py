"""``fedroute offpolicy``: the self-normalised inverse-propensity estimate of a router on an explored EvalLog,
checked against a hand-computed log and against an sdk.Explorer log of the tiny bundle."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from export.signing import generate_keypair
from sdk import EvalLog, Router
from sdk.explorer import Explorer
from tiny_kmeans import MODELS, write_tiny_kmeans
from trainer.cli import app
from trainer.online_offpolicy import snips

A, B = np.array([1.0, 0.0, 0.0]), np.array([0.0, 1.0, 0.0])  # the tiny bundle's greedy choice: model-x, model-y


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    keys = generate_keypair(tmp_path_factory.mktemp("keys"))
    bundle, _ = write_tiny_kmeans(tmp_path_factory.mktemp("tiny"), keys[0])
    return bundle, keys[1]


def _run(log, tiny, *lams):
    args = ["offpolicy", "--log", str(log), "--bundle", str(tiny[0]), "--public-key", str(tiny[1])]
    result = CliRunner().invoke(app, [*args, *(a for lam in lams for a in ("--lam", str(lam)))])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.output.splitlines()]


def test_snips_on_four_rows_is_the_hand_computed_ratio():
    # w = 1[match] / p: rows (match, p 0.5, r 1), (match, 0.25, 0), (miss, 0.8, 1), (match, 1.0, 1) -> w = 2, 4, 0, 1;
    # V = (2 + 1) / 7 = 3/7; SE = sqrt(4 (4/7)^2 + 16 (3/7)^2 + (4/7)^2) / 7 = sqrt(224) / 49.
    value, se = snips(np.array([2.0, 4.0, 0.0, 1.0]), np.array([1.0, 0.0, 1.0, 1.0]))
    assert value == pytest.approx(3 / 7) and se == pytest.approx(math.sqrt(224) / 49)


def test_cli_estimates_a_hand_computed_log(tiny, tmp_path):
    # Rows (embedding, logged model, score, cost, propensity); the candidate (greedy tiny bundle) picks model-x
    # near A and model-y near B, so w = 1/0.5, 1/0.25, 1/0.8, 0 (row 4 logged model-x near B), and the row
    # without a propensity is left out. sum w = 7.25; accuracy (2 + 1.25) / 7.25 = 13/29; cost
    # (2 * 0.001 + 4 * 0.002 + 1.25 * 0.004) / 7.25 = 3/1450 USD; SE of the accuracy
    # sqrt(4 (16/29)^2 + 16 (13/29)^2 + 1.5625 (16/29)^2) / 7.25 = sqrt(4128) / (29 * 7.25).
    log = tmp_path / "log.sqlite"
    with EvalLog(log, MODELS) as ev:
        for x, model, score, cost, p in ((A, "model-x", 1.0, 0.001, 0.5), (A, "model-x", 0.0, 0.002, 0.25),
                                         (B, "model-y", 1.0, 0.004, 0.8), (B, "model-x", 1.0, 0.001, 0.2),
                                         (B, "model-y", 0.0, 0.009, None)):
            ev.record(model, score, cost, embedding=x, policy=None if p is None else "thompson", propensity=p)
    (est,) = _run(log, tiny, 100.0)
    assert est["accuracy"] == pytest.approx(13 / 29) and est["cost_usd"] == pytest.approx(3 / 1450)
    assert est["accuracy_se"] == pytest.approx(math.sqrt(4128) / (29 * 7.25))
    w = np.array([2.0, 4.0, 1.25])
    assert est["cost_usd_se"] == pytest.approx(np.sqrt(np.sum(w**2 * (np.array([1e-3, 2e-3, 4e-3]) - 3 / 1450) ** 2)) / 7.25)
    assert est["effective_sample_size"] == pytest.approx(7.25**2 / 21.5625)
    assert (est["n_rows"], est["n_matched"], est["left_out_no_propensity"], est["lam"]) == (4, 3, 1, 100.0)


def test_cli_on_an_explorer_log_recovers_the_greedy_routers_accuracy(tiny, tmp_path):
    # The uniform Explorer logs either model (p = 1/2); model-x is right near A, model-y near B, so the greedy
    # candidate is right on every query (1.0) while the log's own mean score is about 1/2.
    router = Router.load(*tiny)
    log = tmp_path / "explored.sqlite"
    ex = Explorer(router, policy="uniform", seed=3)
    with EvalLog(log, MODELS) as ev:
        for choice in ex.choose_batch(["a", "b", "a a", "b b"] * 10, 0.0):
            right = choice.model == ("model-x" if choice.embedding[0] > 0.5 else "model-y")
            ev.record_choice(choice, score=float(right), cost_usd=0.001)
        logged_mean = ev.rows().score.mean()
    est, est2 = _run(log, tiny, 0.0, 50.0)
    assert est["accuracy"] == 1.0 and est["accuracy_se"] == 0.0 and est["cost_usd"] == pytest.approx(0.001)
    assert est["n_rows"] == 40 and 10 <= est["n_matched"] <= 30 and abs(logged_mean - 0.5) < 0.2
    assert est2["lam"] == 50.0 and est2["accuracy"] == 1.0  # equal costs: the same choices at any lam


def test_cli_refuses_a_missing_log_and_creates_nothing(tiny, tmp_path):
    missing = tmp_path / "none.sqlite"
    result = CliRunner().invoke(app, ["offpolicy", "--log", str(missing), "--bundle", str(tiny[0]),
                                      "--public-key", str(tiny[1]), "--lam", "1"])
    assert result.exit_code == 2 and "--log" in result.output and not missing.exists()
