"""RouterBench-style evaluation tables: each query scored and priced for each model.

Two on-disk forms are read into one :class:`EvalTable`:

- the local wide schema of ``shared/data/routerbench/{train,test}.parquet`` (README section A):
  ``sample_id``, ``task``, ``prompt``, then per model ``'<model>|correctness'`` (1.0 / 0.0 / NaN)
  and ``'<model>|cost_usd'`` (USD per query); ``'<model>|response'`` and other columns are ignored.
  Read by :func:`load_eval_file` (``.parquet`` or ``.csv``) and :func:`load_routerbench_dir`.
- the upstream hub form (``withmartian/routerbench``, e.g. ``routerbench_0shot.pkl``, a pickled
  DataFrame): ``sample_id``, ``prompt`` (a Python-list literal), ``eval_name``, then per model
  ``'<model>'`` (correctness), ``'<model>|model_response'`` and ``'<model>|total_cost'``.
  Read by :func:`from_upstream_frame` and :func:`load_routerbench_hub`.

Both forms go through one validator (:func:`_require_columns`, :func:`_check_model_columns`,
:func:`_build_table`), which raises :class:`~trainer.data.errors.DataFormatError` naming the file,
the column and the first offending row (0-based position among the data rows).
"""

from __future__ import annotations

import ast
import contextlib
import math
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
from huggingface_hub import hf_hub_download
from huggingface_hub import errors as hf_errors

from sdk.errors import InvalidInputError, ShapeError, UnknownModelError
from trainer.data.errors import DataFormatError, DataUnavailableError

__all__ = [
    "EvalTable",
    "from_upstream_frame",
    "load_eval_file",
    "load_routerbench_dir",
    "load_routerbench_hub",
]

CORRECTNESS_SUFFIX = "|correctness"
COST_SUFFIX = "|cost_usd"
RESPONSE_SUFFIX = "|response"
UPSTREAM_COST_SUFFIX = "|total_cost"
UPSTREAM_RESPONSE_SUFFIX = "|model_response"

# Columns of the local schema read as text verbatim (never turned into NaN) from CSV.
_TEXT_COLUMNS = ("sample_id", "task", "prompt")
#: Why an SQLite file (an ``sdk.EvalLog``) is refused where an evaluation table is read.
_NOT_A_TABLE = ("an SQLite file (an sdk.EvalLog?) is not an evaluation table: a device's log holds the outcome of the "
                "one model that served each query, and scoring or replaying routers needs each query's outcome for "
                "several models; run your prompts through the models you route between and write the outcomes as "
                "'<model>|correctness' and '<model>|cost_usd' columns in a .parquet or .csv file "
                "(docs/routers-and-results.md, 'Your own logs'); to estimate a router on a log an Explorer "
                "wrote (rows with propensities), use fedroute offpolicy")
# Cells of a numeric CSV column that mean "missing" (pandas' usual spellings).
_CSV_NA_TOKENS = frozenset(
    {"", "nan", "NaN", "NAN", "NA", "N/A", "n/a", "null", "NULL", "None", "<NA>"}
)


