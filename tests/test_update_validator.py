"""The one update validator (:func:`trainer.federated.update_checks.check_kmeans_update`) on every class
of refusal, through the three ways an update reaches it: the HTTPS server with a MessagePack body,
with a JSON body (:func:`trainer.server.validation.validate_update`, 422 naming the field) and a
Flower strategy (the arrays as a reply carries them). Also the difference and sample-count checks."""

from __future__ import annotations

import json
import time

import msgpack
import numpy as np
import pytest

from sdk.errors import InvalidInputError, PrivacyError, ShapeError
from trainer.federated.kmeans_aggregation import AggregationConfig
from trainer.server import round_kinds
from trainer.server.errors import UploadRejected
from trainer.server.round_kind import round_settings
from trainer.server.store import Store
from trainer.federated.update_checks import check_kmeans_update
from trainer.server.validation import decode_body, parse_kmeans_body, validate_update

N_CELLS, D_EMB, MODELS, MIN_COUNT = 4, 3, ("a", "b"), 2


@pytest.fixture(scope="module")
def round_(tmp_path_factory):
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('fast') / 'fed.db'}")
    r = store.open_round(kind="kmeans", models=list(MODELS), embedder={"name": "e", "dim": D_EMB},
                         deadline_unix=time.time() + 3600, quorum=10, min_count=MIN_COUNT,
                         settings=round_settings(aggregation=AggregationConfig()),
                         centroids=np.eye(N_CELLS, D_EMB, dtype=np.float32))
    yield r
    store.close()


def base_fields() -> dict:
    """A valid update: counts 2 and 3, scores 0.5 per query, 0.002 USD per query; cells 1 and 3
    reported over 2 and 4 queries; log size 10."""
    count = np.zeros((N_CELLS, len(MODELS)))
    count[0, 0], count[1, 1] = 2, 3
    return {"count": count, "sum_accuracy": count * 0.5, "sum_cost": count * 0.002,
            "centroid_cells": np.array([1, 3]), "local_centroids": np.array([[0.0, 0.6, 0.1], [0.5, 0.5, 0.5]]),
            "local_weights": np.array([2.0, 4.0]), "log_size": 10}


def _set(name, index, value):
    def change(f):
        f[name] = np.array(f[name], dtype=np.float64 if name != "centroid_cells" else np.int64)
        f[name][index] = value
    return change


TOLERANCE_NEG = -1e-12  # a score sum below 0 within sdk.CellStatistics' tolerance: accepted by the field checks
CASES = {
    "valid": lambda f: None,
    "count NaN": _set("count", (2, 1), np.nan),
    "count +inf": _set("count", (2, 1), np.inf),
    "count -inf": _set("count", (2, 1), -np.inf),
    "count negative": _set("count", (2, 1), -2.0),
    "count fraction": _set("count", (1, 1), 3.5),
    "count below min_count": _set("count", (2, 1), 1.0),
    "count above MAX_COUNT": _set("count", (2, 1), 2.0**31),
    "counts above log_size": _set("count", (2, 1), 6.0),
    "score NaN": _set("sum_accuracy", (0, 0), np.nan),
    "score above count": _set("sum_accuracy", (0, 0), 2.1),
    "score above count within tolerance": _set("sum_accuracy", (0, 0), 2.0 + 1e-10),
    "score below 0 within tolerance": _set("sum_accuracy", (0, 0), TOLERANCE_NEG),
    "score below 0 where count is 0": _set("sum_accuracy", (3, 0), TOLERANCE_NEG),
    "score where count is 0": _set("sum_accuracy", (3, 0), 1e-300),
    "score negative": _set("sum_accuracy", (0, 0), -0.5),
    "cost negative": _set("sum_cost", (0, 0), -0.001),
    "cost -0.0": _set("sum_cost", (3, 0), -0.0),
    "cost above the bound": _set("sum_cost", (1, 1), 3000.5),
    "cost at the bound": _set("sum_cost", (1, 1), 3000.0),
    "cost inf": _set("sum_cost", (1, 1), np.inf),
    "cost where count is 0": _set("sum_cost", (3, 1), 1e-300),
    "cells repeated": _set("centroid_cells", 1, 1),
    "cell out of range": _set("centroid_cells", 1, N_CELLS),
    "cell negative": _set("centroid_cells", 1, -1),
    "mean NaN": _set("local_centroids", (0, 1), np.nan),
    "mean inf": _set("local_centroids", (0, 1), np.inf),
    "mean norm above 1": _set("local_centroids", (0, 1), 1.0001),
    "mean norm at the bound": _set("local_centroids", (0, 1), 1.0 + 1e-4),
    "mean norm just below the bound": _set("local_centroids", (0, 1), 1.0 + 0.99e-4),
    "weight fraction": _set("local_weights", 0, 2.5),
    "weight below threshold": _set("local_weights", 0, 1.0),
    "weight NaN": _set("local_weights", 0, np.nan),
    "weight -inf": _set("local_weights", 0, -np.inf),
    "weights above log_size": _set("local_weights", 1, 9.0),
    "nothing reported": lambda f: f.update(count=np.zeros((N_CELLS, 2)), sum_accuracy=np.zeros((N_CELLS, 2)),
                                           sum_cost=np.zeros((N_CELLS, 2)), centroid_cells=np.zeros(0, np.int64),
                                           local_centroids=np.zeros((0, D_EMB)), local_weights=np.zeros(0)),
    "means only": lambda f: f.update(count=np.zeros((N_CELLS, 2)), sum_accuracy=np.zeros((N_CELLS, 2)),
                                     sum_cost=np.zeros((N_CELLS, 2))),
    "counts only": lambda f: f.update(centroid_cells=np.zeros(0, np.int64), local_centroids=np.zeros((0, D_EMB)),
                                      local_weights=np.zeros(0)),
    "count of another shape": lambda f: f.update(count=np.zeros((N_CELLS, 3))),
    "means of another dimension": lambda f: f.update(local_centroids=np.zeros((2, D_EMB + 1))),
    "fewer weights than cells": lambda f: f.update(local_weights=np.array([2.0])),
}


