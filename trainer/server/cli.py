"""Server and operator commands: ``fedroute serve``, ``fedroute clients ...``, ``fedroute rounds ...``,
``fedroute publish``. All take ``--db``, a SQLAlchemy URL (``sqlite:///fed.db`` by default, or
``postgresql+psycopg://user@host/db``); operator commands work while the server runs.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import ssl
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from sdk import bundle_manifest
from sdk.cli_paths import PathCheckedGroup
from sdk.errors import BundleError
from sdk.finite_option import COUNT_MAX, SEED_MAX, finite_option
from sdk.http_options import (BodyTimeoutOpt, HeaderTimeoutOpt, HttpParserOpt, KeepAliveOpt, MaxConnectionsOpt,
                              MaxHeaderBytesOpt, http_limits)
from sdk.kind_registry import UnknownKindError
from trainer.federated.gaussian_privacy import gaussian_epsilon
from trainer.federated.update_checks import DEFAULT_MIN_COUNT
from trainer.server.errors import PublishRefused
from trainer.server.round_kind import OpenRequest, Publisher

DbOpt = Annotated[str, typer.Option("--db", help="SQLAlchemy database URL, e.g. sqlite:///fed.db")]

clients_app = typer.Typer(cls=PathCheckedGroup, no_args_is_help=True, help="create, list and revoke device clients")
rounds_app = typer.Typer(cls=PathCheckedGroup, no_args_is_help=True, help="open, close and inspect federated rounds")


def _sqlite_file(db: str) -> Path | None:
    """The file of the SQLite URL ``db``; None for another backend, an in-memory database or an unparsable URL."""
    from sqlalchemy.engine import make_url  # server extra (sqlalchemy): `fedroute --help` works without it

    try:
        url = make_url(db)
    except Exception:  # noqa: BLE001 - Store(db) names the bad URL
        return None
    sqlite = url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:")
    return Path(url.database) if sqlite else None


def _store(db: str, *, existing: bool = False):
    """The :class:`~trainer.server.store.Store` at ``db``. ``existing`` (commands that read or change what is
    there) refuses, without writing to it, a database that is not the server's (e.g. a SQLite file missing, empty
    or another program's)."""
    from trainer.server.store import Store  # server extra (sqlalchemy): `fedroute --help` works without it

    path = _sqlite_file(db) if existing else None
    if path is not None and not path.exists():
        raise typer.BadParameter(f"--db {db}: no database at {path}; `fedroute clients add` or "
                                 "`fedroute rounds open` creates one")
    try:
        return Store(db, create=not existing)
    except Exception as exc:
        # A plain file name (`--db fed.db`) was "Could not parse SQLAlchemy URL from given URL string".
        hint = f"; a SQLite file is given as a URL: --db sqlite:///{db}" if "://" not in db else ""
        raise typer.BadParameter(f"cannot open database {db!r}: {exc}{hint}") from exc