@dataclass(frozen=True, eq=False)
class EvalTable:
    """Dense evaluation table: each query x each model; NaN accuracy = not labelled upstream.

    The loaders (:func:`load_eval_file`, :func:`from_upstream_frame`, ...) validate the data
    cell by cell and report the file, column and row of a fault; the constructor re-checks
    shapes, dtypes and ranges so that a table built by hand holds the same guarantees.
    Arrays are stored read-only; :meth:`subset` and :meth:`with_models` return new tables.

    Parameters
    ----------
    prompts : tuple of str of length n_queries
        Prompt texts, non-empty.
    tasks : ndarray of shape (n_queries,), dtype object (str)
        Task (RouterBench ``eval_name``) of each query.
    sample_ids : ndarray of shape (n_queries,), dtype object (str)
        Upstream sample id of each query (not unique in RouterBench).
    models : tuple of str of length n_models
        Model ids, in file column order; unique.
    accuracy : ndarray of shape (n_queries, n_models), float64
        Correctness in [0, 1] (RouterBench: 1.0 correct, 0.0 wrong); NaN = not labelled.
    cost : ndarray of shape (n_queries, n_models), float64
        USD per query; finite and >= 0 (also where accuracy is NaN).
    source : str
        File path or hub id the table came from.

    Raises
    ------
    sdk.errors.ShapeError
        A field has the wrong length, shape or dtype, or values outside the ranges above.
    sdk.errors.InvalidInputError
        ``models`` is empty or holds duplicates.
    """

    prompts: tuple[str, ...]
    tasks: np.ndarray
    sample_ids: np.ndarray
    models: tuple[str, ...]
    accuracy: np.ndarray
    cost: np.ndarray
    source: str

    def __post_init__(self) -> None:
        prompts = tuple(self.prompts)
        models = tuple(self.models)
        n_queries, n_models = len(prompts), len(models)
        if n_models == 0:
            raise InvalidInputError("an EvalTable needs at least one model, got models=()")
        duplicated = sorted(name for name, count in Counter(models).items() if count > 1)
        if duplicated:
            raise InvalidInputError(f"model ids must be unique, duplicated: {duplicated}")
        if not all(isinstance(p, str) and p.strip() for p in prompts):
            raise ShapeError("prompts must all be non-empty strings")
        tasks = _object_vector(self.tasks, "tasks", n_queries)
        sample_ids = _object_vector(self.sample_ids, "sample_ids", n_queries)
        accuracy = _float_matrix(self.accuracy, "accuracy", (n_queries, n_models))
        cost = _float_matrix(self.cost, "cost", (n_queries, n_models))
        labelled = ~np.isnan(accuracy)
        if np.any((accuracy[labelled] < 0.0) | (accuracy[labelled] > 1.0)):
            raise ShapeError("accuracy must lie in [0, 1] or be NaN (unlabelled)")
        if not np.all(np.isfinite(cost)) or np.any(cost < 0.0):
            raise ShapeError("cost must be finite and >= 0 USD per query")
        for name, value in (
            ("prompts", prompts),
            ("models", models),
            ("tasks", tasks),
            ("sample_ids", sample_ids),
            ("accuracy", accuracy),
            ("cost", cost),
            ("source", os.fspath(self.source)),
        ):
            object.__setattr__(self, name, value)

    @property
    def n_queries(self) -> int:
        """Number of queries (rows)."""
        return len(self.prompts)

    @property
    def n_models(self) -> int:
        """Number of models (columns)."""
        return len(self.models)

    def labelled(self) -> np.ndarray:
        """Which cells carry a correctness label.

        Returns
        -------
        ndarray of shape (n_queries, n_models), bool
            ``~isnan(accuracy)``.
        """
        return ~np.isnan(self.accuracy)

    def subset(self, index: np.ndarray | Sequence[int] | Sequence[bool]) -> EvalTable:
        """Select rows (queries).

        Parameters
        ----------
        index : array-like of int, or array-like of bool of shape (n_queries,)
            Row positions in [0, n_queries) (order and repeats are kept), or a boolean mask.

        Returns
        -------
        EvalTable
            A new table with the selected rows; models and source unchanged.

        Raises
        ------
        sdk.errors.ShapeError
            ``index`` is not 1-D, is neither integer nor bool, or is a mask of the wrong length.
        sdk.errors.InvalidInputError
            An integer position lies outside [0, n_queries).
        """
        rows = np.asarray(index)
        if rows.ndim != 1:
            raise ShapeError(f"index must be 1-D, got shape {rows.shape}")
        if rows.size == 0 and rows.dtype.kind not in "bi":
            rows = rows.astype(np.intp)
        if rows.dtype == np.bool_:  # a mask (numpy dtype, not an artefact kind)
            if rows.shape[0] != self.n_queries:
                raise ShapeError(
                    f"boolean mask has length {rows.shape[0]}, should be n_queries={self.n_queries}"
                )
            rows = np.flatnonzero(rows)
        elif rows.dtype.kind in "iu":
            outside = (rows < 0) | (rows >= self.n_queries)
            if np.any(outside):
                raise InvalidInputError(
                    f"row index {rows[outside][0]} is outside [0, n_queries={self.n_queries})"
                )
        else:
            raise ShapeError(f"index must hold integers or bools, got dtype {rows.dtype}")
        return self._take(rows, np.arange(self.n_models))

    def complete_rows(self) -> EvalTable:
        """Only the rows where every model is labelled (for evaluation).

        Returns
        -------
        EvalTable
            The rows of ``labelled().all(axis=1)``, in their original order.
        """
        return self.subset(self.labelled().all(axis=1))

    def with_models(self, models: Sequence[str]) -> EvalTable:
        """Select and reorder columns (models).

        Parameters
        ----------
        models : sequence of str
            Model ids, each in ``self.models``, without repeats; the new column order.

        Returns
        -------
        EvalTable
            A new table whose ``models`` equals ``tuple(models)``.

        Raises
        ------
        sdk.errors.UnknownModelError
            A name is not in ``self.models``; the message lists the valid names.
        sdk.errors.InvalidInputError
            ``models`` is a single string, empty, or holds duplicates.
        """
        if isinstance(models, str):
            raise InvalidInputError(
                f"models must be a sequence of model ids, got the string {models!r}; "
                f"pass [{models!r}] to keep one model"
            )
        wanted = list(models)
        position = {name: j for j, name in enumerate(self.models)}
        for name in wanted:
            if name not in position:
                raise UnknownModelError(
                    f"unknown model {name!r}; valid models: {', '.join(self.models)}"
                )
        if not wanted:
            raise InvalidInputError("models is empty; select at least one model")
        duplicated = sorted(name for name, count in Counter(wanted).items() if count > 1)
        if duplicated:
            raise InvalidInputError(f"models must not repeat, duplicated: {duplicated}")
        return self._take(np.arange(self.n_queries), np.array([position[m] for m in wanted]))

    def describe(self) -> str:
        """A short human-readable summary.

        Returns
        -------
        str
            Source, n_queries, n_models, per-task query counts, unlabelled (NaN) cells per
            model, and the number of rows with no labelled model at all.
        """
        labelled = self.labelled()
        unlabelled = (~labelled).sum(axis=0)
        tasks = Counter(self.tasks.tolist())
        lines = [
            f"EvalTable from {self.source}: n_queries={self.n_queries}, n_models={self.n_models}",
            "queries per task: "
            + (", ".join(f"{task}={tasks[task]}" for task in sorted(tasks)) or "(none)"),
            "unlabelled cells per model:",
            *(f"  {model}: {int(n)}" for model, n in zip(self.models, unlabelled)),
            f"rows with no labelled model: {int((~labelled.any(axis=1)).sum())}",
        ]
        return "\n".join(lines)

    def _take(self, rows: np.ndarray, columns: np.ndarray) -> EvalTable:
        """Rows x columns by position; does not validate (callers checked the indices)."""
        grid = np.ix_(rows, columns)
        return EvalTable(
            prompts=tuple(self.prompts[i] for i in rows),
            tasks=self.tasks[rows],
            sample_ids=self.sample_ids[rows],
            models=tuple(self.models[j] for j in columns),
            accuracy=self.accuracy[grid],
            cost=self.cost[grid],
            source=self.source,
        )


