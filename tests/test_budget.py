"""BudgetController (sdk.budget): bad inputs, the documented feedback rule by hand, randomised
mixing between two steps, closed-loop tracking of a biased cost, events, threads. Real bundle."""

import logging
import math
import threading

import numpy as np
import pytest

from sdk import Router
from sdk.budget import MIN_RECORDS, TARGET_RANGE, BudgetController
from sdk.errors import InvalidInputError, InvalidQueryError, ShapeError, UnknownModelError


@pytest.fixture(scope="module")
def bundle_dir(make_bundle, tmp_path_factory):
    return make_bundle(tmp_path_factory.mktemp("budget") / "bundle")


@pytest.fixture(scope="module")
def router(bundle_dir, signing_keys) -> Router:
    return Router.load(bundle_dir, signing_keys[1])


def _row(router, values):
    """A prediction row over the router's models: the first len(values) given, the rest NaN."""
    out = np.full(len(router.model_ids), np.nan)
    out[: len(values)] = values
    return out


# One K-means-like query seen again and again: A = (0.9, 0.7, 0.5), C = (0.010, 0.004, 0.001) USD.
# Predicted spend: 10 USD per 1k at lam = 0, 4 from lam = 33.3, 1 from lam = 66.7 (no lam gives 7).
ACC = (0.9, 0.7, 0.5)
COST = (0.010, 0.004, 0.001)


@pytest.mark.parametrize("budget", [0, 0.0, -1.0, float("nan"), float("inf"), -float("inf"), "1", None, True, 10**400])
def test_bad_budgets_are_refused(router, budget):
    with pytest.raises(InvalidInputError, match="budget_usd_per_1k"):
        BudgetController(router, budget)


