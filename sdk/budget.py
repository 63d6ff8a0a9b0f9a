"""``BudgetController``: keep the realised spend per 1,000 queries on a budget while traffic shifts.

Feed-forward: on the router's predictions for the last ``window`` queries the predicted spend is a step
function ``S(lam)`` (:class:`sdk.spend_curve.SpendCurve`); each query is routed by the randomised
threshold policy that meets the predicted-spend target ``s`` in expectation (``lam_low`` with
probability ``p_low = (s - S(lam_high)) / (S(lam_low) - S(lam_high))``, else ``lam_high``). Feedback:
an integral controller in log space moves ``s`` by the realised spend ``R`` of the window,
``log s <- log s - clip((gain / window) * log(R / b), -max_step, max_step)``, ``s`` clamped to
``[b / TARGET_RANGE, b * TARGET_RANGE]``; drift beyond ``tolerance`` and an unreachable target are
:class:`BudgetEvent` s. Rule, defaults (chosen on RouterBench train streams by
``benchmarks/budget_controller_settings.py``) and figures: docs/budgets.md. Thread-safe.
"""

from __future__ import annotations

import logging
import math
import numbers
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from sdk.arrays import real_array
from sdk.errors import InvalidInputError, ShapeError, UnknownModelError
from sdk.real_numbers import finite_float, shown
from sdk.router import Router, check_query
from sdk.spend_curve import Mix, SpendCurve, row_steps
from sdk.utility import _decide_unchecked

log = logging.getLogger("fedroute.budget")
_F64 = npt.NDArray[np.float64]

#: Largest ``window`` accepted (queries): its ring buffers take (n_models + 1) floats per query.
MAX_WINDOW = 1_000_000
#: Correction per window of records, as a multiple of the log-error ``log(R / b)``.
DEFAULT_GAIN = 1.0
#: Largest change of ``log s`` per record.
DEFAULT_MAX_STEP = 0.05
#: The predicted-spend target stays within ``[b / TARGET_RANGE, b * TARGET_RANGE]``.
TARGET_RANGE = 8.0
#: Feedback starts after ``min(window, MIN_RECORDS)`` recorded costs.
MIN_RECORDS = 20
#: Events kept in :attr:`BudgetController.events`.
MAX_EVENTS = 1000
#: Smallest budget accepted, USD per 1,000 queries (~2.2e-305): below it the budget per query, and the
#: bounds and floors derived from it, underflow to 0.
MIN_BUDGET_USD_PER_1K = 1000.0 * sys.float_info.min


@dataclass(frozen=True)
class BudgetEvent:
    """``kind``: ``"drift"`` (the window's realised spend left ``budget * (1 +- tolerance)``), ``"recovered"``,
    ``"unreachable"`` (the target is below the cheapest decisions' predicted cost) or ``"reachable"``;
    spends in USD per 1,000 queries (``realised_usd_per_1k`` None before a record), ``lam`` in USD^-1."""

    kind: str
    n_chosen: int
    n_recorded: int
    realised_usd_per_1k: float | None
    budget_usd_per_1k: float
    lam: float
    message: str


def check_budget_floor(value: float, given: object) -> None:
    """Raise :class:`InvalidInputError` for a budget ``value`` (USD per 1,000 queries, a finite float > 0;
    ``given`` as passed) below :data:`MIN_BUDGET_USD_PER_1K`, where the controller's bounds underflow."""
    if value < MIN_BUDGET_USD_PER_1K:
        raise InvalidInputError(f"budget_usd_per_1k must be at least {MIN_BUDGET_USD_PER_1K:.3g} USD per "
                                f"1,000 queries (a smaller budget underflows), got {shown(given)}")


def _mean(values: deque[float]) -> float:
    """The exact mean of finite floats >= 0, also where their sum exceeds the float range."""
    try:
        return math.fsum(values) / len(values)
    except OverflowError:
        return math.fsum(v / len(values) for v in values)


