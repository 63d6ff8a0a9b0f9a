"""``fedroute proxy``: serve the OpenAI-compatible routing proxy (registered by ``trainer/cli.py``).

Imports only typer here: fastapi, uvicorn, openai and prometheus-client (the ``proxy`` extra) are
imported when the command runs, so ``fedroute --help`` works without them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from sdk.errors import InvalidInputError
from sdk.http_options import (BodyTimeoutOpt, HeaderTimeoutOpt, HttpParserOpt, KeepAliveOpt, MaxConnectionsOpt,
                              MaxHeaderBytesOpt, http_limits)


def proxy(
    config: Annotated[Path, typer.Option(help="proxy config JSON (bundle, upstreams, prices, log): docs/openai_proxy.md",
                                         exists=True, dir_okay=False)],
    token_file: Annotated[Path, typer.Option(help="callers' bearer tokens, one per line", exists=True, dir_okay=False)],
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port")] = 8080,
    tls_cert: Annotated[Optional[Path], typer.Option(help="PEM certificate chain (HTTPS); with --tls-key")] = None,
    tls_key: Annotated[Optional[Path], typer.Option(help="PEM private key of --tls-cert")] = None,
    header_timeout_s: HeaderTimeoutOpt = 10.0,
    body_timeout_s: BodyTimeoutOpt = 30.0,
    max_header_bytes: MaxHeaderBytesOpt = 16384,
    keep_alive_s: KeepAliveOpt = 5.0,
    max_connections: MaxConnectionsOpt = 1000,
    http_parser: HttpParserOpt = None,
) -> None:
    """Serve an OpenAI-compatible API that routes model="fedroute" (or "fedroute:lam=X", "fedroute:budget=Y").

    HTTP limits (the options from --header-timeout-s on, as fedroute serve's): docs/openai_proxy.md."""
    try:
        import uvicorn  # proxy extra, imported on use

        from sdk.proxy.app import create_app, token_digests  # proxy extra (fastapi, openai, prometheus-client)
        from sdk.proxy.config import ProxyConfig  # proxy extra (openai)
        from sdk.proxy.metrics import ProxyMetrics  # proxy extra (prometheus-client)
    except ModuleNotFoundError as exc:  # the base install: name the extra (fastapi and uvicorn are the server's too)
        raise InvalidInputError(f"fedroute proxy needs the proxy extra ({exc.name} is missing): "
                                f"pip install 'fedroute[proxy]'") from exc

    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter("--tls-cert and --tls-key go together")
    try:  # read first: a bad token file is refused before the bundle loads
        tokens = token_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"--token-file {token_file}: cannot read it as UTF-8 text, one token per line "
                                f"({exc})") from exc
    token_digests(tokens)  # no token at all: refused now too
    limits = http_limits(max_header_bytes=max_header_bytes, header_timeout_s=header_timeout_s,
                         body_timeout_s=body_timeout_s, keep_alive_s=keep_alive_s, max_connections=max_connections,
                         http_parser=http_parser)
    metrics = ProxyMetrics()
    settings = ProxyConfig.load(config)
    chat = settings.build_chat(observer=metrics)
    app = create_app(chat, tokens, metrics, max_headers=limits.max_headers, **settings.app_options())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    typer.echo(f"routing over {list(chat.pool)} (pass-through: {[m for m in chat.models if m not in chat.pool]})"
               + ("" if chat.explorer is None else f", exploring: {chat.explorer.policy}"), err=True)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5,
                ssl_certfile=None if tls_cert is None else str(tls_cert),
                ssl_keyfile=None if tls_key is None else str(tls_key), **limits.uvicorn_options())
