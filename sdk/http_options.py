"""The HTTP-limit options of ``fedroute serve`` and ``fedroute proxy`` (typer), one declaration for both.

Imports only typer: :func:`http_limits` imports uvicorn (:mod:`sdk.http_limits`) when a command runs.
Defaults and what each limit does: :mod:`sdk.http_limits`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from sdk.finite_option import COUNT_MAX, finite_option

if TYPE_CHECKING:
    from sdk.http_limits import HttpLimits

HeaderTimeoutOpt = Annotated[float, typer.Option(callback=finite_option, min=0.01,
                                                 help="seconds to send a request's headers (408)")]
BodyTimeoutOpt = Annotated[float, typer.Option(callback=finite_option, min=0.01,
                                               help="seconds to send a request's body after its headers (408)")]
MaxHeaderBytesOpt = Annotated[int, typer.Option(min=1024, max=COUNT_MAX,
                                                help="largest request line + headers (bytes; 431 above)")]
KeepAliveOpt = Annotated[float, typer.Option(callback=finite_option, min=0.01,
                                             help="seconds an idle keep-alive connection stays open")]
MaxConnectionsOpt = Annotated[int, typer.Option(min=1, max=COUNT_MAX,
                                                help="concurrent connections and requests (503 above)")]
HttpParserOpt = Annotated[str | None, typer.Option(help="httptools (default when installed) or h11 (uvicorn's "
                                                        "HTTP parsers; both with the header cap and deadlines)")]


def http_limits(*, max_header_bytes: int, header_timeout_s: float, body_timeout_s: float, keep_alive_s: float,
                max_connections: int, http_parser: str | None) -> HttpLimits:
    """The :class:`sdk.http_limits.HttpLimits` of these options.

    Raises
    ------
    typer.BadParameter
        ``http_parser`` is not None, ``"h11"`` or ``"httptools"``.
    """
    from sdk.http_limits import HttpLimits  # uvicorn: server or proxy extra

    if http_parser not in (None, "h11", "httptools"):
        raise typer.BadParameter(f"--http-parser must be h11 or httptools, got {http_parser!r}")
    return HttpLimits(max_header_bytes=max_header_bytes, header_timeout_s=header_timeout_s,
                      body_timeout_s=body_timeout_s, keep_alive_s=keep_alive_s, limit_concurrency=max_connections,
                      parser=http_parser or HttpLimits.parser)
