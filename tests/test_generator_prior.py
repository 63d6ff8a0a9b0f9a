"""trainer.generator_prior: counts, federated sum == pooled counts, the Bradley-Terry fit against its
closed form, and no prior for unknown generators or HH-RLHF's chosen/rejected."""

from collections import Counter

import numpy as np
import pandas as pd
import pytest

from sdk.errors import InvalidInputError
from trainer.generator_prior import (aggregate_win_counts, apply_prior, client_win_counts, fit_bradley_terry,
                                     generator_logit)


def _frame(rows):
    return pd.DataFrame(rows, columns=["domain", "source_a", "source_b", "label"])


def test_counts_skip_hh_and_federated_sum_equals_pooled():
    rows = [("alpacaeval", "g", "h", 1), ("alpacaeval", "g", "h", 0), ("alpacaeval", "h", "g", 0),
            ("routerbench", "m", "g", 1), ("hh_harmless", "chosen", "rejected", 1)]
    f = _frame(rows)
    assert client_win_counts(f) == Counter({("g", "h"): 2, ("h", "g"): 1, ("m", "g"): 1})
    parts = [client_win_counts(f.iloc[:2]), client_win_counts(f.iloc[2:])]
    assert aggregate_win_counts(parts) == client_win_counts(f)


def test_two_generators_match_the_closed_form():
    # g beats h 30 times out of 40: with weak regularisation beta_g - beta_h -> logit(0.75) = log 3
    beta = fit_bradley_terry(Counter({("g", "h"): 30, ("h", "g"): 10}), C=1e6)
    assert beta["g"] - beta["h"] == pytest.approx(np.log(3), rel=1e-3)
    assert beta["g"] + beta["h"] == pytest.approx(0, abs=1e-3)  # symmetric rows: the L2 term centres them


def test_unknown_generators_and_hh_get_no_prior():
    beta = {"g": 1.0, "h": -1.0}
    f = _frame([("alpacaeval", "g", "h", 1), ("alpacaeval", "g", "new", 1), ("hh_harmless", "g", "h", 1)])
    np.testing.assert_allclose(generator_logit(f, beta), [2.0, 0.0, 0.0])
    p = apply_prior(np.array([0.5, 0.5, 0.5]), generator_logit(f, beta), 0.5)
    np.testing.assert_allclose(p, [1 / (1 + np.exp(-1.0)), 0.5, 0.5])


def test_empty_counts_are_refused():
    with pytest.raises(InvalidInputError):
        fit_bradley_terry(Counter())