def serve(
    db: DbOpt = "sqlite:///fed.db",
    tls_cert: Annotated[Path, typer.Option(help="PEM certificate chain of the server", exists=True, dir_okay=False)] = ...,
    tls_key: Annotated[Path, typer.Option(help="PEM private key of the certificate (if encrypted, its passphrase is "
                                                "asked once, or read from --tls-key-password-file)", exists=True,
                                           dir_okay=False)] = ...,
    tls_key_password_file: Annotated[Path | None, typer.Option(help="file whose first line is the passphrase of an "
                                                                    "encrypted --tls-key (no prompt)", exists=True,
                                                               dir_okay=False)] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port")] = 8443,
    bundle_dir: Annotated[Path | None, typer.Option(help="published bundle served at /v1/bundles")] = None,
    max_body_bytes: Annotated[int, typer.Option(min=1024, max=COUNT_MAX, help="largest accepted upload (bytes)")] = 4 << 20,
    tick_s: Annotated[float, typer.Option(callback=finite_option, min=0.05, help="seconds between checks for rounds to close")] = 1.0,
    upload_quota: Annotated[int, typer.Option(min=0, max=COUNT_MAX, help="uploads per client per --quota-window-s (429 with "
                                                         "Retry-After above it; 0: no quota)")] = 30,
    quota_window_s: Annotated[float, typer.Option(callback=finite_option, min=0.001, help="window of the upload quota (seconds)")] = 60.0,
    header_timeout_s: HeaderTimeoutOpt = 10.0,
    body_timeout_s: BodyTimeoutOpt = 30.0,
    max_header_bytes: MaxHeaderBytesOpt = 16384,
    keep_alive_s: KeepAliveOpt = 5.0,
    max_connections: MaxConnectionsOpt = 1000,
    access_log: Annotated[bool, typer.Option(help="log one line per request (costs CPU per upload)")] = False,
    http_parser: HttpParserOpt = None,
    commit_delay_ms: Annotated[float, typer.Option(callback=finite_option, min=0.0, max=1000.0, help="longest wait of a group commit for "
                                                   "uploads already on their way (ms; 0: commit at once)")] = 5.0,
    *,
    publisher: Publisher | None = None,
) -> None:
    """Run the aggregation server over HTTPS (uvicorn with httptools, one process: SQLite has one writer).

    HTTP limits (the options below): docs/sync-protocol-and-operations.md, sdk/http_limits.py."""
    import uvicorn  # server extra, imported on use

    from trainer.server.app import create_app  # server extra (fastapi)
    from trainer.server.upload_state import UploadQuota  # server extra

    if bundle_dir is not None and bundle_dir.exists() and not bundle_dir.is_dir():
        raise typer.BadParameter(f"--bundle-dir {bundle_dir} is a file, not a bundle folder")
    if bundle_dir is not None and bundle_dir.is_dir() and not (bundle_dir / "manifest.json").exists():
        # e.g. `--bundle-dir bundles` for bundles/kmeans: it served 404 and devices never got a new bundle
        inside = sorted(str(m.parent) for m in bundle_dir.glob("*/manifest.json") if not m.parent.name.startswith("."))
        raise typer.BadParameter(f"--bundle-dir {bundle_dir} holds no manifest.json, so no bundle to serve"
                                 + (f"; the bundles in it: {', '.join(inside)}" if inside else ""))
    passphrase: list[str] = []  # an encrypted key's, asked once: OpenSSL's own prompt asked here and again in uvicorn

    def key_passphrase() -> str:  # called by OpenSSL only for an encrypted key
        if not passphrase:
            passphrase.append(_read_passphrase(tls_key_password_file) if tls_key_password_file is not None else
                              typer.prompt(f"passphrase of --tls-key {tls_key}", hide_input=True, err=True))
        return passphrase[0]

    try:  # a clear error now rather than a traceback from inside uvicorn
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(str(tls_cert), str(tls_key),
                                                                            password=key_passphrase)
    except (ssl.SSLError, OSError) as exc:
        wrong = " (a wrong passphrase?)" if passphrase else ""
        raise typer.BadParameter(f"--tls-cert {tls_cert} / --tls-key {tls_key}: {exc}{wrong}") from exc
    if bundle_dir is not None and not bundle_dir.exists():
        typer.echo(f"warning: --bundle-dir {bundle_dir} does not exist yet; /v1/bundles answers 404 until a round "
                   "publishes there", err=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    limits = http_limits(max_header_bytes=max_header_bytes, header_timeout_s=header_timeout_s,
                         body_timeout_s=body_timeout_s, keep_alive_s=keep_alive_s, max_connections=max_connections,
                         http_parser=http_parser)
    store = _store(db, existing=True)
    _warn_if_the_round_publishes_elsewhere(store, bundle_dir)
    app = create_app(store, bundle_dir, max_body_bytes=max_body_bytes, tick_s=tick_s,
                     publisher=publisher, quota=UploadQuota(upload_quota, quota_window_s), limits=limits,
                     commit_delay_s=commit_delay_ms / 1e3, freeze_gc=True)
    uvicorn.run(app, host=host, port=port, ssl_certfile=str(tls_cert), ssl_keyfile=str(tls_key),
                ssl_keyfile_password=passphrase[0] if passphrase else None,
                log_level="info", timeout_graceful_shutdown=5, access_log=access_log, **limits.uvicorn_options())


def _warn_if_the_round_publishes_elsewhere(store, bundle_dir: Path | None) -> None:
    """A warning on stderr when the latest round publishes its bundle to another folder than the one
    served (--bundle-dir): the devices would never get what it publishes."""
    r = store.latest_round()
    target = None if r is None or r.settings is None or r.settings.publish is None else Path(r.settings.publish.bundle_dir)
    if target is None or (bundle_dir is not None and target.absolute() == bundle_dir.absolute()):
        return
    served = "no bundle (no --bundle-dir)" if bundle_dir is None else f"--bundle-dir {bundle_dir.absolute()}"
    typer.echo(f"warning: round {r.id} publishes its bundle to {target}, but this server serves {served}: the "
               f"devices will not get it; serve --bundle-dir {target}", err=True)


def _read_passphrase(path: Path) -> str:
    """The first line of ``path`` (its line end dropped). Raises typer.BadParameter: unreadable or empty."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"--tls-key-password-file {path}: {exc}") from exc
    if not lines or not lines[0]:
        raise typer.BadParameter(f"--tls-key-password-file {path}: its first line is empty; write the passphrase there")
    return lines[0]


@clients_app.command("add")
def clients_add(client_id: Annotated[str, typer.Argument(help="client id, 1-64 of [A-Za-z0-9_.-]")],
                db: DbOpt = "sqlite:///fed.db") -> None:
    """Create a client; prints its bearer token once on stdout (only a hash is stored)."""
    try:
        token = _store(db).add_client(client_id)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"client {client_id} created; its token (shown once):", err=True)
    typer.echo(token)


@clients_app.command("list")
def clients_list(db: DbOpt = "sqlite:///fed.db") -> None:
    """List clients as JSON lines (id, created time, revoked)."""
    for c in _store(db, existing=True).list_clients():
        typer.echo(json.dumps(c))


@clients_app.command("rotate")
def clients_rotate(client_id: str, db: DbOpt = "sqlite:///fed.db") -> None:
    """Give a client a new token (printed once on stdout); the old one stops working, and a revoked
    client becomes active again with the new one."""
    token = _store(db, existing=True).rotate_token(client_id)
    if token is None:
        raise typer.BadParameter(f"no client {client_id!r}")
    typer.echo(f"client {client_id}: new token (shown once):", err=True)
    typer.echo(token)


@clients_app.command("revoke")
def clients_revoke(client_id: str, db: DbOpt = "sqlite:///fed.db") -> None:
    """Revoke a client's token (its accepted updates stay)."""
    if not _store(db, existing=True).revoke_client(client_id):
        raise typer.BadParameter(f"no client {client_id!r}")
    typer.echo(f"client {client_id} revoked")


def rounds_open(
    bundle_dir: Annotated[Path, typer.Option(help="published bundle the round starts from (K-means or MLP)")],
    db: DbOpt = "sqlite:///fed.db",
    kind: Annotated[str, typer.Option(help="a registered round kind: kmeans (statistics, any device) or mlp "
                                           "(FedAvg, clients with torch)")] = "kmeans",
    signing_key: Annotated[Path | None, typer.Option(help="signing.key: publish a new bundle at close")] = None,
    public_key: Annotated[Path | None, typer.Option(help="signing.pub, when the round does not publish")] = None,
    deadline_s: Annotated[float, typer.Option(callback=finite_option, min=0.001, help="seconds until the round closes")] = 3600.0,
    quorum: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="the round closes early once this many clients uploaded")] = 1,
    min_count: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="privacy threshold: smallest reported (cell, model) count, "
                                                      "or smallest MLP training set")] = DEFAULT_MIN_COUNT,
    recluster: Annotated[bool, typer.Option(help="kmeans: use the Lloyd step of the last aggregated round")] = False,
    router: Annotated[Path | None, typer.Option(help="mlp: trained router folder with the starting parameters")] = None,
    resume: Annotated[bool, typer.Option("--continue", help="mlp: start from the last aggregated MLP round")] = False,
    clip_count: Annotated[float | None, typer.Option(callback=finite_option, help="most queries (or samples) one client may weigh "
                                                        "(default: 20,000, an EvalLog's default retention)")] = 20000.0,
    max_cost_usd: Annotated[float | None, typer.Option(callback=finite_option, help="kmeans: bound on one query's cost (USD), for clipping/DP")] = None,
    clip_norm: Annotated[float | None, typer.Option(callback=finite_option, help="mlp: L2 bound of each client's delta (DP-FedAvg)")] = None,
    trim_fraction: Annotated[float, typer.Option(callback=finite_option, min=0.0, max=0.49, help="share of clients trimmed at each end")] = 0.0,
    noise_multiplier: Annotated[float, typer.Option(callback=finite_option, min=0.0, help="Gaussian DP noise, std / sensitivity")] = 0.0,
    delta: Annotated[float, typer.Option(callback=finite_option, help="delta of the (epsilon, delta) guarantee")] = 1e-5,
    seed: Annotated[int | None, typer.Option(min=0, max=SEED_MAX, help="seed of the DP noise (tests only: whoever knows it can "
                                                        "remove the noise; default: secret, random)")] = None,
    prior_router: Annotated[Path | None, typer.Option(help="kmeans: trained router whose statistics (same "
                                                           "centroids) are merged into every aggregate")] = None,
    min_total_count: Annotated[int | None, typer.Option(min=1, max=COUNT_MAX, help="kmeans: publish only aggregates of at least this many "
                                                                   "evaluations (default 100)")] = None,
    *,
    publisher: Publisher | None = None,
) -> None:
    """Open a round of a registered kind: K-means over the bundle's centroids (or the last Lloyd step
    with --recluster), or MLP from a trained router (--router) or the last MLP aggregate (--continue)."""
    from trainer.server import round_kinds  # server extra (sqlalchemy, pydantic): imported on use

    try:
        round_kind = round_kinds.get(kind)
    except UnknownKindError as exc:
        raise typer.BadParameter(f"--kind: {exc}") from exc
    if (signing_key is None) == (public_key is None):
        raise typer.BadParameter("give exactly one of --signing-key (publish at close) or --public-key (no publishing)")
    if signing_key is not None and publisher is None:
        raise typer.BadParameter("--signing-key: this command was started without a publisher (use `fedroute`)")
    # Checked first so that the error names the option (the round kind reads them again).
    if not bundle_dir.is_dir():
        raise typer.BadParameter(f"--bundle-dir {bundle_dir}: no bundle folder there")
    for option, path in (("--signing-key", signing_key), ("--public-key", public_key)):
        if path is not None and not path.is_file():
            raise typer.BadParameter(f"{option} {path}: no key file there")
    key = publisher.public_key(signing_key) if signing_key is not None else public_key
    try:  # signature and schema only (the files are hashed by the round kind)
        bundle_manifest.read_verified(bundle_dir, key, wanted=(), verify_unused=False)
    except BundleError as exc:
        which = f"--signing-key {signing_key}" if signing_key is not None else f"--public-key {public_key}"
        raise typer.BadParameter(f"--bundle-dir {bundle_dir} (checked with {which}): {exc}") from exc
    request = OpenRequest(
        bundle_dir=bundle_dir, public_key=key, deadline_s=deadline_s, quorum=quorum, min_count=min_count,
        signing_key=signing_key, seed=seed, clip_count=clip_count, trim_fraction=trim_fraction,
        noise_multiplier=noise_multiplier, delta=delta,
        options={"recluster": recluster, "router": router, "resume": resume, "max_cost_usd": max_cost_usd,
                 "clip_norm": clip_norm, "prior_router": prior_router, "min_total_count": min_total_count})
    try:
        if (path := _sqlite_file(db)) is not None and (not path.exists() or path.stat().st_size == 0):
            # On a scratch database first: a refused first `rounds open` leaves --db as it was (absent or empty).
            with tempfile.TemporaryDirectory() as scratch:
                store = _store(f"sqlite:///{scratch}/fed.db")
                try:
                    round_kind.open(store, request)
                finally:
                    store.close()
        r = round_kind.open(_store(db), request)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    eps = gaussian_epsilon(noise_multiplier, delta) if noise_multiplier > 0 else None
    typer.echo(json.dumps({"round_id": r.id, "kind": r.kind, **round_kind.summary(r), "models": len(r.models),
                           "deadline_unix": r.deadline_unix, "quorum": quorum, "min_count": min_count,
                           "epsilon_per_release": eps}))


