"""sdk.routed_chat.RoutedChat against a stub OpenAI-compatible upstream (uvicorn on 127.0.0.1), with a
real signed bundle (exported MiniLM + a K-means router fitted on RouterBench rows) and a real EvalLog."""

from __future__ import annotations

import asyncio
import math
import re

import numpy as np
import openai
import pytest

from openai_stub import COMPLETION_TOKENS, PROMPT_TOKENS, StubUpstream, answer_text, serve_stub
from sdk import EvalLog, Router
from sdk.chat_text import routing_text
from sdk.errors import (InvalidInputError, InvalidQueryError, ModelSpecError, PriceError, UnknownModelError,
                        UnknownResponseError, UpstreamError)
from sdk.model_spec import ModelSpec, parse_model_spec
from sdk.routed_chat import RoutedChat, Upstream, check_budget
from sdk.token_prices import TokenPrice

POOL = {"gpt-4-1106-preview": "up-gpt4", "gpt-3.5-turbo-1106": "up-gpt35", "mistralai/mixtral-8x7b-chat": "up-mixtral"}
PRICES = {"gpt-4-1106-preview": TokenPrice(10.0, 30.0), "gpt-3.5-turbo-1106": TokenPrice(1.0, 2.0),
          "mistralai/mixtral-8x7b-chat": TokenPrice(0.5, 0.5)}
QUERY = "Write a Python function that reverses a linked list."


def hand_cost(model: str) -> float:
    p = PRICES[model]
    return (PROMPT_TOKENS * p.input_usd_per_1m + COMPLETION_TOKENS * p.output_usd_per_1m) / 1e6


def expected_order(router: Router, text: str, lam: float) -> list[str]:
    """The pool ranked by utility, then lower predicted cost, then lower index (METRICS.md), NaN left out:
    written here with sorted(), independently of sdk.utility."""
    choice = router.choose(text, lam)
    rows = [(-s.utility, s.cost_usd, i, s.model) for i, s in enumerate(choice.scores)
            if s.model in POOL and not math.isnan(s.utility)]
    return [m for *_, m in sorted(rows)]


@pytest.fixture(scope="module")
def router(make_bundle, signing_keys, tmp_path_factory) -> Router:
    return Router.load(make_bundle(tmp_path_factory.mktemp("chat") / "bundle"), signing_keys[1])


@pytest.fixture(scope="module")
def served_stub():
    stub = StubUpstream(hang_s=3.0)
    with serve_stub(stub):
        yield stub


@pytest.fixture()
def stub(served_stub):
    served_stub.modes.clear()
    served_stub.repeat_id = None
    served_stub.requests.clear()
    return served_stub


def make_chat(router, stub, tmp_path, **kwargs) -> RoutedChat:
    upstreams = {m: Upstream(stub.base_url, api_key="k", model=name, timeout_s=kwargs.pop("timeout_s", 2.0))
                 for m, name in POOL.items()}
    options = dict(lam=100.0, prices=PRICES, log=EvalLog(tmp_path / "evals.sqlite", router.model_ids))
    options.update(kwargs)
    return RoutedChat(router, upstreams=upstreams, **options)


def test_routes_to_the_best_model_by_utility_and_records_the_observed_cost_on_feedback(router, stub, tmp_path):
    chat = make_chat(router, stub, tmp_path)
    order = expected_order(router, QUERY, 100.0)
    assert chat.choose(QUERY).order == tuple(order)
    result = chat.create_routed(messages=[{"role": "user", "content": QUERY}], temperature=0.2)
    assert [r["model"] for r in stub.requests] == [POOL[order[0]]]
    assert stub.requests[0]["temperature"] == 0.2 and stub.requests[0]["messages"][0]["content"] == QUERY
    assert result.completion.choices[0].message.content == answer_text(POOL[order[0]])
    outcome = result.outcome
    assert outcome.route.model == order[0] and outcome.route.failed == ()
    assert outcome.cost_usd == pytest.approx(hand_cost(order[0]), rel=1e-12)
    assert (outcome.prompt_tokens, outcome.completion_tokens) == (PROMPT_TOKENS, COMPLETION_TOKENS)
    assert outcome.latency_ms > 0 and outcome.awaiting_score
    # No score yet: nothing in the log (never an invented score), one call pending.
    assert len(chat._log) == 0 and len(chat.pending) == 1
    row = chat.feedback(result.completion.id, 0.75)
    rows = chat._log.rows()
    assert list(rows.id) == [row] and rows.model == (order[0],) and rows.score[0] == 0.75
    assert rows.cost_usd[0] == pytest.approx(hand_cost(order[0]), rel=1e-12)
    assert rows.latency_ms[0] == pytest.approx(outcome.latency_ms)
    np.testing.assert_allclose(rows.embedding[0], router.choose(QUERY, 100.0).embedding, atol=1e-6)
    assert rows.bundle_version[0] == router.bundle_version and rows.query == (None,)
    assert chat.explorer is None and rows.policy == (None,) and np.isnan(rows.propensity[0])  # greedy: as before
    with pytest.raises(UnknownResponseError, match="already scored"):
        chat.feedback(result.completion.id, 0.5)
    for bad in (1.5, -0.1, float("nan"), True, "0.5"):
        with pytest.raises(InvalidInputError, match="score"):
            chat.feedback("whatever", bad)


