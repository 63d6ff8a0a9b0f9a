"""trainer.data.routerbench: the real RouterBench split, every malformed-file case, and the upstream form."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from huggingface_hub import errors as hf_errors

from sdk.errors import FedrouteError, InvalidInputError, ShapeError, UnknownModelError
from trainer.data import routerbench
from trainer.data.errors import DataFormatError, DataUnavailableError
from trainer.data.routerbench import (
    EvalTable,
    from_upstream_frame,
    load_eval_file,
    load_routerbench_dir,
    load_routerbench_hub,
)

MODELS = (
    "WizardLM/WizardLM-13B-V1.2",
    "claude-instant-v1",
    "claude-v1",
    "claude-v2",
    "gpt-3.5-turbo-1106",
    "gpt-4-1106-preview",
    "meta/code-llama-instruct-34b-chat",
    "meta/llama-2-70b-chat",
    "mistralai/mistral-7b-chat",
    "mistralai/mixtral-8x7b-chat",
    "zero-one-ai/Yi-34B-Chat",
)
GPT35 = "gpt-3.5-turbo-1106"
GPT4 = "gpt-4-1106-preview"
MISTRAL = "mistralai/mistral-7b-chat"


@pytest.fixture(scope="module")
def split(routerbench_dir: Path) -> tuple[EvalTable, EvalTable]:
    return load_routerbench_dir(routerbench_dir)


@pytest.fixture(scope="module")
def few_rows(routerbench_dir: Path) -> pd.DataFrame:
    """Eight real train rows, the last with NaN correctness (row 75 of train.parquet)."""
    frame = pd.read_parquet(routerbench_dir / "train.parquet")
    assert frame.iloc[75].filter(like="|correctness").isna().any()
    return frame.iloc[[0, 1, 2, 3, 4, 5, 6, 75]].reset_index(drop=True)


def _write(frame: pd.DataFrame, path: Path) -> Path:
    if path.suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path, index=False)
    return path


# --------------------------------------------------------------------------- the real files


def test_real_split_shapes_models_and_tasks(split: tuple[EvalTable, EvalTable]) -> None:
    train, test = split
    assert (train.n_queries, train.n_models) == (2225, 11)
    assert (test.n_queries, test.n_models) == (762, 11)
    assert train.models == MODELS and test.models == MODELS
    assert pd.Series(train.tasks).value_counts().to_dict() == {
        "arc-challenge": 1039, "winogrande": 887, "mbpp": 299,
    }
    assert pd.Series(test.tasks).value_counts().to_dict() == {
        "arc-challenge": 356, "winogrande": 304, "mbpp": 102,
    }
    for table in (train, test):
        assert table.accuracy.shape == table.cost.shape == (table.n_queries, 11)
        assert table.accuracy.dtype == table.cost.dtype == np.float64
        assert table.tasks.dtype == table.sample_ids.dtype == object
        assert len(table.prompts) == table.n_queries
        assert np.all(table.cost > 0)
        labelled = table.accuracy[table.labelled()]
        assert set(np.unique(labelled)) <= {0.0, 1.0}
    assert train.source.endswith("train.parquet") and test.source.endswith("test.parquet")


@pytest.mark.parametrize(("which", "n_nan_gpt35", "n_nan_other"), [(0, 12, 8), (1, 2, 6)])
def test_real_split_nan_counts(split, which: int, n_nan_gpt35: int, n_nan_other: int) -> None:
    table = split[which]
    unlabelled = dict(zip(table.models, (~table.labelled()).sum(axis=0).tolist()))
    assert unlabelled == {m: (n_nan_gpt35 if m == GPT35 else n_nan_other) for m in MODELS}


@pytest.mark.parametrize("which", [0, 1])
def test_complete_rows_drops_exactly_rows_with_any_nan(split, routerbench_dir: Path, which: int) -> None:
    table = split[which]
    raw = pd.read_parquet(routerbench_dir / ("train.parquet", "test.parquet")[which])
    keep = raw[[m + "|correctness" for m in MODELS]].notna().all(axis=1).to_numpy()
    complete = table.complete_rows()
    assert complete.n_queries == int(keep.sum()) < table.n_queries
    assert complete.labelled().all()
    np.testing.assert_array_equal(complete.sample_ids, raw["sample_id"].to_numpy(dtype=object)[keep])
    np.testing.assert_array_equal(complete.accuracy, table.accuracy[keep])
    np.testing.assert_array_equal(complete.cost, table.cost[keep])


def test_describe_summarises_counts(split) -> None:
    text = split[0].describe()
    assert "n_queries=2225" in text
    assert "arc-challenge=1039" in text and "mbpp=299" in text and "winogrande=887" in text
    assert f"{GPT35}: 12" in text and "claude-v2: 8" in text
    assert "rows with no labelled model: 0" in text


# --------------------------------------------------------------------------- table operations


def test_subset_by_index_and_mask_agree(split) -> None:
    train = split[0]
    by_index = train.subset(np.array([5, 0, 7]))
    assert by_index.prompts == (train.prompts[5], train.prompts[0], train.prompts[7])
    np.testing.assert_array_equal(by_index.cost, train.cost[[5, 0, 7]])
    mask = np.zeros(train.n_queries, dtype=bool)
    mask[[0, 5, 7]] = True
    by_mask = train.subset(mask)
    np.testing.assert_array_equal(by_mask.accuracy, train.accuracy[[0, 5, 7]])
    assert by_mask.models == train.models and by_mask.source == train.source
    assert train.subset([]).n_queries == 0


def test_subset_rejects_bad_index(split) -> None:
    train = split[0]
    with pytest.raises(InvalidInputError, match="outside"):
        train.subset([0, train.n_queries])
    with pytest.raises(InvalidInputError, match="length 3"):
        train.subset(np.array([True, False, True]))


def test_with_models_reorders_columns(split) -> None:
    train = split[0]
    picked = train.with_models(["claude-v2", "WizardLM/WizardLM-13B-V1.2"])
    assert picked.models == ("claude-v2", "WizardLM/WizardLM-13B-V1.2")
    np.testing.assert_array_equal(picked.accuracy, train.accuracy[:, [3, 0]], strict=True)
    np.testing.assert_array_equal(picked.cost, train.cost[:, [3, 0]], strict=True)


def test_with_models_unknown_name_lists_valid_names(split) -> None:
    with pytest.raises(UnknownModelError) as info:
        split[0].with_models(["claude-v1", "gpt-4"])
    message = str(info.value)
    assert "'gpt-4'" in message
    assert all(model in message for model in MODELS)


def test_constructor_checks_shapes(split) -> None:
    train = split[0].subset([0, 1])
    with pytest.raises(ShapeError, match="accuracy must have shape"):
        EvalTable(train.prompts, train.tasks, train.sample_ids, train.models,
                  train.accuracy[:, :3], train.cost, "hand-made")
    with pytest.raises(ShapeError, match="cost must be finite"):
        EvalTable(train.prompts, train.tasks, train.sample_ids, train.models,
                  train.accuracy, -train.cost, "hand-made")


def test_arrays_are_read_only(split) -> None:
    with pytest.raises(ValueError, match="read-only"):
        split[0].accuracy[0, 0] = 0.5


# --------------------------------------------------------------------------- malformed files


def _set(column: str, rows_values: dict[int, object], as_text: bool = False):
    def mutate(frame: pd.DataFrame) -> pd.DataFrame:
        if as_text:  # a string column (parquet cannot hold a str in a float column)
            frame[column] = frame[column].map(lambda v: "" if pd.isna(v) else repr(float(v)))
        else:
            frame[column] = frame[column].astype(object)
        for row, value in rows_values.items():
            frame.loc[row, column] = value
        return frame

    return mutate


def _drop(*columns: str):
    return lambda frame: frame.drop(columns=list(columns))


def _drop_models(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns=[c for c in frame.columns if "|" in c])


# (mutation, expected column, expected row); when two cells are bad, the first is reported.
MALFORMED = {
    "missing prompt": (_drop("prompt"), "prompt", None),
    "missing task": (_drop("task"), "task", None),
    "missing sample_id": (_drop("sample_id"), "sample_id", None),
    "no model columns": (_drop_models, None, None),
    "correctness without cost": (_drop("claude-v1|cost_usd"), "claude-v1|cost_usd", None),
    "cost without correctness": (_drop("claude-v1|correctness"), "claude-v1|correctness", None),
    "non-numeric correctness": (
        _set("claude-v2|correctness", {3: "yes", 5: "no"}, as_text=True), "claude-v2|correctness", 3,
    ),
    "correctness above 1": (
        _set(GPT4 + "|correctness", {2: 1.5, 4: -0.5}), GPT4 + "|correctness", 2,
    ),
    "correctness below 0": (_set("claude-v1|correctness", {6: -0.5}), "claude-v1|correctness", 6),
    "cost NaN": (_set("claude-v1|cost_usd", {1: np.nan}), "claude-v1|cost_usd", 1),
    "cost inf": (_set(MISTRAL + "|cost_usd", {4: np.inf}), MISTRAL + "|cost_usd", 4),
    "cost negative": (_set(GPT4 + "|cost_usd", {2: -0.1, 5: -0.2}), GPT4 + "|cost_usd", 2),
    "empty prompt": (_set("prompt", {3: ""}), "prompt", 3),
    "whitespace prompt": (_set("prompt", {1: "  \n\t "}), "prompt", 1),
    "non-string prompt": (_set("prompt", {2: None}), "prompt", 2),
}


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
@pytest.mark.parametrize(("mutation", "column", "row"), MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_file_names_file_column_and_row(
    few_rows: pd.DataFrame, tmp_path: Path, suffix: str, mutation, column, row
) -> None:
    path = _write(mutation(few_rows.copy()), tmp_path / f"bad_rows{suffix}")
    with pytest.raises(DataFormatError) as info:
        load_eval_file(path)
    error = info.value
    assert type(error) is DataFormatError
    assert (error.column, error.row) == (column, row)
    message = str(error)
    assert f"bad_rows{suffix}" in message
    if column is not None:
        assert repr(column) in message
    if row is not None:
        assert f"row {row}" in message
    else:
        assert "row " not in message.split(": ")[0]


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_small_valid_file_keeps_nan_and_values(few_rows: pd.DataFrame, tmp_path: Path, suffix: str) -> None:
    table = load_eval_file(_write(few_rows, tmp_path / f"ok{suffix}"))
    assert table.models == MODELS
    assert table.prompts == tuple(few_rows["prompt"])
    np.testing.assert_array_equal(table.accuracy, few_rows[[m + "|correctness" for m in MODELS]].to_numpy())
    np.testing.assert_allclose(table.cost, few_rows[[m + "|cost_usd" for m in MODELS]].to_numpy(), rtol=1e-15)
    assert np.isnan(table.accuracy[7]).any() and not np.isnan(table.accuracy[:7]).any()


def test_the_data_root_instead_of_its_routerbench_folder_names_the_folder_to_give(few_rows: pd.DataFrame,
                                                                                   tmp_path: Path) -> None:
    """`--data ../shared/data` (the root, as the prism and mor commands take it) points at the subfolder."""
    (tmp_path / "routerbench").mkdir()
    _write(few_rows, tmp_path / "routerbench" / "train.parquet")
    _write(few_rows, tmp_path / "routerbench" / "test.parquet")
    with pytest.raises(DataUnavailableError) as info:
        load_routerbench_dir(tmp_path)
    assert str(info.value) == (f"{tmp_path} holds no train.parquet or train.csv; the subfolder "
                               f"{tmp_path / 'routerbench'} does: give --data {tmp_path / 'routerbench'}")
    with pytest.raises(DataUnavailableError, match="evaluation file not found"):
        load_routerbench_dir(tmp_path / "routerbench" / "missing")
    train, _ = load_routerbench_dir(tmp_path / "routerbench")
    assert train.n_queries == len(few_rows)


def test_csv_prompt_that_looks_like_na_stays_text(few_rows: pd.DataFrame, tmp_path: Path) -> None:
    frame = few_rows.copy()
    frame.loc[0, "prompt"] = "NA"
    assert load_eval_file(_write(frame, tmp_path / "na.csv")).prompts[0] == "NA"


def test_unknown_suffix_and_missing_file(few_rows: pd.DataFrame, tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    few_rows.to_json(path)
    with pytest.raises(DataFormatError, match=r"rows\.json: unknown file suffix '\.json'"):
        load_eval_file(path)
    with pytest.raises(DataUnavailableError, match="absent.parquet"):
        load_eval_file(tmp_path / "absent.parquet")
    (tmp_path / "garbage.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataFormatError, match="garbage.parquet"):
        load_eval_file(tmp_path / "garbage.parquet")


# --------------------------------------------------------------------------- the upstream form


def _to_upstream(frame: pd.DataFrame) -> pd.DataFrame:
    """The hub layout of rows in the local schema: bare correctness, |total_cost, list-literal prompts."""
    out = {"sample_id": frame["sample_id"], "prompt": [repr([p]) for p in frame["prompt"]],
           "eval_name": frame["task"]}
    for model in MODELS:
        out[model] = frame[model + "|correctness"]
        out[model + "|model_response"] = [repr([r]) for r in frame[model + "|response"]]
        out[model + "|total_cost"] = frame[model + "|cost_usd"]
    out["oracle_model_to_route_to"] = "claude-v2"
    upstream = pd.DataFrame(out)
    upstream["prompt"] = upstream["prompt"].astype(object)
    upstream.loc[1, "prompt"] = repr([frame.loc[1, "prompt"]] * 2)  # duplicated-prompt list
    upstream.at[2, "prompt"] = [frame.loc[2, "prompt"]]  # an actual list
    return upstream


def _assert_same_table(a: EvalTable, b: EvalTable) -> None:
    assert a.models == b.models
    assert a.prompts == b.prompts
    np.testing.assert_array_equal(a.tasks, b.tasks)
    np.testing.assert_array_equal(a.sample_ids, b.sample_ids)
    np.testing.assert_array_equal(a.accuracy, b.accuracy)
    np.testing.assert_array_equal(a.cost, b.cost)


def test_from_upstream_frame_equals_local_file(few_rows: pd.DataFrame, tmp_path: Path) -> None:
    local = load_eval_file(_write(few_rows, tmp_path / "rows.parquet"))
    upstream = from_upstream_frame(_to_upstream(few_rows), "routerbench_0shot.pkl")
    _assert_same_table(upstream, local)
    assert upstream.source == "routerbench_0shot.pkl"


@pytest.mark.parametrize(
    ("mutation", "column", "row"),
    [
        (_drop("eval_name"), "eval_name", None),
        (_drop("claude-v1|total_cost"), "claude-v1|total_cost", None),
        (_drop("claude-v1"), "claude-v1", None),
        (_set("claude-v1", {4: 2.0}), "claude-v1", 4),
        (_set("claude-v1|total_cost", {3: -1.0}), "claude-v1|total_cost", 3),
        (_set("prompt", {5: "['   ']"}), "prompt", 5),
        (_set("prompt", {6: "[]"}), "prompt", 6),
        (_set("prompt", {7: 123}), "prompt", 7),
    ],
    ids=["missing eval_name", "missing total_cost", "missing correctness", "correctness 2",
         "negative cost", "blank prompt in list", "empty prompt list", "non-string prompt"],
)
def test_from_upstream_frame_shares_the_validator(few_rows: pd.DataFrame, mutation, column, row) -> None:
    with pytest.raises(DataFormatError) as info:
        from_upstream_frame(mutation(_to_upstream(few_rows)), "routerbench_0shot.pkl")
    assert (info.value.column, info.value.row) == (column, row)
    assert str(info.value).startswith("routerbench_0shot.pkl: ")


def test_load_routerbench_hub_reads_the_downloaded_pickle(
    few_rows: pd.DataFrame, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pickled = tmp_path / "routerbench_0shot.pkl"
    _to_upstream(few_rows).to_pickle(pickled)
    calls = []

    def fake_download(**kwargs):
        calls.append(kwargs)
        return str(pickled)

    monkeypatch.setattr(routerbench, "hf_hub_download", fake_download)
    table = load_routerbench_hub(revision="abc123", cache_dir=tmp_path / "cache")
    assert calls == [{
        "repo_id": "withmartian/routerbench", "filename": "routerbench_0shot.pkl",
        "repo_type": "dataset", "revision": "abc123", "cache_dir": tmp_path / "cache",
    }]
    _assert_same_table(table, load_eval_file(_write(few_rows, tmp_path / "rows.parquet")))
    assert table.source == "hf://datasets/withmartian/routerbench/routerbench_0shot.pkl@abc123"


@pytest.mark.parametrize(
    "hub_error",
    [
        hf_errors.LocalEntryNotFoundError("offline and the file is not in the local cache"),
        hf_errors.OfflineModeIsEnabled("HF_HUB_OFFLINE=1"),
        ConnectionError("connection refused"),
    ],
    ids=["local-entry-not-found", "offline-mode", "connection-error"],
)
def test_load_routerbench_hub_maps_hub_errors(monkeypatch: pytest.MonkeyPatch, hub_error: Exception) -> None:
    def fake_download(**kwargs):
        raise hub_error

    monkeypatch.setattr(routerbench, "hf_hub_download", fake_download)
    with pytest.raises(DataUnavailableError) as info:
        load_routerbench_hub()
    assert type(info.value) is DataUnavailableError and isinstance(info.value, FedrouteError)
    assert info.value.__cause__ is hub_error
    assert "load_eval_file" in str(info.value) and "withmartian/routerbench" in str(info.value)


def test_load_routerbench_hub_rejects_non_frame_pickle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    not_a_frame = tmp_path / "list.pkl"
    not_a_frame.write_bytes(pickle.dumps([1, 2, 3]))
    monkeypatch.setattr(routerbench, "hf_hub_download", lambda **kwargs: str(not_a_frame))
    with pytest.raises(DataFormatError, match="expected a pandas DataFrame, got list"):
        load_routerbench_hub()
    corrupt = tmp_path / "corrupt.pkl"
    corrupt.write_bytes(b"\x80\x04garbage")
    monkeypatch.setattr(routerbench, "hf_hub_download", lambda **kwargs: str(corrupt))
    with pytest.raises(DataFormatError, match="corrupt.pkl: cannot unpickle"):
        load_routerbench_hub()