def rounds_close(db: DbOpt = "sqlite:///fed.db",
                 round_id: Annotated[int | None, typer.Option("--round", min=1, max=COUNT_MAX, help="default: the open round")] = None,
                 *, publisher: Publisher | None = None) -> None:
    """Close a round now: aggregate and publish (as at its deadline)."""
    from trainer.server.rounds import close_round  # server extra (sqlalchemy)

    store = _store(db, existing=True)
    if round_id is None:
        current = store.current_round() or store.latest_round()
        if current is None or current.status == "closed":
            raise typer.BadParameter("no round is open")
        round_id = current.id
    outcome = close_round(store, round_id, progress=lambda m: typer.echo(m, err=True), publisher=publisher)
    if outcome is None:
        raise typer.BadParameter(_why_not_closed(store, round_id))
    typer.echo(json.dumps({"round_id": round_id, **outcome.to_json()}))


def _why_not_closed(store, round_id: int) -> str:
    """Why ``close_round`` closed nothing: no such round, closed already, or another closer holds it."""
    holder = store.close_holder(round_id)
    if holder is None:
        return f"round {round_id} does not exist"
    status, owner, lease_unix = holder
    if status == "closing":
        left = max(0, math.ceil(lease_unix - time.time()))
        return (f"round {round_id} is being closed by {owner}; if that process died, its claim runs out in {left} s "
                "(then rerun this)")
    return f"round {round_id} is already closed"


