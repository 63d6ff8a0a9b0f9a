"""`fedroute proxy` end to end: the official ``openai`` client -> the proxy (uvicorn on 127.0.0.1) -> a stub
OpenAI-compatible upstream (uvicorn on 127.0.0.1). Real bundle, real EvalLog, config read from JSON."""

from __future__ import annotations

import hashlib
import json
import math
import os

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from openai_stub import COMPLETION_TOKENS, PROMPT_TOKENS, ServedApp, StubUpstream, answer_text, serve_stub
from sdk import EvalLog, Router
from sdk.errors import InvalidInputError, PriceError, UnknownModelError
from sdk.proxy.app import create_app
from sdk.proxy.config import ProxyConfig
from sdk.proxy.metrics import ProxyMetrics

POOL = {"gpt-4-1106-preview": ("up-gpt4", 10.0, 30.0), "gpt-3.5-turbo-1106": ("up-gpt35", 1.0, 2.0),
        "mistralai/mixtral-8x7b-chat": ("up-mixtral", 0.5, 0.5)}
EXT = ("ext-model", "up-ext", 3.0, 4.0)
TOKEN = "caller-token-1"
QUERY = "Write a Python function that reverses a linked list."


def hand_cost(inp: float, out: float) -> float:
    return (PROMPT_TOKENS * inp + COMPLETION_TOKENS * out) / 1e6


def cost_of(model: str) -> float:
    return hand_cost(*POOL[model][1:])


def expected_order(router: Router, text: str, lam: float) -> list[str]:
    choice = router.choose(text, lam)
    rows = [(-s.utility, s.cost_usd, i, s.model) for i, s in enumerate(choice.scores)
            if s.model in POOL and not math.isnan(s.utility)]
    return [m for *_, m in sorted(rows)]


def write_config(tmp_path, bundle, public_key, base_url, **extra) -> ProxyConfig:
    upstreams = {m: {"base_url": base_url, "api_key_env": "STUB_KEY", "model": name, "timeout_s": 1.0,
                     "input_usd_per_1m": i, "output_usd_per_1m": o} for m, (name, i, o) in POOL.items()}
    raw = {"bundle": str(bundle), "public_key": str(public_key), "log": "proxy_log.sqlite", "lam": 100,
           "upstreams": upstreams,
           "passthrough": {EXT[0]: {"base_url": base_url, "api_key_env": "STUB_KEY", "model": EXT[1],
                                    "input_usd_per_1m": EXT[2], "output_usd_per_1m": EXT[3]}}}
    raw.update(extra)
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps(raw))
    return ProxyConfig.load(path)


@pytest.fixture(scope="module")
def deployment(make_bundle, signing_keys, tmp_path_factory):
    """A stub upstream and the proxy in front of it, both served by uvicorn on 127.0.0.1."""
    tmp = tmp_path_factory.mktemp("proxy")
    bundle = make_bundle(tmp / "bundle")
    stub = StubUpstream(hang_s=3.0)
    mp = pytest.MonkeyPatch()
    mp.setenv("STUB_KEY", "upstream-key")
    with serve_stub(stub):
        metrics = ProxyMetrics()
        chat = write_config(tmp, bundle, signing_keys[1], stub.base_url).build_chat(observer=metrics)
        with ServedApp(create_app(chat, ["", TOKEN, "second-token"], metrics)) as proxy:
            base = f"http://127.0.0.1:{proxy.port}"
            yield {"stub": stub, "chat": chat, "base": base, "tmp": tmp, "bundle": bundle,
                   "client": openai.OpenAI(base_url=base + "/v1", api_key=TOKEN, max_retries=0),
                   "http": httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}),
                   "router": chat.router}
        chat.close()
    mp.undo()


