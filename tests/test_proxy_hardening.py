"""The proxy and RoutedChat at their edges: unknown routes, the message cap, what has nothing to route,
budgets per caller (bounded, saved, surviving a kill), hot bundle reload with calls in flight, and the
HTTP attacks of ``benchmarks/proxy_attacks.py`` against the real ``fedroute proxy`` command.

Real bundles (signed, installed behind the exporter's symlink), real EvalLog and SQLite files, a stub
upstream and the proxy served by uvicorn on 127.0.0.1."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from openai_stub import ServedApp, StubUpstream, serve_stub
from sdk import EvalLog, Router
from sdk.caller_budgets import CallerBudgets
from sdk.budget import BudgetController
from sdk.errors import BundleError
from sdk.proxy.app import create_app
from sdk.proxy.metrics import ProxyMetrics
from test_proxy import POOL, QUERY, write_config
from test_routed_chat import make_chat

ROOT = Path(__file__).resolve().parents[1]
A, B = "caller-a", "caller-b"
USER = [{"role": "user", "content": QUERY}]


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@pytest.fixture(scope="module")
def stub():
    s = StubUpstream(hang_s=1.5)
    with serve_stub(s):
        yield s


@pytest.fixture()
def proxy(make_bundle, signing_keys, stub, tmp_path, monkeypatch):
    """``proxy(**config) -> (base URL, chat, bundle path)``: the proxy app over a fresh bundle (version 1)."""
    monkeypatch.setenv("STUB_KEY", "k")
    opened = []

    def start(**extra):
        bundle = make_bundle(tmp_path / "bundle")
        config = write_config(tmp_path, bundle, signing_keys[1], stub.base_url, **extra)
        chat = config.build_chat(observer=ProxyMetrics())
        served = ServedApp(create_app(chat, [A, B], **config.app_options())).__enter__()
        opened.append((served, chat))
        return f"http://127.0.0.1:{served.port}", chat, bundle

    yield start
    for served, chat in opened:
        served.__exit__()
        chat.close()


def post(base: str, token: str, **body) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"},
                      timeout=30)


def test_unknown_routes_and_methods_answer_openai_style_errors(proxy):
    base, _, _ = proxy()
    auth = {"Authorization": f"Bearer {A}"}
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/embeddings"), ("GET", "/nothing")):
        r = httpx.request(method, base + path, headers=auth, json={})
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
        assert path in r.json()["error"]["message"]
    r = httpx.get(base + "/v1/models/gpt-4o", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    model = "mistralai/mixtral-8x7b-chat"  # an id with a slash
    assert openai.OpenAI(base_url=base + "/v1", api_key=A).models.retrieve(model).id == model
    r = httpx.get(base + "/v1/chat/completions", headers=auth)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert httpx.post(base + "/v1/embeddings").status_code == 401  # no token: refused before the route is looked up


def test_the_message_cap_is_a_400_naming_the_option(proxy):
    base, _, _ = proxy(max_messages=3)
    r = post(base, A, model="fedroute", messages=USER * 4)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "too_many_messages" and error["param"] == "messages"
    assert "max_messages" in error["message"] and "4 messages" in error["message"]
    assert post(base, A, model="fedroute", messages=USER * 3).status_code == 200


def test_an_image_only_conversation_has_nothing_to_route_but_passes_through_by_name(proxy):
    base, _, _ = proxy()
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    r = post(base, A, model="fedroute", messages=image)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "nothing to route" in r.json()["error"]["message"]
    model = next(iter(POOL))
    assert post(base, A, model=model, messages=image).headers["x-fedroute-model"] == model


def test_one_caller_cannot_deny_budgets_to_another(proxy):
    base, chat, _ = proxy(max_budgets_per_caller=4)
    assert post(base, B, model="fedroute:budget=0.5", messages=USER).status_code == 200
    for i in range(20):  # A cycles through far more budgets than its 4 slots
        assert post(base, A, model=f"fedroute:budget={i + 1}", messages=USER).status_code == 200
    assert sorted(chat.budget_controllers(digest(A))) == [17.0, 18.0, 19.0, 20.0]
    for _ in range(2):
        assert post(base, B, model="fedroute:budget=0.5", messages=USER).status_code == 200
    mine = chat.budget_controllers(digest(B))
    assert list(mine) == [0.5] and mine[0.5].n_chosen == 3 and mine[0.5].n_recorded == 3


def test_budgets_are_bounded_overall_least_recently_used_first(router):
    budgets = CallerBudgets(lambda b: BudgetController(router, b), max_per_caller=3, max_total=4)
    for caller, budget in (("a", 1.0), ("b", 1.0), ("c", 1.0), ("a", 2.0)):
        budgets.get(caller, budget)
    budgets.get("b", 1.0)  # used again: now the most recent
    budgets.get("d", 1.0)  # over max_total: the least recently used overall, ("a", 1.0), goes
    assert list(budgets.controllers()) == [("c", 1.0), ("a", 2.0), ("b", 1.0), ("d", 1.0)]
    budgets.get("d", 2.0)  # total full: the least recently used overall, ("c", 1.0)
    budgets.get("d", 3.0)  # and ("a", 2.0)
    assert list(budgets.controllers()) == [("b", 1.0), ("d", 1.0), ("d", 2.0), ("d", 3.0)]
    budgets.get("d", 4.0)  # d at its cap of 3: its own least recently used goes, not ("b", 1.0)
    assert list(budgets.controllers()) == [("b", 1.0), ("d", 2.0), ("d", 3.0), ("d", 4.0)]


@pytest.fixture(scope="module")
def router(make_bundle, signing_keys, tmp_path_factory) -> Router:
    return Router.load(make_bundle(tmp_path_factory.mktemp("hardening") / "bundle"), signing_keys[1])


def test_budget_state_is_restored_after_a_restart(router, stub, tmp_path):
    chat = make_chat(router, stub, tmp_path, budget_state=tmp_path / "budgets.sqlite", budget_seed=0)
    for _ in range(5):
        chat.create_routed(messages=USER, model="fedroute:budget=0.5", caller="x")
    before = chat.budget_controllers("x")[0.5].state()
    chat.close()  # saves
    again = make_chat(router, stub, tmp_path, budget_state=tmp_path / "budgets.sqlite", budget_seed=0)
    assert again.budget_controllers("x") == {}  # restored on first use
    again.choose(USER, model="fedroute:budget=0.5", caller="x")
    restored = again.budget_controllers("x")[0.5]
    assert restored.n_recorded == 5 and restored.n_chosen == 6
    assert restored.realised_usd_per_1k == pytest.approx(1000 * sum(before["realised"]) / 5, rel=1e-12)
    assert again.budget_controllers("y") == {}
    again.close()


def test_the_budget_file_keeps_the_newest_max_total_rows(router, tmp_path):
    path = tmp_path / "budgets.sqlite"
    for keys in ((("a", 1.0), ("b", 1.0)), (("c", 1.0),)):  # two runs; "c" is saved last
        budgets = CallerBudgets(lambda b: BudgetController(router, b), max_total=2, path=path)
        for key in keys:
            budgets.get(*key).record(router.model_ids[0], 0.001)
        budgets.close()
        time.sleep(0.01)
    budgets = CallerBudgets(lambda b: BudgetController(router, b), max_total=2, path=path)
    import sqlite3

    with sqlite3.connect(path) as conn:
        kept = {r[0] for r in conn.execute("SELECT caller FROM budget_state")}
    assert len(kept) == 2 and "c" in kept
    assert budgets.get("c", 1.0).n_recorded == 1
    budgets.close()


KILLED = r"""
import sys
sys.path.insert(0, sys.argv[1])
from sdk import Router
from sdk.budget import BudgetController
from sdk.caller_budgets import CallerBudgets
router = Router.load(sys.argv[2], sys.argv[3])
budgets = CallerBudgets(lambda b: BudgetController(router, b, seed=0), path=sys.argv[4])
c = budgets.get("x", 0.5)
for i in range(30):
    c.choose("Sort a list in Python.")
    c.record(router.model_ids[0], 0.001)
