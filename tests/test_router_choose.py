"""``sdk.Router``: bad input, truncation, batch == single, thread safety, lambda for a budget."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from conftest import BUNDLE_MAX_TOKENS

from sdk import Router
from sdk.errors import BudgetError, InvalidInputError, InvalidLambdaError, InvalidQueryError


@pytest.fixture(scope="module")
def bundle_dir(make_bundle, tmp_path_factory):
    return make_bundle(tmp_path_factory.mktemp("b") / "bundle", kind="kmeans")


@pytest.fixture(scope="module", params=["int8", "fp32"])
def router(bundle_dir, signing_keys, request) -> Router:
    return Router.load(bundle_dir, signing_keys[1], precision=request.param)


@pytest.fixture(scope="module")
def prompts(fitted_routers) -> list[str]:
    return list(fitted_routers["test"].prompts[:40])


@pytest.mark.parametrize("query, match", [
    ("", "empty or whitespace"),
    ("   \n\t ", "empty or whitespace"),
    (None, "must be a str, got NoneType"),
    (42, "must be a str, got int"),
    (b"bytes", "must be a str, got bytes"),
])
def test_bad_queries_raise_invalid_query_error(router, query, match):
    with pytest.raises(InvalidQueryError, match=match):
        router.choose(query, 1.0)


@pytest.mark.parametrize("lam, match", [
    (-1.0, ">= 0"), (float("nan"), "finite"), (float("inf"), "finite"), ("1", "real number"), (True, "real number"),
])
def test_bad_lambdas_raise_invalid_lambda_error(router, lam, match):
    with pytest.raises(InvalidLambdaError, match=match):
        router.choose("What is 2 + 2?", lam)


@pytest.mark.parametrize("queries, match", [
    ([], r"non-empty list of str, got \[\]"), ("just one string", "list of str"), (["fine", "  "], r"queries\[1\] is empty"),
    (["fine", 3], r"queries\[1\] must be a str"),
])
def test_bad_batches_raise_invalid_query_error(router, queries, match):
    with pytest.raises(InvalidQueryError, match=match):
        router.choose_batch(queries, 1.0)


def test_invalid_input_errors_are_value_errors(router):
    with pytest.raises(ValueError):
        router.choose("", 1.0)


def test_overlong_query_is_truncated_to_its_last_tokens(router):
    question = "Which planet is known as the red planet? A) Venus B) Mars C) Jupiter D) Saturn. Answer: "
    tail = question * 4  # > max_tokens tokens on its own
    long_query = "lorem ipsum dolor sit amet " * 2000 + tail
    assert router.token_counts([long_query]) == [BUNDLE_MAX_TOKENS]
    a, b = router.choose(long_query, 10.0), router.choose(tail, 10.0)
    # Both read the same last max_tokens tokens, so they are the same query to the router.
    np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)
    assert a.model == b.model
    c = router.choose("lorem ipsum dolor sit amet " * 2000, 10.0)
    assert float(a.embedding @ c.embedding) < 0.9


def test_choose_batch_gives_the_same_answers_as_choose(router, prompts):
    batch = router.choose_batch(prompts, 30.0)
    for prompt, got in zip(prompts, batch):
        single = router.choose(prompt, 30.0)
        assert got.model == single.model
        assert got.utility == pytest.approx(single.utility, abs=1e-6)
        np.testing.assert_allclose(got.embedding, single.embedding, atol=1e-5)


def test_four_threads_give_the_same_answers_as_serial(router, prompts):
    lams = (0.0, 10.0, 1000.0)
    serial = {(i, lam): router.choose(p, lam) for i, p in enumerate(prompts) for lam in lams}
    results: dict = {}
    errors: list = []

    def worker(k: int) -> None:
        try:
            for i in range(k, len(prompts), 4):
                for lam in lams:
                    results[(i, lam)] = router.choose(prompts[i], lam)
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results.keys() == serial.keys()
    for key, choice in serial.items():
        assert results[key].model == choice.model
        np.testing.assert_array_equal(results[key].embedding, choice.embedding)


def test_lambda_trades_accuracy_for_cost(router, prompts):
    free = router.choose_batch(prompts, 0.0)
    frugal = router.choose_batch(prompts, 1e6)
    assert np.mean([c.cost_usd for c in frugal]) < np.mean([c.cost_usd for c in free])
    assert np.mean([c.accuracy for c in frugal]) <= np.mean([c.accuracy for c in free])
    for c in free:  # lam = 0: the most accurate model of the query's cell
        assert c.accuracy == pytest.approx(np.nanmax([s.accuracy for s in c.scores]))


def _mean_cost(router, prompts, lam):
    return float(np.mean([c.cost_usd for c in router.choose_batch(prompts, lam)]))


def test_lam_for_budget_meets_the_budget_tightly(router, prompts):
    cost_free = _mean_cost(router, prompts, 0.0)
    cost_floor = _mean_cost(router, prompts, 1e12)
    budget_per_query = 0.5 * (cost_free + cost_floor)
    lam = router.lam_for_budget(budget_per_query * 1000, prompts)
    assert lam > 0
    assert _mean_cost(router, prompts, lam) <= budget_per_query
    assert _mean_cost(router, prompts, lam * (1 - 1e-6)) > budget_per_query  # the smallest such lam


def test_lam_for_budget_edges(router, prompts):
    assert router.lam_for_budget(1e9, prompts) == 0.0
    with pytest.raises(BudgetError, match="cheapest model"):
        router.lam_for_budget(1e-12, prompts)
    for bad in (0, -1.0, math.nan, math.inf, "5"):
        with pytest.raises(InvalidInputError, match="usd_per_1k_queries"):
            router.lam_for_budget(bad, prompts)
    with pytest.raises(InvalidQueryError):
        router.lam_for_budget(1.0, [])


def test_thread_options_are_validated(bundle_dir, signing_keys):
    with pytest.raises(InvalidInputError, match="intra_op_threads"):
        Router.load(bundle_dir, signing_keys[1], intra_op_threads=0)
    with pytest.raises(InvalidInputError, match="precision"):
        Router.load(bundle_dir, signing_keys[1], precision="fp16")


def test_tail_tokenisation_equals_full_tokenisation(router, fitted_routers, exported_embedder):
    """The SDK tokenises only the tail of long queries; the kept tokens must be exactly the full text's."""
    from tokenizers import Tokenizer

    full = Tokenizer.from_file(str(exported_embedder[0].tokenizer))
    full.no_padding()
    full.enable_truncation(BUNDLE_MAX_TOKENS, direction="left")
    hostile = [
        "What is 2 + 2?" + " " * 5000,                 # the tail is only whitespace
        "What is the capital of Peru? " + " " * 40000,  # more whitespace than the second look used to read
        "alpha beta gamma " * 20 + "Which one? " + "\u200b" * 30000,
        "x" * 3000 + " what now?",                     # one giant word
        "word " * 1000 + "supercalifragilisticexpialidocious " * 40,
        "é" * 800 + " 日本語のテキスト " * 50,
        "intro words " * 60 + "y" * 180 + " what is it?",  # the first tail is too short, the second exact
        "short words: " + "a b " * 100,                    # one-character words: the first tail is exact
    ]
    texts = list(fitted_routers["test"].prompts) + hostile
    for text in texts:
        (enc,) = router._embedder._encode([text])
        assert enc.ids == full.encode(text).ids, text[:60]


