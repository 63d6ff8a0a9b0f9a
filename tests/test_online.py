"""trainer.online: the online replay reads only chosen outcomes, reproduces bit for bit, and scores per cell
exactly as the per-query metrics do."""

import dataclasses

import numpy as np
import pytest

from sdk.errors import InvalidInputError
from trainer import metrics
from trainer.online import POLICIES, OnlineConfig, Stream, ScoringSet, _Scorer, run_online, run_online_seed
from trainer.routers.kmeans_router import KMeansRouterConfig


def _table(n: int, rng: np.random.Generator):
    """Three well-separated tasks in 8-d, four models whose accuracy depends on the task; costs 1..8 mUSD."""
    tasks = rng.integers(0, 3, size=n)
    centres = np.eye(8)[:3] * 5
    emb = (centres[tasks] + rng.normal(size=(n, 8))).astype(np.float32)
    p = np.array([[0.2, 0.5, 0.7, 0.9], [0.6, 0.6, 0.8, 0.85], [0.3, 0.8, 0.6, 0.9]])[tasks]
    acc = (rng.random(p.shape) < p).astype(np.float64)
    cost = np.array([1.0, 2.0, 4.0, 8.0]) * 1e-3 * rng.uniform(0.8, 1.2, size=p.shape)
    return np.array([f"t{t}" for t in tasks], dtype=object), emb, acc, cost


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    tasks, emb, acc, cost = _table(600, rng)
    avail = np.ones_like(acc, dtype=bool)
    avail[::7, 1] = False  # some queries lack a label for model 1: never logged with it
    stream = Stream(emb, tasks, acc, cost, avail)
    _, temb, tacc, tcost = _table(300, rng)
    test = ScoringSet(temb, tacc, tcost)
    refs = (metrics.zero_router_report(tacc, tcost).auc, metrics.oracle_report(tacc, tcost).auc)
    return stream, test, refs


def _config(**kw):
    return OnlineConfig(round_labels=100, n_clients=4, kmeans=KMeansRouterConfig(n_clusters=3, n_local_clusters=4,
                                                                               prior_strength=4.0), **kw)


def test_the_loop_never_reads_an_unchosen_outcome(data):
    stream, test, refs = data
    cfg = _config(passes=1.5, policies=POLICIES)
    runs = run_online_seed(stream, test, cfg, 3, refs)
    assert set(runs) == set(POLICIES)
    for policy, run in runs.items():
        q, m = run.chosen.T
        seen = np.zeros_like(stream.accuracy, dtype=bool)
        seen[q, m] = True
        poisoned = dataclasses.replace(stream, accuracy=np.where(seen, stream.accuracy, np.nan),
                                       cost=np.where(seen, stream.cost, np.nan))
        again = run_online_seed(poisoned, test, dataclasses.replace(cfg, policies=(policy,)), 3, refs)[policy]
        assert again.gains == run.gains
        np.testing.assert_array_equal(again.chosen, run.chosen)
        assert again.served_accuracy == run.served_accuracy and again.served_cost == run.served_cost
        assert stream.available[q, m].all()  # never a model without a label for the query


def test_seeded_runs_reproduce_bit_for_bit_and_seeds_differ(data):
    stream, test, _ = data
    ws = (np.array([1e-3, 0.5]), np.array([8e-3, 0.9]))
    a = run_online(stream, test, _config(), [0, 1], ws)
    b = run_online(stream, test, _config(), [0, 1], ws)
    assert a == b
    c = run_online(stream, test, _config(), [2, 3], ws)
    assert c["thompson"]["gain_per_seed"] != a["thompson"]["gain_per_seed"]


def test_stream_length_and_rounds_follow_passes_and_round_labels(data):
    stream, test, refs = data
    runs = run_online_seed(stream, test, _config(passes=2.0, policies=("uniform",)), 0, refs)
    assert runs["uniform"].chosen.shape[0] == 1200
    assert runs["uniform"].labels == list(range(100, 1201, 100))


def test_exploration_beats_fixed_logging_on_a_clear_problem(data):
    stream, test, _ = data
    ws = (np.array([1e-3, 0.5]), np.array([8e-3, 0.9]))
    out = run_online(stream, test, _config(), range(6), ws)
    assert out["thompson"]["gain_mean"] > out["fixed"]["gain_mean"]
    assert out["dense_ceiling"]["gain_mean"] >= max(out[p]["gain_mean"] for p in ("fixed", "uniform")) - 0.02


def test_per_cell_scorer_equals_the_per_query_curve(data):
    _, test, _ = data
    centroids = np.eye(8, dtype=np.float32)[:3] * 5
    scorer = _Scorer(test, centroids)
    rng = np.random.default_rng(1)
    acc_t, cost_t = rng.random((3, 4)), rng.random((3, 4)) * 1e-2
    from sdk.voronoi import nearest_cell

    cells = nearest_cell(test.embeddings, centroids)
    np.testing.assert_allclose(scorer.points(acc_t, cost_t),
                               metrics.curve_points(acc_t[cells], cost_t[cells], test.accuracy, test.cost))


