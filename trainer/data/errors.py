"""Errors raised while loading evaluation data; they extend the one hierarchy of :mod:`sdk.errors`::

    FedrouteError
    ├── InvalidInputError (ValueError)
    │   └── DataFormatError             malformed evaluation file or frame (names file, column, row)
    └── DataUnavailableError            the data cannot be fetched or found (hub offline, file absent)

Library exceptions (pandas, pyarrow, huggingface_hub) that cross the data boundary are re-raised as
one of these with ``raise ... from exc``.
"""

from __future__ import annotations

import os

from sdk.errors import FedrouteError, InvalidInputError


class DataFormatError(InvalidInputError):
    """A malformed evaluation file (or in-memory frame standing for one).

    ``str(err)`` names the file, then the column and the row when known, then the reason::

        train.parquet: column 'gpt-4|cost_usd', row 17 (0-based, header excluded): cost must be >= 0 USD, got -0.1

    Parameters
    ----------
    message : str
        The reason, quoting the offending value.
    path : str or os.PathLike
        The file path or hub id the data came from.
    column : str or None, default=None
        The offending column, or None when the error is not about one column.
    row : int or None, default=None
        0-based position of the first offending data row in the file (not a line number),
        or None when the error is not about one row.

    Attributes
    ----------
    path : str
    column : str or None
    row : int or None
    reason : str
        ``message`` as given, without the location prefix.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str],
        column: str | None = None,
        row: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.column = column
        self.row = None if row is None else int(row)
        self.reason = message
        where = [f"column {column!r}"] if column is not None else []
        where += [f"row {self.row} (0-based, header excluded)"] if self.row is not None else []
        prefix = ": ".join([self.path, ", ".join(where)]) if where else self.path
        super().__init__(f"{prefix}: {message}")


class DataUnavailableError(FedrouteError):
    """The evaluation data cannot be obtained: the hub is unreachable or offline, or a file is absent.

    The message says where the data was looked for and how to provide it instead
    (download the file, then load it with ``load_eval_file`` / the ``--train``/``--test`` options).
    """
