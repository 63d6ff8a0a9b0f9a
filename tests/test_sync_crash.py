"""kill -9 of the aggregation server mid-round, under concurrent uploads (ARCHITECTURE.md §6).

The small-scale version of ``benchmarks/sync_load.py``'s crash run, with the same code
(``tests/sync_fleet.py``): a real ``fedroute serve`` over TLS on 127.0.0.1 and a real SQLite
file, 8 devices uploading synthetic K-means statistics (32 cells x the bundle's 11 models) back to
back, SIGKILL mid-load, restart on the same database and port while the devices retry with the same
``Idempotency-Key``. No speed is asserted: only that no acknowledged upload is lost, no key is stored
twice, and the round then closes with the sum of each device's latest acknowledged counts.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sync_fleet import (
    Fleet,
    ServerProcess,
    check_recovery,
    deploy,
    fetch_round,
    run_with_kill,
    synthetic_uploads,
)

pytestmark = pytest.mark.slow

N_DEVICES = 8


def test_kill_9_mid_round_loses_no_acknowledged_upload(tmp_path, make_bundle, signing_keys):
    bundle = make_bundle(tmp_path / "bundle")
    d = deploy(tmp_path / "server", bundle, signing_keys[1], n_clients=N_DEVICES, n_cells=32, min_count=2)
    server = ServerProcess.for_deployment(d, tick_s=0.2).start()
    try:
        spec = fetch_round(server.url, d, "dev000")
        rng = np.random.default_rng(0)
        uploads = {c: synthetic_uploads(spec, c, rng, log_sizes=(200, 400)) for c in d.tokens}
        fleet = Fleet(server.url, d, uploads, retry_grace_s=30.0)
        load, times = asyncio.run(run_with_kill(fleet, server, duration_s=4.0, kill_at_s=1.5, clients=list(d.tokens)))
        check = check_recovery(fleet, load.acks)
    finally:
        server.stop()

    assert spec.centroids.shape == (32, 384) and len(spec.models) == 11
    assert server.starts == 2
    # The kill landed mid-load: receipts before it and from the restarted process after it, and
    # the devices saw the dead connection.
    assert any(a.acked_s < times["kill_s"] for a in load.acks)
    assert any(a.acked_s > times["ready_s"] for a in load.acks)
    assert sum(load.errors.values()) > 0, load.errors
    assert not load.rejected, load.rejected_details
    assert load.gave_up == 0
    assert check.acknowledged == len(load.acks) > 0
    assert check.acknowledged_missing == 0
    assert check.receipt_mismatch == 0
    assert check.duplicate_keys == 0
    assert check.stored_unacknowledged == 0
    assert check.retried > 0
    assert (check.replayed, check.replay_mismatch) == (N_DEVICES, 0)
    assert check.outcome["result"] == "aggregated"
    assert check.outcome["clients"] == sorted(d.tokens)
    assert check.outcome["on_time_updates"] == check.acknowledged
    assert check.aggregated_total_count == check.expected_total_count > 0
    assert check.count_matrix_equal