def load_eval_file(path: str | os.PathLike[str]) -> EvalTable:
    """Load one evaluation file in the local wide schema (README section A).

    Columns: ``sample_id``, ``task``, ``prompt`` (str), and for each model
    ``'<model>|correctness'`` (float in [0, 1], NaN = unlabelled) and ``'<model>|cost_usd'``
    (USD per query, finite, >= 0). ``'<model>|response'`` and any other column are ignored.

    Parameters
    ----------
    path : str or os.PathLike
        A ``.parquet`` or ``.csv`` file (chosen by suffix, case-insensitive).

    Returns
    -------
    EvalTable
        Models in the order their columns first appear in the file; ``source`` is ``str(path)``.

    Raises
    ------
    trainer.data.errors.DataFormatError
        Unknown suffix; unreadable file; missing ``sample_id``/``task``/``prompt`` column; no
        model columns; a model with a correctness column but no cost column or the reverse;
        non-numeric or out-of-range correctness; NaN, infinite or negative cost; empty,
        whitespace-only or non-string prompt; missing task or sample id. The message names the
        file, the column and the first offending row (0-based position among the data rows).
    trainer.data.errors.DataUnavailableError
        The file does not exist.
    """
    source = os.fspath(path)
    frame = _read_frame(Path(source))
    columns = [str(c) for c in frame.columns]
    _require_columns(frame, _TEXT_COLUMNS, source)
    models = _ordered_prefixes(columns, (CORRECTNESS_SUFFIX, COST_SUFFIX))
    _check_model_columns(
        columns,
        models,
        source=source,
        correctness_of=lambda m: m + CORRECTNESS_SUFFIX,
        cost_of=lambda m: m + COST_SUFFIX,
        expected="'<model>|correctness' and '<model>|cost_usd'",
    )
    return _build_table(
        frame,
        source=source,
        prompts=frame["prompt"].tolist(),
        task_column="task",
        models=models,
        correctness_of=lambda m: m + CORRECTNESS_SUFFIX,
        cost_of=lambda m: m + COST_SUFFIX,
    )