def metric(http: httpx.Client, name: str, **labels) -> float:
    text = http.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_proxy_end_to_end(deployment):
    """One story, in order, so that the metric counters have hand-computed values."""
    d = deployment
    stub, client, http, router = d["stub"], d["client"], d["http"], d["router"]
    order = expected_order(router, QUERY, 100.0)
    messages = [{"role": "user", "content": QUERY}]

    # 1. routing: model="fedroute" answers from the best model by utility at the config's lam.
    raw = client.chat.completions.with_raw_response.create(model="fedroute", messages=messages, temperature=0.3,
                                                            extra_body={"seed_of_vendor": 7})
    reply = raw.parse()
    assert reply.choices[0].message.content == answer_text(POOL[order[0]][0])
    assert raw.headers["x-fedroute-model"] == order[0] and raw.headers["x-fedroute-fallbacks"] == "0"
    assert float(raw.headers["x-fedroute-routing-ms"]) > 0
    sent = stub.requests[-1]
    assert sent["model"] == POOL[order[0]][0] and sent["temperature"] == 0.3 and sent["seed_of_vendor"] == 7
    assert reply.usage.prompt_tokens == PROMPT_TOKENS

    # 2. lam in the model string.
    top_at_0 = expected_order(router, QUERY, 0.0)[0]
    assert client.chat.completions.create(model="fedroute:lam=0", messages=messages).choices[0].message.content \
        == answer_text(POOL[top_at_0][0])

    # 3. pass-through: another model id goes straight to its upstream.
    ext = client.chat.completions.create(model=EXT[0], messages=messages)
    assert stub.requests[-1]["model"] == EXT[1] and ext.choices[0].message.content == answer_text(EXT[1])

    # 4. streaming (SSE) passthrough.
    chunks = list(client.chat.completions.create(model="fedroute", messages=messages, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer_text(POOL[order[0]][0])
    assert stub.requests[-1]["stream"] is True

    # 5. fallback on an upstream 503.
    stub.modes[POOL[order[0]][0]] = "503"
    raw = client.chat.completions.with_raw_response.create(model="fedroute", messages=messages)
    assert raw.headers["x-fedroute-model"] == order[1] and raw.headers["x-fedroute-fallbacks"] == "1"
    assert raw.parse().choices[0].message.content == answer_text(POOL[order[1]][0])
    fallback_id = raw.parse().id
    stub.modes.clear()

    # 6. auth: a wrong or missing token is a 401 in OpenAI's error shape; /health needs none.
    bad = openai.OpenAI(base_url=d["base"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model="fedroute", messages=messages)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    for headers in ({}, {"Authorization": "Basic " + TOKEN}, {"Authorization": "Bearer other"}):
        r = httpx.get(d["base"] + "/metrics", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(d["base"] + "/health").json() == {"status": "ok", "bundle_version": d["router"].bundle_version}

    # 7. metrics.
    assert metric(http, "fedroute_proxy_requests_total", route="routed", status="200") == 4
    assert metric(http, "fedroute_proxy_requests_total", route="passthrough", status="200") == 1
    assert metric(http, "fedroute_proxy_choices_total", model=order[0]) == 3
    assert metric(http, "fedroute_proxy_fallbacks_total", model=order[0], reason="server_error") == 1
    assert metric(http, "fedroute_proxy_answers_total", model=order[1], route="routed") \
        == 1 + (top_at_0 == order[1])
    spent = {m: 0.0 for m in POOL}
    for m in (order[0], top_at_0, order[0], order[1]):
        spent[m] += cost_of(m)
    for m, usd in spent.items():
        assert metric(http, "fedroute_proxy_spend_usd_total", model=m) == pytest.approx(usd, rel=1e-9)
    assert metric(http, "fedroute_proxy_spend_usd_total", model=EXT[0]) == pytest.approx(hand_cost(*EXT[2:]))
    assert metric(http, "fedroute_proxy_routing_seconds_count") == 4

    # 8. feedback appends the outcome to the device's EvalLog (the file fedroute-sync reads).
    r = http.post("/v1/fedroute/feedback", json={"id": fallback_id, "score": 0.5})
    assert r.status_code == 200
    with EvalLog(d["tmp"] / "proxy_log.sqlite", router.model_ids) as log:
        rows = log.rows()
    assert rows.model == (order[1],) and rows.score[0] == 0.5 and list(rows.id) == [r.json()["recorded"]]
    assert rows.cost_usd[0] == pytest.approx(cost_of(order[1]))
    np.testing.assert_allclose(rows.embedding[0], router.choose(QUERY, 100.0).embedding, atol=1e-6)
    assert http.post("/v1/fedroute/feedback", json={"id": fallback_id, "score": 0.5}).status_code == 404
    assert http.post("/v1/fedroute/feedback", json={"id": ext.id, "score": 0.5}).status_code == 404  # pass-through
    assert http.post("/v1/fedroute/feedback", json={"id": reply.id, "score": 2}).json()["error"]["param"] == "score"
    assert metric(http, "fedroute_proxy_feedback_total", result="recorded") == 1

    # 9. /v1/models.
    ids = [m.id for m in client.models.list()]
    assert ids == ["fedroute", *[m for m in router.model_ids if m in POOL], EXT[0]]


@pytest.mark.parametrize("model, status, param", [
    ("fedroute:lam=abc", 400, "model"), ("fedroute:lam=-1", 400, "model"), ("fedroute:budget=0", 400, "model"),
    ("fedroute:budget=-0.5", 400, "model"), ("fedroute:budget=nan", 400, "model"), ("fedroute:x=1", 400, "model"),
    ("fedroutex", 400, "model"), ("no-such-model", 404, "model"),
])
def test_bad_model_strings_get_openai_style_4xx(deployment, model, status, param):
    before = len(deployment["stub"].requests)
    with pytest.raises(openai.APIStatusError) as info:
        deployment["client"].chat.completions.create(model=model, messages=[{"role": "user", "content": QUERY}])
    assert info.value.status_code == status
    body = info.value.body
    assert body["param"] == param and body["message"] and body["type"] == "invalid_request_error"
    if status == 404:
        assert body["code"] == "model_not_found"
    assert len(deployment["stub"].requests) == before  # nothing reached the upstream


@pytest.mark.parametrize("body, status", [
    ({"model": "fedroute:budget=abc"}, 400), ({"model": "fedroute:lam="}, 400), ({"model": "fedroute:nonsense"}, 400),
    ({"model": "fedroutex"}, 400), ({"model": 7}, 400), ({"model": "no-such-model"}, 404),
    ({"model": "fedroute", "messages": []}, 400), ({"model": EXT[0], "messages": [{"content": "no role"}]}, 400),
], ids=["budget=abc", "lam=", "nonsense", "fedroutex", "model 7", "no upstream", "no messages", "roleless passthrough"])
def test_requests_the_proxy_refuses_are_counted_as_invalid_not_routed(deployment, body, status):
    """A malformed ``fedroute:...`` model string was counted as route="routed" (the label came from the
    string's prefix), though the proxy refused it and nothing was routed; bad messages likewise."""
    http = deployment["http"]
    labels = ("routed", "passthrough", "invalid")
    count = (lambda: {r: metric(http, "fedroute_proxy_requests_total", route=r, status=str(status)) for r in labels})
    before = count()
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUERY}], **body})
    assert r.status_code == status
    after = count()
    assert {k: after[k] - before[k] for k in labels} == {"routed": 0, "passthrough": 0, "invalid": 1}