budgets.save()
for i in range(30):  # not saved: the process dies first
    c.record(router.model_ids[0], 0.001)
print("saved", flush=True)
import time
time.sleep(60)
"""


def test_saved_budget_state_survives_a_kill(router, make_bundle, signing_keys, tmp_path):
    bundle = make_bundle(tmp_path / "bundle")
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(ROOT), str(bundle), str(signing_keys[1]),
                              str(tmp_path / "budgets.sqlite")], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "saved"
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    budgets = CallerBudgets(lambda b: BudgetController(router, b, seed=0), path=tmp_path / "budgets.sqlite")
    controller = budgets.get("x", 0.5)
    assert controller.n_recorded == 30 and controller.n_chosen == 30
    assert controller.realised_usd_per_1k == pytest.approx(1.0, rel=1e-12)  # 0.001 USD per query
    budgets.close()


def test_reload_swaps_the_bundle_and_calls_in_flight_finish_on_the_old_one(make_bundle, signing_keys, stub, tmp_path):
    bundle = make_bundle(tmp_path / "bundle")
    chat = make_chat(Router.load(bundle, signing_keys[1]), stub, tmp_path, timeout_s=10.0)
    assert chat.reload() is False  # nothing newer installed
    stub.modes.update({name: "hang" for name in ("up-gpt4", "up-gpt35", "up-mixtral")})
    try:
        results = []
        call = threading.Thread(target=lambda: results.append(chat.create_routed(messages=USER)))
        call.start()
        deadline = time.monotonic() + 10
        while not stub.requests or stub.requests[-1].get("messages") != USER:  # routed and sent: in flight
            assert time.monotonic() < deadline
            time.sleep(0.01)
        make_bundle(bundle, bundle_version=2)  # the exporter's atomic install, as the sync job's
        assert chat.reload() is True and chat.router.bundle_version == 2
        call.join(10)
    finally:
        stub.modes.clear()
    old = results[0].outcome
    assert old.route.plan.choice.bundle_version == 1
    assert chat.choose(USER).choice.bundle_version == 2
    row = chat.feedback(old.response_id, 1.0)
    log = EvalLog(tmp_path / "evals.sqlite", chat.router.model_ids)
    assert log.rows().bundle_version[-1] == 1 and row >= 1
    assert chat.reload() is False
    chat.close()


def test_reload_keeps_the_old_bundle_when_the_newer_one_does_not_load(make_bundle, signing_keys, stub, tmp_path):
    bundle = make_bundle(tmp_path / "bundle")
    router = Router.load(bundle, signing_keys[1])
    chat = make_chat(router, stub, tmp_path)
    models = router.manifest["models"]  # the last model renamed: its price table and router file disagree
    make_bundle(bundle, bundle_version=2, models=[*models[:-1], dict(models[-1], id=models[-1]["id"] + "-v2")])
    with pytest.raises(BundleError, match="disagree"):
        chat.reload()
    assert chat.router is router and chat.choose(USER).choice.bundle_version == 1
    chat.close()


def test_the_proxy_picks_up_a_newer_bundle_and_explores_with_a_new_explorer(proxy, make_bundle, tmp_path):
    base, chat, bundle = proxy(reload_s=0.1, explore={"policy": "uniform", "seed": 3})
    assert httpx.get(base + "/health").json()["bundle_version"] == 1
    first = chat.explorer
    ids = [post(base, A, model="fedroute", messages=USER).json()["id"]]
    make_bundle(bundle, bundle_version=2)
    deadline = time.monotonic() + 20
    while httpx.get(base + "/health").json()["bundle_version"] != 2:
        assert time.monotonic() < deadline, "the proxy did not reload the bundle"
        time.sleep(0.05)
    assert chat.router.bundle_version == 2 and chat.explorer is not first and chat.explorer.router is chat.router
    ids.append(post(base, A, model="fedroute", messages=USER).json()["id"])
    for i in ids:  # scored through the proxy: each row keeps the policy and the propensity (1 of the 3 upstreams)
        r = httpx.post(base + "/v1/fedroute/feedback", json={"id": i, "score": 1.0},
                       headers={"Authorization": f"Bearer {A}"})
        assert r.status_code == 200, r.text
    rows = EvalLog(tmp_path / "proxy_log.sqlite", chat.router.model_ids).rows()
    assert list(rows.bundle_version) == [1, 2] and rows.policy == ("uniform", "uniform")
    assert list(rows.propensity) == [1 / 3, 1 / 3] and set(rows.model) <= set(POOL)


def test_fedroute_proxy_under_attack_answers_others_within_a_second(make_bundle, signing_keys, tmp_path):
    """benchmarks/proxy_attacks.py against the real command, with short deadlines so that every attack
    connection is closed within the run: the victim's chat request and /health are each answered
    within 1 s throughout, and the proxy's log holds no traceback."""
    bundle = make_bundle(tmp_path / "bundle")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import proxy_attacks

    r = proxy_attacks.main(["--bundle", str(bundle), "--public-key", str(signing_keys[1]), "--out", str(tmp_path),
                            "--duration-s", "12", "--baseline-s", "3", "--proxy-option=--header-timeout-s=3",
                            "--proxy-option=--body-timeout-s=6"])
    # The target is 1 s (docs/openai_proxy.md gives the benchmark's figures); 3 s here leaves room for a
    # machine shared with other jobs (load 21 on 2 cores: chat 1.1 s at most, /health 0.5 s), where the
    # unhardened proxy stalled every caller for 17-26 s.
    assert r["health"]["max_s"] < 3.0 and r["chat"]["max_s"] < 3.0, (r["health"], r["chat"])
    assert r["health"]["statuses"] == [200] and r["chat"]["statuses"] == [200]
    assert r["tracebacks"] == 0
    for name in ("half_open", "idle", "slow_bodies"):
        assert r["attacks"][name]["closed_by_proxy"] == r["attacks"][name]["n"], name
    assert {f["answer"] for f in r["attacks"]["flood"]} <= {"HTTP/1.1 431 Request Header Fields Too Large", ""}
    assert max(f["sent_bytes"] for f in r["attacks"]["flood"]) < 8 << 20
    assert {m["status"] for m in r["attacks"]["many_messages"]} == {200}


@pytest.mark.parametrize("key, value", [("max_messages", 0), ("max_messages", "9"), ("max_budgets_per_caller", True),
                                        ("reload_s", -1), ("budget_save_s", float("inf")), ("budget_state", ""),
                                        ("budget_state", 3)])
def test_bad_limit_and_upkeep_keys_are_refused_naming_the_key(make_bundle, signing_keys, tmp_path, monkeypatch,
                                                              key, value):
    from sdk.errors import InvalidInputError

    monkeypatch.setenv("STUB_KEY", "k")
    bundle = make_bundle(tmp_path / "bundle")
    with pytest.raises(InvalidInputError, match=repr(key)):
        write_config(tmp_path, bundle, signing_keys[1], "http://127.0.0.1:9/v1", **{key: value})


def test_the_budget_state_file_is_owner_only(tmp_path):
    """It holds the callers' token hashes and spend: created 0600 as the EvalLog and the pending store (was 0644)."""
    path = tmp_path / "log.budgets.sqlite"
    CallerBudgets(lambda b: None, path=path).close()
    assert path.stat().st_mode & 0o777 == 0o600
