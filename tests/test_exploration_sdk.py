"""sdk.Explorer on real signed bundles: posteriors, choices, propensities, seeds, the EvalLog rows it
writes (schema 2, migrated from 1) and the statistics upload they feed (unchanged on the wire)."""

from __future__ import annotations

import io
import json
import sqlite3

import numpy as np
import pytest

from export.signing import generate_keypair
from sdk import EvalLog, Router
from sdk.errors import BundleError, EvalLogError, InvalidInputError
from sdk.eval_log import SCHEMA_VERSION
from sdk.exploration import thompson_choice, uniform_choice
from sdk.explorer import Explorer
from sdk.local_update import kmeans_update
from sdk.protocol import UPDATE_FIELDS, RoundSpec, centroids_hash, encode_kmeans_update, encode_kmeans_update_msgpack
from sdk.scorers import DEFAULT_PRIOR_STRENGTH, KMeansScorer
from tiny_kmeans import MODELS, write_tiny_kmeans
from trainer.routers.kmeans_router import KMeansRouterConfig

# Queries of the tiny bundle: "a" embeds to [1, 0, 0] (model-x answered right, model-y wrong), "b" to [0, 1, 0].
A_QUERIES = ["a", "a a", "a a a"]
#: Uniform Beta(1, 1) prior (prior "model": each model's mean over all cells is 4/8 = 0.5; kappa = 2).
HAND = KMeansRouterConfig(n_clusters=2, prior_strength=2.0, model_prior_strength=0.0, prior="model")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return generate_keypair(tmp_path_factory.mktemp("keys"))


def _router(tmp_path_factory, keys, name, **kwargs) -> Router:
    bundle, _ = write_tiny_kmeans(tmp_path_factory.mktemp(name), keys[0], **kwargs)
    return Router.load(bundle, keys[1])


@pytest.fixture(scope="module")
def hand(tmp_path_factory, keys) -> Router:
    """4 evaluations per (cell, model), uniform prior: Beta(5, 1) and Beta(1, 5) in each cell."""
    return _router(tmp_path_factory, keys, "hand", config=HAND)


@pytest.fixture(scope="module")
def tight(tmp_path_factory, keys) -> Router:
    """1,000 evaluations per (cell, model): posteriors Beta(1001, 1) and Beta(1, 1001)."""
    return _router(tmp_path_factory, keys, "tight", config=HAND, n_copies=250)


@pytest.fixture(scope="module")
def default(tmp_path_factory, keys) -> Router:
    """The trainer's default shrinkage (kappa = 16, additive prior): loose posteriors, both models explored."""
    return _router(tmp_path_factory, keys, "default")


def _cells(router: Router) -> tuple[int, int]:
    return router.choose("a", 0.0).cell, router.choose("b", 0.0).cell


def test_posterior_from_counts_is_the_hand_computed_beta(hand):
    # Beta(1, 1) prior; in cell "a" model-x was right 4 times out of 4 -> Beta(5, 1), model-y wrong 4 times -> Beta(1, 5).
    ex = Explorer(hand, seed=0)
    a, b = _cells(hand)
    np.testing.assert_allclose(ex.alpha_[[a, b]], [[5.0, 1.0], [1.0, 5.0]], rtol=1e-12)
    np.testing.assert_allclose(ex.beta_[[a, b]], [[1.0, 5.0], [5.0, 1.0]], rtol=1e-12)


def test_kmeans_npz_carries_the_trainers_prior_strength(hand, default):
    assert hand._scorer.prior_strength == 2.0
    assert default._scorer.prior_strength == KMeansRouterConfig().prior_strength


def _npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


TABLE = dict(centroids=np.eye(2, 3, dtype=np.float32), accuracy=np.full((2, 2), 0.5), cost=np.full((2, 2), 0.001),
             count=np.full((2, 2), 4.0), models=np.array(MODELS), embedder_name=np.array("tiny"), embedder_dim=np.array(3))


def test_a_bundle_without_prior_strength_gets_the_trainers_default():
    scorer = KMeansScorer(_npz(**TABLE), MODELS, {"name": "tiny", "dim": 3})
    assert scorer.prior_strength == DEFAULT_PRIOR_STRENGTH == KMeansRouterConfig().prior_strength


@pytest.mark.parametrize("bad", [np.array(-1.0), np.array(np.nan), np.array([2.0]), np.array("16")])
def test_a_bad_prior_strength_is_a_bundle_error(bad):
    with pytest.raises(BundleError, match="prior_strength"):
        KMeansScorer(_npz(**TABLE, prior_strength=bad), MODELS, {"name": "tiny", "dim": 3})