def test_pending_calls_survive_a_restart(router, stub, tmp_path):
    chat = make_chat(router, stub, tmp_path)
    reply = chat.create(messages=[{"role": "user", "content": QUERY}])
    chat.close()
    again = make_chat(router, stub, tmp_path)  # same log, same pending file beside it
    assert again.feedback(reply.id, 1.0) >= 1 and len(again._log) == 1


@pytest.mark.parametrize("first_mode, kind, status", [("503", "server_error", 503), ("429", "rate_limit", 429),
                                                      ("hang", "timeout", None)])
def test_falls_back_to_the_next_best_model_on_5xx_429_and_timeout(router, stub, tmp_path, first_mode, kind, status):
    chat = make_chat(router, stub, tmp_path, timeout_s=0.5)
    order = expected_order(router, QUERY, 100.0)
    stub.modes[POOL[order[0]]] = first_mode
    result = chat.create_routed(messages=[{"role": "user", "content": QUERY}])
    assert [r["model"] for r in stub.requests] == [POOL[order[0]], POOL[order[1]]]  # no retry of the same model
    assert result.outcome.route.model == order[1]
    (failed,) = result.outcome.route.failed
    assert (failed.model, failed.kind, failed.status) == (order[0], kind, status)
    assert result.outcome.cost_usd == pytest.approx(hand_cost(order[1]))


def test_fallback_is_bounded_and_a_4xx_is_not_retried(router, stub, tmp_path):
    order = expected_order(router, QUERY, 100.0)
    chat = make_chat(router, stub, tmp_path, max_fallbacks=1)
    for m in order:
        stub.modes[POOL[m]] = "503"
    with pytest.raises(UpstreamError) as info:
        chat.create(messages=[{"role": "user", "content": QUERY}])
    assert len(stub.requests) == 2 and info.value.status == 503 and info.value.kind == "server_error"
    assert [a.model for a in info.value.attempts] == order[:2]
    stub.requests.clear()
    stub.modes[POOL[order[0]]] = "400"
    with pytest.raises(UpstreamError) as info:
        chat.create(messages=[{"role": "user", "content": QUERY}])
    assert len(stub.requests) == 1 and info.value.status == 400 and info.value.kind == "client_error"
    assert isinstance(info.value.__cause__, openai.BadRequestError)
    assert len(chat.pending) == 0  # failed calls are not recorded


def test_streaming_passes_the_chunks_through_and_records_at_the_end(router, stub, tmp_path):
    chat = make_chat(router, stub, tmp_path)
    order = expected_order(router, QUERY, 100.0)
    stream = chat.create(messages=[{"role": "user", "content": QUERY}], stream=True)
    assert stream.route.model == order[0] and stream.outcome is None
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer_text(POOL[order[0]])
    assert all(c.choices for c in chunks)  # the usage-only chunk the caller did not ask for is not passed on
    assert stub.requests[0]["stream"] is True and stub.requests[0]["stream_options"] == {"include_usage": True}
    assert stream.outcome.cost_usd == pytest.approx(hand_cost(order[0])) and stream.outcome.awaiting_score
    asked = list(chat.create(messages=[{"role": "user", "content": QUERY}], stream=True,
                             stream_options={"include_usage": True}))
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == COMPLETION_TOKENS