def load_routerbench_dir(data_dir: str | os.PathLike[str]) -> tuple[EvalTable, EvalTable]:
    """Load the RouterBench train/test split of ``shared/data/routerbench``.

    Parameters
    ----------
    data_dir : str or os.PathLike
        Folder holding ``train.parquet`` and ``test.parquet`` (local wide schema); ``.csv`` files
        of the same names are used where no ``.parquet`` exists.

    Returns
    -------
    train, test : EvalTable
        As :func:`load_eval_file` returns them.

    Raises
    ------
    trainer.data.errors.DataFormatError
        Either file is malformed (see :func:`load_eval_file`).
    trainer.data.errors.DataUnavailableError
        Either file does not exist.
    """
    folder = Path(data_dir)

    def pick(stem: str) -> Path:
        parquet, csv = folder / f"{stem}.parquet", folder / f"{stem}.csv"
        return csv if not parquet.exists() and csv.exists() else parquet

    train = pick("train")
    if not train.exists() and folder.is_dir():
        # The usual slip: --data ../shared/data (the data root) instead of ../shared/data/routerbench.
        inside = sorted(p.parent for p in folder.glob("*/train.*") if p.suffix in (".parquet", ".csv"))
        if inside:
            raise DataUnavailableError(
                f"{folder} holds no train.parquet or train.csv; the subfolder {inside[0]} does: "
                f"give --data {inside[0]}"
            )
    return load_eval_file(train), load_eval_file(pick("test"))