@pytest.mark.parametrize("field, value", [("policies", ("greedy",)), ("passes", 0.5), ("round_labels", 0),
                                          ("thompson_axis_power", 1.5), ("top_two_axis_power", -0.1)])
def test_config_refuses_bad_values(field, value):
    with pytest.raises(InvalidInputError, match=field):
        OnlineConfig(**{field: value})


def test_cli_online_on_a_users_own_log_writes_the_online_table(routerbench_dir, tmp_path):
    import json

    import pandas as pd
    from typer.testing import CliRunner

    from trainer.cli import app

    train = pd.read_parquet(routerbench_dir / "train.parquet").groupby("task").head(60)
    test = pd.read_parquet(routerbench_dir / "test.parquet").groupby("task").head(30)
    train.to_parquet(tmp_path / "my_log.parquet")
    test.to_parquet(tmp_path / "my_test.parquet")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["simulate", "--online", "--train", str(tmp_path / "my_log.parquet"), "--test",
                                      str(tmp_path / "my_test.parquet"), "--out", str(out), "--seeds", "2",
                                      "--round-labels", "60", "--passes", "2"])
    assert result.exit_code == 0, result.output
    def refuse(constant):
        raise AssertionError(f"non-strict JSON constant {constant}")

    online = json.loads((out / "results.json").read_text(), parse_constant=refuse)["online"]
    for policy in ("fixed", "uniform", "thompson", "top_two"):
        r = online[policy]
        assert len(r["gain_per_seed"]) == 2 and list(r["curve"])[-1] == "360"
        for key in ("gain_mean", "gain_se", "apgr_mean", "cost_saved_at_best_acc_median", "never_reaches_best_share",
                    "served_acc", "served_cost_usd"):
            assert key in r
        # strict JSON: a seed that never reaches the best single model's accuracy saves None, not -inf
        per_seed = r["cost_saved_at_best_acc_per_seed"]
        assert len(per_seed) == 2 and all(v is None or isinstance(v, float) for v in per_seed)
        assert r["never_reaches_best_share"] == sum(v is None for v in per_seed) / 2
    assert (out / "online.png").stat().st_size > 0 and "| thompson" in (out / "results.md").read_text()


def test_cli_online_refuses_a_log_of_served_calls_and_says_what_the_replay_needs(routerbench_dir, tmp_path):
    """A user's own device log (an sdk.EvalLog, or its rows as a table: one model's outcome per query) cannot
    drive the replay: every policy could only log the model that was served. Refused before any embedding."""
    import numpy as np
    import pandas as pd
    from typer.testing import CliRunner

    from sdk import EvalLog
    from trainer.cli import app

    test = pd.read_parquet(routerbench_dir / "test.parquet").groupby("task").head(5)
    test.to_parquet(tmp_path / "my_test.parquet")
    models = [c.removesuffix("|correctness") for c in test.columns if c.endswith("|correctness")]
    with EvalLog(tmp_path / "evals.sqlite", models) as log:
        log.record(models[0], 1.0, 0.001, embedding=np.full(4, 0.5, dtype=np.float32), cell=0,
                   bundle_version=1)
    served = test.copy()  # one served model per query: the others' outcomes unknown
    for i, m in enumerate(models):
        served.loc[np.arange(len(served)) % len(models) != i, f"{m}|correctness"] = np.nan
    served.to_parquet(tmp_path / "served.parquet")
    for train, message in (("evals.sqlite", "an SQLite file (an sdk.EvalLog?) is not an evaluation table"),
                           ("served.parquet", "no train query has an outcome for more than one model")):
        out = tmp_path / f"out_{train}"
        result = CliRunner().invoke(app, ["simulate", "--online", "--train", str(tmp_path / train), "--test",
                                          str(tmp_path / "my_test.parquet"), "--out", str(out)],
                                    env={"COLUMNS": "500"})
        assert result.exit_code != 0 and message in " ".join((str(result.exception) + result.output).split())
        assert not out.exists()


def test_equal_costs_score_quality_against_the_best_single_model_and_the_oracle(data):
    stream, test, _ = data
    rng = np.random.default_rng(5)

    def quality(emb):  # model m is good (0.8) on task m only, else 0.3; models 3 is never best
        task = np.argmax(emb[:, :3], axis=1)
        p = np.where(np.arange(4)[None, :] == task[:, None], 0.8, 0.3)
        return (rng.random(p.shape) < p).astype(np.float64), task

    acc, _ = quality(stream.embeddings)
    eq = dataclasses.replace(stream, accuracy=acc, cost=np.ones_like(stream.cost))
    tacc, task = quality(test.embeddings)
    eq_test = ScoringSet(test.embeddings, tacc, np.ones_like(tacc))
    out = run_online(eq, eq_test, _config(policies=("fixed", "thompson")), range(3), None)
    assert "apgr_mean" not in out["thompson"] and out["thompson"]["served_cost_usd"] == 1.0
    # The dense table has one cell per task and picks model m on task m: its accuracy is the mean of
    # each row's own-task outcome; gain = (that - best single model) / (oracle - best single model).
    best, oracle = tacc.mean(axis=0).max(), tacc.max(axis=1).mean()
    task_level = tacc[np.arange(task.shape[0]), task].mean()
    assert out["dense_ceiling"]["gain_mean"] == pytest.approx((task_level - best) / (oracle - best), abs=1e-9)
    assert out["thompson"]["gain_mean"] > 0.5