@rounds_app.command("status")
def rounds_status(db: DbOpt = "sqlite:///fed.db") -> None:
    """The latest round as JSON: id, status, deadline, quorum, min_count, kind, the updates counted in it
    (updates_counted: stored uploads, a client's replaced ones included), the clients its quorum
    counts (clients_counted: active clients with an upload in it, also under DP noise) and the outcome."""
    store = _store(db, existing=True)
    r = store.latest_round()
    if r is None:
        typer.echo(json.dumps({"round_id": None}))
        return
    typer.echo(json.dumps({"round_id": r.id, "status": r.status, "deadline_unix": r.deadline_unix,
                           "quorum": r.quorum, "min_count": r.min_count, "kind": r.kind,
                           "updates_counted": len(store.round_updates(r.id)),
                           "clients_counted": store.clients_counted(r.id),
                           "outcome": None if r.outcome is None else r.outcome.to_json()}))


def publish(
    round_id: Annotated[int, typer.Option("--round", min=1, max=COUNT_MAX, help="an aggregated round")],
    bundle_dir: Annotated[Path, typer.Option(help="bundle to publish a new version of")],
    signing_key: Annotated[Path, typer.Option(help="signing.key")],
    db: DbOpt = "sqlite:///fed.db",
    *,
    publisher: Publisher | None = None,
) -> None:
    """Publish a closed round's aggregate as a new signed bundle (for rounds opened without --signing-key),
    under the rules of a round that publishes at close (enough evaluations, at least 2 clients without
    DP noise, the bundle's embedder still the round's); a rerun for the same round publishes nothing new."""
    from trainer.server import round_kinds  # server extra (sqlalchemy, pydantic)

    if publisher is None:
        raise typer.BadParameter("this command was started without a publisher (use `fedroute`)")
    store = _store(db, existing=True)
    r = store.get_round(round_id)
    agg = store.aggregate_of(round_id)
    if r is None or agg is None:
        raise typer.BadParameter(f"round {round_id} has no aggregate (not closed, or a no-op)")
    newer = _published_round(bundle_dir)
    if newer is not None and newer > round_id:  # a stale command from the shell's history, a typo in --round
        raise PublishRefused(f"--round {round_id}: {bundle_dir} already holds the aggregate of the newer round {newer}; "
                             f"publishing round {round_id}'s would roll the devices back to older statistics")
    # As the close records it: the round's uid (a rerun publishes nothing new), no client count under DP noise.
    provenance = {"federated_round": round_id, "round_uid": r.settings.round_uid,
                  **({} if r.outcome.epsilon is not None else {"clients": len(r.outcome.clients or [])})}
    try:
        manifest = round_kinds.get(r.kind).publish(r, agg, bundle_dir, signing_key, provenance, publisher)
    except BundleError as exc:  # as `rounds open` names them: a wrong key read "the bundle was modified"
        raise typer.BadParameter(f"--bundle-dir {bundle_dir} (checked with --signing-key {signing_key}): {exc}") from exc
    typer.echo(f"bundle v{manifest['bundle_version']} published at {bundle_dir}")