@pytest.mark.parametrize("query, match", [
    ("abc\ud800def", "not valid Unicode"),
    ("\x00\x01\x02", "no token the embedder can read"),
    ("\u200b\u200b", "no token the embedder can read"),
])
def test_queries_without_readable_text_are_refused(router, query, match):
    with pytest.raises(InvalidQueryError, match=match):
        router.choose(query, 1.0)
    with pytest.raises(InvalidQueryError, match="position 1" if "token" in match else match):
        router.choose_batch(["a fine query", query], 1.0)


def test_huge_lambda_integer_is_an_invalid_lambda(router):
    with pytest.raises(InvalidLambdaError, match="too large"):
        router.choose("What is 2 + 2?", 10**400)
    assert router.choose("What is 2 + 2?", np.float32(1.0)).lam == 1.0  # numpy scalars are fine


def test_only_the_last_64k_characters_are_read(router):
    with pytest.raises(InvalidQueryError, match="in its last 65536 characters"):
        router.choose("A question lost in front: what is 2 + 2?" + " " * 70_000, 1.0)


def test_multi_megabyte_query_without_spaces_is_routed(router):
    choice = router.choose("x" * 2_000_000 + " and then the question: what is the capital of Peru?", 10.0)
    assert choice.model in router.model_ids


def test_router_is_immutable(router):
    with pytest.raises(AttributeError, match="immutable"):
        router.precision = "fp32"
    manifest = router.manifest
    manifest["bundle_version"] = 99
    assert router.manifest["bundle_version"] == router.bundle_version == 1
