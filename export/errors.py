"""Errors of the exporter, under the SDK's one hierarchy (:mod:`sdk.errors`)."""

from __future__ import annotations

from sdk.errors import FedrouteError


class ExportError(FedrouteError):
    """The bundle cannot be built: unreadable router, bad key, missing embedder or data."""


class ParityError(ExportError):
    """An exported part disagrees with the trainer beyond the thresholds; no bundle was written.

    Attributes
    ----------
    report : dict, the measured parity figures (same layout as the bundle's ``parity.json``).
    """

    def __init__(self, message: str, report: dict) -> None:
        super().__init__(message)
        self.report = report
