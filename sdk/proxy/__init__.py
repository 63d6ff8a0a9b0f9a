"""``fedroute proxy``: an OpenAI-compatible HTTP server that routes (docs/openai_proxy.md).

- :mod:`sdk.proxy.config` — the JSON config (bundle, upstreams, prices, log) -> a :class:`sdk.routed_chat.RoutedChat`;
- :mod:`sdk.proxy.metrics` — the Prometheus counters and histograms (``prometheus-client``);
- :mod:`sdk.proxy.app` — the FastAPI application (``/v1/chat/completions``, ``/v1/models``,
  ``/v1/fedroute/feedback``, ``/metrics``, ``/health``);
- :mod:`sdk.proxy.cli` — the ``fedroute proxy`` command (uvicorn).

Needs the ``proxy`` extra (openai, fastapi, uvicorn, prometheus-client); ``import sdk`` never imports it.
"""