@pytest.mark.parametrize("payload, param", [
    (b"not json", None), (b"[1, 2]", None), (b'{"model": "fedroute"}', "messages"),
    (b'{"model": "fedroute", "messages": []}', "messages"),
    (b'{"model": "fedroute", "messages": [{"role": "assistant", "content": "hi"}]}', "messages"),
])
def test_bad_bodies_get_400(deployment, payload, param):
    r = deployment["http"].post("/v1/chat/completions", content=payload, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


@pytest.mark.parametrize("stream", ["yes", 1, "false", {}], ids=["'yes'", "1", "'false'", "object"])
@pytest.mark.parametrize("model", ["fedroute", EXT[0]])
def test_a_stream_that_is_not_a_boolean_is_refused_before_routing(deployment, stream, model):
    """``"stream": "yes"`` was taken as true (and ``"false"`` too): OpenAI's API takes a boolean only."""
    http, stub = deployment["http"], deployment["stub"]
    routed = (lambda: sum(metric(http, "fedroute_proxy_choices_total", model=m) for m in POOL))
    before = (len(stub.requests), routed(),
              metric(http, "fedroute_proxy_requests_total", route="invalid", status="400"))
    r = http.post("/v1/chat/completions",
                  json={"model": model, "messages": [{"role": "user", "content": QUERY}], "stream": stream})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "stream")  # param: as OpenAI's API says
    assert error["message"] == f"stream must be a boolean (true or false), got {type(stream).__name__} {stream!r}"
    after = (len(stub.requests), routed(),
             metric(http, "fedroute_proxy_requests_total", route="invalid", status="400"))
    assert after == (before[0], before[1], before[2] + 1)  # nothing sent, nothing routed, counted as refused


