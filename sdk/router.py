"""``Router``: load a signed bundle and choose, on the device, the model that maximises utility.

``choose(query, lam)`` embeds the query (ONNX encoder), predicts each model's accuracy and cost in
USD (MLP head or K-means cell table) and returns ``argmax_m A(x, m) - lam * C(x, m)`` with the
METRICS.md tie-break (paper 002, "Overall framework"). ``lam`` is in USD^-1: ``lam = 0`` ignores
cost; ``lam = 100`` trades 1 accuracy point (0.01) for 0.0001 USD per query.

Loading verifies the manifest signature and the sha256 of every file it uses before any of it is used, and
checks that embedder, router heads and price table agree; on any failure a :class:`BundleError`
is raised and no ``Router`` exists (nothing is half-loaded).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sdk import bundle_manifest as fmt
from sdk import kinds
from sdk.embedder import SessionThreads
from sdk.arrays import finite_rows
from sdk.background_read import PendingFiles
from sdk.bundle_install import read_version
from sdk.errors import BudgetError, BundleError, InvalidInputError, InvalidQueryError
from sdk.real_numbers import finite_float, shown
from sdk.utility import _decide_unchecked, check_lambda

#: Upper end of the lambda search in :meth:`Router.lam_for_budget`, USD^-1.
MAX_LAMBDA = 1e12
#: ``precision="auto"`` loads the first of these the bundle ships (fastest first; every shipped
#: precision passed the export's parity gate).
AUTO_PRECISIONS = ("int8-all", "int8", "fp32")
#: ``Router.load`` reads and hashes used files of at least this size in the background
#: (:mod:`sdk.background_read`): the static embedder's table overlaps its tokenizer's construction
#: (only where the process may run on more than one CPU, :func:`_background_bytes`).
BACKGROUND_BYTES = 1 << 20


def _background_bytes() -> int | None:
    """:data:`BACKGROUND_BYTES` if this process may use two CPUs or more, else None (one CPU: nothing
    to overlap, a worker thread would only add GIL hand-overs)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        cpus = os.cpu_count() or 1
    return BACKGROUND_BYTES if cpus > 1 else None


