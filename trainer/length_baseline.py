"""Length-only and structure-feature baselines of the preference tables: logistic regression on pair features.

Design notes: docs/prism.md (Module notes).
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd

from sdk.errors import InvalidInputError
from sdk.pair_encoding import LENGTH_FEATURE_NAMES
from sdk.pair_features import PROMPT_FEATURES, check_feature_names, pair_features_many
from trainer.data.errors import DataFormatError
from trainer.preference_metrics import pairwise_accuracy


#: Inverse L2 strength of the structure-feature baseline, chosen on validation pairs with its features
#: (``benchmarks/pair_features_settings.py``, docs/pair_features_settings.json).
STRUCTURE_C = 10.0


def _features(df: pd.DataFrame, names: tuple[str, ...]) -> np.ndarray:
    reads_prompt = bool(set(names) & set(PROMPT_FEATURES))
    for col in ("prompt",) * reads_prompt + ("response_a", "response_b", "domain"):
        if col not in df.columns:
            raise DataFormatError("missing column", path="<pairs frame>", column=col)
    prompts = list(df["prompt"]) if reads_prompt else [""] * len(df)  # no feature of `names` reads it
    return pair_features_many(prompts, list(df["response_a"]), list(df["response_b"]), names).astype(np.float64)


class LengthBaseline:
    """Logistic regression on pair features (length by default), global or one per domain.

    Parameters
    ----------
    per_domain : bool, one model per ``domain`` value (default) or one global model.
    C : float > 0, inverse L2 strength of scikit-learn's LogisticRegression.
    features : names of :data:`sdk.pair_features.FEATURE_NAMES` (default the 3 length features).

    Attributes
    ----------
    coef_ : dict domain -> ndarray of shape (len(features),), float64 (key ``'*'`` for the global model).

    Raises
    ------
    InvalidInputError
        An unknown feature name.
    """

    def __init__(self, per_domain: bool = True, C: float = 1.0, features=LENGTH_FEATURE_NAMES) -> None:
        self.per_domain = per_domain
        self.C = C
        self.features = check_feature_names(features)

    def _key(self, domain: str) -> str:
        return domain if self.per_domain else "*"

    def fit(self, df: pd.DataFrame) -> LengthBaseline:
        """Fit on a pairs frame (needs ``response_a``, ``response_b``, ``domain``, ``label``).

        Raises
        ------
        DataFormatError
            A needed column is missing.
        InvalidInputError
            A domain (or the whole frame) holds only one label value.
        """
        from sklearn.linear_model import LogisticRegression  # sklearn: optional heavy dependency, imported on use

        if "label" not in df.columns:
            raise DataFormatError("missing column", path="<pairs frame>", column="label")
        x, y = _features(df, self.features), df["label"].to_numpy(dtype=np.int64)
        keys = df["domain"].map(self._key).to_numpy()
        self.coef_ = {}
        for k in sorted(set(keys)):
            sel = keys == k
            if len(np.unique(y[sel])) < 2:
                raise InvalidInputError(f"domain {k!r}: the labels hold one value only; cannot fit")
            lr = LogisticRegression(C=self.C, fit_intercept=False).fit(x[sel], y[sel])
            self.coef_[k] = lr.coef_[0].copy()
        return self

    def predict_proba(self, df: pd.DataFrame) -> np.ndarray:
        """P(response_a better) of each pair: ndarray of shape (n_pairs,), float64.

        Raises
        ------
        InvalidInputError
            Not fitted, or a domain not seen by ``fit`` (per-domain model).
        """
        if not hasattr(self, "coef_"):
            raise InvalidInputError("LengthBaseline is not fitted: call fit(df) first")
        x = _features(df, self.features)
        keys = df["domain"].map(self._key).to_numpy()
        unknown = sorted(set(keys) - set(self.coef_))
        if unknown:
            raise InvalidInputError(f"domains {unknown} were not seen by fit (known: {sorted(self.coef_)})")
        w = np.stack([self.coef_[k] for k in keys]) if len(keys) else np.zeros((0, x.shape[1]))
        return 1.0 / (1.0 + np.exp(-(x * w).sum(axis=1)))


def cross_validated_accuracy(df: pd.DataFrame, per_domain: bool, n_folds: int = 5, seed: int = 0) -> dict[str, float]:
    """Accuracy per domain of :class:`LengthBaseline` under ``n_folds``-fold cross-validation by prompt_id."""

    ids = np.array(sorted(df["prompt_id"].unique()))
    fold_of = dict(zip(ids, np.random.default_rng(seed).permutation(len(ids)) % n_folds))
    fold = df["prompt_id"].map(fold_of).to_numpy()
    proba = np.zeros(len(df))
    for k in range(n_folds):
        model = LengthBaseline(per_domain=per_domain).fit(df[fold != k])
        proba[fold == k] = model.predict_proba(df[fold == k])
    y = df["label"].to_numpy()
    out = {d: pairwise_accuracy(proba[df["domain"].to_numpy() == d], y[df["domain"].to_numpy() == d])
           for d in sorted(df["domain"].unique())}
    out["overall"] = pairwise_accuracy(proba, y)
    return out


def main(argv: list[str]) -> None:
    """``python -m trainer.length_baseline DATA_DIR``: print the cross-validated length-only accuracies."""
    from trainer.data.preferences import load_preference_pairs  # trainer.data.preferences imports pandas: on use only

    data = argv[0] if argv else "../shared/data"
    for equal in ("drop", "keep"):
        df = load_preference_pairs(data, equal_length=equal)
        for per_domain in (True, False):
            acc = cross_validated_accuracy(df, per_domain)
            name = "per-domain" if per_domain else "global"
            print(f"equal_length={equal} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