def test_upstream_failures_after_fallback_map_to_gateway_statuses(deployment):
    stub, client, router = deployment["stub"], deployment["client"], deployment["router"]
    order = expected_order(router, QUERY, 100.0)
    try:
        for mode, status in (("503", 502), ("429", 429), ("400", 400)):
            for m in order:
                stub.modes[POOL[m][0]] = mode
            with pytest.raises(openai.APIStatusError) as info:
                client.chat.completions.create(model="fedroute", messages=[{"role": "user", "content": QUERY}])
            assert info.value.status_code == status and info.value.body["type"] == "upstream_error"
    finally:
        stub.modes.clear()


def test_budget_mode_through_the_proxy(deployment):
    client, chat = deployment["client"], deployment["chat"]
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(model="fedroute:budget=0.5",
                                                                messages=[{"role": "user", "content": QUERY}])
        assert raw.headers["x-fedroute-model"] in POOL
    controller = chat.budget_controllers(hashlib.sha256(TOKEN.encode()).hexdigest())[0.5]
    assert controller.n_recorded == 3 and controller.realised_usd_per_1k > 0


def test_config_errors(tmp_path, make_bundle, signing_keys, monkeypatch):
    monkeypatch.setenv("STUB_KEY", "k")
    bundle = make_bundle(tmp_path / "bundle")
    base = "http://127.0.0.1:9/v1"
    def upstreams(**change):
        entries = json.loads(write_config(tmp_path, bundle, signing_keys[1], base).path.read_text())["upstreams"]
        return {**entries, **change}

    one_price = {"base_url": base, "input_usd_per_1m": 1.0}
    config = write_config(tmp_path, bundle, signing_keys[1], base, upstreams=upstreams(**{"gpt-4-1106-preview": one_price}))
    with pytest.raises(InvalidInputError, match="give both"):
        config.build_chat()
    no_price = {m: {"base_url": base} for m in POOL}
    with pytest.raises(PriceError):
        write_config(tmp_path, bundle, signing_keys[1], base, upstreams=no_price).build_chat()
    config = write_config(tmp_path, bundle, signing_keys[1], base, upstreams=upstreams(**{"gpt-5": {**one_price, "output_usd_per_1m": 2.0}}))
    with pytest.raises(UnknownModelError, match="gpt-5"):
        config.build_chat()
    for extra, match in (({"lamda": 3}, "unknown keys"), ({"upstreams": []}, "'upstreams'"),
                         ({"upstreams": {"claude-v1": {"url": base}}}, "base_url")):
        with pytest.raises(InvalidInputError, match=match):
            write_config(tmp_path, bundle, signing_keys[1], base, **extra)
    config = write_config(tmp_path, bundle, signing_keys[1], base, budget_usd_per_1k=0)
    with pytest.raises(InvalidInputError, match="exactly one"):
        config.build_chat()
    config = write_config(tmp_path, bundle, signing_keys[1], base, lam=None, budget_usd_per_1k=float("nan"))
    with pytest.raises(InvalidInputError, match="budget"):
        config.build_chat()
    config = write_config(tmp_path, bundle, signing_keys[1], base, explore={"policy": "frontier", "seed": 0})
    with pytest.raises(InvalidInputError, match="policy must be one of"):  # sdk.Explorer's checks (its own tests)
        config.build_chat()
    monkeypatch.delenv("STUB_KEY")
    with pytest.raises(InvalidInputError, match=r"\$STUB_KEY"):
        write_config(tmp_path, bundle, signing_keys[1], base).build_chat()
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InvalidInputError, match="JSON"):
        ProxyConfig.load(tmp_path / "bad.json")
    with pytest.raises(InvalidInputError, match="token"):
        create_app(object(), ["", "  "])