def test_async_twin_routes_falls_back_and_streams_like_the_sync_client(router, stub, tmp_path):
    chat = make_chat(router, stub, tmp_path)
    order = expected_order(router, QUERY, 100.0)

    async def run():
        plan = await chat.achoose(QUERY)
        stub.modes[POOL[order[0]]] = "503"
        result = await chat.acreate_routed(messages=[{"role": "user", "content": QUERY}])
        stream = await chat.acreate(messages=[{"role": "user", "content": QUERY}], stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        row = await chat.afeedback(result.completion.id, 0.25)
        return plan, result, stream, text, row

    plan, result, stream, text, row = asyncio.run(run())
    assert plan.order == tuple(order)
    assert result.outcome.route.model == order[1] and result.outcome.route.failed[0].status == 503
    assert text == answer_text(POOL[order[1]]) and stream.outcome.cost_usd == pytest.approx(hand_cost(order[1]))
    assert chat._log.rows().model == (order[1],) and row == 1


def test_the_routed_text_of_a_conversation(router, stub, tmp_path):
    earlier = "We are writing Rust code for an embedded board. " * 3
    messages = [{"role": "system", "content": "You are a very long system prompt. " * 20},
                {"role": "user", "content": earlier},
                {"role": "assistant", "content": [{"type": "text", "text": "Sure, here it is."},
                                                  {"type": "image_url", "image_url": {"url": "x"}}]},
                {"role": "user", "content": "And in Python?"},
                {"role": "assistant", "content": "prefill"}]
    # Context: user + assistant turns before the last user message, last 40 characters; no system prompt.
    context = (earlier + "\nSure, here it is.")[-40:]
    assert routing_text(messages, 40) == context + "\nAnd in Python?"
    assert routing_text(messages, 0) == "And in Python?"
    chat = make_chat(router, stub, tmp_path, context_chars=40)
    plan = chat.choose(messages)
    assert plan.text == context + "\nAnd in Python?"
    np.testing.assert_allclose(plan.choice.embedding, router.embed([plan.text])[0], atol=1e-6)
    for bad in ([], "", [{"role": "assistant", "content": "hi"}], [{"content": "no role"}],
                [{"role": "user", "content": 3}], [{"role": "user", "content": "   "}]):
        with pytest.raises(InvalidQueryError):
            chat.create(messages=bad)
    assert stub.requests == []


def test_pass_through_calls_the_named_model_without_routing_or_logging(router, stub, tmp_path):
    chat = make_chat(router, stub, tmp_path,
                     passthrough={"ext-model": Upstream(stub.base_url, api_key="k", model="up-ext")},
                     prices={**PRICES, "ext-model": TokenPrice(3.0, 4.0)})
    result = chat.create_routed(messages=[{"role": "user", "content": QUERY}], model="ext-model")
    assert [r["model"] for r in stub.requests] == ["up-ext"] and result.outcome.route.plan is None
    assert result.outcome.cost_usd == pytest.approx((PROMPT_TOKENS * 3.0 + COMPLETION_TOKENS * 4.0) / 1e6)
    assert not result.outcome.awaiting_score and len(chat.pending) == 0
    direct = chat.create_routed(messages=[{"role": "user", "content": QUERY}], model="gpt-4-1106-preview")
    assert stub.requests[-1]["model"] == "up-gpt4" and direct.outcome.route.failed == ()
    assert chat.chat.completions.create(messages=[{"role": "user", "content": QUERY}], model="ext-model").id


def test_lam_in_the_model_string_changes_the_trade_off(router, stub, tmp_path):
    chat = make_chat(router, stub, tmp_path)
    for lam in (0.0, 1e6):
        result = chat.create_routed(messages=[{"role": "user", "content": QUERY}], model=f"fedroute:lam={lam:g}")
        assert result.outcome.route.plan.lam == lam
        assert result.outcome.route.model == expected_order(router, QUERY, lam)[0]


def test_budget_mode_uses_one_controller_per_budget_and_feeds_it_the_observed_cost(router, stub, tmp_path):
    chat = make_chat(router, stub, tmp_path, budget_seed=0)
    for model in ("fedroute:budget=0.5", "fedroute:budget=0.5", "fedroute:budget=2"):
        result = chat.create_routed(messages=[{"role": "user", "content": QUERY}], model=model)
        assert result.outcome.route.model in POOL
    controllers = chat.budget_controllers()
    assert sorted(controllers) == [0.5, 2.0]
    assert controllers[0.5].n_recorded == 2 and controllers[2.0].n_recorded == 1
    assert controllers[0.5].realised_usd_per_1k > 0
    default = make_chat(router, stub, tmp_path, lam=None, budget_usd_per_1k=1.0)
    assert default.choose(QUERY).budget_usd_per_1k == 1.0


def test_budget_controller_chooses_and_predicts_spend_among_the_pool_only(router, stub, tmp_path):
    # The router scores 11 models, the client has upstreams for 3. An unreachable budget makes the
    # controller take its cheapest decisions: its predicted spend must be the cheapest *pool* model's
    # predicted cost (it was the cheapest of all 11, a model the client cannot call), and its pick
    # that model.
    assert len(router.model_ids) > len(POOL)
    chat = make_chat(router, stub, tmp_path, budget_seed=0)
    plan = chat.choose(QUERY, model="fedroute:budget=1e-9")
    scores = router.choose(QUERY, 0.0).scores
    cheapest_pool = min((s.cost_usd, i, s.model) for i, s in enumerate(scores) if s.model in POOL)
    cheapest_all = min(s.cost_usd for s in scores)
    assert cheapest_all < cheapest_pool[0]  # the case this test is about
    controller = chat.budget_controllers()[1e-9]
    assert controller.mix is not None and not controller.mix.reachable
    assert controller.mix.expected_cost == pytest.approx(cheapest_pool[0], rel=1e-12)
    assert plan.order[0] == cheapest_pool[2]


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["fedroute:", "fedroute:lam", "fedroute:lam=", "fedroute:lam=abc", "fedroute:lam=-1",
                                   "fedroute:lam=inf", "fedroute:lam=nan", "fedroute:budget=0", "fedroute:budget=-2",
                                   "fedroute:budget=nan", "fedroute:budget=inf", "fedroute:speed=9",
                                   "fedroute:lam=1,budget=2", "fedroute:lam=1:2", "fedrouter", "", "  ", 3])
