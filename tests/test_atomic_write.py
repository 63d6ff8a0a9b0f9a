"""sdk.atomic_write: the one helper every layer writes files with."""

from __future__ import annotations

import os
import stat

import pytest

from sdk.atomic_write import commit_file, replace_dir, temporary_path, write_atomic

pytestmark = pytest.mark.sdk  # runs in the base-install venv of .ci/run too


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_write_atomic_creates_private_files_with_their_mode_from_the_start(tmp_path):
    write_atomic(tmp_path / "signing.key", b"secret", mode=0o600)
    if os.name == "posix":
        assert stat.S_IMODE((tmp_path / "signing.key").stat().st_mode) == 0o600


def test_a_failed_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    with pytest.raises(TypeError):
        write_atomic(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_commit_file_moves_a_library_written_file_into_place(tmp_path):
    target = tmp_path / "model.onnx"
    tmp = temporary_path(target)
    assert tmp.parent == tmp_path and tmp.name.startswith(".model.onnx.tmp-")
    tmp.write_bytes(b"graph")
    commit_file(tmp, target)
    assert target.read_bytes() == b"graph" and not tmp.exists()


def test_replace_dir_swaps_a_folder_in_whole(tmp_path):
    final, staged = tmp_path / "model", tmp_path / ".model.partial"
    final.mkdir()
    (final / "weights.bin").write_bytes(b"old")
    (final / "shard-2.bin").write_bytes(b"old shard")  # the new model has no second shard
    staged.mkdir()
    (staged / "weights.bin").write_bytes(b"new")
    (staged / "config.json").write_text("{}")
    replace_dir(staged, final)
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "weights.bin"]
    assert (final / "weights.bin").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staged or renamed-away folder left
    # no folder there yet: the staged one is renamed; no staged folder: an error, the target untouched
    replace_dir(final, tmp_path / "fresh")
    assert (tmp_path / "fresh" / "weights.bin").read_bytes() == b"new"
    with pytest.raises(FileNotFoundError):
        replace_dir(tmp_path / "absent", tmp_path / "fresh")
    assert (tmp_path / "fresh" / "weights.bin").read_bytes() == b"new"