@pytest.mark.parametrize("argv, message", [
    (["--policies", "thompson"], "--policies only goes with --online"),
    (["--passes", "2", "--round-labels", "60"], "--passes, --round-labels only goes with --online"),
    (["--online", "--routers", "mlp"], "--routers does not go with --online"),
])
def test_cli_refuses_an_option_the_run_would_ignore(tmp_path, argv, message):
    """Without --online the online options (and with it --routers) would be ignored: refused before any work."""
    from typer.testing import CliRunner

    from trainer.cli import app

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["simulate", "--data", str(tmp_path / "no-data"), "--out", str(out), *argv],
                                env={"COLUMNS": "500"})
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not out.exists()


def test_cli_online_without_a_weak_strong_pair_reports_the_rest(routerbench_dir, tmp_path):
    """A user's log whose models all cost within 10x of the most accurate one has no RouteLLM weak/strong
    pair: the replay still reports gains (APGR and CPT: None / n/a) instead of stopping after the embedding."""
    import json

    import pandas as pd
    from typer.testing import CliRunner

    from trainer.cli import app

    models = ["WizardLM/WizardLM-13B-V1.2", "claude-instant-v1", "mistralai/mixtral-8x7b-chat"]
    columns = ["sample_id", "task", "prompt"] + [f"{m}|{s}" for m in models for s in ("correctness", "cost_usd")]
    for split, rows, name in (("train", 40, "my_log"), ("test", 20, "my_test")):
        frame = pd.read_parquet(routerbench_dir / f"{split}.parquet").groupby("task").head(rows)[columns]
        frame.to_parquet(tmp_path / f"{name}.parquet")
    cost = frame[[f"{m}|cost_usd" for m in models]].mean()
    assert cost.max() < 10 * cost.min()  # no model costs a tenth of another
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["simulate", "--online", "--train", str(tmp_path / "my_log.parquet"), "--test",
                                      str(tmp_path / "my_test.parquet"), "--out", str(out), "--seeds", "2",
                                      "--round-labels", "60", "--policies", "fixed,thompson"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "results.json").read_text())
    assert summary["config"]["weak_strong"] is None
    for policy in ("fixed", "thompson"):
        r = summary["online"][policy]
        assert r["apgr_mean"] is None and r["cpt50_median"] is None and len(r["gain_per_seed"]) == 2
    assert "| n/a | n/a | n/a |" in (out / "results.md").read_text()


def test_the_settings_choice_rule_reads_every_online_target():
    from benchmarks.online_settings import choose, target_checks

    fixed = {"gain_mean": 0.10, "served_cost_usd": 1.0, "served_acc": 0.70}
    good = {"gain_mean": 0.16, "served_cost_usd": 1.4, "served_acc": 0.70,
            "resampled_capture_share": 0.51, "resampled_never_share": 0.25}
    results = {"meets all": good,
               "higher gain, dear": {**good, "gain_mean": 0.20, "served_cost_usd": 1.41},  # over 1.4x fixed's cost
               "higher gain, worse served": {**good, "gain_mean": 0.19, "served_acc": 0.69},
               "higher gain, saves in half the runs": {**good, "gain_mean": 0.19, "resampled_capture_share": 0.5},
               "higher gain, often never": {**good, "gain_mean": 0.19, "resampled_never_share": 0.26},
               "low gain": {**good, "gain_mean": 0.149, "served_cost_usd": 0.5}}
    assert choose(results, fixed) == ("meets all", True)
    assert [k for k, ok in target_checks(results["higher gain, dear"], fixed).items() if not ok] == ["served_cost"]
    assert [k for k, ok in target_checks(results["low gain"], fixed).items() if not ok] == ["gain"]
    # None meets every target: the highest capture share among those meeting gain and the served-query limits.
    rest = {k: v for k, v in results.items() if k != "meets all"}
    assert choose(rest, fixed) == ("higher gain, often never", False)
    assert choose({"dear": results["higher gain, dear"]}, fixed) == (None, False)


def test_savings_are_strict_json_with_none_for_seeds_that_never_reach():
    from trainer.online import _saved

    out = _saved(np.array([0.7, np.inf, np.inf]))
    # savings 0.3, -inf, -inf: the median is a seed that never reaches it -> None, and so is the SE.
    assert out["cost_saved_at_best_acc_per_seed"] == [pytest.approx(0.3), None, None]
    assert out["cost_saved_at_best_acc_median"] is None and out["cost_saved_at_best_acc_median_se"] is None
    assert out["never_reaches_best_share"] == pytest.approx(2 / 3)