@dataclass(frozen=True)
class ModelInfo:
    """One entry of the bundle's price table.

    Attributes
    ----------
    id : model id as the app's LLM client names it.
    price_per_1k_input_usd, price_per_1k_output_usd : list price in USD per 1000 tokens, or None
        when unknown.
    mean_cost_usd : mean cost of one query in the router's training logs, USD (None if unseen).
    """

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
    model : chosen model id.
    index : its position in :attr:`Router.model_ids`.
    accuracy, cost_usd, utility : predictions for the chosen model (cost in USD per query).
    lam : the trade-off used, USD^-1.
    scores : tuple of :class:`ModelScore`, one per model in :attr:`Router.model_ids` order.
    embedding : ndarray of shape (d_emb,), float32: the query embedding (stays on the device; an
        :class:`~sdk.eval_log.EvalLog` stores it so the sync job can compute cell statistics).
    cell : Voronoi cell id for a K-means router, else None.
    bundle_version : version of the bundle that made the choice.
    policy : the policy that chose ``model``: ``"greedy"`` (:meth:`Router.choose`, the argmax) or an
        :class:`sdk.Explorer`'s (``"thompson"``).
    propensity : float in (0, 1], the probability that ``policy`` chose ``model`` for this query
        (1.0 for greedy); an :class:`~sdk.eval_log.EvalLog` row keeps it for offline evaluation.
    """

    model: str
    index: int
    accuracy: float
    cost_usd: float
    utility: float
    lam: float
    scores: tuple[ModelScore, ...]
    embedding: np.ndarray
    cell: int | None
    bundle_version: int
    policy: str = "greedy"
    propensity: float = 1.0


def check_query(query: object, position: int | None = None) -> str:
    """Return ``query`` if it is a non-blank ``str``.

    Raises
    ------
    InvalidQueryError
        Not a ``str``, empty / whitespace only, or not encodable as UTF-8 (lone surrogates).
        (A query whose every character the tokenizer drops, e.g. only control characters, is
        refused later, by the embedder.)
    """
    where = "query" if position is None else f"queries[{position}]"
    if not isinstance(query, str):
        raise InvalidQueryError(f"{where} must be a str, got {type(query).__name__}")
    if not query.strip():
        raise InvalidQueryError(f"{where} is empty or whitespace only; there is nothing to route")
    try:
        query.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidQueryError(f"{where} is not valid Unicode ({exc.reason} at position {exc.start})") from exc
    return query


def _check_queries(queries: object) -> list[str]:
    if isinstance(queries, str) or not isinstance(queries, Sequence):
        raise InvalidQueryError(f"queries must be a list of str, got {type(queries).__name__}")
    if len(queries) == 0:
        raise InvalidQueryError("queries is empty")
    return [check_query(q, i) for i, q in enumerate(queries)]


class Router:
    """An on-device router loaded from a verified bundle. Use :meth:`load`, not the constructor.

    Thread-safe: :meth:`choose`, :meth:`choose_batch`, :meth:`predict` and :meth:`lam_for_budget`
    may run concurrently from several threads (no state changes after loading).
    """

    def __init__(self, manifest: dict, embedder: kinds.Embedder, scorer: kinds.RouterScorer, precision: str,
                 source: tuple | None = None) -> None:
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

    def __setattr__(self, name: str, value) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"Router is immutable after loading (tried to set {name!r}); load another bundle instead")
        object.__setattr__(self, name, value)

    @property
    def manifest(self) -> dict:
        """A copy of the bundle's verified manifest."""
        return copy.deepcopy(self._manifest)

    @classmethod
    def load(cls, bundle_dir, public_key, *, precision: str = "auto", intra_op_threads: int = 1,
             inter_op_threads: int = 1, min_bundle_version: int = 1) -> Router:
        """Verify and load the bundle at ``bundle_dir``.

        Parameters
        ----------
        bundle_dir : path of a bundle written by ``fedroute export``.
        public_key : path of ``signing.pub``, its PEM text (str or bytes) or an ``Ed25519PublicKey``.
        precision : ``"int8"``, ``"int8-all"``, ``"fp32"`` or ``"auto"`` (the first the bundle has of
            :data:`AUTO_PRECISIONS`: ``int8-all``, ``int8``, ``fp32``, fastest first).
        intra_op_threads, inter_op_threads : onnxruntime thread counts, integers in [1, 1024]. One
            intra-op thread gives the lowest single-query latency on a busy device.
        min_bundle_version : refuse a bundle older than this. Pass the version the app last
            loaded, so that a replayed old bundle (validly signed, but superseded) is refused.

        Verification: the signature, then the sha256 of the files this precision uses (tokenizer,
        that encoder, the router file). The other precisions' encoders are not read: they were
        verified at export and are at install (:mod:`sdk.sync`, :func:`sdk.bundle_manifest.verify_all`).
        The encoder is hashed from one open descriptor and onnxruntime loads it from that
        descriptor's path, so it is never held in Python memory and a file swapped after the check
        is not the one loaded (:mod:`sdk.verified_file`). A used file of at least
        :data:`BACKGROUND_BYTES` (a static embedder's table) is read and hashed by a worker thread
        while the rest loads, and handed to its kind only once its sha256 matched
        (:mod:`sdk.background_read`).

        Raises
        ------
        BundleError
            Signature or a used file's sha256 does not verify, a file is missing or unloadable, the format is
            unsupported, the requested precision is absent, the bundle is older than
            ``min_bundle_version``, or embedder, router and price table disagree (model names,
            order, embedder name or dimension).
        InvalidInputError
            ``precision`` or a thread count is not valid.
        """
        if not isinstance(precision, str) or (precision != "auto" and precision not in fmt.EMBEDDER_FILES):
            raise InvalidInputError(f"precision must be 'auto' or one of {sorted(fmt.EMBEDDER_FILES)}, got {precision!r}")
        # Checked now; onnxruntime is imported only by a kind that creates a session (not a static embedder).
        options = SessionThreads(intra_op_threads, inter_op_threads)
        chosen: dict[str, str] = {}
        requested = precision

        if isinstance(min_bundle_version, bool) or not isinstance(min_bundle_version, int):
            raise InvalidInputError(f"min_bundle_version must be an int, got {shown(min_bundle_version)}")

        def files_needed(manifest: dict) -> tuple[str, ...]:
            # Called once the signature has verified: pick the files to keep in memory.
            if manifest["bundle_version"] < min_bundle_version:
                raise BundleError(f"bundle version {manifest['bundle_version']} is older than "
                                  f"min_bundle_version {shown(min_bundle_version)} (a superseded bundle)")
            found = kinds.manifest_kinds(manifest)
            if kinds.ROUTER_FAMILY not in found:
                raise kinds.carries_no(kinds.ROUTER_FAMILY, found)
            available = manifest["embedder"]["files"]
            want = precision
            if precision == "auto":
                want = next((p for p in AUTO_PRECISIONS if p in available), "fp32")
            if want not in available:
                raise BundleError(f"bundle has no {want} embedder (it has {sorted(available)})")
            used = [kinds.get(family, found[family]) for family in (kinds.EMBEDDER_FAMILY, kinds.ROUTER_FAMILY)]
            chosen["precision"] = want
            chosen["by_path"] = tuple(name for kind in used for name in kind.path_files(manifest, want))
            return tuple(name for kind in used for name in kind.files(manifest, want))

        # Files of >= 1 MiB (a static table) are read and hashed by a worker thread while the kinds load the
        # rest (the tokenizer); each is verified when the kind looks it up, before any use of it.
        with fmt.read_verified(bundle_dir, public_key, wanted=files_needed, by_path=lambda _: chosen["by_path"],
                               verify_unused=False, background_bytes=_background_bytes()) as verified:
            manifest, precision = verified.manifest, chosen["precision"]
            embedder = kinds.load_artefact(kinds.EMBEDDER_FAMILY, manifest, verified.files, options=options,
                                           precision=precision, paths=verified.opened)
            scorer = kinds.load_artefact(kinds.ROUTER_FAMILY, manifest, verified.files, options=options,
                                         precision=precision, paths=verified.opened)
            if isinstance(verified.files, PendingFiles):
                verified.files.check_all()  # a used file no kind looked up is still refused if corrupt
        source = (bundle_dir, public_key, {"precision": requested, "intra_op_threads": intra_op_threads,
                                           "inter_op_threads": inter_op_threads})
        return cls(manifest, embedder, scorer, precision, source)

    def reloaded(self) -> Router | None:
        """The bundle installed now at the folder this router was loaded from, if its ``bundle_version`` is
        newer than :attr:`bundle_version` (the sync job installs one atomically: :mod:`sdk.bundle_install`);
        None otherwise. Loaded as :meth:`load` with the same public key, precision and threads and
        ``min_bundle_version`` = this version + 1. This router is unchanged (immutable): use the one returned.
        The version is first read from the unverified manifest (a cheap check, every poll); the bundle
        is verified only when it is newer.

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

    def embed(self, queries: Sequence[str]) -> np.ndarray:
        """Embeddings of ``queries``: (n_queries, d_emb) float32, unit L2 norm.

        Raises
        ------
        InvalidQueryError
            ``queries`` is not a non-empty list of non-blank ``str``.
        """
        return self._embedder.embed(_check_queries(queries))

    def token_counts(self, queries: Sequence[str]) -> list[int]:
        """Tokens the embedder reads per query (after truncation to ``max_tokens``, special tokens included).

        Raises
        ------
        InvalidQueryError
        """
        return self._embedder.n_tokens(_check_queries(queries))

    def predict(self, queries: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Predicted (accuracy, cost USD per query), each (n_queries, n_models) float64; NaN = no estimate.

        Raises
        ------
        InvalidQueryError
        """
        acc, cost, _, _ = self._predict(_check_queries(queries))
        return acc, cost

    def predict_from_embeddings(self, embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Predicted (accuracy, cost USD) for precomputed embeddings of this bundle's embedder.

        Parameters
        ----------
        embeddings : ndarray of shape (n_queries, d_emb), float32, finite.

        Returns
        -------
        (accuracy, cost), each (n_queries, n_models) float64; NaN = no estimate.

        Raises
        ------
        ShapeError
            Wrong shape or non-finite values.
        """
        x = finite_rows(embeddings, self.d_emb, "embeddings", rows="n_queries")
        acc, cost, _ = self._scorer.predict(x)
        return acc, cost

    def _predict(self, queries: list[str]):
        emb = self._embedder.embed(queries)
        acc, cost, cells = self._scorer.predict(emb)
        return acc, cost, cells, emb

    # -- decisions ----------------------------------------------------------------------------

    def choose(self, query: str, lam: float) -> Choice:
        """The model maximising ``A - lam * C`` for ``query``.

        Parameters
        ----------
        query : non-blank str; longer than ``max_tokens`` tokens is truncated (see :mod:`sdk.embedder`).
        lam : float, USD^-1, finite and >= 0.

        Raises
        ------
        InvalidQueryError, InvalidLambdaError
        """
        lam = check_lambda(lam)
        return self._choices([check_query(query)], lam)[0]

    def choose_batch(self, queries: Sequence[str], lam: float) -> list[Choice]:
        """:meth:`choose` for each query, with the same answers: the fp32 encoder embeds the batch in
        one padded call, the int8 encoder one query at a time (see :class:`sdk.embedder.OnnxEmbedder`).

        Raises
        ------
        InvalidQueryError, InvalidLambdaError
        """
        lam = check_lambda(lam)
        return self._choices(_check_queries(queries), lam)

    def _choices(self, queries: list[str], lam: float) -> list[Choice]:
        acc, cost, cells, emb = self._predict(queries)
        return self._choices_of(acc, cost, cells, emb, lam, _decide_unchecked(acc - lam * cost, cost))

    def _choices_of(self, acc, cost, cells, emb, lam: float, picked, policy: str = "greedy",
                    propensity=None) -> list[Choice]:
        """:class:`Choice` per query of :meth:`_predict`'s outputs and the picked model indices
        ``picked`` (n,); ``propensity`` (n,) float in (0, 1] for an exploring policy
        (:class:`sdk.explorer.Explorer`), None for greedy (1.0). Does not validate."""
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
        """The smallest ``lam`` whose predicted mean cost on ``sample_queries`` fits the budget.

        The predicted cost of the chosen model is non-increasing in ``lam`` for every query, so the
        mean is too, and bisection over ``[0, MAX_LAMBDA]`` finds the boundary (to a relative
        1e-9). Returns 0.0 when even ``lam = 0`` fits.

        Parameters
        ----------
        usd_per_1k_queries : float > 0, budget in USD per 1000 queries.
        sample_queries : non-empty list of non-blank str, representative of the app's traffic.

        Returns
        -------
        float, lam in USD^-1.

        Raises
        ------
        InvalidInputError
            Budget not a finite positive number (bools, and ints beyond the float range, included).
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