def _published_round(bundle_dir: Path) -> int | None:
    """The round whose aggregate the bundle at ``bundle_dir`` holds (its manifest's
    ``provenance.federated_round``), or None: not published by a round, or unreadable (the publisher
    reports that)."""
    try:
        round_id = json.loads((bundle_dir / "manifest.json").read_bytes())["provenance"]["federated_round"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return round_id if isinstance(round_id, int) and not isinstance(round_id, bool) else None


def _bind(command, **bound):
    """``command`` with keyword-only arguments ``bound`` fixed and hidden from the CLI."""
    signature = inspect.signature(command, eval_str=True)  # typer reads the Annotated options from it

    @functools.wraps(command)
    def bound_command(*args, **kwargs):
        return command(*args, **kwargs, **bound)

    bound_command.__signature__ = signature.replace(
        parameters=[p for name, p in signature.parameters.items() if name not in bound])
    return bound_command


def register(app: typer.Typer, publisher: Publisher | None = None) -> None:
    """Add the server and operator commands to the ``fedroute`` CLI; ``publisher`` (from the
    console-script module, ``export.publish.BundlePublisher``) publishes bundles (the server never
    imports ``export``)."""
    rounds_app.command("open")(_bind(rounds_open, publisher=publisher))
    rounds_app.command("close")(_bind(rounds_close, publisher=publisher))
    app.command("serve")(_bind(serve, publisher=publisher))
    app.command("publish")(_bind(publish, publisher=publisher))
    app.add_typer(clients_app, name="clients")
    app.add_typer(rounds_app, name="rounds")
