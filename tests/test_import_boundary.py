"""``import sdk`` must not pull in torch, transformers, sentence-transformers, trainer or export."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.sdk  # runs in the base-install venv of .ci/run too

FORBIDDEN = ("torch", "transformers", "sentence_transformers", "trainer", "export", "sklearn",
             "fastapi", "uvicorn", "sqlalchemy", "flwr", "dp_accounting", "ray")


def test_import_sdk_loads_no_heavy_or_server_side_package():
    code = (
        "import sys, sdk, sdk.utility, sdk.voronoi, sdk.cell_statistics, sdk.personalisation, sdk.errors\n"
        "import sdk.sync, sdk.sync_cli, sdk.local_update, sdk.bundle_install, sdk.router, sdk.eval_log, sdk.pair_encoding\n"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
