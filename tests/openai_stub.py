"""A stub of a third-party OpenAI-compatible endpoint (FastAPI served by uvicorn on 127.0.0.1), for tests,
``benchmarks/proxy_latency.py`` and the examples' self-test.

``POST /v1/chat/completions`` answers like OpenAI: a ``chat.completion`` with ``usage`` (``prompt_tokens``
= :data:`PROMPT_TOKENS`, ``completion_tokens`` = :data:`COMPLETION_TOKENS`), or with ``"stream": true``
server-sent events: a role chunk, the words of :func:`answer_text` one chunk each, a ``finish_reason``
chunk, a usage-only chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]``.
``modes[model]`` switches one model's behaviour: ``"ok"`` (default), ``"503"``, ``"429"``, ``"400"``
(OpenAI-style error JSON) or ``"hang"`` (sleeps ``hang_s`` before answering, for client timeouts).
Every request body is appended to ``requests``. Response ids are ``chatcmpl-stub-<n>``, unique, or
``repeat_id`` on every answer when it is set (an upstream that repeats ids).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

PROMPT_TOKENS = 12
COMPLETION_TOKENS = 30


def answer_text(model: str) -> str:
    return f"stub answer from {model}"


@dataclass
class StubUpstream:
    modes: dict[str, str] = field(default_factory=dict)
    requests: list[dict] = field(default_factory=list)
    hang_s: float = 5.0
    repeat_id: str | None = None
    port: int = 0
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def completions(request: Request):
            body = await request.json()
            self.requests.append(body)
            model = body["model"]
            mode = self.modes.get(model, "ok")
            if mode == "hang":
                await asyncio.sleep(self.hang_s)
            elif mode in ("503", "429", "400"):
                return JSONResponse({"error": {"message": f"stub {mode} for {model}", "type": "stub", "code": mode}},
                                    status_code=int(mode))
            rid = self.repeat_id or f"chatcmpl-stub-{next(self._ids)}"
            usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS,
                     "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS}
            text = answer_text(model)
            if not body.get("stream"):
                return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": text}}], "usage": usage}
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            def chunk(delta: dict, finish: str | None = None, choices: bool = True, with_usage: bool = False) -> str:
                data = {"id": rid, "object": "chat.completion.chunk", "created": 0, "model": model,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else []}
                if with_usage:
                    data["usage"] = usage
                return f"data: {json.dumps(data)}\n\n"

            async def events():
                yield chunk({"role": "assistant", "content": ""})
                for i, word in enumerate(text.split(" ")):
                    yield chunk({"content": word if i == 0 else " " + word})
                yield chunk({}, finish="stop")
                if include_usage:
                    yield chunk({}, choices=False, with_usage=True)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return app


class ServedApp:
    """Serve an ASGI ``app`` with uvicorn on 127.0.0.1 (a free port) in a daemon thread."""

    def __init__(self, app) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServedApp:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve_stub(stub: StubUpstream) -> ServedApp:
    """``with serve_stub(stub) as served:`` runs the stub; ``stub.port`` is set on entry."""
    served = ServedApp(stub.app())

    class _Ctx:
        def __enter__(self_inner):
            served.__enter__()
            stub.port = served.port
            return served

        def __exit__(self_inner, *exc):
            served.__exit__(*exc)

    return _Ctx()


if __name__ == "__main__":  # python tests/openai_stub.py [port]: the stub alone, for docs/openai_proxy.md's walk-through
    import sys

    uvicorn.run(StubUpstream().app(), host="127.0.0.1", port=int(sys.argv[1]) if len(sys.argv) > 1 else 8000,
                log_level="warning")
