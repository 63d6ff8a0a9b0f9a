"""The HTTP floor of the sync server: a bare ASGI app served exactly as ``fedroute serve`` serves.

``python benchmarks/http_floor_app.py PORT PEM|none`` runs uvicorn on 127.0.0.1:PORT with the
server's HTTP settings (:meth:`sdk.http_limits.HttpLimits.uvicorn_options`: the same
parser and protocol class, deadlines, header cap) and TLS from ``PEM`` (key + certificate chain;
``none``: plain HTTP). Every request's body is read to its end and answered 201 with a fixed
receipt-shaped JSON (``update_id`` 1); ``GET /v1/health`` answers 200. No framework, no checks, no
store: ``benchmarks/sync_load.py`` runs the same devices against it to measure what HTTP (and TLS)
alone cost the server per request, the floor under the real upload path.
"""

from __future__ import annotations

import sys

RECEIPT = b'{"update_id":1,"client_id":"floor","round_id":1,"late":false,"counted_round":1,"log_size":1}'
_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(RECEIPT)).encode())]


async def app(scope, receive, send) -> None:
    """ASGI: read the whole body, answer 201 (200 for ``/v1/health``) with :data:`RECEIPT`."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        more = message.get("more_body", False)
    status = 200 if scope["path"] == "/v1/health" else 201
    await send({"type": "http.response.start", "status": status, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": RECEIPT})


def main(argv: list[str]) -> None:
    import uvicorn  # server extra, imported on use

    from sdk.http_limits import HttpLimits  # server extra (uvicorn), imported on use

    port, pem = int(argv[0]), argv[1]
    tls = {} if pem == "none" else {"ssl_certfile": pem, "ssl_keyfile": pem}
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", **tls, **HttpLimits().uvicorn_options())


if __name__ == "__main__":
    main(sys.argv[1:])
