"""The README's quick-start blocks, extracted from the markdown and run with bash, as printed.

Each block is marked by ``<!-- quickstart: NAME -->`` right before its fenced ``bash`` block. They run
in README order, each in a fresh ``bash -e`` process, in one temporary folder laid out like a clone
(``../shared/data`` beside it), with this checkout first on ``PYTHONPATH`` and an empty embedding
cache. The operator block serves on port 8443 of this machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = re.compile(r"<!-- quickstart: ([\w-]+) -->\n```bash\n(.*?)\n```", re.S)
ORDER = ["bundle", "app", "operator", "researcher"]
BLOCK_TIMEOUT_S = 900

pytestmark = pytest.mark.slow


def quickstart_blocks(markdown: str) -> dict[str, str]:
    """``{name: bash text}`` of the marked blocks, in document order."""
    blocks: dict[str, str] = {}
    for name, body in QUICKSTART.findall(markdown):
        if name in blocks:
            raise ValueError(f"quick-start block {name!r} is marked twice")
        blocks[name] = body
    return blocks


def test_the_readme_marks_the_four_quick_starts_in_order():
    blocks = quickstart_blocks((ROOT / "README.md").read_text())
    assert list(blocks) == ORDER
    assert all(len(body.splitlines()) >= 3 for body in blocks.values())


def test_block_extraction_takes_the_fenced_text_after_the_marker():
    text = "x\n<!-- quickstart: a -->\n```bash\necho 1\necho 2\n```\n```bash\nnot this\n```\n"
    assert quickstart_blocks(text) == {"a": "echo 1\necho 2"}


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def ran(tmp_path_factory, shared_data) -> dict:
    """Run the blocks in order; ``{name: (returncode, stdout, stderr, seconds)}`` plus ``"ws"``.
    A block after a failed one is not run (its entry is missing)."""
    if not _port_free(8443):
        pytest.fail("port 8443 is in use on 127.0.0.1; the operator quick start serves on it")
    base = tmp_path_factory.mktemp("quickstart")
    ws = base / "fedroute"  # the clone's place
    ws.mkdir()
    (base / "shared").mkdir()
    (base / "shared" / "data").symlink_to(shared_data.resolve(), target_is_directory=True)
    env = dict(os.environ)
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
        FEDROUTE_CACHE=str(base / "cache"),
        HF_HUB_OFFLINE="1",
    )
    results: dict = {"ws": ws}
    for name, body in quickstart_blocks((ROOT / "README.md").read_text()).items():
        start = time.monotonic()
        proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", body], cwd=ws, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            out += f"\n(timed out after {BLOCK_TIMEOUT_S} s)"
        finally:
            try:  # a server left running by a failed block
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        results[name] = (proc.returncode, out, err, time.monotonic() - start)
        print(f"quick start {name}: {results[name][3]:.1f} s, exit {proc.returncode}")
        if proc.returncode != 0:
            break
    return results


def _ok(ran: dict, name: str) -> tuple[str, str]:
    assert name in ran, f"not run: an earlier block failed ({ {k: v[0] for k, v in ran.items() if k != 'ws'} })"
    code, out, err, _ = ran[name]
    assert code == 0, f"{name} block failed (exit {code})\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"
    return out, err


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_bundle_block_writes_a_signed_parity_checked_bundle(ran):
    out, _ = _ok(ran, "bundle")
    assert re.search(r"bundle v1 \(kmeans, 11 models, embedder \['fp32', 'int8'\]\) at bundles/kmeans; parity passed", out)
    manifest = json.loads((ran["ws"] / "bundles" / "kmeans" / "manifest.json").read_text())  # v2 after the operator's round
    # the device profile: the static (model2vec) embedder, 256-d (docs/static_embedder.md)
    assert manifest["router_kind"] == "kmeans" and manifest["embedder_kind"] == "static" and manifest["embedder"]["dim"] == 256
    assert (ran["ws"] / "keys" / "signing.key").stat().st_mode & 0o077 == 0  # private key: owner only


def test_app_block_routes_and_logs_one_outcome(ran):
    from sdk import EvalLog

    out, _ = _ok(ran, "app")
    manifest = json.loads((ran["ws"] / "bundles" / "kmeans" / "manifest.json").read_text())
    models = [m["id"] for m in manifest["models"]]
    first, second = out.splitlines()[:2]
    assert first.split()[0] in models
    assert float(second.rsplit(":", 1)[1]) >= 0.0
    with EvalLog(ran["ws"] / "evals.sqlite", models) as log:
        rows = log.rows()
    assert len(rows) == 1 and rows.score[0] == 1.0 and rows.cost_usd[0] == 0.0021 and rows.query[0] is None


def test_operator_block_runs_a_round_and_a_device_installs_the_new_bundle(ran):
    out, err = _ok(ran, "operator")
    lines = _json_lines(out)
    demo = [j for j in lines if "n_recorded" in j]
    syncs = [j for j in lines if "bundle_updated" in j]
    closed = [j for j in lines if j.get("result") == "aggregated"]
    assert len(demo) == 2 and all(d["rows_in_log"] == d["n_recorded"] > 250 for d in demo)
    assert [s["uploaded"] for s in syncs] == [True, True, False]
    assert syncs[-1]["bundle_updated"] is True and syncs[-1]["bundle_version"] == 2
    assert closed and closed[0]["clients"] == ["phone-1", "phone-2"] and closed[0]["bundle_version"] == 2
    # The close message counts the clients' evaluations apart from the prior router's statistics.
    message = re.search(r"aggregated 2 clients \((\d+) evaluations, plus (\d+) of the prior\); bundle v2", err)
    assert message, err[-2000:]
    federated, prior = int(message[1]), int(message[2])
    assert 0 < federated <= sum(d["n_recorded"] for d in demo)
    assert federated + prior == closed[0]["total_count"]
    assert "vNone" not in err
    installed = json.loads((ran["ws"] / "device-1" / "bundle" / "manifest.json").read_text())
    assert installed["bundle_version"] == 2
    assert json.loads((ran["ws"] / "device-2" / "bundle" / "manifest.json").read_text())["bundle_version"] == 1


def test_researcher_block_prints_the_aucs_of_a_one_seed_run(ran):
    out, _ = _ok(ran, "researcher")
    results = json.loads((ran["ws"] / "results" / "quick" / "results.json").read_text())
    assert set(results["routers"]) == {"kmeans"}
    assert results["config"]["simulation"]["n_clients"] == 20 and results["config"]["simulation"]["alpha"] == 0.6
    zero = results["references"]["zero"]["auc"]
    assert f"zero router {round(zero, 4)}" in out
    kmeans = results["routers"]["kmeans"]
    assert f"'federated': {round(kmeans['federated']['auc_mean'], 4)}" in out
    # 20 clients: each local router sees ~110 queries and a few models; the federated one sees them all.
    assert kmeans["federated"]["auc_mean"] > kmeans["local"]["auc_mean"] + 0.03