def test_malformed_model_strings_are_model_spec_errors(router, stub, tmp_path, model):
    with pytest.raises(ModelSpecError):
        parse_model_spec(model)
    chat = make_chat(router, stub, tmp_path)
    with pytest.raises(ModelSpecError):
        chat.create(messages=[{"role": "user", "content": QUERY}], model=model)
    assert stub.requests == []


@pytest.mark.parametrize("raw", ["\u0663", "1\u0660\u0660", "\uff11", "1_000", " 3", "3 ", "0x10", "infinity", "1e"])
def test_option_numbers_must_be_ascii_decimals(raw):
    """float() read Arabic-Indic '\u0663' as 3 (and '1_000', ' 3'): only ASCII decimal syntax is a number here."""
    with pytest.raises(ModelSpecError) as info:
        parse_model_spec(f"fedroute:lam={raw}")
    assert f"{raw!r} is not a decimal number in ASCII digits (e.g. 100, 0.5, 1e-3)" in str(info.value)


def test_valid_model_strings():
    assert parse_model_spec(None) == parse_model_spec("fedroute") == ModelSpec()
    assert parse_model_spec("fedroute:lam=100") == ModelSpec(lam=100.0)
    assert parse_model_spec("fedroute:lam=0") == ModelSpec(lam=0.0)
    assert parse_model_spec("fedroute:budget=0.5") == ModelSpec(budget_usd_per_1k=0.5)
    lams = [parse_model_spec(f"fedroute:lam={x}").lam for x in ("+2", "2.", ".5", "1E2", "2.5e-1")]
    assert lams == [2, 2, 0.5, 100, 0.25]
    assert parse_model_spec("gpt-4o") == ModelSpec(passthrough="gpt-4o")


def test_a_model_without_a_price_is_an_error_at_construction(router, stub):
    assert all(m.price_per_1k_input_usd is None for m in router.models)  # this bundle has no price table
    with pytest.raises(PriceError, match="gpt-3.5-turbo-1106"):
        RoutedChat(router, lam=1.0, upstreams={m: stub.base_url for m in POOL},
                   prices={"gpt-4-1106-preview": TokenPrice(1, 1), "mistralai/mixtral-8x7b-chat": TokenPrice(1, 1)})
    with pytest.raises(PriceError, match="ext"):
        RoutedChat(router, lam=1.0, upstreams={"gpt-4-1106-preview": Upstream(stub.base_url, api_key="k")},
                   passthrough={"ext": Upstream(stub.base_url, api_key="k")},
                   prices={"gpt-4-1106-preview": TokenPrice(1, 1)})
    with pytest.raises(InvalidInputError, match="input_usd_per_1m"):
        TokenPrice(-1.0, 2.0)
    with pytest.raises(InvalidInputError, match="output_usd_per_1m"):
        TokenPrice(1.0, float("nan"))


def test_bundle_prices_per_1k_are_used_times_1000(make_bundle, signing_keys, stub, tmp_path):
    from test_bundle import ROUTERBENCH_MODELS

    models = [{"id": m, "price_per_1k_input_usd": 0.001, "price_per_1k_output_usd": 0.002, "mean_cost_usd": None}
              for m in ROUTERBENCH_MODELS]
    priced = Router.load(make_bundle(tmp_path / "priced", models=models), signing_keys[1])
    chat = RoutedChat(priced, lam=1.0, upstreams={"claude-v1": Upstream(stub.base_url, api_key="k")})
    assert chat.prices == {"claude-v1": TokenPrice(1.0, 2.0)}
    reply = chat.create_routed(messages=[{"role": "user", "content": QUERY}])
    assert reply.outcome.cost_usd == pytest.approx((PROMPT_TOKENS * 0.001 + COMPLETION_TOKENS * 0.002) / 1000)


