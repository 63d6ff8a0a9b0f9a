"""`fedroute proxy` as the proxy-only install runs it (``pip install -e ".[proxy]"``: no torch, no
scikit-learn): the console script serves the tiny static-embedder K-means bundle of ``tiny_kmeans.py``
in front of a stub OpenAI-compatible upstream (``openai_stub.py``), and the official ``openai`` client
gets a routed answer, a streamed one and a fallback, and records feedback in the EvalLog.

``.ci/run`` runs the ``proxy``-marked files in a fresh venv with only the ``[proxy]`` extra (and the test
runner), besides the full run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from openai_stub import StubUpstream, answer_text, serve_stub
from sdk import EvalLog, Router
from tiny_kmeans import MODELS, write_tiny_kmeans

pytestmark = pytest.mark.proxy

TOKEN = "caller-token"
#: Upstream model name and (input, output) USD per 1M tokens of each routed model.
UPSTREAMS = {"model-x": ("up-x", 1.0, 2.0), "model-y": ("up-y", 1.0, 2.0)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fedroute_command() -> list[str]:
    """The ``fedroute`` console script of this interpreter's venv (what the install put there)."""
    script = Path(sys.executable).with_name("fedroute")
    if not script.exists():
        pytest.fail(f"no fedroute console script beside {sys.executable}: pip install -e '.[proxy]' first")
    return [str(script)]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    """The stub upstream (in this process) and ``fedroute proxy`` (a subprocess) in front of it."""
    from export.signing import generate_keypair

    tmp = tmp_path_factory.mktemp("proxy-install")
    key, public_key = generate_keypair(tmp / "keys")
    bundle, _ = write_tiny_kmeans(tmp, key)
    stub = StubUpstream(hang_s=3.0)
    with serve_stub(stub):
        upstreams = {m: {"base_url": stub.base_url, "api_key_env": "STUB_KEY", "model": name, "timeout_s": 2.0,
                         "input_usd_per_1m": i, "output_usd_per_1m": o} for m, (name, i, o) in UPSTREAMS.items()}
        (tmp / "proxy.json").write_text(json.dumps(
            {"bundle": str(bundle), "public_key": str(public_key), "log": str(tmp / "proxy_log.sqlite"), "lam": 1.0,
             "upstreams": upstreams}))
        (tmp / "tokens").write_text(TOKEN + "\n")
        port = free_port()
        log = open(tmp / "proxy.log", "w+")
        process = subprocess.Popen([*fedroute_command(), "proxy", "--config", str(tmp / "proxy.json"),
                                    "--token-file", str(tmp / "tokens"), "--port", str(port)],
                                   stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
                                   env={**os.environ, "STUB_KEY": "upstream-key"})
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if process.poll() is not None:
                    log.seek(0)
                    pytest.fail(f"fedroute proxy exited with {process.returncode}:\n{log.read()[-4000:]}")
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail("fedroute proxy did not answer /health within 120 s")
                time.sleep(0.2)
            yield {"stub": stub, "base": base, "tmp": tmp, "public_key": public_key, "bundle": bundle, "log": log,
                   "client": openai.OpenAI(base_url=base + "/v1", api_key=TOKEN, max_retries=0)}
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()


def test_the_proxy_install_routes_streams_falls_back_and_records_feedback(proxy):
    stub, client = proxy["stub"], proxy["client"]
    router = Router.load(proxy["bundle"], public_key=proxy["public_key"])
    # tiny_kmeans: queries near "a" were answered right only by model-x, near "b" only by model-y, same cost.
    assert router.choose("a a", 1.0).model == "model-x" and router.choose("b b", 1.0).model == "model-y"

    # 1. routed: model="fedroute" answers from the model of highest utility.
    for query, model in (("a a", "model-x"), ("b b", "model-y")):
        raw = client.chat.completions.with_raw_response.create(model="fedroute",
                                                                messages=[{"role": "user", "content": query}])
        assert raw.headers["x-fedroute-model"] == model and raw.headers["x-fedroute-fallbacks"] == "0"
        assert raw.parse().choices[0].message.content == answer_text(UPSTREAMS[model][0])
        assert stub.requests[-1]["model"] == UPSTREAMS[model][0]

    # 2. streamed (server-sent events through the proxy).
    chunks = list(client.chat.completions.create(model="fedroute", messages=[{"role": "user", "content": "a a"}],
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer_text("up-x")
    assert stub.requests[-1]["stream"] is True

    # 3. fallback: model-x's upstream answers 503, the proxy answers from model-y.
    stub.modes["up-x"] = "503"
    raw = client.chat.completions.with_raw_response.create(model="fedroute",
                                                            messages=[{"role": "user", "content": "a a"}])
    stub.modes.clear()
    assert raw.headers["x-fedroute-model"] == "model-y" and raw.headers["x-fedroute-fallbacks"] == "1"
    reply = raw.parse()
    assert reply.choices[0].message.content == answer_text("up-y")

    # 4. feedback: the outcome of the answer lands in the device's EvalLog (the file fedroute-sync reads).
    http = httpx.Client(base_url=proxy["base"], headers={"Authorization": f"Bearer {TOKEN}"})
    r = http.post("/v1/fedroute/feedback", json={"id": reply.id, "score": 0.5})
    assert r.status_code == 200, r.text
    with EvalLog(proxy["tmp"] / "proxy_log.sqlite", list(MODELS)) as log:
        rows = log.rows()
    assert rows.model == ("model-y",) and rows.score[0] == 0.5

    # 5. a wrong token is OpenAI's 401, and the proxy logged no traceback.
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=proxy["base"] + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="fedroute", messages=[{"role": "user", "content": "a"}])
    proxy["log"].seek(0)
    assert "Traceback" not in proxy["log"].read()