def test_thompson_picks_the_greedy_model_when_posteriors_are_tight(tight):
    ex = Explorer(tight, seed=0)
    for lam in (0.0, 50.0):
        for query in A_QUERIES + ["b", "b b"]:
            greedy = tight.choose(query, lam)
            explored = [ex.choose(query, lam) for _ in range(20)]
            assert {c.model for c in explored} == {greedy.model}
            assert all(c.policy == "thompson" and c.propensity == 1.0 for c in explored)  # (1000 + 1) / (1000 + 1)


def test_propensity_of_the_runner_up_is_the_exact_probability(hand):
    # In cell "a" model-y (Beta(1, 5)) beats model-x (Beta(5, 1)) with probability
    # int_0^1 5 x^4 (1 - x)^5 dx = 5 B(5, 6) = 1/252; equal costs, so at any lam.
    n = 200_000
    ex = Explorer(hand, seed=1, n_draws=n)
    a, _ = _cells(hand)
    for lam in (0.0, 10.0):
        p = ex.probabilities(lam)
        assert abs(p[a, 1] - 1 / 252) < 4 * np.sqrt(1 / 252 / n)
        np.testing.assert_allclose(p.sum(axis=1), 1.0)
        # Expected regret: p_y * (A_x - A_y) = (1/252) * (5/6 - 1/6).
        assert abs(ex.expected_regret(lam)[a] - (1 / 252) * (2 / 3)) < 4 * np.sqrt(1 / 252 / n) * (2 / 3)


def test_propensities_lie_in_0_1_and_sum_to_1(default):
    ex = Explorer(default, seed=2)
    for lam in (0.0, 30.0, 1e4):
        p = ex.probabilities(lam)
        assert ((p >= 0) & (p <= 1)).all()
        np.testing.assert_allclose(p.sum(axis=1), 1.0)
        choices = ex.choose_batch(["a", "b", "a b", "c"] * 25, lam)
        assert len({c.model for c in choices}) == 2  # loose posteriors: both models get explored
        for c in choices:
            assert 0 < c.propensity <= 1
            n = ex.policy.n_draws
            assert c.propensity == (round(p[c.cell, c.index] * n) + 1) / (n + 1)


def test_choices_are_thompson_choice_and_uniform_choice_draw_for_draw(default):
    queries = ["a", "b", "a b", "c", "b b c"] * 40
    cells = np.array([c.cell for c in default.choose_batch(queries, 0.0)])
    for policy, reference in (("thompson", thompson_choice), ("uniform", uniform_choice)):
        for lam in (0.0, 100.0):
            ex = Explorer(default, seed=11, policy=policy)
            got = np.array([c.index for c in ex.choose_batch(queries, lam)])
            args = (ex.alpha_, ex.beta_, default._scorer.cost)
            want = (reference(*args, lam, cells, np.random.default_rng(11)) if policy == "thompson"
                    else reference(*args, cells, np.random.default_rng(11)))
            np.testing.assert_array_equal(got, want)