def from_upstream_frame(df: pd.DataFrame, source: str) -> EvalTable:
    """Convert the upstream RouterBench DataFrame (hub pickle form) into an :class:`EvalTable`.

    Columns: ``sample_id``, ``prompt``, ``eval_name`` (becomes the task), and for each model
    ``'<model>'`` (correctness in [0, 1], NaN = unlabelled), ``'<model>|total_cost'`` (USD per
    query) and ``'<model>|model_response'`` (ignored); ``oracle_model_to_route_to`` and other
    columns are ignored. A model is recognised by its ``|total_cost`` or ``|model_response``
    column, so a bare correctness column with neither is taken for an unrelated extra column.

    ``prompt`` is a string, a Python-list literal string such as ``"['text']"``, or a list of
    strings; a list (literal) is unwrapped to its first element, since upstream repeats a
    duplicated prompt inside one list (shared data README, section A). A string that is not a
    list literal is kept verbatim.

    Parameters
    ----------
    df : pandas.DataFrame
        The upstream frame, one row per query.
    source : str
        Where the frame came from (file path or hub id); quoted in errors and kept in the table.

    Returns
    -------
    EvalTable
        Models in the order their columns first appear in ``df``.

    Raises
    ------
    trainer.data.errors.DataFormatError
        ``df`` is not a DataFrame, or any fault listed in :func:`load_eval_file` (with the
        upstream column names); also a prompt list that is empty or holds a non-string.
    """
    source = os.fspath(source)
    if not isinstance(df, pd.DataFrame):
        raise DataFormatError(
            f"expected a pandas DataFrame, got {type(df).__name__}", path=source
        )
    columns = [str(c) for c in df.columns]
    _require_columns(df, ("sample_id", "eval_name", "prompt"), source)
    models = _ordered_prefixes(columns, (UPSTREAM_COST_SUFFIX, UPSTREAM_RESPONSE_SUFFIX))
    _check_model_columns(
        columns,
        models,
        source=source,
        correctness_of=lambda m: m,
        cost_of=lambda m: m + UPSTREAM_COST_SUFFIX,
        expected="'<model>' and '<model>|total_cost'",
    )
    prompts = [
        _unwrap_upstream_prompt(value, source=source, row=i)
        for i, value in enumerate(df["prompt"].tolist())
    ]
    return _build_table(
        df,
        source=source,
        prompts=prompts,
        task_column="eval_name",
        models=models,
        correctness_of=lambda m: m,
        cost_of=lambda m: m + UPSTREAM_COST_SUFFIX,
    )


