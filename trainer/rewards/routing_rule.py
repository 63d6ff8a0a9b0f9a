"""The routing rule of MoR's routed reward: router logits -> routing weights -> one reward per (x, y).

Design notes: docs/mor.md (Module notes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from sdk.errors import InvalidInputError, ShapeError

MODES = ("sparse", "soft")
ROUTE_BY = ("response", "prompt")
PROBABILITIES = ("softmax", "ovr")


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of (n, K) logits, float64."""
    z = np.asarray(logits, dtype=np.float64)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def prompt_groups(prompts: Sequence[str]) -> np.ndarray:
    """(n,) int64 group ids: equal prompt strings share an id (first-seen order)."""
    ids: dict[str, int] = {}
    return np.array([ids.setdefault(p, len(ids)) for p in prompts], dtype=np.int64)


@dataclass(frozen=True)
class RoutingRule:
    """How router logits become one reward per (x, y) (design notes).

    mode : ``"sparse"`` | ``"soft"``. temperature : > 0, divides the logits before the softmax.
    route_by : ``"response"`` | ``"prompt"``.
    fallback : sparse only, in [0, 1): rows whose largest routing weight is below it get the soft reward (every
        client asked); 0 (default) = plain sparse routing.
    fallback_top : with ``fallback`` > 0 only: 0 (default) = the fallback mixes every client; k >= 2 = only the k
        clients with the largest weights of the row, renormalised (only they are asked about it).
    probabilities : ``"softmax"`` (default, the paper) or ``"ovr"`` (normalised ``sigmoid(z / T)``).

    Raises InvalidInputError on an unknown mode / route_by / probabilities, a temperature that is not a finite number
    > 0, a fallback outside [0, 1) (or non-zero with soft routing), or a fallback_top that is not 0 or an int >= 2
    with a fallback > 0.
    """

    mode: str = "sparse"
    temperature: float = 1.0
    route_by: str = "response"
    fallback: float = 0.0
    fallback_top: int = 0
    probabilities: str = "softmax"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidInputError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.route_by not in ROUTE_BY:
            raise InvalidInputError(f"route_by must be one of {list(ROUTE_BY)}, got {self.route_by!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t <= 0:
            raise InvalidInputError(f"temperature must be a finite number > 0, got {t!r}")
        object.__setattr__(self, "temperature", float(t))
        f = self.fallback
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1 or (self.mode == "soft" and f != 0):
            raise InvalidInputError(f"fallback must be a number in [0, 1) (0 with soft routing), got {f!r}")
        object.__setattr__(self, "fallback", float(f))
        k = self.fallback_top
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0 or k == 1 or (k and not self.fallback):
            raise InvalidInputError(f"fallback_top must be 0 or an int >= 2 with a fallback > 0, got {k!r}")
        object.__setattr__(self, "fallback_top", int(k))
        if self.probabilities not in PROBABILITIES:
            raise InvalidInputError(f"probabilities must be one of {list(PROBABILITIES)}, got {self.probabilities!r}")

    @classmethod
    def from_variant(cls, variant: str) -> RoutingRule:
        """Parse an evaluation variant key: ``"sparse|<route_by>"``, ``"sparse<<fallback>|<route_by>"``,
        ``"sparse<<fallback>,top<k>|<route_by>"`` or ``"soft|<route_by>|T=<t>"``, each optionally followed by ``"|ovr"``
        (``probabilities="ovr"``). Raises InvalidInputError on any other string."""
        parts = str(variant).split("|")
        probs = "softmax"
        if len(parts) > 2 and parts[-1] in PROBABILITIES:
            probs, parts = parts[-1], parts[:-1]
        try:
            if parts[0] == "sparse" and len(parts) == 2:
                return cls("sparse", 1.0, parts[1], probabilities=probs)
            if parts[0].startswith("sparse<") and len(parts) == 2:
                f, _, top = parts[0][len("sparse<"):].partition(",top")
                return cls("sparse", 1.0, parts[1], float(f), int(top) if top else 0, probs)
            if parts[0] == "soft" and len(parts) == 3 and parts[2].startswith("T="):
                return cls("soft", float(parts[2][2:]), parts[1], probabilities=probs)
        except ValueError:
            pass
        raise InvalidInputError(f"routing variant must be 'sparse|<route_by>', 'sparse<<fallback>[,top<k>]|<route_by>' or "
                                f"'soft|<route_by>|T=<t>', each optionally followed by '|ovr', got {variant!r}")

    @property
    def variant(self) -> str:
        """The evaluation's key of this rule (inverse of :meth:`from_variant`; sparse ignores T)."""
        ovr = "|ovr" if self.probabilities == "ovr" else ""
        if self.mode == "sparse":
            top = f",top{self.fallback_top}" if self.fallback_top else ""
            return (f"sparse<{self.fallback:g}{top}|{self.route_by}" if self.fallback else f"sparse|{self.route_by}") + ovr
        return f"soft|{self.route_by}|T={self.temperature:g}" + ovr

    def to_dict(self) -> dict:
        return asdict(self)

    def weights(self, logits: np.ndarray, groups: np.ndarray | None = None) -> np.ndarray:
        """Routing weights (n, K) float64: ``softmax(logits / temperature)`` (``probabilities="ovr"``: normalised
        ``sigmoid(logits / temperature)``); with ``route_by="prompt"`` each row replaced by the mean of the rows of
        its group.

        logits : (n, K) router logits. groups : (n,) ints, the prompt group of each row (None: each row
        its own group; needed for ``route_by="prompt"`` to have an effect). Raises ShapeError on bad shapes.
        """
        z = np.asarray(logits, dtype=np.float64)
        if z.ndim != 2 or z.shape[0] == 0 or z.shape[1] < 1 or not np.isfinite(z).all():
            raise ShapeError(f"logits must be finite with shape (n >= 1, K), got {z.shape}")
        if self.probabilities == "ovr":
            p = 0.5 * (1.0 + np.tanh(0.5 * z / self.temperature))  # sigmoid, without overflow warnings
            p = np.clip(p, np.finfo(np.float64).tiny, None)
            w = p / p.sum(axis=1, keepdims=True)
        else:
            w = softmax(z / self.temperature)
        if self.route_by == "prompt" and groups is not None:
            g = np.asarray(groups)
            if g.shape != (len(z),):
                raise ShapeError(f"groups must have shape ({len(z)},), got {g.shape}")
            _, inv = np.unique(g, return_inverse=True)
            sums = np.zeros((inv.max() + 1, w.shape[1]))
            np.add.at(sums, inv, w)
            w = sums[inv] / np.bincount(inv)[inv, None]
        return w

    def combine(self, weights: np.ndarray, ask: Callable[[int, np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The routed reward from routing ``weights`` (n, K) (:meth:`weights`).

        ask : ``ask(k, rows) -> (len(rows),)`` client k's normalised scores of the rows ``rows`` (int array);
            sparse asks each client only about the rows routed to it (and, with ``fallback``, every client, or the
            ``fallback_top`` clients with the largest weights, about the rows whose largest weight is below it), soft
            asks every client about every row.
        Returns (rewards (n,) float64, choice (n,) int64 = argmax of the weights, the client each row went to).
        Raises ShapeError when a client returns the wrong number of scores.
        """
        w = np.asarray(weights, dtype=np.float64)
        n, k_clients = w.shape
        choice = w.argmax(axis=1)
        mixed = np.ones(n, dtype=bool) if self.mode == "soft" else w.max(axis=1) < self.fallback  # soft-scored rows
        asked = np.ones_like(w, dtype=bool)  # which clients a mixed row mixes (and asks)
        if self.fallback_top:
            asked = np.zeros_like(w, dtype=bool)
            np.put_along_axis(asked, np.argsort(-w, axis=1, kind="stable")[:, : self.fallback_top], True, axis=1)
            w = np.where(asked, w, 0.0)
            w = w / w.sum(axis=1, keepdims=True)
        out = np.zeros(n, dtype=np.float64)
        for k in range(k_clients):
            rows = np.flatnonzero((choice == k) | (mixed & asked[:, k]))
            if not len(rows):
                continue
            s = np.asarray(ask(k, rows), dtype=np.float64)
            if s.shape != (len(rows),):
                raise ShapeError(f"client {k} returned {s.shape} scores for {len(rows)} rows")
            m = mixed[rows]
            out[rows[~m]] = s[~m]
            out[rows[m]] += w[rows[m], k] * s[m]
        return out, choice

    def reward(self, logits: np.ndarray, scores: np.ndarray, groups: np.ndarray | None = None) -> np.ndarray:
        """The routed reward when every client's scores are already known: logits and scores (n, K) -> (n,)
        float64 (:meth:`weights` then :meth:`combine`; what the evaluation uses)."""
        s = np.asarray(scores, dtype=np.float64)
        return self.combine(self.weights(logits, groups), lambda k, rows: s[rows, k])[0]
