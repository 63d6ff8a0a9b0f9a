"""Shared fixtures: the read-only real data beside the checkout (../shared/data)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FEDROUTE_SHARED_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path of ``../shared/data``; the tests need it (CI lays it beside the clone)."""
    if not (SHARED_DATA / "routerbench" / "train.parquet").exists():
        pytest.fail(f"shared data not found at {SHARED_DATA}; set FEDROUTE_SHARED_DATA")
    return SHARED_DATA


@pytest.fixture(scope="session")
def routerbench_dir(shared_data: Path) -> Path:
    return shared_data / "routerbench"