def test_unknown_upstreams_and_other_bad_construction(router, stub, tmp_path):
    up = Upstream(stub.base_url, api_key="k")
    with pytest.raises(UnknownModelError, match="gpt-5"):
        RoutedChat(router, lam=1.0, upstreams={"gpt-5": up}, prices={"gpt-5": TokenPrice(1, 1)})
    with pytest.raises(InvalidInputError, match="exactly one"):
        RoutedChat(router, upstreams={"claude-v1": up}, prices={"claude-v1": TokenPrice(1, 1)})
    with pytest.raises(InvalidInputError, match="exactly one"):
        RoutedChat(router, lam=1.0, budget_usd_per_1k=1.0, upstreams={"claude-v1": up})
    for budget in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(InvalidInputError, match="budget"):
            RoutedChat(router, budget_usd_per_1k=budget, upstreams={"claude-v1": up},
                       prices={"claude-v1": TokenPrice(1, 1)})
        with pytest.raises(InvalidInputError):
            check_budget(budget)
    for lam in (-1.0, float("nan")):
        with pytest.raises(InvalidInputError, match="lam"):
            RoutedChat(router, lam=lam, upstreams={"claude-v1": up}, prices={"claude-v1": TokenPrice(1, 1)})
    with pytest.raises(InvalidInputError, match="must be a base URL"):
        RoutedChat(router, lam=1.0, upstreams={"claude-v1": 42}, prices={"claude-v1": TokenPrice(1, 1)})
    for url in ("api.openai.com/v1", "not a url", "ftp://host/v1", "https://"):   # a typo fails here, not as "connection"
        with pytest.raises(InvalidInputError, match="base_url"):
            RoutedChat(router, lam=1.0, upstreams={"claude-v1": url}, prices={"claude-v1": TokenPrice(1, 1)})
    with pytest.raises(InvalidInputError, match="passthrough key"):
        RoutedChat(router, lam=1.0, upstreams={"claude-v1": up}, passthrough={"claude-v2": up},
                   prices={"claude-v1": TokenPrice(1, 1), "claude-v2": TokenPrice(1, 1)})
    with pytest.raises(InvalidInputError, match="prices names"):
        RoutedChat(router, lam=1.0, upstreams={"claude-v1": up}, prices={"claude-v1": TokenPrice(1, 1),
                                                                          "claude-v2": TokenPrice(1, 1)})
    with pytest.raises(InvalidInputError, match="max_fallbacks"):
        RoutedChat(router, lam=1.0, upstreams={"claude-v1": up}, prices={"claude-v1": TokenPrice(1, 1)},
                   max_fallbacks=-1)
    chat = RoutedChat(router, lam=1.0, upstreams={"claude-v1": up}, prices={"claude-v1": TokenPrice(1, 1)})
    with pytest.raises(UnknownModelError, match="no upstream"):
        chat.create(messages=[{"role": "user", "content": QUERY}], model="claude-v2")
    with pytest.raises(InvalidInputError, match="no EvalLog"):
        chat.feedback("chatcmpl-1", 1.0)
    assert stub.requests == []


def test_pending_store_keeps_the_newest_rows_and_drops_expired_ones(tmp_path):
    import time

    from sdk.pending_outcomes import PendingOutcome, PendingOutcomes

    store = PendingOutcomes(tmp_path / "p.sqlite", max_rows=2, max_age_s=3600)
    emb = np.arange(4, dtype=np.float32)
    for i, ts in enumerate((time.time(), time.time(), time.time(), time.time() - 7200)):
        store.add(PendingOutcome(f"id-{i}", ts, "claude-v1", 0.001 * i, 10.0, emb, None, 3))
    # id-3 is older than max_age_s (dropped at its own insert), id-0 fell out of the newest two.
    assert store.get("id-0") is None and store.get("id-3") is None and len(store) == 1
    kept = store.get("id-2")
    assert (kept.model, kept.cost_usd, kept.cell, kept.bundle_version) == ("claude-v1", 0.002, None, 3)
    np.testing.assert_array_equal(kept.embedding, emb)
    assert store.remove("id-2") and not store.remove("id-2")
    for bad in ({"max_rows": 0}, {"max_age_s": 0}, {"max_age_s": float("nan")}):
        with pytest.raises(InvalidInputError):
            PendingOutcomes(":memory:", **bad)


