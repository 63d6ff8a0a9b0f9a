"""Running a console command: fedroute's own errors print one line and exit with status 2."""

from __future__ import annotations

import typer

from sdk.errors import FedrouteError


def run_app(app) -> None:
    """Run the Typer ``app``; a :class:`sdk.errors.FedrouteError` prints ``error: <message>`` on stderr
    and exits 2 (no traceback), so cron jobs and timer units can alert on the status."""
    try:
        app()
    except FedrouteError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from exc
