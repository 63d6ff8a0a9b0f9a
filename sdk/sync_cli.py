"""``fedroute-sync`` (also ``fedroute sync``): one federated sync of a device, for cron or systemd.

Example crontab line (every 15 minutes)::

    */15 * * * * FEDROUTE_TOKEN=$(cat ~/.fedroute/token) fedroute-sync --server https://fed.example:8443 \
        --log ~/.fedroute/eval_log.sqlite --bundle ~/.fedroute/bundle --public-key ~/.fedroute/signing.pub

Prints one JSON line (:class:`sdk.sync.SyncResult`); exit status 0 on success, 2 on an error of ours
(message on stderr), so a timer unit can alert on it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from collections.abc import Callable
from typing import Annotated

import typer

from sdk import bundle_manifest as fmt
from sdk.cli_paths import PathCheckedCommand
from sdk.console import run_app
from sdk.device_rounds import LocalTrainer
from sdk.eval_log import EvalLog
from sdk.finite_option import COUNT_MAX
from sdk.sync import SyncClient


def _read_token(token_file: Path | None) -> tuple[str, str]:
    """(the bearer token or "", why there is none) from ``token_file`` or ``$FEDROUTE_TOKEN``."""
    if token_file is None:
        return os.environ.get("FEDROUTE_TOKEN", "").strip(), "give --token-file or set FEDROUTE_TOKEN"
    try:  # empty: e.g. a failed `fedroute clients add NAME > token` (its error went to the terminal)
        return token_file.read_text().strip(), (f"--token-file {token_file} is empty; the operator issues a token "
                                                "with `fedroute clients add` (`fedroute clients rotate` for an "
                                                "existing client)")
    except OSError as exc:
        return "", f"--token-file {token_file}: cannot read it ({exc.strerror})"
    except UnicodeDecodeError as exc:  # e.g. the EvalLog or a key given by mistake
        return "", (f"--token-file {token_file} is not a text file (byte {exc.start} is not UTF-8); it holds the "
                    "token `fedroute clients add` printed")


def make_sync_command(mlp_trainer: LocalTrainer | None = None) -> Callable[..., None]:
    """The ``sync`` command; with ``mlp_trainer`` (:class:`sdk.SyncClient`) it takes part in MLP rounds."""

    def sync(
        server: Annotated[str, typer.Option(help="https://host:port of the aggregation server")],
        log: Annotated[Path, typer.Option(help="the device's EvalLog (SQLite file)")],
        bundle: Annotated[Path, typer.Option(help="bundle in use; replaced atomically by newer ones")],
        public_key: Annotated[Path, typer.Option(help="signing.pub that must have signed any bundle")],
        token_file: Annotated[Path | None, typer.Option(help="file holding the bearer token (else $FEDROUTE_TOKEN)")] = None,
        ca_cert: Annotated[Path | None, typer.Option(help="PEM of the CA of the server certificate", exists=True,
                                                     dir_okay=False)] = None,
        state: Annotated[Path | None, typer.Option(help="sync state file (default beside the bundle)")] = None,
        retries: Annotated[int, typer.Option(min=0, max=COUNT_MAX, help="retries on connection errors and 5xx")] = 5,
        min_count_floor: Annotated[int, typer.Option(
            min=1, max=COUNT_MAX, help="smallest privacy threshold accepted: K-means rounds use max(the round's min_count, this); "
                        "MLP rounds with a lower min_count are skipped")] = 5,
        allow_repartition: Annotated[bool, typer.Option(
            help="also upload for rounds over other centroids than the last upload (weakens privacy: "
                 "uploads over two partitions can be combined)")] = False,
    ) -> None:
        """Upload this round's statistics and install a newer bundle, once."""
        token, no_token = _read_token(token_file)
        problem = (no_token if not token else None if log.is_file()  # e.g. the app's data folder:
                   else f"--log {log} {'is not a file' if log.exists() else 'does not exist'} (the app's EvalLog file)")
        if problem:
            raise typer.BadParameter(problem)
        models = [m["id"] for m in fmt.read_verified(bundle, public_key, wanted=()).manifest["models"]]
        try:
            with EvalLog(log, models) as eval_log, SyncClient(
                    server, token, eval_log, bundle, public_key, ca_cert=ca_cert, state_path=state, retries=retries,
                    mlp_trainer=mlp_trainer, min_count_floor=min_count_floor,
                    allow_repartition=allow_repartition) as client:
                result = client.run_once()
        except OSError as exc:  # the state file, its lock or the new bundle's files: a file in the way, a full disk
            typer.echo(f"error: {exc.filename if exc.filename is not None else 'fedroute-sync'}: {exc.strerror or exc}",
                       err=True)
            raise typer.Exit(2) from exc
        typer.echo(json.dumps(result.to_json()))

    return sync


sync = make_sync_command()


def make_app() -> typer.Typer:
    """The ``fedroute-sync`` app: the ``sync`` command, path options refusing an empty value (:mod:`sdk.cli_paths`)."""
    app = typer.Typer(add_completion=False)
    app.command(cls=PathCheckedCommand)(sync)
    return app


def main() -> None:
    """Console-script entry point of ``fedroute-sync``."""
    run_app(make_app())


if __name__ == "__main__":
    main()
