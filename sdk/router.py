"""``Router``: load a signed bundle and choose, on the device, the model that maximises utility.

``choose(query, lam)`` embeds the query, predicts each model's accuracy and cost in USD (MLP head or K-means
cell table) and returns ``argmax_m A(x, m) - lam * C(x, m)`` with the METRICS.md tie-break (paper 002,
"Overall framework"); ``lam`` is in USD^-1 (``lam = 100`` trades 0.01 accuracy for 0.0001 USD per query).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from sdk import bundle_manifest as fmt
from sdk import kinds
from sdk.arrays import finite_rows
from sdk.bundle_install import read_version
from sdk.embedder import check_text
from sdk.errors import BudgetError, InvalidInputError, InvalidQueryError
from sdk.real_numbers import finite_float, shown
from sdk.utility import _decide_unchecked, check_lambda

#: Upper end of the lambda search in :meth:`Router.lam_for_budget`, USD^-1.
MAX_LAMBDA = 1e12
#: ``precision="auto"`` loads the first of these the bundle ships (fastest first; each passed the export's parity gate).
AUTO_PRECISIONS = ("int8-all", "int8", "fp32")

F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class ModelInfo:
    """One entry of the bundle's price table: the model ``id`` as the app's LLM client names it, list prices in
    USD per 1000 tokens and the mean cost of one query in the training logs (USD), each None when unknown."""

    id: str
    price_per_1k_input_usd: float | None
    price_per_1k_output_usd: float | None
    mean_cost_usd: float | None


@dataclass(frozen=True)
class ModelScore:
    """Prediction for one model: accuracy in [0, 1], cost in USD per query, utility ``A - lam*C``
    (all NaN when the router has no estimate for this model)."""

    model: str
    accuracy: float
    cost_usd: float
    utility: float


@dataclass(frozen=True)
class Choice:
    """The routing decision for one query.

    Attributes
    ----------
    model, index : chosen model id and its position in :attr:`Router.model_ids`.
    accuracy, cost_usd, utility : predictions for the chosen model (cost in USD per query).
    lam : the trade-off used, USD^-1.
    scores : one :class:`ModelScore` per model, in :attr:`Router.model_ids` order.
    embedding : (d_emb,) float32 query embedding (stays on the device; an EvalLog stores it for the sync).
    cell : Voronoi cell id for a K-means router, else None.
    policy, propensity : ``"greedy"`` (1.0) or an :class:`sdk.Explorer`'s policy and the probability in (0, 1]
        that it chose ``model``.
    """

    model: str
    index: int
    accuracy: float
    cost_usd: float
    utility: float
    lam: float
    scores: tuple[ModelScore, ...]
    embedding: npt.NDArray[np.float32]
    cell: int | None
    bundle_version: int
    policy: str = "greedy"
    propensity: float = 1.0


def check_query(query: object, position: int | None = None) -> str:
    """``query`` if it is a non-blank ``str`` valid as UTF-8; else :class:`InvalidQueryError` naming it."""
    return check_text(query, "query" if position is None else f"queries[{position}]", InvalidQueryError,
                      "; there is nothing to route")


def _check_queries(queries: object) -> list[str]:
    if isinstance(queries, str) or not isinstance(queries, Sequence) or len(queries) == 0:
        raise InvalidQueryError(f"queries must be a non-empty list of str, got {'[]' if queries == [] else type(queries).__name__}")
    return [check_query(q, i) for i, q in enumerate(queries)]


class Router:
    """An on-device router loaded from a verified bundle. Use :meth:`load`, not the constructor.

    Thread-safe: :meth:`choose`, :meth:`choose_batch`, :meth:`predict` and :meth:`lam_for_budget`
    may run concurrently from several threads (no state changes after loading).
    """

    def __init__(self, manifest: dict[str, Any], embedder: kinds.Embedder, scorer: kinds.RouterScorer,
                 precision: str, source: tuple[Any, ...] | None = None) -> None:
        self._manifest = copy.deepcopy(manifest)
        self._source = source  # (bundle_dir, public_key, load options) of load(), for reloaded()
        self._embedder = embedder
        self._scorer = scorer
        self.precision = precision
        self.models = tuple(
            ModelInfo(m["id"], m.get("price_per_1k_input_usd"), m.get("price_per_1k_output_usd"), m.get("mean_cost_usd"))
            for m in manifest["models"]
        )
        self.model_ids = tuple(m.id for m in self.models)
        self.bundle_version = int(manifest["bundle_version"])
        self.router_kind = manifest["router_kind"]
        self.embedder_name = manifest["embedder"]["name"]
        self.d_emb = int(manifest["embedder"]["dim"])
        self.max_tokens = int(manifest["embedder"]["max_tokens"])
        self._frozen = True

    def __setattr__(self, name: str, value: object) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"Router is immutable after loading (tried to set {name!r}); load another bundle instead")
        object.__setattr__(self, name, value)

    @property
    def manifest(self) -> dict[str, Any]:
        """A copy of the bundle's verified manifest."""
        return copy.deepcopy(self._manifest)

    @classmethod
    def load(cls, bundle_dir: str | os.PathLike[str], public_key: fmt.PublicKey, *, precision: str = "auto",
             intra_op_threads: int = 1, inter_op_threads: int = 1, min_bundle_version: int = 1) -> Router:
        """Verify and load the bundle at ``bundle_dir`` (``fedroute export``) with ``public_key`` (path of
        ``signing.pub``, PEM text or an ``Ed25519PublicKey``): :func:`sdk.kinds.load_bundle`. ``precision``:
        ``"int8"``, ``"int8-all"``, ``"fp32"`` or ``"auto"`` (the first the bundle has of :data:`AUTO_PRECISIONS`);
        thread counts in [1, 1024]; ``min_bundle_version``: pass the version last loaded, so that a replayed,
        superseded bundle is refused.

        Raises
        ------
        BundleError
            Signature or a used file's sha256 does not verify, a file is missing or unloadable, the format is
            unsupported, the precision is absent, the bundle is too old, or embedder, router and price table
            disagree.
        InvalidInputError
            ``precision``, a thread count or ``min_bundle_version`` is not valid.
        """
        loaded = kinds.load_bundle(bundle_dir, public_key, kinds.ROUTER_FAMILY, precision=precision,
                                   preference=AUTO_PRECISIONS, intra_op_threads=intra_op_threads,
                                   inter_op_threads=inter_op_threads, min_bundle_version=min_bundle_version)
        source = (bundle_dir, public_key, {"precision": precision, "intra_op_threads": intra_op_threads,
                                           "inter_op_threads": inter_op_threads})
        return cls(loaded.manifest, loaded.runtimes[kinds.EMBEDDER_FAMILY], loaded.runtimes[kinds.ROUTER_FAMILY],
                   loaded.precision, source)

    def reloaded(self) -> Router | None:
        """The bundle installed now at this router's folder if its (unverified, cheaply read) ``bundle_version``
        is newer than :attr:`bundle_version`, loaded as :meth:`load` with the same options and
        ``min_bundle_version`` = this version + 1; None otherwise. This router is unchanged.

        Raises
        ------
        BundleError
            The newer bundle does not verify or load (as :meth:`load`).
        InvalidInputError
            This router was not built by :meth:`load`.
        """
        if self._source is None:
            raise InvalidInputError("this Router was not built by Router.load: there is no folder to reload from")
        bundle_dir, public_key, options = self._source
        version = read_version(bundle_dir)
        if version is None or version <= self.bundle_version:
            return None
        return Router.load(bundle_dir, public_key, min_bundle_version=self.bundle_version + 1, **options)

    # -- prediction ---------------------------------------------------------------------------

    def embed(self, queries: Sequence[str]) -> npt.NDArray[np.float32]:
        """Embeddings of ``queries``: (n_queries, d_emb) float32, unit L2 norm. Raises InvalidQueryError."""
        return self._embedder.embed(_check_queries(queries))

    def token_counts(self, queries: Sequence[str]) -> list[int]:
        """Tokens the embedder reads per query (after truncation, special tokens included). Raises InvalidQueryError."""
        return self._embedder.n_tokens(_check_queries(queries))

    def predict(self, queries: Sequence[str]) -> tuple[F64, F64]:
        """Predicted (accuracy, cost USD per query), each (n_queries, n_models) float64; NaN = no estimate.
        Raises InvalidQueryError."""
        acc, cost, _, _ = self._predict(_check_queries(queries))
        return acc, cost

    def predict_from_embeddings(self, embeddings: npt.ArrayLike) -> tuple[F64, F64]:
        """:meth:`predict` for precomputed (n_queries, d_emb) float32 embeddings of this bundle's embedder.
        Raises ShapeError on a wrong shape or non-finite values."""
        x = finite_rows(embeddings, self.d_emb, "embeddings", rows="n_queries")
        acc, cost, _ = self._scorer.predict(x)
        return acc, cost

    def _predict(self, queries: list[str]) -> tuple[F64, F64, npt.NDArray[np.int64] | None, npt.NDArray[np.float32]]:
        emb = self._embedder.embed(queries)
        acc, cost, cells = self._scorer.predict(emb)
        return acc, cost, cells, emb

    # -- decisions ----------------------------------------------------------------------------

    def choose(self, query: str, lam: float) -> Choice:
        """The model maximising ``A - lam * C`` for ``query`` (non-blank str) at ``lam`` (USD^-1, finite, >= 0).
        Raises InvalidQueryError, InvalidLambdaError."""
        lam = check_lambda(lam)
        return self._choices([check_query(query)], lam)[0]

    def choose_batch(self, queries: Sequence[str], lam: float) -> list[Choice]:
        """:meth:`choose` for each query, with the same answers. Raises InvalidQueryError, InvalidLambdaError."""
        lam = check_lambda(lam)
        return self._choices(_check_queries(queries), lam)

    def _choices(self, queries: list[str], lam: float) -> list[Choice]:
        acc, cost, cells, emb = self._predict(queries)
        return self._choices_of(acc, cost, cells, emb, lam, _decide_unchecked(acc - lam * cost, cost))

    def _choices_of(self, acc: F64, cost: F64, cells: npt.NDArray[np.int64] | None, emb: npt.NDArray[np.float32],
                    lam: float, picked: npt.NDArray[np.intp], policy: str = "greedy",
                    propensity: F64 | None = None) -> list[Choice]:
        """:class:`Choice` per query of :meth:`_predict`'s outputs and the picked indices (n,); ``propensity``
        (n,) of an exploring policy, None for greedy (1.0)."""
        u = acc - lam * cost
        out = []
        for i, j in enumerate(picked):
            scores = tuple(ModelScore(m, float(acc[i, k]), float(cost[i, k]), float(u[i, k]))
                           for k, m in enumerate(self.model_ids))
            out.append(Choice(
                model=self.model_ids[j], index=int(j), accuracy=float(acc[i, j]), cost_usd=float(cost[i, j]),
                utility=float(u[i, j]), lam=lam, scores=scores, embedding=emb[i],
                cell=None if cells is None else int(cells[i]), bundle_version=self.bundle_version,
                policy=policy, propensity=1.0 if propensity is None else float(propensity[i]),
            ))
        return out

    def lam_for_budget(self, usd_per_1k_queries: float, sample_queries: Sequence[str]) -> float:
        """The smallest ``lam`` (USD^-1) whose predicted mean cost on ``sample_queries`` fits the budget
        ``usd_per_1k_queries`` (USD per 1000 queries, > 0); 0.0 when ``lam = 0`` fits. The chosen model's cost is
        non-increasing in ``lam``, so bisection over ``[0, MAX_LAMBDA]`` finds the boundary (relative 1e-9).

        Raises
        ------
        InvalidInputError
            Budget not a finite positive number.
        InvalidQueryError
            Bad ``sample_queries``.
        BudgetError
            The budget is below the predicted cost of always choosing the cheapest model.
        """
        budget = finite_float(usd_per_1k_queries)
        if budget is None or budget <= 0:
            raise InvalidInputError(f"usd_per_1k_queries must be a finite number > 0, got {shown(usd_per_1k_queries)}")
        target = budget / 1000.0
        acc, cost, _, _ = self._predict(_check_queries(sample_queries))

        def mean_cost(lam: float) -> float:
            picked = _decide_unchecked(acc - lam * cost, cost)
            return float(cost[np.arange(len(picked)), picked].mean())

        if mean_cost(0.0) <= target:
            return 0.0
        floor = mean_cost(MAX_LAMBDA)
        if floor > target:
            raise BudgetError(
                f"budget {budget} USD per 1k queries is below {floor * 1000:.6g} USD per 1k, the predicted "
                "cost of always choosing the cheapest model on these sample queries"
            )
        lo, hi = 0.0, 1.0
        while mean_cost(hi) > target:
            lo, hi = hi, min(hi * 10.0, MAX_LAMBDA)
        while hi - lo > 1e-9 * hi:
            mid = 0.5 * (lo + hi)
            if mean_cost(mid) <= target:
                hi = mid
            else:
                lo = mid
        return hi

    def __repr__(self) -> str:
        return (f"Router(kind={self.router_kind!r}, models={len(self.model_ids)}, bundle_version={self.bundle_version}, "
                f"embedder={self.embedder_name!r}/{self.precision})")

