"""The exception tree (sdk/errors.py): each error is raised as its most specific class."""

from __future__ import annotations

import numpy as np
import pytest

from sdk.cell_statistics import CellStatistics
from sdk.errors import FedrouteError, InvalidInputError, PayloadError, PrivacyError, ShapeError

pytestmark = pytest.mark.sdk  # runs in the base-install venv of .ci/run too


def test_the_tree():
    for cls in (PrivacyError, PayloadError, ShapeError):
        assert issubclass(cls, InvalidInputError) and issubclass(cls, ValueError)
    assert not issubclass(PrivacyError, ShapeError) and not issubclass(PayloadError, ShapeError)
    from trainer.server.errors import IdempotencyKeyReused, PublishRefused, ServerError, UploadRejected

    for cls in (UploadRejected, PublishRefused, IdempotencyKeyReused):
        assert issubclass(cls, ServerError) and issubclass(cls, FedrouteError) and not issubclass(cls, KeyError)


def raised(fn) -> type:
    with pytest.raises(FedrouteError) as info:
        fn()
    return type(info.value)


def test_values_that_are_not_shapes_are_not_shape_errors():
    from trainer.metrics import normalise_cost
    from trainer.routers.shrinkage import shrunk_means

    stats = CellStatistics(np.array([[2.0]]), np.array([[1.0]]), np.array([[0.1]]))
    assert raised(lambda: shrunk_means(stats, 1.0, 0.0, "median")) is InvalidInputError
    assert raised(lambda: shrunk_means(stats, -1.0, 0.0, "additive")) is InvalidInputError
    assert raised(lambda: normalise_cost(np.array([1.0]), 2.0, 2.0)) is InvalidInputError


def test_a_privacy_violation_is_a_privacy_error():
    from sdk.local_update import KMeansUpdate
    from trainer.federated.update_checks import check_difference

    def update(count):
        return KMeansUpdate(CellStatistics(np.array([[count]]), np.array([[0.0]]), np.array([[0.0]])),
                            np.zeros(0, np.int64), np.zeros((0, 2)), np.zeros(0), 40)

    assert raised(lambda: check_difference(update(31.0), update(30.0), 5)) is PrivacyError
    check_difference(update(35.0), update(30.0), 5)  # moved by min_count: allowed


def test_bytes_that_do_not_decode_are_payload_errors():
    pytest.importorskip("safetensors")
    from trainer.federated.mlp_local import read_parameters

    assert raised(lambda: read_parameters(b"not safetensors")) is PayloadError