def body_of(r, fields: dict, media: str):
    """The parsed body (:class:`KMeansBody`) of ``fields`` sent as MessagePack or JSON."""
    wire = {"client_id": "alice", "round_id": r.id, "kind": "kmeans", "centroids_hash": r.centroids_hash,
            "models": list(MODELS), "log_size": fields["log_size"]}
    for name, dtype in (("count", "<f8"), ("sum_accuracy", "<f8"), ("sum_cost", "<f8"), ("centroid_cells", "<i8"),
                        ("local_centroids", "<f4"), ("local_weights", "<f8")):
        a = np.asarray(fields[name])
        if media == "application/msgpack":
            a = np.ascontiguousarray(a, dtype=dtype)
            wire[name] = [list(a.shape), a.tobytes()]
        else:
            wire[name] = a.tolist()
    raw = msgpack.packb(wire) if media == "application/msgpack" else json.dumps(wire).encode()
    try:
        return parse_kmeans_body(decode_body(raw, media))
    except UploadRejected:
        return None  # refused by the field types already (a negative cell in JSON), before either check


#: The field each case's refusal names (None: accepted), and whether it is the privacy rule.
EXPECTED = {
    "valid": None, "means only": None, "counts only": None, "cost at the bound": None, "cost -0.0": None,
    "score above count within tolerance": None, "score below 0 within tolerance": None,
    **{case: "count" for case in ("count NaN", "count +inf", "count -inf", "count negative", "count fraction",
                                          "count above MAX_COUNT", "counts above log_size", "count below min_count",
                                          "count of another shape")},
    "nothing reported": "count",
    **dict.fromkeys(("score NaN", "score above count", "score negative", "score where count is 0",
                     "score below 0 where count is 0"), "sum_accuracy"),
    **dict.fromkeys(("cost negative", "cost above the bound", "cost inf", "cost where count is 0"), "sum_cost"),
    **dict.fromkeys(("cells repeated", "cell out of range", "cell negative"), "centroid_cells"),
    **dict.fromkeys(("mean NaN", "mean inf", "mean norm above 1", "mean norm at the bound",
                     "mean norm just below the bound", "means of another dimension"), "local_centroids"),
    **dict.fromkeys(("weight fraction", "weight below threshold", "weight NaN", "weight -inf",
                     "weights above log_size", "fewer weights than cells"), "local_weights"),
}
PRIVACY = {"count below min_count", "weight below threshold"}


def test_every_case_has_an_expected_verdict():
    assert set(EXPECTED) == set(CASES)


def server_verdict(r, fields: dict, media: str) -> str | None:
    """The field the server's 422 names for ``fields`` sent as ``media``, or None when accepted."""
    body = body_of(r, fields, media)
    if body is None:
        return "centroid_cells"  # a negative cell in JSON: refused by its type already
    try:
        validate_update(body, r)
    except UploadRejected as exc:
        assert exc.status == 422
        return exc.detail.split(":")[0]
    return None


