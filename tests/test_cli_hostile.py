"""Bad input to the ``fedroute`` console commands: one clear error line and exit status 2, before any
data is read or training starts (no traceback, nothing written)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from trainer.cli import app


def flat(output: str) -> str:
    """The message without rich's box and line breaks."""
    return " ".join(output.replace("│", " ").split())


@pytest.mark.parametrize("alpha", ["nan", "inf"])
def test_simulate_rejects_a_non_finite_alpha_before_reading_data(tmp_path, alpha):
    """--alpha nan used to pass typer's min=1e-6 (NaN compares False) and numpy's Dirichlet then drew NaN
    task shares: a silent wrong split after the embeddings were computed."""
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["simulate", "--alpha", alpha, "--data", str(tmp_path / "absent"),
                                      "--out", str(out)], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert f"alpha (a Dirichlet concentration) must be a finite number > 0, got {alpha}" in flat(result.output)
    assert not out.exists()