@pytest.mark.parametrize("override, field", [
    ({"bundle": 5}, "'bundle'"), ({"public_key": None}, "'public_key'"), ({"log": ["a"]}, "'log'"),
    ({"log": ""}, "'log' is an empty path"),  # it silently kept no log
    ({"public_key": " "}, "'public_key' is an empty path"),
    ({"passthrough": {"x": {"base_url": "http://127.0.0.1:9/v1", "api_key_env": 5}}},
     "passthrough['x']['api_key_env']"),
    ({"upstreams": {"m": {"base_url": "http://127.0.0.1:9/v1", "model": {"a": 1}}}}, "upstreams['m']['model']"),
    ({"max_messages": True}, "'max_messages'"), ({"max_budgets_per_caller": 0}, "'max_budgets_per_caller'"),
    ({"reload_s": -1}, "'reload_s'"), ({"budget_save_s": float("inf")}, "'budget_save_s'"),
    ({"lamb": 1}, "unknown keys ['lamb']"), ({"upstreams": None}, "'upstreams'"),
    # an empty or scheme-less base_url was accepted and failed only at the first request routed to it
    ({"upstreams": {"m": {"base_url": ""}}}, "base_url must be an http(s) URL"),
    ({"passthrough": {"x": {"base_url": "api.openai.com/v1"}}}, "base_url must be an http(s) URL"),
    ({"explore": {"policy": "thompson", "sed": 1}}, "explore['sed']"), ({"explore": {"seed": "1"}}, "explore['seed']"),
    ({"explore": "thompson"}, "'explore'"),
])
def test_config_values_of_the_wrong_json_type_are_refused_at_load(tmp_path, override, field):
    # They passed load() and raised raw TypeErrors in build_chat (Path / 5, os.environ.get(5)): a traceback at start.
    raw = {"bundle": "bundles/kmeans", "public_key": "keys/signing.pub", "log": "proxy_log.sqlite", "lam": 100,
           "upstreams": {"m": {"base_url": "http://127.0.0.1:9/v1"}}, **override}
    (tmp_path / "proxy.json").write_text(json.dumps(raw))
    with pytest.raises(InvalidInputError) as info:
        ProxyConfig.load(tmp_path / "proxy.json")
    assert field in str(info.value)


@pytest.mark.parametrize("document", ["[]", "5", '"proxy.json"', "null"])
def test_a_config_that_is_not_a_json_object_is_refused_at_load(tmp_path, document):
    # A list, a number, a string or null raised a bare ValueError (an error with an empty location) at start.
    (tmp_path / "proxy.json").write_text(document)
    with pytest.raises(InvalidInputError, match="expected a JSON object"):
        ProxyConfig.load(tmp_path / "proxy.json")


def test_the_proxy_command_is_registered():
    from typer.testing import CliRunner

    from trainer.cli import app

    result = CliRunner().invoke(app, ["proxy", "--help"])
    assert result.exit_code == 0 and "--token-file" in result.output and "--config" in result.output