def test_an_answer_costing_more_than_a_log_row_holds_is_not_kept_for_feedback(router, stub, tmp_path, caplog):
    """Observed cost = usage x price above 1000 USD (sdk.eval_log.MAX_COST_PER_QUERY_USD; here a price typed
    in the wrong unit): it used to wait for a score that the log then refused at feedback, as an error about
    a ``cost_usd`` the app never sent. Now the answer is returned and counted, and not kept."""
    absurd = {**PRICES, **{m: TokenPrice(1e8, 1e8) for m in POOL}}  # 42 tokens -> 4,200 USD
    chat = make_chat(router, stub, tmp_path, prices=absurd)
    with caplog.at_level("WARNING", logger="fedroute.routed_chat"):
        result = chat.create_routed(messages=QUERY)
    assert result.outcome.cost_usd == pytest.approx(4200.0) and result.outcome.awaiting_score is False
    assert "above the 1000 USD per query a log row holds" in caplog.text
    assert len(chat.pending) == 0
    with pytest.raises(UnknownResponseError):
        chat.feedback(result.completion.id, 1.0)
    budget_chat = make_chat(router, stub, tmp_path / "b", prices=absurd, lam=None, budget_usd_per_1k=0.5)
    budget_chat.create(messages=QUERY)  # still observed spend for the budget controller
    assert budget_chat.budget_controllers()[0.5].realised_usd_per_1k == pytest.approx(4200.0 * 1000)
    chat.close()
    budget_chat.close()


def test_an_upstream_that_repeats_response_ids_gets_each_routed_answer_scored_once(router, stub, tmp_path):
    """Some OpenAI-compatible servers repeat completion ids (drawn from a small range, or fixed). The pending
    store is keyed by id: the second answer replaced the first, whose outcome was lost, and the app's score
    of the first answer was recorded against the second one. A routed answer whose id already awaits a
    score now gets a fresh one, in the completion (and in every chunk of a stream)."""
    stub.repeat_id = "chatcmpl-same"
    chat = make_chat(router, stub, tmp_path)
    first = chat.create_routed(messages=QUERY)
    second = chat.create_routed(messages="Is a whale a fish? Answer yes or no.")
    with chat.create(messages="Name three prime numbers.", stream=True) as stream:
        chunks = list(stream)
    ids = [first.completion.id, second.completion.id, chunks[0].id]
    assert ids[0] == "chatcmpl-same" and len(set(ids)) == 3 and all(i.startswith("chatcmpl-same") for i in ids)
    assert {c.id for c in chunks} == {ids[2]} and stream.outcome.response_id == ids[2]
    assert second.outcome.response_id == ids[1] and second.outcome.awaiting_score and len(chat.pending) == 3
    rows = [chat.feedback(i, score) for i, score in zip(ids, (1.0, 0.0, 0.5))]
    log = EvalLog(tmp_path / "evals.sqlite", router.model_ids)
    got = log.rows()
    assert list(got.id) == rows and list(got.score) == [1.0, 0.0, 0.5]
    for i, text in enumerate((QUERY, "Is a whale a fish? Answer yes or no.", "Name three prime numbers.")):
        np.testing.assert_allclose(got.embedding[i], router.choose(text, 100.0).embedding, atol=1e-6)
    # scored, the id is free again: the next answer keeps the upstream's id
    assert chat.create(messages=QUERY).id == "chatcmpl-same"
    log.close()
    chat.close()