@pytest.mark.parametrize("kwargs, match", [
    ({"window": 0}, "window"), ({"window": -5}, "window"), ({"window": 2.5}, "window"), ({"window": True}, "window"),
    ({"window": "200"}, "window"), ({"tolerance": 0.0}, "tolerance"), ({"tolerance": float("nan")}, "tolerance"),
    ({"tolerance": -0.1}, "tolerance"), ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"), ({"gain": 0}, "gain"),
    ({"max_step": float("inf")}, "max_step"), ({"on_event": 3}, "on_event"), ({"router": None}, "router"),
    ({"router": "bundle/"}, "router"),
])
def test_bad_settings_are_refused(router, kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        BudgetController(**{"router": router, "budget_usd_per_1k": 1.0, **kwargs})


def test_a_huge_int_or_a_str_number_is_named_as_such(router):
    """An int of over 4,300 digits made the message's str() raise ValueError (a traceback instead of the
    refusal); a str "200" was shown as 200, which reads as a valid window."""
    huge = 10**5000
    with pytest.raises(InvalidInputError, match="window"):
        BudgetController(router, 1.0, window=huge)
    with pytest.raises(InvalidInputError, match="cost_usd"):
        BudgetController(router, 1.0).record(router.model_ids[0], huge)
    with pytest.raises(InvalidInputError, match="seed"):
        BudgetController(router, 1.0, seed=-huge)
    with pytest.raises(InvalidInputError, match="window .*got str '200'"):
        BudgetController(router, 1.0, window="200")
    with pytest.raises(InvalidInputError, match="usd_per_1k_queries .*got str '0.5'"):
        router.lam_for_budget("0.5", ["Is a whale a fish?"])
    with pytest.raises(InvalidInputError, match="usd_per_1k_queries"):
        router.lam_for_budget(huge, ["Is a whale a fish?"])


def test_bad_records_are_refused(router):
    controller = BudgetController(router, 1.0)
    with pytest.raises(UnknownModelError, match="no-such-model"):
        controller.record("no-such-model", 0.001)
    for cost in (-0.001, float("nan"), float("inf"), "0.001", None, True):
        with pytest.raises(InvalidInputError, match="cost_usd"):
            controller.record(router.model_ids[0], cost)
    assert controller.n_recorded == 0 and controller.realised_usd_per_1k is None  # nothing half-recorded


def test_bad_queries_and_predictions_are_refused(router):
    controller = BudgetController(router, 1.0)
    with pytest.raises(InvalidQueryError, match=r"^query is empty"):
        controller.choose("   ")  # it named queries[0], a list the caller never passed
    with pytest.raises(InvalidQueryError, match=r"^query"):
        controller.choose(3)
    with pytest.raises(ShapeError):
        controller.choose_from_predictions(np.array(ACC), np.array(COST))  # 3 of 11 models
    with pytest.raises(InvalidInputError):
        controller.choose_from_predictions(_row(router, []), _row(router, []))  # no estimate at all
    assert controller.n_chosen == 0


def test_feedback_step_by_hand(router):
    # window 4, gain 1: from the 4th record, log s -= (1 / 4) * log(R / b).
    controller = BudgetController(router, 1.0, window=4, gain=1.0, max_step=10.0)
    m = router.model_ids[0]
    for _ in range(3):
        controller.record(m, 0.002)
    assert controller.spend_target_usd_per_1k == pytest.approx(1.0)  # min(window, MIN_RECORDS) = 4 not reached
    controller.record(m, 0.002)  # R = 0.002 USD = 2 per 1k, b = 1 per 1k
    assert controller.realised_usd_per_1k == pytest.approx(2.0)
    assert controller.spend_target_usd_per_1k == pytest.approx(2.0 ** -0.25)
    controller.record(m, 0.0)  # window (0.002, 0.002, 0.002, 0): R = 1.5 per 1k
    assert controller.spend_target_usd_per_1k == pytest.approx(2.0 ** -0.25 * 1.5 ** -0.25)


def test_steps_are_bounded_and_the_target_clamped(router):
    controller = BudgetController(router, 1.0, window=1, gain=1000.0, max_step=0.05)
    controller.record(router.model_ids[0], 0.1)  # log-error log(100): step clipped to 0.05
    assert controller.spend_target_usd_per_1k == pytest.approx(math.exp(-0.05))
    for _ in range(200):
        controller.record(router.model_ids[0], 0.1)
    assert controller.spend_target_usd_per_1k == pytest.approx(1.0 / TARGET_RANGE)
    assert MIN_RECORDS >= 1


def test_mixing_meets_a_target_between_two_steps(router):
    # s = 7 per 1k lies between the steps 10 (lam = 0) and 4: p_low = (7 - 4) / (10 - 4) = 0.5.
    controller = BudgetController(router, 7.0, seed=0)
    a, c = _row(router, ACC), _row(router, COST)
    picks = [controller.choose_from_predictions(a, c) for _ in range(4000)]
    share = np.mean([p == router.model_ids[0] for p in picks])
    assert set(picks) == {router.model_ids[0], router.model_ids[1]}
    assert share == pytest.approx(0.5, abs=0.03)  # 4000 draws: sd 0.008
    mix = controller.mix
    assert mix.lam_low == 0.0 and mix.lam_high == pytest.approx(math.sqrt(100 / 3 * 200 / 3)) and mix.p_low == pytest.approx(0.5)
    assert controller.lam == mix.lam_high


def test_closed_loop_corrects_a_biased_cost_prediction(router):
    # Every call costs twice the prediction, so 5 per 1k needs the 8 / 2 per 1k steps half and half.
    controller = BudgetController(router, 5.0, window=100, seed=1)
    a, c = _row(router, ACC), _row(router, COST)
    realised = []
    for _ in range(3000):
        m = controller.choose_from_predictions(a, c)
        cost = 2 * COST[router.model_ids.index(m)]
        controller.record(m, cost)
        realised.append(cost)
    after_warm_up = 1000 * np.mean(realised[1000:])
    assert after_warm_up == pytest.approx(5.0, rel=0.05)
    assert controller.spend_target_usd_per_1k == pytest.approx(2.5, rel=0.15)  # predicted target = budget / bias


def test_drift_and_recovery_events(router, caplog):
    seen = []
    controller = BudgetController(router, 1.0, window=4, tolerance=0.10, on_event=seen.append)
    m = router.model_ids[0]
    with caplog.at_level(logging.WARNING, logger="fedroute.budget"):
        for _ in range(4):
            controller.record(m, 0.002)
    assert [e.kind for e in controller.events] == ["drift"]
    event = controller.events[0]
    assert event.realised_usd_per_1k == pytest.approx(2.0) and event.budget_usd_per_1k == 1.0 and event.n_recorded == 4
    assert "+100.0%" in event.message and any("+100.0%" in r.getMessage() for r in caplog.records)
    for _ in range(4):
        controller.record(m, 0.00105)  # 1.05 per 1k: within 10%
    assert [e.kind for e in controller.events] == ["drift", "recovered"]
    assert seen == list(controller.events)


def test_unreachable_budget_event(router):
    controller = BudgetController(router, 0.5)  # below the cheapest predicted step (1 per 1k)
    a, c = _row(router, ACC), _row(router, COST)
    assert controller.choose_from_predictions(a, c) == router.model_ids[2]
    assert [e.kind for e in controller.events] == ["unreachable"]
    assert not controller.mix.reachable


def test_choose_routes_real_queries_with_the_router(router, fitted_routers):
    prompts = list(fitted_routers["test"].prompts[:30])
    acc, cost = router.predict(prompts)
    budget = 1000 * float(np.nanmean(np.nanmin(cost, axis=1)) * 3)
    controller = BudgetController(router, budget, seed=0)
    picks = [controller.choose(p) for p in prompts]
    assert set(picks) <= set(router.model_ids)
    assert controller.n_chosen == 30
    # the last choice is the router's own decision at lam_low or lam_high
    lam_choices = {router.choose(prompts[-1], controller.mix.lam_low).model,
                   router.choose(prompts[-1], controller.mix.lam_high).model}
    assert picks[-1] in lam_choices


def test_concurrent_choose_and_record(router):
    controller = BudgetController(router, 5.0, window=50, seed=3)
    a, c = _row(router, ACC), _row(router, COST)
    errors = []

    def worker() -> None:
        try:
            for _ in range(300):
                m = controller.choose_from_predictions(a, c)
                controller.record(m, COST[router.model_ids.index(m)])
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert controller.n_chosen == 2400 and controller.n_recorded == 2400
    assert 1.0 <= controller.realised_usd_per_1k <= 10.0


def test_example_holds_a_budget_on_a_single_task_stream(bundle_dir, signing_keys, router, routerbench_dir, capsys):
    import re
    import runpy

    import pandas as pd

    from conftest import ROOT
    from sdk.spend_curve import SpendCurve, decision_steps

    frame = pd.read_parquet(routerbench_dir / "test.parquet")
    prompts = list(frame[frame["task"] == "winogrande"]["prompt"][:60])
    curve = SpendCurve.from_steps(decision_steps(*router.predict(prompts)))
    budget = 1000 * float(np.sqrt(curve.levels[0] * curve.levels[-1]))  # between the cheapest and lam = 0
    module = runpy.run_path(str(ROOT / "examples" / "budget_controller.py"))
    code = module["main"](["--bundle", str(bundle_dir), "--public-key", str(signing_keys[1]), "--data",
                           str(routerbench_dir), "--budget", f"{budget:.6f}", "--task", "winogrande",
                           "--queries", "500", "--window", "100"])
    out = capsys.readouterr().out
    assert code == 0 and out.count(" queries  lam ") == 5
    realised = float(re.search(r"warm-up of 100: ([0-9.]+) USD per 1k", out).group(1))
    assert realised == pytest.approx(budget, rel=0.2)  # 400 queries after the warm-up


@pytest.mark.parametrize("key, value, match", [
    ("log_target", float("nan"), "'log_target'"), ("log_target", "x", "'log_target'"),
    ("realised", [float("nan")], "'realised'"), ("realised", [-1.0], "'realised'"), ("realised", "x", "'realised'"),
    ("realised", [0.001] * 51, "'realised'"), ("n_chosen", -5, "counts"), ("n_recorded", 1.5, "counts"),
    ("last_toggle", None, "counts"), ("drifting", "no", "'drifting'"), ("base", ["x"] * 50, "numeric"),
    ("base", [float("nan")] * 50, "arrays must be real"), ("base", [-1.0] * 50, "arrays must be real"),
])
def test_a_hand_edited_state_is_refused_and_leaves_the_controller_as_it_was(router, key, value, match):
    # These raised bare ValueError/TypeError after assigning part of the state (a controller half restored that
    # the proxy then used "afresh"), or were taken silently: a NaN log_target routed at lam 0 (the dearest model).
    rng = np.random.default_rng(0)
    saved = BudgetController(router, 0.5, window=50, seed=0)
    for _ in range(30):
        saved.choose_from_predictions(rng.random(len(router.model_ids)), rng.random(len(router.model_ids)) / 1e3)
        saved.record(router.model_ids[0], 0.002)
    state = {**saved.state(), "n_predicted": 7, "n_chosen": 3, key: value}
    fresh = BudgetController(router, 0.5, window=50, seed=0)
    before = fresh.state()
    with pytest.raises(InvalidInputError, match=match):
        fresh.restore(state)
    assert fresh.state() == before


def test_restore_refuses_a_state_that_is_not_a_dict_or_misses_keys(router):
    controller = BudgetController(router, 0.5, seed=0)
    with pytest.raises(InvalidInputError, match="must be a dict"):
        controller.restore([])  # type: ignore[arg-type]
    state = controller.state()
    del state["realised"]
    with pytest.raises(InvalidInputError, match=r"misses \['realised'\]"):
        controller.restore(state)


def test_a_state_round_trips_through_json(router):
    import json

    saved = BudgetController(router, 0.5, window=50, seed=0)
    for _ in range(25):
        saved.choose_from_predictions(np.linspace(0.2, 0.9, len(router.model_ids)),
                                      np.linspace(1e-5, 1e-3, len(router.model_ids)))
        saved.record(router.model_ids[-1], 0.004)
    restored = BudgetController(router, 0.5, window=50, seed=0)
    restored.restore(json.loads(json.dumps(saved.state())))
    assert restored.state() == saved.state()
