"""Federated rounds over a model pool changed by ``fedroute add-model`` (trainer/server/pool_changes.py).

K-means: uploads made for the narrower pool are migrated by model id (a zero column for the new
model) and merged; an upload naming a model the round lacks is kept but not merged; a prior router
or a bundle of another pool is refused with a message. Devices align their record of the last sent
update by model id, so the privacy hold works across the change. MLP: a round from a router whose
pool differs from the bundle's is refused.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from export.bundle_writer import write_bundle
from export.pipeline import assemble
from export.publish import BundlePublisher
from export.signing import load_signing_key
from sdk.cell_statistics import CellStatistics
from sdk.errors import BundleError, InvalidInputError
from sdk.eval_log import Evaluations
from sdk.local_update import hold_small_changes, kmeans_update
from sdk.protocol import RoundSpec, centroids_hash, decode_sent_record, encode_sent_record
from tests.conftest import BUNDLE_MAX_TOKENS
from trainer.federated.kmeans_aggregation import AggregationConfig
from trainer.routers.add_model import add_model_kmeans, add_model_mlp
from trainer.server.app import create_app
from trainer.server.kmeans_rounds import KMeansRoundKind, open_round_from_bundle
from trainer.server.mlp_rounds import MlpRoundKind
from trainer.server.pool_changes import widen_update
from trainer.server.round_kind import OpenRequest, round_settings
from trainer.server.rounds import close_round
from trainer.server.store import Store

NEW = "budget-genius"


def _bundle(router, out, exported_embedder, signing_keys):
    exported, _ = exported_embedder
    parts, fields = assemble(router, exported, None, "all-MiniLM-L6-v2", BUNDLE_MAX_TOKENS, "left", {}, 1)
    write_bundle(out, parts, fields, load_signing_key(signing_keys[0]))
    return out


@pytest.fixture(scope="module")
def pools(fitted_routers, exported_embedder, signing_keys, tmp_path_factory):
    """Bundles and router folders of the fitted K-means / MLP routers and of the same routers + NEW."""
    tmp = tmp_path_factory.mktemp("pools")
    emb = fitted_routers["test_embeddings"][:20]
    out = {}
    for kind, add in (("kmeans", add_model_kmeans), ("mlp", add_model_mlp)):
        narrow = fitted_routers[kind]
        wide = add(narrow, NEW, emb, np.ones(20), np.full(20, 1e-5), 1e-5)
        wide.save(tmp / f"{kind}_wide_router")
        out[kind] = {"narrow": _bundle(narrow, tmp / f"{kind}_narrow", exported_embedder, signing_keys),
                     "wide": _bundle(wide, tmp / f"{kind}_wide", exported_embedder, signing_keys),
                     "wide_router": tmp / f"{kind}_wide_router", "narrow_router": fitted_routers["dir"] / kind}
    return out


def body(r, client, entries, log_size=None):
    """A valid K-means upload for round ``r``: ``entries`` maps (cell, model index) -> count (score 1/2, cost 0.002)."""
    k, m, d = r.centroids.shape[0], len(r.models), r.centroids.shape[1]
    count = np.zeros((k, m))
    for (cell, model), n in entries.items():
        count[cell, model] = n
    mean = np.zeros(d)
    mean[0] = 0.6
    return {"client_id": client, "round_id": r.id, "kind": "kmeans", "centroids_hash": r.centroids_hash,
            "models": list(r.models), "log_size": int(log_size or count.sum()), "count": count.tolist(),
            "sum_accuracy": (count * 0.5).tolist(), "sum_cost": (count * 0.002).tolist(), "centroid_cells": [0],
            "local_centroids": [mean.tolist()], "local_weights": [2.0]}


def test_kmeans_rounds_migrate_uploads_of_the_narrower_pool_and_keep_those_of_a_wider_one(pools, signing_keys,
                                                                                          tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'fed.db'}")
    tokens = {c: store.add_client(c) for c in ("alice", "bob", "carol")}
    b = pools["kmeans"]

    def open_over(bundle):
        return open_round_from_bundle(store, bundle, signing_keys[1], deadline_s=3600, quorum=100, min_count=2,
                                      settings=round_settings(aggregation=AggregationConfig()))

    app = create_app(store, b["narrow"], max_body_bytes=1 << 20, tick_s=60, publisher=BundlePublisher())
    with TestClient(app, base_url="https://testserver") as http:
        def post(r, payload, client):
            return http.post(f"/v1/rounds/{r.id}/updates", content=json.dumps(payload).encode(),
                             headers={"Authorization": f"Bearer {tokens[client]}", "Idempotency-Key": f"{client}{r.id}",
                                      "Content-Type": "application/json"})

        r1 = open_over(b["narrow"])
        n_old = len(r1.models)
        alice = body(r1, "alice", {(0, 0): 2, (1, 2): 3})
        assert post(r1, alice, "alice").status_code == 201
        close_round(store, r1.id)
        r2 = open_over(b["wide"])  # same centroids, one more model
        assert r2.centroids_hash == r1.centroids_hash and r2.models == (*r1.models, NEW)
        bob = body(r2, "bob", {(0, 1): 2, (2, n_old): 4})  # bob logged the new model
        assert post(r2, bob, "bob").status_code == 201
        outcome = close_round(store, r2.id)
        assert outcome.clients == ["alice", "bob"]  # alice counted with her upload for the narrower pool
        agg = store.aggregate_of(r2.id)
        expected = np.array(bob["count"])
        expected[:, :n_old] += np.array(alice["count"])  # alice's column for NEW: zeros
        np.testing.assert_array_equal(agg["count"], expected)
        np.testing.assert_allclose(agg["sum_accuracy"], expected * 0.5)
        # Back to the narrower pool: bob's latest upload has NEW, which this round lacks.
        r3 = open_over(b["narrow"])
        assert post(r3, body(r3, "carol", {(0, 0): 5}), "carol").status_code == 201
        messages = []
        outcome = close_round(store, r3.id, progress=messages.append)
        assert outcome.clients == ["alice", "carol"]
        assert any("['bob'] name models this round's pool lacks; not merged" in m for m in messages)
        assert store.count_updates() == 3  # kept, not lost
    store.close()


def test_widen_update_places_columns_by_model_id_and_refuses_a_removed_model():
    from sdk.protocol import KMeansUpdate

    stats = CellStatistics(np.array([[2.0, 3.0]]), np.array([[1.0, 3.0]]), np.array([[0.1, 0.2]]))
    update = KMeansUpdate(stats, np.array([0]), np.zeros((1, 4)), np.array([5.0]), 5, np.array([5]))
    wide = widen_update(update, ["a", "b"], ["b", "new", "a"])
    np.testing.assert_array_equal(wide.statistics.count, [[3.0, 0.0, 2.0]])
    np.testing.assert_array_equal(wide.statistics.sum_cost, [[0.2, 0.0, 0.1]])
    assert wide.log_size == 5 and wide.local_weights.tolist() == [5.0]
    with pytest.raises(ValueError, match=r"models \['a'\] are not in the pool"):
        widen_update(update, ["a", "b"], ["b", "new"])


def test_a_prior_router_of_another_pool_and_a_bundle_changed_mid_round_are_refused(pools, signing_keys, tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'fed.db'}")
    b = pools["kmeans"]
    request = OpenRequest(bundle_dir=b["wide"], public_key=signing_keys[1], deadline_s=3600, quorum=2, min_count=2,
                          options={"prior_router": str(b["narrow_router"])})
    with pytest.raises(InvalidInputError, match="--prior-router"):
        KMeansRoundKind().open(store, request)
    ok = OpenRequest(bundle_dir=b["wide"], public_key=signing_keys[1], deadline_s=3600, quorum=2, min_count=2,
                     options={"prior_router": str(b["wide_router"])})
    assert KMeansRoundKind().open(store, ok).models[-1] == NEW
    store.close()
    # Publishing statistics of the narrower pool into the wider bundle is refused, not crashed.
    from trainer.server.errors import PublishRefused
    from trainer.server.kmeans_rounds import publish_kmeans
    from trainer.routers.kmeans_router import KMeansRouter

    narrow = KMeansRouter.load(b["narrow_router"])
    with pytest.raises(PublishRefused, match="model pool"):
        publish_kmeans(BundlePublisher(), b["wide"], signing_keys[0], narrow.centroids_, narrow.statistics_,
                       prior_strength=1.0, model_prior_strength=1.0, prior="model", provenance={})


def test_an_mlp_round_from_a_router_of_another_pool_than_the_bundle_is_refused(pools, signing_keys, tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'fed.db'}")
    b = pools["mlp"]
    for bundle, router in ((b["narrow"], b["wide_router"]), (b["wide"], b["narrow_router"])):
        request = OpenRequest(bundle_dir=bundle, public_key=signing_keys[1], deadline_s=3600, quorum=2, min_count=2,
                              options={"router": str(router)})
        with pytest.raises(BundleError, match="lists other models than the router's"):
            MlpRoundKind().open(store, request)
    request = OpenRequest(bundle_dir=b["wide"], public_key=signing_keys[1], deadline_s=3600, quorum=2, min_count=2,
                          options={"router": str(b["wide_router"])})
    assert MlpRoundKind().open(store, request).models[-1] == NEW
    store.close()


def test_a_device_holds_small_changes_across_a_pool_change():
    centroids = np.eye(2, 3, dtype=np.float32)

    def spec(models):
        return RoundSpec(1, "kmeans", centroids, centroids_hash(centroids), tuple(models), "e", 3, 2, "2030-01-01T00:00Z")

    def log(models):
        n = len(models)
        x = np.tile(np.array([[1.0, 0.0, 0.0]], dtype=np.float32), (n, 1))
        x[:, 1] = np.arange(n) * 1e-3  # distinct embeddings
        return Evaluations(np.arange(n), np.zeros(n), tuple(models), np.ones(n), np.full(n, 0.001), np.full(n, np.nan),
                           np.full(n, -1), x, np.full(n, -1), (None,) * n)

    narrow, wide = spec(["a", "b"]), spec(["a", "b", NEW])
    sent = kmeans_update(log(["a"] * 4 + ["b"] * 2), narrow)
    record = encode_sent_record(sent, narrow)
    aligned = decode_sent_record(record, wide)
    np.testing.assert_array_equal(aligned.statistics.count[0], [4, 2, 0])
    # One query of NEW since: a change of 1 < min_count = 2 is held back (NEW reported as 0) ...
    now = kmeans_update(log(["a"] * 4 + ["b"] * 2 + [NEW]), wide)
    held = hold_small_changes(now, aligned, 2)
    np.testing.assert_array_equal(held.statistics.count[0], [4, 2, 0])
    # ... two are reported.
    now = kmeans_update(log(["a"] * 4 + ["b"] * 2 + [NEW] * 2), wide)
    np.testing.assert_array_equal(hold_small_changes(now, aligned, 2).statistics.count[0], [4, 2, 2])
