"""FedAvg equals the sample-weighted mean; bad updates are refused before averaging."""

import numpy as np
import pytest

from sdk.errors import InvalidInputError, ShapeError
from trainer.routers.fedavg import fedavg


def test_fedavg_equals_the_sample_weighted_mean():
    rng = np.random.default_rng(0)
    updates = [({"w": rng.normal(size=(3, 2)), "b": rng.normal(size=2)}, n) for n in (5, 1, 14)]
    out = fedavg(updates)
    for key in ("w", "b"):
        expected = np.average(np.stack([u[key] for u, _ in updates]), axis=0, weights=[5, 1, 14])
        np.testing.assert_allclose(out[key], expected, rtol=1e-12)


def test_fedavg_hand_computed():
    out = fedavg([({"x": np.array([0.0, 4.0])}, 1), ({"x": np.array([4.0, 0.0])}, 3)])
    assert out["x"].tolist() == [3.0, 1.0]


def test_single_update_is_returned_unchanged():
    w = np.arange(6.0).reshape(2, 3)
    assert np.array_equal(fedavg([({"w": w}, 7)])["w"], w)


@pytest.mark.parametrize(
    "updates, error, message",
    [
        ([], InvalidInputError, "at least one"),
        ([({"w": np.ones(2)}, 0)], InvalidInputError, "n_examples"),
        ([({"w": np.ones(2)}, -3)], InvalidInputError, "n_examples"),
        ([({"w": np.ones(2)}, float("nan"))], InvalidInputError, "n_examples"),
        ([({"w": np.ones(2)}, 1), ({"w": np.ones(3)}, 1)], ShapeError, "update 1: 'w' has shape"),
        ([({"w": np.ones(2)}, 1), ({"v": np.ones(2)}, 1)], ShapeError, "parameter names"),
        ([({"w": np.ones(2)}, 1), ({"w": np.array([1.0, np.nan])}, 1)], ShapeError, "NaN or inf"),
    ],
)
def test_bad_updates_are_refused(updates, error, message):
    with pytest.raises(error, match=message):
        fedavg(updates)