def test_seeded_runs_reproduce_bit_for_bit(default):
    queries = ["a", "b", "a b", "c"] * 30
    lams = np.repeat([0.0, 20.0, 5e3], 40)
    first, second, other = Explorer(default, seed=7), Explorer(default, seed=7), Explorer(default, seed=8)
    second.probabilities(20.0)  # filling the propensity cache first changes nothing
    runs = [[(c.model, c.propensity) for c in (ex.choose(q, lam) for q, lam in zip(queries, lams))]
            for ex in (first, second, other)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_max_regret_bounds_what_exploring_gives_up(default):
    greedy = [default.choose(q, 0.0).model for q in A_QUERIES + ["b"]]
    capped = Explorer(default, seed=3, max_regret=0.0)
    assert [capped.choose(q, 0.0).model for q in A_QUERIES + ["b"]] == greedy
    assert (capped.expected_regret(0.0) == 0).all()
    free = Explorer(default, seed=3)
    assert (free.expected_regret(0.0) > 0).all()
    loose = Explorer(default, seed=3, max_regret=1.0)  # every gap is below 1: nothing excluded
    np.testing.assert_array_equal(loose.probabilities(0.0), free.probabilities(0.0))


def test_propensities_tabulated_over_lam_equal_the_counted_ones(default):
    # Without max_regret the Thompson propensities come from a per-cell table over lam (breakpoints of
    # each draw's upper envelope); max_regret=1.0 excludes nothing here but counts the same draws per lam.
    table, counted = Explorer(default, seed=5), Explorer(default, seed=5, max_regret=1.0)
    for lam in np.concatenate([[0.0], np.exp(np.random.default_rng(0).uniform(0.0, np.log(1e5), 60))]):
        np.testing.assert_array_equal(table.probabilities(lam), counted.probabilities(lam))


def test_an_mlp_bundle_is_refused_at_construction(tmp_path, keys):
    from export.bundle_writer import write_bundle
    from export.embedder_export import BundleEmbedder
    from export.pipeline import assemble_bundle
    from export.signing import load_signing_key
    from tiny_kmeans import TABLE as STATIC_TABLE, VOCAB
    from tokenizers import Tokenizer, models, pre_tokenizers
    from sdk.static_embedder import STATIC_TABLE_FILES, encode_table
    from trainer.data.client_data import ClientData
    from trainer.routers.mlp_router import MLPRouterConfig, train_mlp_router

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    files = {"tokenizer.json": tok.to_str().encode(), STATIC_TABLE_FILES["fp32"]: encode_table(STATIC_TABLE, "fp32")}
    entry = {"name": "tiny-static", "dim": 3, "max_tokens": 64, "truncation_side": "left", "pooling": "mean",
             "normalised": True, "files": {"fp32": STATIC_TABLE_FILES["fp32"]}}
    emb = np.repeat(np.array([[1, 0, 0], [0, 1, 0]], dtype=np.float32), 8, axis=0)
    data = ClientData(emb, np.tile([0, 1], 8), np.tile([1.0, 0.0], 8), np.full(16, 0.001))
    mlp = train_mlp_router([data], list(MODELS), MLPRouterConfig(hidden=4, epochs=1), np.random.default_rng(0),
                           federated=False)
    mlp.embedder = {k: v for k, v in entry.items() if k != "files"}
    write_bundle(tmp_path / "mlp", *assemble_bundle(mlp, BundleEmbedder(files, entry, "static"), {}, 1),
                 load_signing_key(keys[0]))
    router = Router.load(tmp_path / "mlp", keys[1])
    with pytest.raises(InvalidInputError, match="K-means"):
        Explorer(router)


@pytest.mark.parametrize("field, value", [("policy", "frontier"), ("seed", -1), ("seed", 1.5), ("n_draws", 0),
                                          ("n_draws", True), ("max_regret", -0.1), ("max_regret", float("nan"))])
def test_bad_arguments_are_refused_naming_the_field(default, field, value):
    with pytest.raises(InvalidInputError, match=field):
        Explorer(default, **{field: value})


# --------------------------------------------------------------------------- EvalLog rows and the upload


def test_record_choice_keeps_policy_and_propensity(tmp_path, default):
    ex = Explorer(default, seed=4)
    explored, greedy = ex.choose("a b", 20.0), default.choose("a b", 20.0)
    other = next(m for m in MODELS if m != explored.model)
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log:
        log.record_choice(explored, 1.0, 0.001)
        log.record_choice(greedy, 1.0, 0.001)
        log.record_choice(explored, 1.0, 0.001, model=other)  # the app overrode the policy: no propensity
        rows = log.rows()
    assert rows.policy == ("thompson", "greedy", None)
    np.testing.assert_array_equal(rows.propensity[:2], [explored.propensity, 1.0])
    assert np.isnan(rows.propensity[2])


@pytest.mark.parametrize("policy, propensity, field", [("thompson", None, "propensity"), (None, 0.5, "policy"),
                                                      ("thompson", 0.0, "propensity"), ("thompson", 1.5, "propensity"),
                                                      ("thompson", float("nan"), "propensity"), ("", 0.5, "policy")])
def test_record_refuses_a_bad_policy_or_propensity(tmp_path, policy, propensity, field):
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log:
        with pytest.raises(InvalidInputError, match=field):
            log.record("model-x", 1.0, 0.001, cell=0, policy=policy, propensity=propensity)
        assert len(log) == 0


#: The schema of version-1 logs, as the SDK wrote it before rows recorded their policy.
V1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE evaluations (
    id INTEGER PRIMARY KEY AUTOINCREMENT, timestamp REAL NOT NULL, model TEXT NOT NULL,
    score REAL NOT NULL CHECK (score >= 0 AND score <= 1), cost_usd REAL NOT NULL CHECK (cost_usd >= 0),
    latency_ms REAL CHECK (latency_ms IS NULL OR latency_ms >= 0), cell INTEGER CHECK (cell IS NULL OR cell >= 0),
    embedding BLOB, bundle_version INTEGER, query TEXT, CHECK (embedding IS NOT NULL OR cell IS NOT NULL));
CREATE INDEX evaluations_timestamp ON evaluations (timestamp);
PRAGMA user_version=1;
"""


def _v1_log(path) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(V1_SCHEMA)
    conn.executemany("INSERT INTO evaluations (timestamp, model, score, cost_usd, cell, bundle_version) "
                     "VALUES (?, ?, ?, ?, ?, ?)", [(1.7e9, "model-x", 1.0, 0.001, 0, 1), (1.7e9, "model-y", 0.0, 0.002, 1, 1)])
    conn.commit()
    conn.close()


def test_a_version_1_log_is_migrated_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.sqlite"
    _v1_log(path)
    with EvalLog(path, MODELS, max_age_days=None) as log:
        rows = log.rows()
        assert rows.model == ("model-x", "model-y") and rows.policy == (None, None) and np.isnan(rows.propensity).all()
        log.record("model-y", 1.0, 0.001, cell=1, policy="thompson", propensity=0.25)
    with EvalLog(path, MODELS, max_age_days=None) as log:  # reopening a migrated log changes nothing
        rows = log.rows()
    assert rows.policy == (None, None, "thompson") and rows.propensity[2] == 0.25
    np.testing.assert_array_equal(rows.score, [1.0, 0.0, 1.0])
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
    conn.close()


def test_a_failed_migration_leaves_the_version_1_log_as_it_was(tmp_path, monkeypatch):
    import sdk.eval_log

    path = tmp_path / "old.sqlite"
    _v1_log(path)
    first = sdk.eval_log._MIGRATE_1_TO_2[0]
    monkeypatch.setattr(sdk.eval_log, "_MIGRATE_1_TO_2", (first, "ALTER TABLE no_such_table ADD COLUMN x TEXT"))
    with pytest.raises(EvalLogError, match="old.sqlite"):
        EvalLog(path, MODELS)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
    assert "policy" not in {r[1] for r in conn.execute("PRAGMA table_info(evaluations)")}  # the first ALTER rolled back
    assert conn.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0] == 2
    conn.close()
    monkeypatch.undo()
    with EvalLog(path, MODELS, max_age_days=None) as log:  # and the next open migrates it
        assert len(log) == 2


def test_explored_rows_feed_the_same_statistics_upload(tmp_path, default):
    """End to end on the tiny bundle: Explorer -> EvalLog -> kmeans_update. The upload of an explored log
    holds only counts and sums per (cell, model) and per-cell means, byte for byte what the same rows
    logged without policy or propensity give."""
    ex = Explorer(default, seed=5)
    choices = ex.choose_batch(["a", "b", "a a", "b b", "a b", "c"] * 10, 20.0)
    scores = [float(i % 3 == 0) for i in range(len(choices))]
    with EvalLog(tmp_path / "explored.sqlite", MODELS) as log:
        for c, s in zip(choices, scores):
            log.record_choice(c, s, 0.001)
        explored = log.rows()
    with EvalLog(tmp_path / "plain.sqlite", MODELS) as log:
        for c, s in zip(choices, scores):
            log.record(c.model, s, 0.001, embedding=c.embedding, cell=c.cell, bundle_version=c.bundle_version)
        plain = log.rows()
    assert set(explored.policy) == {"thompson"} and set(plain.policy) == {None}
    centroids = default._scorer.centroids
    spec = RoundSpec(1, "kmeans", centroids, centroids_hash(centroids), MODELS, "tiny-static", 3, 2,
                     "2030-01-01T00:00Z")
    up, ref = kmeans_update(explored, spec), kmeans_update(plain, spec)
    assert encode_kmeans_update(up, "dev", spec) == encode_kmeans_update(ref, "dev", spec)
    assert encode_kmeans_update_msgpack(up, "dev", spec) == encode_kmeans_update_msgpack(ref, "dev", spec)
    body = json.loads(encode_kmeans_update(up, "dev", spec))
    assert tuple(body) == UPDATE_FIELDS  # nothing new on the wire
    # The counts are the explored choices per (cell, model), the sums their scores.
    cells, models = np.array([c.cell for c in choices]), np.array([c.index for c in choices])
    want = np.zeros((2, 2))
    np.add.at(want, (cells, models), 1.0)
    np.testing.assert_array_equal(up.statistics.count, want)
    assert up.statistics.sum_accuracy.sum() == sum(scores)