def load_routerbench_hub(
    repo_id: str = "withmartian/routerbench",
    filename: str = "routerbench_0shot.pkl",
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> EvalTable:
    """Download (or reuse from the hub cache) the upstream RouterBench pickle and load it.

    The file is a pickled DataFrame: unpickling can run code, so only load a repository you
    trust, and pin ``revision`` to a commit for reproducible results.

    Parameters
    ----------
    repo_id : str, default="withmartian/routerbench"
        Hugging Face dataset repository.
    filename : str, default="routerbench_0shot.pkl"
        File in that repository.
    revision : str or None, default=None
        Branch, tag or commit; None = the default branch.
    cache_dir : str or os.PathLike or None, default=None
        Hub cache folder; None = the hub default.

    Returns
    -------
    EvalTable
        See :func:`from_upstream_frame`; ``source`` is ``hf://datasets/<repo_id>/<filename>``
        (with ``@<revision>`` when given).

    Raises
    ------
    trainer.data.errors.DataUnavailableError
        The hub cannot be reached, is in offline mode without a cached copy, or has no such
        repository, revision or file.
    trainer.data.errors.DataFormatError
        The file cannot be unpickled, is not a DataFrame, or fails validation.
    """
    source = f"hf://datasets/{repo_id}/{filename}" + (f"@{revision}" if revision else "")
    try:
        local_path = hf_hub_download(
            repo_id=repo_id,
            filename=filename,
            repo_type="dataset",
            revision=revision,
            cache_dir=cache_dir,
        )
    except (OSError, hf_errors.EntryNotFoundError, hf_errors.HfHubHTTPError) as exc:
        raise DataUnavailableError(
            f"cannot fetch {source} from the Hugging Face hub ({type(exc).__name__}: {exc}); "
            "download the file on a machine with network access, convert it to the local "
            "schema, and load it with load_eval_file(path) (or pass --train/--test)"
        ) from exc
    try:
        frame = pd.read_pickle(local_path)
    except Exception as exc:  # unpickling raises arbitrary classes for a corrupt file
        raise DataFormatError(
            f"cannot unpickle ({type(exc).__name__}: {exc})", path=os.fspath(local_path)
        ) from exc
    return from_upstream_frame(frame, source)


# --------------------------------------------------------------------------- validation


def _read_frame(path: Path) -> pd.DataFrame:
    """Read a .parquet or .csv file (CSV text columns verbatim: "NA" stays text), mapping library errors to ours."""
    suffix = path.suffix.lower()
    if suffix not in (".parquet", ".csv"):
        sqlite = False
        with contextlib.suppress(OSError), path.open("rb") as head:
            sqlite = head.read(16) == b"SQLite format 3\x00"
        raise DataFormatError(
            _NOT_A_TABLE if sqlite else f"unknown file suffix {path.suffix!r}; expected '.parquet' or '.csv'",
            path=str(path),
        )
    if not path.is_file():
        raise DataUnavailableError(
            f"evaluation file not found: {path}; see shared/data/README.md for where it lives"
        )
    try:
        if suffix == ".parquet":
            return pd.read_parquet(path)
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pa.ArrowException, pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise DataFormatError(
            f"cannot read file ({type(exc).__name__}: {exc})", path=str(path)
        ) from exc
    for column in frame.columns:
        if column not in _TEXT_COLUMNS and not str(column).endswith(RESPONSE_SUFFIX):
            text = frame[column]
            frame[column] = text.where(~text.str.strip().isin(_CSV_NA_TOKENS), None)
    return frame


def _require_columns(frame: pd.DataFrame, names: Sequence[str], source: str) -> None:
    """Raise DataFormatError for the first of ``names`` missing from ``frame``."""
    present = [str(c) for c in frame.columns]
    for name in names:
        if name not in present:
            shown = ", ".join(repr(c) for c in present[:8]) + (", ..." if len(present) > 8 else "")
            raise DataFormatError(
                f"missing required column {name!r} (columns present: {shown or 'none'})",
                path=source,
                column=name,
            )


def _ordered_prefixes(columns: Sequence[str], suffixes: Sequence[str]) -> list[str]:
    """Model ids ``m`` such that ``m + suffix`` is a column, in order of first appearance."""
    models: dict[str, None] = {}
    for column in columns:
        for suffix in suffixes:
            if column.endswith(suffix):
                models.setdefault(column[: -len(suffix)], None)
    return list(models)


def _check_model_columns(
    columns: Sequence[str],
    models: Sequence[str],
    *,
    source: str,
    correctness_of: Callable[[str], str],
    cost_of: Callable[[str], str],
    expected: str,
) -> None:
    """Raise DataFormatError if there is no model, an empty model id, or half a model."""
    if not models:
        raise DataFormatError(f"no model columns: expected {expected} pairs", path=source)
    present = set(columns)
    for model in models:
        if not model.strip():
            raise DataFormatError(
                "empty model id in column name", path=source, column=cost_of(model)
            )
        pair = (correctness_of(model), cost_of(model))
        for needed, other in (pair, pair[::-1]):
            if needed not in present and other in present:
                raise DataFormatError(
                    f"missing model column {needed!r} for model {model!r} (it has {other!r})",
                    path=source,
                    column=needed,
                )
        if correctness_of(model) not in present:  # upstream: found only by '|model_response'
            raise DataFormatError(
                f"missing model column {correctness_of(model)!r} for model {model!r}",
                path=source,
                column=correctness_of(model),
            )


def _raise_at_first(bad: np.ndarray, values: np.ndarray, source: str, column: str, message: str) -> None:
    """Raise DataFormatError at the first row where ``bad`` holds; ``message`` gets the value."""
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DataFormatError(message.format(float(values[i])), path=source, column=column, row=i)


def _build_table(
    frame: pd.DataFrame,
    *,
    source: str,
    prompts: list[object],
    task_column: str,
    models: Sequence[str],
    correctness_of: Callable[[str], str],
    cost_of: Callable[[str], str],
) -> EvalTable:
    """Validate the cells of ``frame`` (columns already present) and build the table."""
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataFormatError(
                f"prompt must be a non-empty string, got {_quote(prompt)}",
                path=source,
                column="prompt",
                row=i,
            )
    tasks = _text_vector(frame[task_column], source=source, column=task_column, what="task")
    sample_ids = _text_vector(
        frame["sample_id"], source=source, column="sample_id", what="sample id"
    )
    n_queries = len(frame)
    accuracy = np.empty((n_queries, len(models)), dtype=np.float64)
    cost = np.empty((n_queries, len(models)), dtype=np.float64)
    for j, model in enumerate(models):
        column = correctness_of(model)
        values = _numeric_column(frame[column], source=source, column=column, what="correctness")
        _raise_at_first(
            ~np.isnan(values) & ((values < 0.0) | (values > 1.0)), values, source, column,
            "correctness must be in [0, 1] (NaN = unlabelled), got {}",
        )
        accuracy[:, j] = values
        column = cost_of(model)
        values = _numeric_column(frame[column], source=source, column=column, what="cost")
        _raise_at_first(~np.isfinite(values), values, source, column,
                        "cost must be a finite number of USD per query, got {}")
        _raise_at_first(values < 0.0, values, source, column, "cost must be >= 0 USD, got {}")
        cost[:, j] = values
    return EvalTable(
        prompts=tuple(prompts),  # type: ignore[arg-type]  # checked above
        tasks=tasks,
        sample_ids=sample_ids,
        models=tuple(models),
        accuracy=accuracy,
        cost=cost,
        source=source,
    )


def _numeric_column(series: pd.Series, *, source: str, column: str, what: str) -> np.ndarray:
    """float64 values of ``series``; missing cells become NaN, non-numbers raise DataFormatError."""
    if pd.api.types.is_bool_dtype(series) or pd.api.types.is_numeric_dtype(series):
        return series.to_numpy(dtype=np.float64, na_value=np.nan)
    coerced = pd.to_numeric(series, errors="coerce")
    bad = (coerced.isna() & series.notna()).to_numpy()
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DataFormatError(
            f"{what} must be a number (missing cells are NaN), got {_quote(series.iloc[i])}",
            path=source,
            column=column,
            row=i,
        )
    return coerced.to_numpy(dtype=np.float64, na_value=np.nan)


def _text_vector(series: pd.Series, *, source: str, column: str, what: str) -> np.ndarray:
    """Object array of non-empty strings (ints are turned into their decimal text)."""
    values = series.tolist()
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise DataFormatError(
                f"{what} must be a non-empty string, got {_quote(value)}",
                path=source,
                column=column,
                row=i,
            )
        out[i] = value
    return out


def _unwrap_upstream_prompt(value: object, *, source: str, row: int) -> object:
    """First element of an upstream prompt list (or list literal); other values unchanged."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return value  # plain text that happens to start with '['
        if not isinstance(parsed, list):
            return value
        value = parsed
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) == 0:
            raise DataFormatError("prompt list is empty", path=source, column="prompt", row=row)
        first = value[0]
        if not isinstance(first, str):
            raise DataFormatError(
                f"prompt list must hold strings, got {_quote(first)}",
                path=source,
                column="prompt",
                row=row,
            )
        return first
    return value


def _quote(value: object) -> str:
    """A short description of an offending cell: its repr (cut to 60 chars) and type."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{value!r} (missing)"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return text if isinstance(value, str) else f"{text} ({type(value).__name__})"


def _object_vector(values: object, name: str, n: int) -> np.ndarray:
    """1-D object array of length ``n``; raises ShapeError otherwise. Read-only."""
    array = np.asarray(values, dtype=object)
    if array.shape != (n,):
        raise ShapeError(f"{name} must have shape ({n},) like prompts, got {array.shape}")
    array = array.copy() if array is values else array
    array.setflags(write=False)
    return array


def _float_matrix(values: object, name: str, shape: tuple[int, int]) -> np.ndarray:
    """float64 array of ``shape``; raises ShapeError otherwise. Read-only."""
    array = np.asarray(values)
    if array.dtype != np.float64:
        raise ShapeError(f"{name} must have dtype float64, got {array.dtype}")
    if array.shape != shape:
        raise ShapeError(
            f"{name} must have shape (n_queries, n_models)={shape}, got {array.shape}"
        )
    array = array.copy() if array is values else array
    array.setflags(write=False)
    return array