def flower_verdict(fields: dict) -> tuple[str | None, type | None]:
    """(field named, error type) of the validator on the arrays of a Flower reply, (None, None) if accepted."""
    arrays = {k: np.asarray(v, dtype=np.int64 if k == "centroid_cells" else np.float64) for k, v in fields.items()}
    try:
        check_kmeans_update(arrays, fields["log_size"], (N_CELLS, D_EMB), len(MODELS), MIN_COUNT)
    except (ShapeError, PrivacyError) as exc:
        return str(exc).split(":")[0], type(exc)
    return None, None


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_refusal_names_its_field_on_both_encodings_and_on_flower(round_, case):
    fields = base_fields()
    CASES[case](fields)
    field = EXPECTED[case]
    for media in ("application/msgpack", "application/json"):
        assert server_verdict(round_, fields, media) == field, media
    if case == "cell negative":
        fields["centroid_cells"] = np.asarray(fields["centroid_cells"])
    expected_type = None if field is None else PrivacyError if case in PRIVACY else ShapeError
    assert flower_verdict(fields) == (field, expected_type)


def test_random_perturbations_get_one_verdict_on_every_path(round_):
    """300 updates with 1-3 random entries set to edge values: MessagePack, JSON and Flower accept the
    same ones and name the same field for the others; accepted updates keep the values sent."""
    rng = np.random.default_rng(7)
    edges = [np.nan, np.inf, -np.inf, -1.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 1e-300, -1e-300, 2.0**31]
    names = ["count", "sum_accuracy", "sum_cost", "local_centroids", "local_weights"]
    verdicts = set()
    for _ in range(300):
        fields = base_fields()
        for _ in range(rng.integers(1, 4)):
            name = names[rng.integers(len(names))]
            a = np.array(fields[name], dtype=np.float64)
            a.flat[rng.integers(a.size)] = edges[rng.integers(len(edges))] * (0.5 if name == "local_centroids" else 1)
            fields[name] = a
        field, _ = flower_verdict(fields)
        for media in ("application/msgpack", "application/json"):
            assert server_verdict(round_, fields, media) == field
        if field is None:
            update = validate_update(body_of(round_, fields, "application/json"), round_)
            np.testing.assert_array_equal(update.statistics.count, fields["count"])
            np.testing.assert_array_equal(update.local_weights, fields["local_weights"])
        verdicts.add(field)
    assert None in verdicts and len(verdicts) >= 5  # accepted and refused on several fields


def test_the_first_offending_field_in_order_is_named(round_):
    """Two broken fields: the refusal names the first in field order, not the rule across fields."""
    fields = base_fields()
    fields["count"][2, 1] = 1.0  # below min_count: a rule across fields, checked last
    fields["local_weights"] = np.array([2.5, 4.0])  # an earlier field in the order
    raw = json.dumps({"client_id": "alice", "round_id": round_.id, "kind": "kmeans",
                      "centroids_hash": round_.centroids_hash, "models": list(MODELS), "log_size": 10,
                      **{k: np.asarray(v).tolist() for k, v in fields.items() if k != "log_size"}}).encode()
    with pytest.raises(UploadRejected) as info:
        round_kinds.validate_upload(round_kinds.parse_upload(raw, "application/json"), round_)
    assert info.value.status == 422 and info.value.detail.split(":")[0] == "local_weights"


def _small_move_reference(update, previous, min_count: int) -> bool:
    """The rule of check_difference written out entry by entry (a hand-written reference)."""
    from sdk.local_update import centroid_threshold

    now, before = update.statistics.count, previous.statistics.count
    for k in range(now.shape[0]):
        for m in range(now.shape[1]):
            d = abs(now[k, m] - before[k, m])
            if now[k, m] > 0 and 0 < d < min_count:
                return True
    w_now = dict(zip(update.centroid_cells.tolist(), update.local_weights.tolist()))
    w_before = dict(zip(previous.centroid_cells.tolist(), previous.local_weights.tolist()))
    return any(w > 0 and 0 < abs(w - w_before.get(k, 0.0)) < centroid_threshold(min_count) for k, w in w_now.items())