#: The keys of :meth:`BudgetController.state`.
_STATE_KEYS = ("model_ids", "window", "log_target", "n_predicted", "base", "step_lam", "step_delta", "realised",
               "n_chosen", "n_recorded", "drifting", "last_toggle", "unreachable")


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class BudgetController:
    """Route with ``router`` so that the realised spend stays at ``budget_usd_per_1k`` USD per 1,000 queries::

        controller = BudgetController(router, budget_usd_per_1k=0.50)
        model = controller.choose(prompt)          # a model id of router.model_ids
        answer, cost_usd = call_llm(model, prompt)
        controller.record(model, cost_usd)

    Parameters
    ----------
    router : an :class:`sdk.Router` (``model_ids``; ``predict(queries)`` -> accuracy, cost, each
        ``(n_queries, n_models)``, cost in USD per query).
    budget_usd_per_1k : float > 0, at least :data:`MIN_BUDGET_USD_PER_1K`.
    window : int in [1, :data:`MAX_WINDOW`], queries in each sliding window.
    tolerance : float > 0, relative deviation of the realised spend that is a ``"drift"`` (0.10 = +-10%).
    seed : int >= 0 or None (fresh entropy), of the randomised mixing.
    gain, max_step : float > 0, the feedback's gain per window and bound on the change of ``log s`` per record.
    on_event : callable taking each :class:`BudgetEvent` (after the lock is released), or None.

    Raises
    ------
    InvalidInputError
        Any of these out of its range or of another type.
    """

    def __init__(self, router: Router, budget_usd_per_1k: float, *, window: int = 200, tolerance: float = 0.10,
                 seed: int | None = None, gain: float = DEFAULT_GAIN, max_step: float = DEFAULT_MAX_STEP,
                 on_event: Callable[[BudgetEvent], None] | None = None) -> None:
        given = {"router": router, "budget_usd_per_1k": budget_usd_per_1k, "tolerance": tolerance, "gain": gain,
                 "max_step": max_step, "window": window, "seed": seed, "on_event": on_event}
        reals = {name: finite_float(given[name]) for name in ("budget_usd_per_1k", "tolerance", "gain", "max_step")}
        integral = {name: not isinstance(given[name], bool) and isinstance(given[name], numbers.Integral)
                    for name in ("window", "seed")}
        rules = [("router", isinstance(router, Router), "an sdk.Router")] + [
            (name, value is not None and value > 0, "a finite number > 0") for name, value in reals.items()] + [
            ("window", integral["window"] and 1 <= window <= MAX_WINDOW, f"an int in [1, {MAX_WINDOW}] (queries)"),
            ("seed", seed is None or (integral["seed"] and seed >= 0), "None or an int >= 0"),
            ("on_event", on_event is None or callable(on_event), "callable or None")]
        for name, accepted, what in rules:
            if not accepted:
                raise InvalidInputError(f"{name} must be {what}, got {shown(given[name])}", param=name)
        self.budget_usd_per_1k: float = float(budget_usd_per_1k)
        self.window: int = int(window)
        self.tolerance: float = float(tolerance)
        self.gain: float = float(gain)
        self.max_step: float = float(max_step)
        self.router: Router = router
        self.seed: int | None = seed
        self.on_event: Callable[[BudgetEvent], None] | None = on_event
        self._model_ids: tuple[str, ...] = tuple(router.model_ids)
        self._budget: float = self.budget_usd_per_1k / 1000.0
        check_budget_floor(self.budget_usd_per_1k, budget_usd_per_1k)
        self._log_target: float = math.log(self._budget)
        self._rng: np.random.Generator = np.random.default_rng(seed)
        self._lock: threading.Lock = threading.Lock()
        # Prediction window as ring buffers: per query its lam = 0 cost and its breakpoints
        # (padded with lam = inf) with the cost change at each (sdk.spend_curve.row_steps).
        n_steps = max(len(self._model_ids) - 1, 1)
        self._base: npt.NDArray[np.float64] = np.zeros(self.window)
        self._step_lam: npt.NDArray[np.float64] = np.full((self.window, n_steps), np.inf)
        self._step_delta: npt.NDArray[np.float64] = np.zeros((self.window, n_steps))
        self._n_predicted: int = 0
        self._realised: deque[float] = deque(maxlen=self.window)
        self._realised_mean: float = 0.0
        self._mix: Mix | None = None
        self._n_chosen: int = 0
        self._n_recorded: int = 0
        self._drifting: bool = False
        self._last_toggle: int = -self.window  # n_recorded at the last drift / recovered event
        self._unreachable: bool = False
        self._events: deque[BudgetEvent] = deque(maxlen=MAX_EVENTS)

    # -- state --------------------------------------------------------------------------------

    @property
    def lam(self) -> float:
        """``lam_high`` of the current mix, USD^-1 (0.0 before the first :meth:`choose`)."""
        with self._lock:
            return 0.0 if self._mix is None else self._mix.lam_high

    @property
    def mix(self) -> Mix | None:
        """The randomised threshold policy of the last :meth:`choose` (None before the first)."""
        with self._lock:
            return self._mix

    @property
    def realised_usd_per_1k(self) -> float | None:
        """Mean recorded cost over the window, USD per 1,000 queries (None before the first :meth:`record`)."""
        with self._lock:
            return self._realised_per_1k()

    @property
    def spend_target_usd_per_1k(self) -> float:
        """The predicted-spend target ``s``, USD per 1,000 queries (module docstring)."""
        with self._lock:
            return 1000.0 * math.exp(self._log_target)

    @property
    def n_chosen(self) -> int:
        """Queries routed so far."""
        with self._lock:
            return self._n_chosen

    @property
    def n_recorded(self) -> int:
        """Costs recorded so far."""
        with self._lock:
            return self._n_recorded

    @property
    def events(self) -> tuple[BudgetEvent, ...]:
        """The last :data:`MAX_EVENTS` events, oldest first."""
        with self._lock:
            return tuple(self._events)

    def _realised_per_1k(self) -> float | None:
        return None if not self._realised else 1000.0 * self._realised_mean

    # -- routing ------------------------------------------------------------------------------

    def choose(self, query: str) -> str:
        """The model id to call for ``query`` (a non-blank str, else :class:`InvalidQueryError`): the router's
        decision at the controller's randomised ``lam``."""
        accuracy, cost = self.router.predict([check_query(query)])  # checked here: the message names ``query``
        return self._route(*self._checked(np.asarray(accuracy)[0], np.asarray(cost)[0]))

    def choose_from_predictions(self, accuracy: npt.ArrayLike, cost: npt.ArrayLike) -> str:
        """:meth:`choose` for predictions already computed: ``accuracy``, ``cost`` of shape (n_models,),
        cost in USD per query, NaN = no estimate. Raises :class:`ShapeError` (not real, wrong shape, inf, a
        negative cost) or :class:`InvalidInputError` (every prediction NaN)."""
        return self._route(*self._checked(accuracy, cost))

    def _checked(self, accuracy: npt.ArrayLike, cost: npt.ArrayLike) -> tuple[_F64, _F64]:
        a, c = real_array(accuracy, "accuracy"), real_array(cost, "cost")  # ragged lists, strings, complex: ShapeError
        if a.shape != (len(self._model_ids),) or c.shape != a.shape or np.isinf(a).any() or np.isinf(c).any() \
                or (c[~(np.isnan(a) | np.isnan(c))] < 0).any():
            raise ShapeError(f"accuracy and cost must have shape ({len(self._model_ids)},) without inf, and predicted "
                             f"costs must be >= 0 USD, got shapes {a.shape} and {c.shape}")
        valid = ~(np.isnan(a) | np.isnan(c))
        if not valid.any():
            raise InvalidInputError("the query has no model with an estimate (all predictions NaN)")
        return a, c

    def _route(self, a: _F64, c: _F64) -> str:
        base, lams, deltas = row_steps(a, c)
        events: list[BudgetEvent] = []
        with self._lock:
            slot = self._n_predicted % self.window
            self._base[slot] = base
            self._step_lam[slot] = np.inf
            self._step_lam[slot, :len(lams)] = lams
            self._step_delta[slot, :len(deltas)] = deltas
            self._n_predicted += 1
            mix = self._curve().mix_for(math.exp(self._log_target))
            lam = mix.lam_low if self._rng.random() < mix.p_low else mix.lam_high
            self._mix = mix
            self._n_chosen += 1
            if mix.reachable == self._unreachable:
                self._unreachable = not mix.reachable
                events.append(self._event(
                    "unreachable" if self._unreachable else "reachable",
                    "spend target {s:.4g} USD per 1k is below the predicted cost of the cheapest decisions "
                    "on the last {n} queries ({floor:.4g} USD per 1k)" if self._unreachable else
                    "spend target {s:.4g} USD per 1k is reachable again",
                    floor=1000.0 * mix.expected_cost))
        self._emit(events)
        j = int(_decide_unchecked((a - lam * c)[None], c[None])[0])
        return self._model_ids[j]

    def _curve(self) -> SpendCurve:
        """Spend curve of the prediction window (under the lock)."""
        n = min(self._n_predicted, self.window)
        return SpendCurve.from_arrays(self._base[:n], self._step_lam[:n], self._step_delta[:n])

    # -- feedback -----------------------------------------------------------------------------

    def record(self, model: str, cost_usd: float) -> None:
        """Report the realised cost (USD, finite >= 0, else :class:`InvalidInputError`) of one query answered
        by ``model`` (one of ``router.model_ids``, else :class:`UnknownModelError`)."""
        if model not in self._model_ids:
            raise UnknownModelError(f"unknown model {model!r}; the router's models are {list(self._model_ids)}")
        cost = finite_float(cost_usd)
        if cost is None or cost < 0:
            raise InvalidInputError(f"cost_usd must be a finite number >= 0 (USD), got {shown(cost_usd)}")
        events: list[BudgetEvent] = []
        with self._lock:
            self._realised.append(cost)
            self._realised_mean = realised = _mean(self._realised)
            self._n_recorded += 1
            if len(self._realised) >= min(self.window, MIN_RECORDS):
                error = math.log(max(realised, 1e-12 * self._budget) / self._budget)
                step = min(max(self.gain / self.window * error, -self.max_step), self.max_step)
                low, high = math.log(self._budget / TARGET_RANGE), math.log(self._budget * TARGET_RANGE)
                self._log_target = min(max(self._log_target - step, low), high)
            if len(self._realised) == self.window and self._n_recorded - self._last_toggle >= self.window:
                off = abs(realised / self._budget - 1.0) > self.tolerance
                if off != self._drifting:
                    self._drifting = off
                    self._last_toggle = self._n_recorded
                    events.append(self._event(
                        "drift" if off else "recovered",
                        "realised spend {r:.4g} USD per 1k over the last {n} queries is {pct:+.1f}% off the budget "
                        "{b:.4g} (tolerance {tol:.0%})" if off else
                        "realised spend {r:.4g} USD per 1k is back within {tol:.0%} of the budget {b:.4g}"))
        self._emit(events)

    def _event(self, kind: str, template: str, **extra: float) -> BudgetEvent:
        """Build and keep an event (under the lock)."""
        realised = self._realised_per_1k()
        b = self.budget_usd_per_1k
        message = template.format(r=realised if realised is not None else float("nan"), b=b, tol=self.tolerance,
                                  n=self.window, s=1000.0 * math.exp(self._log_target),
                                  pct=100.0 * ((realised or 0.0) / b - 1.0), **extra)
        event = BudgetEvent(kind, self._n_chosen, self._n_recorded, realised, b,
                            0.0 if self._mix is None else self._mix.lam_high, message)
        self._events.append(event)
        return event

    def _emit(self, events: list[BudgetEvent]) -> None:
        for event in events:
            level = logging.WARNING if event.kind in ("drift", "unreachable") else logging.INFO
            log.log(level, "budget controller: %s", event.message)
            if self.on_event is not None:
                self.on_event(event)

    # -- persistence --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The controller's state (target, windows, counters, drift flags) as JSON values, for :meth:`restore`
        (``Infinity`` marks the padding of the breakpoint window: Python's ``json`` writes and reads it)."""
        with self._lock:
            return {"model_ids": list(self._model_ids), "window": self.window, "log_target": self._log_target,
                    "n_predicted": self._n_predicted, "base": self._base.tolist(),
                    "step_lam": self._step_lam.tolist(), "step_delta": self._step_delta.tolist(),
                    "realised": list(self._realised), "n_chosen": self._n_chosen, "n_recorded": self._n_recorded,
                    "drifting": self._drifting, "last_toggle": self._last_toggle, "unreachable": self._unreachable}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state` of a controller with the same models and window (the next
        :meth:`choose` recomputes the mix; events and the random stream start afresh). A ``log_target``
        outside this controller's range (a state of another budget) is clamped into it, as :meth:`record` does.

        Raises
        ------
        InvalidInputError
            ``state`` is not a dict, is of other models or another window, misses a key, or holds a value
            of the wrong type or range (arrays of other shapes, NaN, a negative cost or count); the
            controller is then left as it was.
        """
        if not isinstance(state, dict):
            raise InvalidInputError(f"budget state must be a dict (from BudgetController.state()), got "
                                    f"{type(state).__name__}")
        missing = sorted(set(_STATE_KEYS) - set(state))
        if missing:
            raise InvalidInputError(f"budget state misses {missing}")
        try:
            base, lams, deltas = (np.asarray(state[k], dtype=np.float64) for k in ("base", "step_lam", "step_delta"))
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"budget state arrays must be numeric: {exc}") from None
        realised = [finite_float(c) for c in state["realised"]] if isinstance(state["realised"], list) else None
        log_target = finite_float(state["log_target"])
        counts = [state[k] for k in ("n_predicted", "n_chosen", "n_recorded")]
        problem = next((message for refused, message in (
            (state["model_ids"] != list(self._model_ids) or state["window"] != self.window,
             f"budget state of models {shown(state['model_ids'])} and window {shown(state['window'])}, "
             f"not {list(self._model_ids)} and {self.window}"),
            (base.shape != self._base.shape or lams.shape != self._step_lam.shape or deltas.shape != lams.shape,
             "budget state arrays of other shapes than this controller's windows"),
            (not (np.isfinite(base).all() and (base >= 0).all() and not np.isnan(lams).any()
                  and np.isfinite(deltas).all()), "budget state arrays must be real (base >= 0 USD, no NaN)"),
            (realised is None or len(realised) > self.window or any(c is None or c < 0 for c in realised),
             f"budget state 'realised' must be a list of at most {self.window} finite costs >= 0 USD, "
             f"got {shown(state['realised'])}"),
            (log_target is None, f"budget state 'log_target' must be a finite number, got {shown(state['log_target'])}"),
            (not all(_is_int(n) and n >= 0 for n in counts) or not _is_int(state["last_toggle"]),
             f"budget state counts must be ints (n_predicted, n_chosen, n_recorded >= 0), got {counts} "
             f"and last_toggle {shown(state['last_toggle'])}"),
            (not all(isinstance(state[k], bool) for k in ("drifting", "unreachable")),
             "budget state 'drifting' and 'unreachable' must be booleans"),
        ) if refused), None)
        if problem:
            raise InvalidInputError(problem)
        assert realised is not None and log_target is not None  # checked above
        low, high = math.log(self._budget / TARGET_RANGE), math.log(self._budget * TARGET_RANGE)
        with self._lock:
            self._log_target = min(max(log_target, low), high)
            self._n_predicted = int(state["n_predicted"])
            self._base, self._step_lam, self._step_delta = base, lams, deltas
            self._realised = deque(realised, maxlen=self.window)  # type: ignore[arg-type]
            self._realised_mean = _mean(self._realised) if self._realised else 0.0
            self._n_chosen, self._n_recorded = int(state["n_chosen"]), int(state["n_recorded"])
            self._drifting, self._unreachable = state["drifting"], state["unreachable"]
            self._last_toggle = int(state["last_toggle"])

    def __repr__(self) -> str:
        realised = self.realised_usd_per_1k
        shown = "n/a" if realised is None else f"{realised:.4g}"
        return (f"BudgetController(budget_usd_per_1k={self.budget_usd_per_1k:g}, window={self.window}, "
                f"realised_usd_per_1k={shown}, lam={self.lam:.4g})")