def test_the_proxy_examples_run_against_the_proxy(deployment, tmp_path, capsys):
    """examples/proxy_client.py (openai client) and examples/proxy_curl.sh (curl) against the served proxy."""
    import runpy
    import subprocess

    from conftest import ROOT

    router = deployment["router"]
    order = expected_order(router, "Prove that the square root of 2 is irrational.", 100.0)
    module = runpy.run_path(str(ROOT / "examples" / "proxy_client.py"))
    assert module["main"](["--base-url", deployment["base"] + "/v1", "--token", TOKEN, "--passthrough", EXT[0],
                           "--score", "1"]) == 0
    out = capsys.readouterr().out
    assert f"routed -> {order[0]} (fallbacks 0" in out and answer_text(POOL[order[0]][0]) in out
    assert f"streamed: {answer_text(POOL[order[0]][0])}" in out and f"pass-through {EXT[0]} -> {EXT[1]}" in out
    assert "scored chatcmpl-stub-" in out and "fedroute_proxy_requests_total" in out
    result = subprocess.run(["bash", str(ROOT / "examples" / "proxy_curl.sh")], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PROXY": deployment["base"], "TOKEN": TOKEN})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"x-fedroute-model: {order[0]}".lower() in [line.strip().lower() for line in lines]
    assert answer_text(POOL[order[0]][0]) in lines
    assert "7 events" in lines  # role chunk, 4 words, finish, [DONE] (the usage chunk was not asked for)
    assert any(l.startswith('{"recorded":') for l in lines) and "400" in lines
    assert not (tmp_path / "reply.json").exists()


def test_the_proxy_client_example_says_when_no_proxy_listens(capsys):
    """Run before the proxy has loaded its bundle (the walk-through's race), the example prints one line
    naming the URL and exits 2 instead of the openai client's connection-error traceback."""
    import runpy
    import socket

    from conftest import ROOT

    with socket.socket() as s:  # a port nothing listens on: bound, never listened, closed before the call
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    module = runpy.run_path(str(ROOT / "examples" / "proxy_client.py"))
    assert module["main"](["--base-url", f"http://127.0.0.1:{port}/v1", "--token", TOKEN]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: no fedroute proxy answers at http://127.0.0.1:{port}/health (")
    assert "start `fedroute proxy` first" in captured.err and "Traceback" not in captured.err


def test_the_proxy_command_reports_a_bad_config_in_one_line(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    (tmp_path / "proxy.json").write_text(json.dumps({"bundle": "b", "public_key": "k", "upstreams": {}, "lamb": 1}))
    (tmp_path / "tokens").write_text("t\n")
    result = subprocess.run([sys.executable, "-m", "trainer.cli", "proxy", "--config", str(tmp_path / "proxy.json"),
                             "--token-file", str(tmp_path / "tokens")], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2 and result.stderr.strip().startswith("error: proxy config")
    assert "unknown keys ['lamb']" in result.stderr and "Traceback" not in result.stderr



@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe caller-token\n", "error: --token-file"),  # was a UnicodeDecodeError traceback
    (b"\n  \n", "error: the proxy needs at least one caller token"),
])
def test_the_proxy_command_reports_a_bad_token_file_in_one_line_before_loading_anything(tmp_path, content, message):
    import subprocess
    import sys

    from conftest import ROOT

    (tmp_path / "proxy.json").write_text(json.dumps({"bundle": "b", "public_key": "k", "upstreams": {}}))
    (tmp_path / "tokens").write_bytes(content)
    result = subprocess.run([sys.executable, "-m", "trainer.cli", "proxy", "--config", str(tmp_path / "proxy.json"),
                             "--token-file", str(tmp_path / "tokens")], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2 and result.stderr.strip().startswith(message), result.stderr
    assert "Traceback" not in result.stderr and "UnicodeDecodeError" not in result.stderr


def test_streaming_falls_back_before_the_first_chunk_and_a_timeout_falls_back(deployment):
    stub, client, router = deployment["stub"], deployment["client"], deployment["router"]
    order = expected_order(router, QUERY, 100.0)
    messages = [{"role": "user", "content": QUERY}]
    try:
        stub.modes[POOL[order[0]][0]] = "503"
        with client.chat.completions.with_streaming_response.create(model="fedroute", messages=messages,
                                                                   stream=True) as raw:
            assert raw.headers["x-fedroute-model"] == order[1] and raw.headers["x-fedroute-fallbacks"] == "1"
            chunks = list(raw.parse())
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer_text(POOL[order[1]][0])
        stub.modes[POOL[order[0]][0]] = "hang"  # the config's timeout_s is 1 s, the stub hangs 3 s
        raw = client.chat.completions.with_raw_response.create(model="fedroute", messages=messages)
        assert raw.headers["x-fedroute-model"] == order[1] and raw.headers["x-fedroute-fallbacks"] == "1"
    finally:
        stub.modes.clear()
    assert metric(deployment["http"], "fedroute_proxy_fallbacks_total", model=order[0], reason="timeout") == 1


def test_feedback_the_log_cannot_record_is_an_openai_style_500_and_the_answer_keeps_waiting(deployment, tmp_path):
    """A log that cannot take the row (closed here; locked, full disk, read-only alike) or a waiting answer of
    another bundle's models is the proxy's failure: 500 in the OpenAI error shape, not a bare "Internal
    Server Error" with a traceback. Bad ids and bodies name the right ``param``."""
    from sdk.pending_outcomes import PendingOutcome
    from sdk.routed_chat import RoutedChat, Upstream
    from sdk.token_prices import TokenPrice

    d = deployment
    router, stub = d["router"], d["stub"]
    log = EvalLog(tmp_path / "log.sqlite", router.model_ids)
    chat = RoutedChat(router, lam=100.0, log=log,
                      upstreams={m: Upstream(stub.base_url, api_key="k", model=name) for m, (name, _, _) in POOL.items()},
                      prices={m: TokenPrice(i, o) for m, (_, i, o) in POOL.items()})
    metrics = ProxyMetrics()
    with ServedApp(create_app(chat, [TOKEN], metrics)) as served:
        http = httpx.Client(base_url=f"http://127.0.0.1:{served.port}", headers={"Authorization": f"Bearer {TOKEN}"})
        answered = http.post("/v1/chat/completions", json={"model": "fedroute", "messages": [
            {"role": "user", "content": QUERY}]}).json()["id"]
        # an answer waiting from a bundle with another pool (e.g. before fedroute-sync installed a new one)
        stale = chat.pending.get(answered)
        chat.pending.add(PendingOutcome("chatcmpl-stale", stale.timestamp, "model-of-an-older-bundle", stale.cost_usd,
                                        stale.latency_ms, stale.embedding, stale.cell, stale.bundle_version))
        r = http.post("/v1/fedroute/feedback", json={"id": "chatcmpl-stale", "score": 1.0})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "model-of-an-older-bundle" in r.json()["error"]["message"]
        # a bad id or body is not blamed on the score
        assert http.post("/v1/fedroute/feedback", json={"score": 1.0}).json()["error"]["param"] == "id"
        r = http.post("/v1/fedroute/feedback", json={"id": "x" * 100_000, "score": 1.0})  # not echoed in full
        assert r.status_code == 404 and r.json()["error"]["param"] == "id" and len(r.content) < 1000
        r = http.post("/v1/fedroute/feedback", content=b"[1]")
        assert r.status_code == 400 and r.json()["error"]["param"] is None
        log.close()
        r = http.post("/v1/fedroute/feedback", json={"id": answered, "score": 1.0})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "is closed" in r.json()["error"]["message"]
        assert chat.pending.get(answered) is not None  # still waiting: nothing lost
        assert metric(http, "fedroute_proxy_feedback_total", result="error") == 2
    chat.close()


def test_feedback_after_the_clock_went_back_records_the_answer(deployment, tmp_path):
    """An answer stamped before the wall clock was set back by more than a day: the row takes the time of the
    feedback instead of a timestamp the log refuses as 'in the future' (it was a 400 blaming the score)."""
    import time

    from sdk.pending_outcomes import PendingOutcome
    from sdk.routed_chat import RoutedChat, Upstream
    from sdk.token_prices import TokenPrice

    router = deployment["router"]
    log = EvalLog(tmp_path / "log.sqlite", router.model_ids)
    chat = RoutedChat(router, lam=100.0, log=log, upstreams={m: Upstream("http://127.0.0.1:9/v1", api_key="k")
                                                            for m in POOL},
                      prices={m: TokenPrice(i, o) for m, (_, i, o) in POOL.items()})
    choice = router.choose(QUERY, 100.0)
    ahead = time.time() + 3 * 86_400.0  # stamped three days ahead of today's clock
    chat.pending.add(PendingOutcome("chatcmpl-1", ahead, choice.model, 0.001, 120.0, choice.embedding, choice.cell,
                                    choice.bundle_version))
    before = time.time()
    row = chat.feedback("chatcmpl-1", 0.75)
    rows = log.rows()
    assert list(rows.id) == [row] and rows.score[0] == 0.75 and rows.model == (choice.model,)
    assert before <= rows.timestamp[0] <= time.time()
    assert chat.pending.get("chatcmpl-1") is None
    chat.close()
    log.close()