def test_the_difference_check_refuses_exactly_the_small_moves():
    """300 random pairs of updates (whole counts 0-6, weights 0-6 on random cells): check_difference
    (its quick test first) refuses exactly the pairs the entry-by-entry rule finds."""
    from sdk.cell_statistics import CellStatistics
    from sdk.errors import PrivacyError
    from sdk.protocol import KMeansUpdate
    from trainer.federated.update_checks import check_difference

    rng = np.random.default_rng(3)

    def random_update(base=None):
        count = rng.integers(0, 7, size=(4, 2)).astype(float) if base is None else base.statistics.count.copy()
        if base is not None:
            count.flat[rng.integers(count.size)] = rng.integers(0, 7)
        cells = np.sort(rng.choice(4, size=rng.integers(0, 5), replace=False)).astype(np.int64)
        weights = rng.integers(0, 7, size=cells.size).astype(float)
        return KMeansUpdate(CellStatistics(count, count * 0.5, count * 0.001), cells, np.zeros((cells.size, 3)),
                            weights, 100)

    refused = 0
    for _ in range(300):
        previous = random_update()
        update = random_update(previous if rng.random() < 0.7 else None)
        min_count = int(rng.integers(1, 5))
        expected = _small_move_reference(update, previous, min_count)
        try:
            check_difference(update, previous, min_count)
            got = False
        except PrivacyError:
            got = True
        assert got == expected
        refused += got
    assert 50 < refused < 250  # both outcomes were exercised


def test_an_honest_device_whose_clipped_costs_sum_above_the_bound_by_rounding_is_accepted(tmp_path):
    """A device clips each cost to the round's max_cost_usd and sums them in float64 (sdk.local_update.kmeans_update):
    ten queries clipped to 0.03 USD sum to 0.03 * 10 + 5.6e-17, which both checks of the server compared exactly
    with count * 0.03 and answered 422 'sum_cost: is above 0.03 USD per query' to an honest device."""
    from sdk.eval_log import EvalLog
    from sdk.local_update import RoundSpec, centroids_hash, kmeans_update

    centroids = np.eye(N_CELLS, D_EMB, dtype=np.float32)
    store = Store(f"sqlite:///{tmp_path / 'fed.db'}")
    r = store.open_round(kind="kmeans", models=list(MODELS), embedder={"name": "e", "dim": D_EMB},
                         deadline_unix=time.time() + 3600, quorum=10, min_count=MIN_COUNT,
                         settings=round_settings(aggregation=AggregationConfig(max_cost_usd=0.03)), centroids=centroids)
    with EvalLog(tmp_path / "log.sqlite", MODELS) as log:
        for i in range(10):
            log.record("a", 1.0, 0.05, embedding=centroids[i % 2])  # 5 queries in each of cells 0 and 1
            log.record("b", 1.0, 0.05, embedding=centroids[0])
        update = kmeans_update(log.rows(), RoundSpec(r.id, "kmeans", centroids, centroids_hash(centroids), MODELS,
                                                     "e", D_EMB, MIN_COUNT, "", max_cost_usd=0.03))
    store.close()
    s = update.statistics
    assert s.count[0, 1] == 10 and s.sum_cost[0, 1] > 10 * 0.03  # above count * bound, by rounding only
    fields = {"count": s.count, "sum_accuracy": s.sum_accuracy, "sum_cost": s.sum_cost,
              "centroid_cells": update.centroid_cells, "local_centroids": update.local_centroids,
              "local_weights": update.local_weights, "log_size": update.log_size}
    for media in ("application/msgpack", "application/json"):
        np.testing.assert_array_equal(validate_update(body_of(r, fields, media), r).statistics.sum_cost, s.sum_cost)


@pytest.mark.parametrize("n_samples, log_size, error, message", [
    (3, 3, "PrivacyError", "need min_count=5 <= n_samples=3 <= log_size=3"),
    (20, 10, "ShapeError", "need min_count=5 <= n_samples=20 <= log_size=10"),
    (float("nan"), 10, "PrivacyError", "need min_count=5 <= n_samples=nan <= log_size=10"),
    (2.0, None, "PrivacyError", "need min_count=5 <= n_samples=2"),  # Flower's num-examples is a float
    (5, 5, None, None), (5.0, None, None, None), (10, 10, None, None),
])
def test_the_sample_count_check_shared_by_the_server_and_flower(n_samples, log_size, error, message):
    """check_sample_count is the HTTPS server's check of an MLP upload's n_samples (validate_mlp_update
    answers 422 with this message) and the Flower MoR router strategy's check of num-examples."""
    from trainer.federated.update_checks import check_sample_count

    if error is None:
        check_sample_count(n_samples, 5, log_size)
        return
    with pytest.raises(InvalidInputError) as exc:
        check_sample_count(n_samples, 5, log_size)
    assert (type(exc.value).__name__, str(exc.value)) == (error, message)