def test_a_pending_store_file_that_is_not_one_is_refused_at_open(router, tmp_path):
    """The EvalLog's own file given as the pending store got a 'pending' table added to it; a database with
    a foreign 'pending' table opened, then every lookup raised sqlite3.OperationalError (in the proxy: a 500
    with a traceback)."""
    import sqlite3

    from sdk.errors import EvalLogError
    from sdk.pending_outcomes import PendingOutcomes

    log = EvalLog(tmp_path / "evals.sqlite", router.model_ids)
    with pytest.raises(EvalLogError, match="'evaluations'"):
        PendingOutcomes(tmp_path / "evals.sqlite")
    log.close()
    with sqlite3.connect(tmp_path / "evals.sqlite") as conn:
        assert "pending" not in {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()
    foreign = sqlite3.connect(tmp_path / "other.sqlite")
    foreign.execute("CREATE TABLE pending (x)")
    foreign.commit()
    foreign.close()
    with pytest.raises(EvalLogError, match=r"pending columns \['x'\]"):
        PendingOutcomes(tmp_path / "other.sqlite")
    with pytest.raises(EvalLogError, match="not a pending-outcome store"):
        RoutedChat(router, lam=1.0, upstreams={m: Upstream("http://127.0.0.1:9/v1", api_key="k") for m in POOL},
                   prices=PRICES,
                   log=EvalLog(tmp_path / "e2.sqlite", router.model_ids), pending=tmp_path / "e2.sqlite")


def test_two_clients_on_one_pending_store_record_a_score_once(router, stub, tmp_path):
    """Two RoutedChat (two proxy processes, or a sync and an async client of one app) over one log and one
    pending store, scoring the same answer at once: each read the entry, both wrote a row, then both
    removed it. Now the store holds the entry under its write lock until the row is written: one row,
    the other call is told the answer awaits no score."""
    import threading

    first = make_chat(router, stub, tmp_path)
    second = make_chat(router, stub, tmp_path)  # same evals.sqlite and evals.pending.sqlite
    answer = first.create(messages=QUERY)
    barrier, results = threading.Barrier(2), []

    def score(chat):
        barrier.wait()
        try:
            results.append(chat.feedback(answer.id, 1.0))
        except UnknownResponseError:
            results.append("unknown")

    threads = [threading.Thread(target=score, args=(c,)) for c in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log = EvalLog(tmp_path / "evals.sqlite", router.model_ids)
    assert len(log) == 1 and sorted(results, key=str) == sorted([int(log.rows().id[0]), "unknown"], key=str)
    log.close()
    first.close()
    second.close()


@pytest.mark.parametrize("messages, shown", [([], "got list []"), ("hello", "got str 'hello'"), ({}, "got dict {}")])
def test_messages_that_are_no_list_of_messages_are_named(messages, shown):
    """The 400 for `"messages": []` said 'non-empty list of chat messages, got list': the value is shown."""
    from sdk.chat_text import message_texts

    for check in (routing_text, message_texts):
        with pytest.raises(InvalidQueryError, match=re.escape(f"non-empty list of chat messages, {shown}")):
            check(messages)


# -- exploration (explore=): tiny K-means bundles (tests/tiny_kmeans.py), every model with an upstream -------------

def tiny_chat(router, stub, tmp_path, **kwargs) -> RoutedChat:
    from tiny_kmeans import MODELS

    options = dict(lam=0.0, prices={m: TokenPrice(1.0, 1.0) for m in MODELS},
                   log=EvalLog(tmp_path / "evals.sqlite", router.model_ids))
    return RoutedChat(router, upstreams={m: Upstream(stub.base_url, api_key="k") for m in MODELS},
                      **{**options, **kwargs})


@pytest.fixture(scope="module")
def tiny(signing_keys, tmp_path_factory) -> Router:
    """The trainer's default shrinkage over 4 evaluations per (cell, model): loose posteriors, both models explored."""
    from tiny_kmeans import write_tiny_kmeans

    return Router.load(write_tiny_kmeans(tmp_path_factory.mktemp("tiny"), signing_keys[0])[0], signing_keys[1])


TINY_QUERIES = ["a", "b", "a a", "b b", "a b a", "b a b"] * 3


def test_explore_tries_the_explorers_model_first_and_logs_its_policy_and_propensity(tiny, stub, tmp_path):
    from sdk.explorer import Explorer

    chat = tiny_chat(tiny, stub, tmp_path, explore=Explorer(tiny, seed=4))
    ref = Explorer(tiny, seed=4)  # same seed, same bundle, same calls: the same draws
    served, ids = [], []
    for q in TINY_QUERIES:
        result = chat.create_routed(messages=q)
        plan, expected = result.outcome.route.plan, ref.choose(q, 0.0)
        assert (plan.choice.model, plan.choice.propensity, plan.choice.policy) == \
            (expected.model, expected.propensity, "thompson")
        assert plan.order[0] == expected.model == result.outcome.route.model == stub.requests[-1]["model"]
        served.append((expected.model, expected.propensity))
        ids.append(result.completion.id)
    greedy = [tiny.choose(q, 0.0).model for q in TINY_QUERIES]
    assert sum(m != g for (m, _), g in zip(served, greedy)) == 4  # it explored (seed 4: 4 of 18, about 10% a query)
    chat.close()
    again = tiny_chat(tiny, stub, tmp_path)  # a restart, exploring or not: the pending store keeps the pair
    for i in ids:
        again.feedback(i, 1.0)
    rows = again._log.rows()
    assert list(zip(rows.model, rows.propensity)) == served and set(rows.policy) == {"thompson"}
    assert all(0.0 < p <= 1.0 for _, p in served) and min(p for _, p in served) < 1.0
    again.close()


def test_an_explored_model_that_fails_is_fallen_back_from_and_its_row_carries_no_propensity(tiny, stub, tmp_path):
    """Rule (docs/openai_proxy.md): the probability of logging a fallback depends on the upstream's failures,
    which nobody knows, so a row served by a fallback is logged as not explored (no policy nor propensity)."""
    from sdk.explorer import Explorer

    chat = tiny_chat(tiny, stub, tmp_path, explore=Explorer(tiny, policy="uniform", seed=5))
    first = Explorer(tiny, policy="uniform", seed=5).choose("a", 0.0).model
    stub.modes[first] = "503"
    result = chat.create_routed(messages="a")
    assert [r["model"] for r in stub.requests] == [first, result.outcome.route.model] != [first, first]
    assert result.outcome.route.failed[0].model == first and result.outcome.route.plan.choice.propensity == 0.5
    chat.feedback(result.completion.id, 1.0)
    rows = chat._log.rows()
    assert rows.model == (result.outcome.route.model,) and rows.policy == (None,) and np.isnan(rows.propensity[0])
    chat.close()


def test_explore_chooses_among_the_pool_only(router, stub, tmp_path):
    """3 of the router's 11 models have an upstream: uniform exploration draws each with probability 1/3."""
    chat = make_chat(router, stub, tmp_path, explore="uniform")
    p = chat.explorer.probabilities(100.0)
    pool = [router.model_ids.index(m) for m in POOL]
    np.testing.assert_array_equal(p[:, pool], 1 / 3)
    assert np.delete(p, pool, axis=1).sum() == 0.0
    result = chat.create_routed(messages=QUERY)
    choice = result.outcome.route.plan.choice
    assert choice.model in POOL and choice.propensity == 1 / 3 and stub.requests[-1]["model"] == POOL[choice.model]
    chat.feedback(result.completion.id, 0.0)
    rows = chat._log.rows()
    assert rows.policy == ("uniform",) and rows.propensity[0] == 1 / 3
    budget = make_chat(router, stub, tmp_path, lam=None, budget_usd_per_1k=0.5, explore="uniform")
    result = budget.create_routed(messages=QUERY)  # the controller sets lam and sees the explored model's cost
    assert result.outcome.route.plan.choice.propensity == 1 / 3
    assert budget.budget_controllers()[0.5].n_recorded == 1
    budget.close()
    with pytest.raises(InvalidInputError, match="explore must be"):
        make_chat(router, stub, tmp_path, explore=0.1)
    with pytest.raises(InvalidInputError, match="policy must be one of"):
        make_chat(router, stub, tmp_path, explore="frontier")
    chat.close()


def test_reload_explores_with_a_new_explorer_on_the_new_table(signing_keys, stub, tmp_path):
    from sdk.explorer import Explorer
    from tiny_kmeans import write_tiny_kmeans
    from trainer.routers.kmeans_router import KMeansRouterConfig

    hand = KMeansRouterConfig(n_clusters=2, prior_strength=2.0, model_prior_strength=0.0, prior="model")
    bundle, _ = write_tiny_kmeans(tmp_path / "b", signing_keys[0], config=hand)  # Beta(5, 1) / Beta(1, 5)
    router = Router.load(bundle, signing_keys[1])
    chat = tiny_chat(router, stub, tmp_path, explore=Explorer(router, seed=3, n_draws=500))
    old = chat.explorer
    a, b = router.choose("a", 0.0).cell, router.choose("b", 0.0).cell
    np.testing.assert_allclose(old.alpha_[[a, b]], [[5, 1], [1, 5]])
    write_tiny_kmeans(tmp_path / "b", signing_keys[0], version=2, config=hand, n_copies=250)  # 1,000 per cell
    assert chat.reload() is True
    new = chat.explorer
    assert new is not old and new.router is chat.router and chat.router.bundle_version == 2
    np.testing.assert_allclose(new.alpha_[[a, b]], [[1001, 1], [1, 1001]])
    assert (new.policy, new.max_regret) == (old.policy, None)  # the same settings: policy, seed, n_draws
    assert chat.choose("a").choice.bundle_version == 2
    chat.close()


def test_a_pending_store_written_before_exploration_is_migrated_and_keeps_its_entries(tmp_path):
    import sqlite3
    import time

    from sdk.pending_outcomes import PendingOutcome, PendingOutcomes

    now = time.time()
    conn = sqlite3.connect(tmp_path / "p.sqlite")
    conn.execute("CREATE TABLE pending (response_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, timestamp REAL NOT NULL, "
                 "model TEXT NOT NULL, cost_usd REAL NOT NULL, latency_ms REAL NOT NULL, embedding BLOB NOT NULL, "
                 "cell INTEGER, bundle_version INTEGER NOT NULL)")
    conn.execute("INSERT INTO pending VALUES ('old', 1, ?, 'm', 0.5, 2.0, ?, 3, 4)",
                 (now, np.ones(2, dtype="<f4").tobytes()))
    conn.commit()
    conn.close()
    store = PendingOutcomes(tmp_path / "p.sqlite")
    assert store.get("old").policy is None and store.get("old").cell == 3
    store.add(PendingOutcome("new", now, "m", 0.5, 2.0, np.ones(2, dtype=np.float32), 1, 4, "thompson", 0.25))
    store.close()
    again = PendingOutcomes(tmp_path / "p.sqlite")
    assert (again.get("new").policy, again.get("new").propensity) == ("thompson", 0.25) and len(again) == 2
    again.close()
