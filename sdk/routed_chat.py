"""``RoutedChat``: an OpenAI-compatible chat client that routes each call, falls back, and keeps the books.

What an app otherwise writes around :meth:`sdk.Router.choose`, in one object (ARCHITECTURE.md §10)::

    chat = RoutedChat(router, lam=100.0, upstreams={"gpt-4-1106-preview": "https://api.openai.com/v1",
                                                    "mistral-7b-chat": Upstream("http://127.0.0.1:8000/v1", api_key="x")},
                      log=EvalLog("evals.sqlite", router.model_ids))
    reply = chat.create(messages=[{"role": "user", "content": "Prove that sqrt(2) is irrational."}])
    chat.feedback(reply.id, score=1.0)          # later, when the app knows how good the answer was

Per call (:meth:`create`, :meth:`acreate`; ``model=`` as in :mod:`sdk.model_spec`):

1. **Route.** The text of :func:`sdk.chat_text.routing_text` (the last user message plus at most
   ``context_chars`` characters of the turns before it) is embedded and every model scored; the
   models *with an upstream* are ranked by utility ``A - lam * C`` (paper 002; ties: lower predicted
   cost, then lower index; models without an estimate never called). ``fedroute:budget=Y`` asks a
   :class:`sdk.budget.BudgetController` (one per caller and budget, bounded and saved:
   :class:`sdk.caller_budgets.CallerBudgets`) for the first model, choosing among
   the models with an upstream only (its spend curve is theirs), and ranks the rest at its current
   ``lam``. Router models without an upstream are never chosen.
2. **Call** the first model through the ``openai`` package. On a timeout, a connection failure, a
   429, a 5xx or an answer that is not a chat completion (not JSON, JSON nested too deeply, a JSON
   list or text, no ``choices`` list: kind ``"invalid_response"``) it **falls back** to the next model
   of the ranking, at most ``max_fallbacks`` times,
   each failure logged (``logging`` warning on ``fedroute.routed_chat``) and kept in
   :attr:`Route.failed`. Any other error (a 4xx: the request itself is wrong) is not retried. When
   every try failed: :class:`sdk.errors.UpstreamError`. Clients built here from a base URL have the
   ``openai`` package's own retries off (``max_retries=0``), so the fallback is the only retry;
   clients you pass in keep their settings.
3. **Stream** (``stream=True``): the chunks pass through as they come. Usage is asked for
   (``stream_options={"include_usage": True}``); when the caller did not ask for it the final
   usage-only chunk is not passed on. Fallback is possible only before the first chunk.
4. **Record.** Cost observed = token price x ``usage`` tokens (:mod:`sdk.token_prices`; a model
   without a price is a :class:`sdk.errors.PriceError` at construction); latency = wall time of the
   answering call (until the last chunk when streaming), ms. The outcome goes to the budget
   controller and the ``observer``. With a ``log`` the routed call waits in
   :class:`sdk.pending_outcomes.PendingOutcomes` under the response id until :meth:`feedback` gives
   its score in [0, 1]; then one :class:`sdk.eval_log.EvalLog` row (model that answered, score,
   observed cost, latency, embedding, cell, bundle version) is written for the sync job. No score is
   ever invented, and the router's predicted cost is never recorded as observed. A response without
   ``usage`` has no observed cost: it is returned, warned about, and not recorded; one whose observed
   cost is above :data:`sdk.eval_log.MAX_COST_PER_QUERY_USD` (1000 USD, more than a log row holds) is
   returned, counted and fed to a budget controller, warned about, and not kept for :meth:`feedback`.

Pass-through (``model=`` a model id): that model's upstream, no routing, no fallback; its cost goes to
the ``observer`` (spend metrics) but nothing to the log (it has no routed embedding).

Requires the ``openai`` package (``pip install 'fedroute[proxy]'``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import numbers
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from sdk.budget import BudgetController, check_budget_floor
from sdk.caller_budgets import DEFAULT_MAX_PER_CALLER, CallerBudgets
from sdk.chat_text import DEFAULT_CONTEXT_CHARS, message_text, routing_text
from sdk.errors import (BundleError, EvalLogError, InvalidInputError, InvalidQueryError, ShapeError, UnknownModelError, UnknownResponseError,
                        UpstreamError)
from sdk.eval_log import MAX_COST_PER_QUERY_USD, EvalLog
from sdk.model_spec import ROUTED_MODEL, ModelSpec, parse_model_spec
from sdk.pending_outcomes import PendingOutcome, PendingOutcomes, storable_id
from sdk.real_numbers import finite_float, shown
from sdk.router import Choice, Router
from sdk.token_prices import TokenPrice, price_table
from sdk.utility import _rank_unchecked, check_lambda

log = logging.getLogger("fedroute.routed_chat")

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_FALLBACKS = 2


@dataclass(frozen=True)
class Upstream:
    """An OpenAI-compatible endpoint serving one model.

    Attributes
    ----------
    base_url : e.g. ``"https://api.openai.com/v1"``; clients are built from it (sync and async,
        ``max_retries=0``, ``timeout_s``). Or None when ``client`` / ``async_client`` are given.
    api_key : the endpoint's key; None: the ``openai`` package reads ``OPENAI_API_KEY``.
    model : the model's name at the endpoint (default: the router's model id).
    timeout_s : float > 0, seconds per call (connect + read) for clients built here.
    client : an ``openai.OpenAI`` to use as is (for :meth:`RoutedChat.create`).
    async_client : an ``openai.AsyncOpenAI`` to use as is (for :meth:`RoutedChat.acreate`).
    """

    base_url: str | None = None
    api_key: str | None = None
    model: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    client: object | None = None
    async_client: object | None = None


@dataclass(frozen=True)
class FailedAttempt:
    """One call that failed and was fallen back from (or ended the call).

    ``kind``: ``"timeout"``, ``"connection"``, ``"rate_limit"``, ``"server_error"``, ``"invalid_response"``
    (an answer that is not a chat completion) or ``"client_error"``;
    ``status``: HTTP status or None; ``elapsed_ms``: wall time of the try.
    """

    model: str
    kind: str
    status: int | None
    message: str
    elapsed_ms: float


@dataclass(frozen=True)
class Plan:
    """The routing decision for one call.

    Attributes
    ----------
    text : the routed text (:func:`sdk.chat_text.routing_text`).
    choice : the router's :class:`sdk.router.Choice` (embedding, scores of every model).
    order : model ids to try, best first: the first and up to ``max_fallbacks`` fallbacks.
    lam : USD^-1 used (a budget controller's current ``lam`` in budget mode).
    budget_usd_per_1k : the budget asked for, or None.
    routing_ms : wall time of routing (embedding + scoring + ranking), ms.
    controller : the budget controller that chose (fed the call's cost), or None.
    """

    text: str
    choice: Choice = field(repr=False)
    order: tuple[str, ...]
    lam: float
    budget_usd_per_1k: float | None
    routing_ms: float
    controller: BudgetController | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Route:
    """How one call was served: ``requested`` (the ``model=`` string), ``plan`` (None for a
    pass-through), ``model`` (the model that answered) and ``failed`` (tries fallen back from)."""

    requested: str
    plan: Plan | None
    model: str
    failed: tuple[FailedAttempt, ...]


@dataclass(frozen=True)
class CallOutcome:
    """An answered call, as recorded.

    Attributes
    ----------
    route : :class:`Route`.
    response_id : the completion's ``id`` (the key of :meth:`RoutedChat.feedback`), or None.
    latency_ms : wall time of the answering call, ms (to the last chunk when streaming).
    prompt_tokens, completion_tokens : from ``usage``; None when the response had none.
    cost_usd : observed cost in USD (price x tokens); None when the response had no ``usage``.
    awaiting_score : True when the call waits in the pending store for :meth:`RoutedChat.feedback`.
    """

    route: Route
    response_id: str | None
    latency_ms: float
    prompt_tokens: int | None
    completion_tokens: int | None
    cost_usd: float | None
    awaiting_score: bool


@dataclass(frozen=True)
class RoutedResponse:
    """:meth:`RoutedChat.create_routed`'s answer: the ``openai`` ``ChatCompletion`` and its :class:`CallOutcome`."""

    completion: object
    outcome: CallOutcome


class ChatObserver:
    """Hooks :class:`RoutedChat` calls as a call goes (no-ops here; the proxy's metrics subclass it).
    Called in the calling thread, or a worker thread for async calls; must be thread-safe and not raise."""

    def routed(self, plan: Plan) -> None:
        """A call was routed (before any upstream is called)."""

    def failed(self, attempt: FailedAttempt) -> None:
        """One try failed (fallen back from, or ending the call)."""

    def answered(self, outcome: CallOutcome) -> None:
        """A call was answered and recorded."""


@dataclass
class _UpstreamClients:
    name: str
    sync: object | None
    async_: object | None
    owned: bool = False  # built here from a base URL: closed by RoutedChat.close / aclose


class RoutedChat:
    """Route, call, fall back and record (see the module docstring).

    Parameters
    ----------
    router : :class:`sdk.Router`.
    upstreams : {router model id: base URL str | :class:`Upstream` | ``openai.OpenAI`` |
        ``openai.AsyncOpenAI``}; the routing pool. Every key must be one of ``router.model_ids``.
    lam : float, USD^-1, finite >= 0: the default trade-off (``model=None`` or ``"fedroute"``).
    budget_usd_per_1k : float > 0, USD per 1,000 queries: route by a budget controller by default
        instead (exactly one of ``lam`` and ``budget_usd_per_1k``).
    passthrough : {model id: same values} for models the router does not know, callable by name.
    prices : {model id: :class:`sdk.token_prices.TokenPrice`} overriding the bundle's price table.
    log : an :class:`sdk.EvalLog` over ``router.model_ids``; None records nothing for the sync job.
    pending : :class:`PendingOutcomes`, its path, or None (default: ``<log stem>.pending.sqlite``
        beside the log; unused without a log).
    max_fallbacks : int >= 0, further models tried after the first (default 2).
    context_chars : int >= 0, characters of earlier turns routed with the last user message.
    observer : a :class:`ChatObserver` told of each plan, failed try and answered call (metrics).
    budget_seed : int or None, seed of the budget controllers' random mixing.
    max_budgets_per_caller : int >= 1, budget controllers kept per caller (least recently used dropped).
    budget_state : SQLite file where the budget controllers' state is saved (:meth:`save_budgets`,
        :meth:`close`) and restored from, or None (memory only).

    Raises
    ------
    UnknownModelError
        An ``upstreams`` key the router does not know (the message lists its ids).
    PriceError
        A model of ``upstreams`` or ``passthrough`` without a token price (``prices`` nor bundle).
    InvalidInputError
        Not exactly one of ``lam`` / ``budget_usd_per_1k``, ``lam`` < 0 or NaN, a budget <= 0, NaN or
        below :data:`sdk.budget.MIN_BUDGET_USD_PER_1K`, an empty ``upstreams``, an upstream value of
        another type, ``passthrough`` / ``prices`` that are not mappings, a ``passthrough`` key that is
        a router model or starts with ``fedroute``, bad ``max_fallbacks`` / ``context_chars``, a
        ``log`` over other models, or an ``openai`` client that cannot be built (no API key).
    """

    def __init__(self, router: Router, *, upstreams: Mapping[str, object], lam: float | None = None,
                 budget_usd_per_1k: float | None = None, passthrough: Mapping[str, object] | None = None,
                 prices: Mapping[str, TokenPrice] | None = None, log: EvalLog | None = None,
                 pending: PendingOutcomes | str | Path | None = None, max_fallbacks: int = DEFAULT_MAX_FALLBACKS,
                 context_chars: int = DEFAULT_CONTEXT_CHARS, observer: ChatObserver | None = None,
                 budget_seed: int | None = None, max_budgets_per_caller: int = DEFAULT_MAX_PER_CALLER,
                 budget_state: str | Path | None = None) -> None:
        if not isinstance(router, Router):
            raise InvalidInputError(f"router must be an sdk.Router, got {type(router).__name__}")
        if (lam is None) == (budget_usd_per_1k is None):
            raise InvalidInputError("give exactly one of lam (USD^-1) and budget_usd_per_1k (USD per 1,000 queries), "
                                    f"got lam={lam!r}, budget_usd_per_1k={budget_usd_per_1k!r}")
        self._lam = None if lam is None else check_lambda(lam)
        self._budget = None if budget_usd_per_1k is None else check_budget(budget_usd_per_1k)
        if isinstance(max_fallbacks, bool) or not isinstance(max_fallbacks, numbers.Integral) or max_fallbacks < 0:
            raise InvalidInputError(f"max_fallbacks must be an int >= 0, got {max_fallbacks!r}")
        routing_text([{"role": "user", "content": "x"}], context_chars)  # validates context_chars
        if not isinstance(upstreams, Mapping) or not upstreams:
            raise InvalidInputError("upstreams must be a non-empty mapping {router model id: base URL or Upstream}")
        unknown = [m for m in upstreams if m not in router.model_ids]
        if unknown:
            raise UnknownModelError(f"upstreams names {unknown}, not in the router's models {list(router.model_ids)} "
                                    "(models the router does not know go in passthrough=)")
        if passthrough is not None and not isinstance(passthrough, Mapping):
            raise InvalidInputError(f"passthrough must be a mapping {{model id: base URL or Upstream}}, got "
                                    f"{type(passthrough).__name__}")
        passthrough = dict(passthrough or {})
        for name in passthrough:
            if not isinstance(name, str) or not name.strip() or name.startswith(ROUTED_MODEL) or name in router.model_ids:
                raise InvalidInputError(f"passthrough key {name!r} must be a model id the router does not know, not "
                                        "starting with 'fedroute' (router models go in upstreams=)")
        if log is not None and (not isinstance(log, EvalLog) or tuple(log.models) != tuple(router.model_ids)):
            raise InvalidInputError("log must be an sdk.EvalLog opened with router.model_ids")
        self._router = router
        self._pool = tuple(m for m in router.model_ids if m in upstreams)  # router order
        self._pool_ids = frozenset(self._pool)
        callable_ids = (*self._pool, *passthrough)
        self._prices = price_table(callable_ids, prices, router.models)
        self._price_args = (callable_ids, prices)  # for reload(): the bundle's prices may change
        self._clients = {m: _clients_for(m, spec) for m, spec in (*upstreams.items(), *passthrough.items())}
        self._max_fallbacks = int(max_fallbacks)
        self._context_chars = int(context_chars)
        self._log = log
        if log is not None and not isinstance(pending, PendingOutcomes):
            pending = PendingOutcomes(pending if pending is not None else log.path.with_suffix(".pending.sqlite"))
        self._pending = pending if log is not None else None
        self._observer = observer or ChatObserver()
        self._budget_seed = budget_seed
        self._budgets = CallerBudgets(lambda b: BudgetController(self._router, b, seed=budget_seed),
                                      max_per_caller=max_budgets_per_caller, path=budget_state)
        self._closed = False
        self._feedback_lock = threading.Lock()
        self._id_lock = threading.Lock()
        self._reserved_ids: set[str] = set()  # routed answers between their id's check and their pending entry
        # Drop-in shape of openai.OpenAI: chat.chat.completions.create(model=..., messages=...).
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    # -- properties --------------------------------------------------------------------------

    @property
    def pool(self) -> tuple[str, ...]:
        """Router model ids with an upstream (the models routing may choose), in router order."""
        return self._pool

    @property
    def models(self) -> tuple[str, ...]:
        """Every model id callable by name: the pool, then the pass-through ids."""
        return (*self._pool, *(m for m in self._clients if m not in self._pool))

    @property
    def prices(self) -> dict[str, TokenPrice]:
        """The price table in use, {model id: TokenPrice}."""
        return dict(self._prices)

    @property
    def router(self) -> Router:
        return self._router

    @property
    def pending(self) -> PendingOutcomes | None:
        """The store of calls awaiting a score (None without a log)."""
        return self._pending

    def budget_controllers(self, caller: str = "") -> dict[float, BudgetController]:
        """{budget USD per 1k queries: its :class:`sdk.budget.BudgetController`} kept for ``caller``."""
        return {b: c for (who, b), c in self._budgets.controllers().items() if who == caller}

    def save_budgets(self) -> int:
        """Save the budget controllers' state to ``budget_state`` (rows written; 0 without one).

        Raises
        ------
        EvalLogError
            The file cannot be written (the previous save stays).
        """
        return self._budgets.save()

    def reload(self) -> bool:
        """Swap in a newer bundle installed where the router was loaded from (:meth:`sdk.Router.reloaded`):
        calls routed after the swap use it; calls already routed finish on the old one (their plan holds
        its choice, embedding, cell and bundle version). Returns True if a newer bundle was swapped in.

        Raises
        ------
        BundleError
            The newer bundle does not verify, or routes other models than this one (the old one stays).
        PriceError
            A model has no price in the newer bundle nor in ``prices`` (the old one stays).
        InvalidInputError
            The router was not built by :meth:`sdk.Router.load`.
        """
        new = self._router.reloaded()
        if new is None:
            return False
        if new.model_ids != self._router.model_ids:
            raise BundleError(f"bundle version {new.bundle_version} routes {list(new.model_ids)}, not this client's "
                              f"{list(self._router.model_ids)} (its log and upstreams): not swapped in; restart with it")
        prices = price_table(*self._price_args, new.models)
        old = self._router.bundle_version
        self._router, self._prices = new, prices
        log.info("routing with bundle version %d (was %d)", new.bundle_version, old)
        return True

    # -- routing -----------------------------------------------------------------------------

    def choose(self, messages: object, *, model: str | None = None, caller: str = "") -> Plan:
        """Route without calling: the :class:`Plan` for ``messages`` (a list of chat messages, or a
        str taken as one user message) under ``model=`` (``None``, ``"fedroute"``,
        ``"fedroute:lam=X"`` or ``"fedroute:budget=Y"``); ``caller`` picks the budget controllers.

        Raises
        ------
        ModelSpecError, InvalidQueryError, InvalidInputError
            A malformed ``model``, a pass-through id (nothing to route), no user text, or no model
            of the pool with an estimate.
        """
        spec = parse_model_spec(model)
        if not spec.routed:
            raise InvalidInputError(f"choose() routes; model={model!r} names a model to call directly")
        return self._plan(_as_messages(messages), spec, caller)

    async def achoose(self, messages: object, *, model: str | None = None, caller: str = "") -> Plan:
        """:meth:`choose` in a worker thread (the ONNX embedder would block the event loop)."""
        return await asyncio.to_thread(self.choose, messages, model=model, caller=caller)

    def _plan(self, messages: Sequence, spec: ModelSpec, caller: str) -> Plan:
        text = routing_text(messages, self._context_chars)
        t0 = time.perf_counter()
        budget = spec.budget_usd_per_1k if spec.budget_usd_per_1k is not None else (
            self._budget if spec.lam is None else None)
        first = controller = None
        router = self._router  # one bundle per call, also when reload() swaps it meanwhile
        if budget is not None:
            # One embedding: the choice at the controller's lam, then its randomised pick from the same
            # predictions, models without an upstream left out (NaN = no estimate): the controller's spend
            # curve is then that of the models this client can call, and its pick is one of them.
            controller = self._budgets.get(caller, budget)
            choice = router.choose(text, float(controller.lam))
            pool = self._pool_ids
            first = controller.choose_from_predictions(
                np.array([s.accuracy if s.model in pool else math.nan for s in choice.scores]),
                np.array([s.cost_usd if s.model in pool else math.nan for s in choice.scores]))
        else:
            choice = router.choose(text, self._lam if spec.lam is None else spec.lam)
        lam = choice.lam
        ranked = self._ranked(choice)
        if first in self._pool:
            ranked = [first] + [m for m in ranked if m != first]
        if not ranked:
            raise InvalidInputError(f"the router has no estimate for any model with an upstream {list(self._pool)}")
        order = tuple(ranked[: 1 + self._max_fallbacks])
        plan = Plan(text, choice, order, lam, budget, (time.perf_counter() - t0) * 1e3, controller)
        self._observer.routed(plan)
        return plan

    def _ranked(self, choice: Choice) -> list[str]:
        u = np.array([[s.utility for s in choice.scores]], dtype=np.float64)
        cost = np.array([[s.cost_usd for s in choice.scores]], dtype=np.float64)
        return [choice.scores[j].model for j in _rank_unchecked(u, cost)[0]
                if choice.scores[j].model in self._pool_ids and not (math.isnan(u[0, j]) or math.isnan(cost[0, j]))]

    # -- calling (sync) ----------------------------------------------------------------------

    def create(self, *, messages: object, model: str | None = None, caller: str = "", **kwargs):
        """Route (or pass through) and call; the ``openai`` ``ChatCompletion``, or with
        ``stream=True`` a :class:`RoutedStream` of ``ChatCompletionChunk``. ``kwargs`` go to
        ``chat.completions.create`` unchanged (``model`` is replaced by the upstream's name).
        ``caller`` names whose budget controllers ``fedroute:budget=Y`` uses (the proxy: the token's digest).

        Raises
        ------
        ModelSpecError, UnknownModelError, InvalidQueryError, InvalidInputError
            Bad ``model=`` (malformed, or an id with no upstream) or ``messages``, a ``stream`` that is
            not a bool (nor None), a ``stream_options`` that is not a mapping, or text the request
            cannot carry (lone surrogates; nothing is sent).
        UpstreamError
            A non-retryable upstream error, or every try failed (``.attempts``).
        """
        result = self.create_routed(messages=messages, model=model, caller=caller, **kwargs)
        return result if isinstance(result, RoutedStream) else result.completion

    def create_routed(self, *, messages: object, model: str | None = None, caller: str = "", **kwargs):
        """:meth:`create`, returning a :class:`RoutedResponse` (completion + :class:`CallOutcome`) or a
        :class:`RoutedStream` (whose ``route`` is known at once and ``outcome`` after the last chunk)."""
        _check_stream_kwargs(kwargs)
        requested, plan, order, messages = self._prepare(messages, model, caller)
        kwargs, stream, strip = _call_kwargs(messages, kwargs)
        failed: list[FailedAttempt] = []
        for m in order:
            client = self._clients[m]
            if client.sync is None:
                raise InvalidInputError(f"the upstream of {m!r} is an async client only; use acreate()")
            t0 = time.perf_counter()
            try:
                response = client.sync.chat.completions.create(model=client.name, **kwargs)
                if not stream:
                    _check_completion(response)
            except UnicodeEncodeError as exc:
                raise _unsendable(exc) from exc
            except (openai.OpenAIError, *_GARBAGE) as exc:
                failed.append(self._failure(m, exc, t0, order, failed))
                continue
            route = Route(requested, plan, m, tuple(failed))
            if stream:
                return RoutedStream(response, route, self, strip, t0)
            return RoutedResponse(response, self._finish_response(route, response, _ms(t0)))
        raise _exhausted(failed)

    # -- calling (async) ---------------------------------------------------------------------

    async def acreate(self, *, messages: object, model: str | None = None, caller: str = "", **kwargs):
        """Async :meth:`create` (``openai.AsyncOpenAI``; routing and bookkeeping in a worker thread):
        the ``ChatCompletion``, or with ``stream=True`` an :class:`AsyncRoutedStream`. Same errors."""
        result = await self.acreate_routed(messages=messages, model=model, caller=caller, **kwargs)
        return result if isinstance(result, AsyncRoutedStream) else result.completion

    async def acreate_routed(self, *, messages: object, model: str | None = None, caller: str = "", **kwargs):
        """Async :meth:`create_routed`."""
        _check_stream_kwargs(kwargs)
        requested, plan, order, messages = await asyncio.to_thread(self._prepare, messages, model, caller)
        kwargs, stream, strip = _call_kwargs(messages, kwargs)
        failed: list[FailedAttempt] = []
        for m in order:
            client = self._clients[m]
            if client.async_ is None:
                raise InvalidInputError(f"the upstream of {m!r} is a sync client only; use create()")
            t0 = time.perf_counter()
            try:
                response = await client.async_.chat.completions.create(model=client.name, **kwargs)
                if not stream:
                    _check_completion(response)
            except UnicodeEncodeError as exc:
                raise _unsendable(exc) from exc
            except (openai.OpenAIError, *_GARBAGE) as exc:
                failed.append(self._failure(m, exc, t0, order, failed))
                continue
            route = Route(requested, plan, m, tuple(failed))
            if stream:
                return AsyncRoutedStream(response, route, self, strip, t0)
            outcome = await asyncio.to_thread(self._finish_response, route, response, _ms(t0))
            return RoutedResponse(response, outcome)
        raise _exhausted(failed)

    # -- shared steps ------------------------------------------------------------------------

    def _prepare(self, messages: object, model: str | None, caller: str) -> tuple[str, Plan | None, tuple[str, ...], list]:
        """The ``model=`` string answered, the plan (None: pass-through), the models to try and the checked
        ``messages`` as a list (a str as one user message); in a worker thread for ``acreate``."""
        if self._closed:  # nothing is sent: an answer could not be recorded (the pending store is closed)
            raise UpstreamError("this RoutedChat is closed (close() shut its clients and its pending store); "
                                "create a new one", status=None, kind="connection")
        spec = parse_model_spec(model)
        messages = _as_messages(messages)
        if spec.routed:
            plan = self._plan(messages, spec, caller)
            return model or ROUTED_MODEL, plan, plan.order, list(messages)
        if spec.passthrough not in self._clients:
            raise UnknownModelError(f"model {spec.passthrough!r} has no upstream; callable: {list(self._clients)} "
                                    "or 'fedroute' to route")
        _check_messages(messages)
        return spec.passthrough, None, (spec.passthrough,), list(messages)

    def _failure(self, model: str, exc: Exception, t0: float, order: tuple[str, ...],
                 failed: list[FailedAttempt]) -> FailedAttempt:
        kind, status = _classify(exc)
        attempt = FailedAttempt(model, kind, status, str(exc)[:500], _ms(t0))
        self._observer.failed(attempt)
        if kind == "client_error":
            raise UpstreamError(f"{model} refused the request ({status}): {exc}", status=status, kind=kind,
                                attempts=(*failed, attempt)) from exc
        remaining = order[len(failed) + 1:]
        if remaining:
            log.warning("%s failed (%s%s); falling back to %s", model, kind, f" {status}" if status else "", remaining[0])
        return attempt

    def _reserve_id(self, response_id: str | None, route: Route) -> str | None:
        """The id a routed answer waits under: the upstream's, or ``<id>-fedroute-<12 hex>`` when that one
        already awaits a score or is reserved by a call still being answered (an upstream that repeats
        ids: keyed by it, a second answer replaced the first in the pending store, and the first one's score
        went to the second). Reserved until :meth:`_finish` has stored it. Other calls: ``response_id``."""
        if route.plan is None or self._pending is None or not storable_id(response_id):
            return response_id
        with self._id_lock:
            key = response_id
            while key in self._reserved_ids or self._pending.get(key) is not None:
                key = f"{response_id}-fedroute-{secrets.token_hex(6)}"
            self._reserved_ids.add(key)
        return key

    def _finish_response(self, route: Route, response, latency_ms: float) -> CallOutcome:
        """:meth:`_finish` for a whole completion, whose ``id`` becomes the reserved one."""
        key = self._reserve_id(response.id, route)
        if key != response.id:
            response.id = key
        return self._finish(route, key, response.usage, latency_ms)

    def _finish(self, route: Route, response_id: str | None, usage, latency_ms: float) -> CallOutcome:
        """Record an answered call: cost from usage, the budget controller, the pending store, the hook.
        ``response_id`` is released from the reserved ids (:meth:`_reserve_id`) once done."""
        try:
            return self._record(route, response_id, usage, latency_ms)
        finally:
            if response_id is not None:
                with self._id_lock:
                    self._reserved_ids.discard(response_id)

    def _record(self, route: Route, response_id: str | None, usage, latency_ms: float) -> CallOutcome:
        prompt_tokens = getattr(usage, "prompt_tokens", None)
        completion_tokens = getattr(usage, "completion_tokens", None)
        cost = None
        if isinstance(prompt_tokens, int) and isinstance(completion_tokens, int):
            try:
                cost = self._prices[route.model].cost_usd(prompt_tokens, completion_tokens)
            except InvalidInputError as exc:  # negative or absurd counts from the upstream: the answer still stands
                log.warning("the answer of %s (id %s) reports unusable usage (%s): its cost is not observed and it "
                            "is not recorded", route.model, response_id, exc)
        else:
            log.warning("the answer of %s (id %s) has no usage: its cost is not observed and it is not recorded",
                        route.model, response_id)
        plan = route.plan
        if plan is not None and plan.controller is not None and cost is not None:
            plan.controller.record(route.model, cost)
        awaiting = False
        to_store = plan is not None and self._pending is not None and cost is not None and bool(response_id)
        if to_store and not storable_id(response_id):  # e.g. lone surrogates from the upstream: the answer still stands
            log.warning("the answer of %s has an id that cannot be stored (%r): it cannot be scored later",
                        route.model, str(response_id)[:80])
        elif to_store and cost > MAX_COST_PER_QUERY_USD:  # no log row may hold it: feedback could never record it
            log.warning("the answer of %s (id %s) cost %.6g USD by its usage, above the %g USD per query a log row "
                        "holds (absurd token counts or prices?): it cannot be scored later", route.model,
                        response_id, cost, MAX_COST_PER_QUERY_USD)
        elif to_store:
            c = plan.choice
            self._pending.add(PendingOutcome(response_id, time.time(), route.model, cost, latency_ms, c.embedding,
                                             c.cell, c.bundle_version))
            awaiting = True
        outcome = CallOutcome(route, response_id, latency_ms, prompt_tokens, completion_tokens, cost, awaiting)
        self._observer.answered(outcome)
        return outcome

    # -- feedback ----------------------------------------------------------------------------

    def feedback(self, response_id: str, score: float) -> int:
        """Record the score of an answered routed call: one :class:`sdk.EvalLog` row (the model that
        answered, ``score``, observed cost and latency, embedding, cell, bundle version, the time of
        the answer). Returns the row id.

        Parameters
        ----------
        response_id : the completion's ``id``.
        score : real in [0, 1], the app's judgement of the answer.

        Raises
        ------
        InvalidInputError
            This client has no log, or ``score`` is not a real in [0, 1].
        UnknownResponseError
            No routed call awaits a score under ``response_id`` (unknown, already scored, expired,
            a pass-through, an answer without usage or one costing over 1000 USD).
        EvalLogError
            The log or the pending store cannot be written or read, or was closed (:meth:`close`), or
            the waiting answer cannot go in the log (a model or embedding of another bundle's log, a
            cost above :data:`sdk.eval_log.MAX_COST_PER_QUERY_USD`); the entry stays pending.
        """
        if self._log is None or self._pending is None:
            raise InvalidInputError("this RoutedChat has no EvalLog (log=None): there is nowhere to record a score")
        value = finite_float(score)
        if value is None or not 0.0 <= value <= 1.0:
            raise InvalidInputError(f"score must be a real number in [0, 1], got {shown(score)}")
        if not isinstance(response_id, str):
            raise InvalidInputError(f"response_id must be a str, got {type(response_id).__name__}")
        def record(pending: PendingOutcome) -> int:
            try:  # a clock set back since the answer: the row takes the time of the feedback (not a future one)
                return self._log.record(pending.model, value, pending.cost_usd, latency_ms=pending.latency_ms,
                                        embedding=pending.embedding, cell=pending.cell,
                                        bundle_version=pending.bundle_version,
                                        timestamp=min(pending.timestamp, time.time()))
            except (InvalidInputError, UnknownModelError, ShapeError) as exc:  # the stored outcome, not the score
                raise EvalLogError(f"the answer awaiting a score under id {response_id!r} cannot be recorded in "
                                   f"{str(self._log.path)!r} (it stays pending): {exc}") from exc

        # The entry is removed once its row is committed, under the pending store's write lock (another client
        # or process scoring the same id waits, then finds none); a crash in between re-scores, never loses.
        with self._feedback_lock:
            row = self._pending.take(response_id, record)
        if row is None:
            raise UnknownResponseError(f"no routed call awaits a score under id {response_id!r} (unknown, "
                                       "already scored, expired, a pass-through or an answer without usage)")
        return row

    async def afeedback(self, response_id: str, score: float) -> int:
        """:meth:`feedback` in a worker thread."""
        return await asyncio.to_thread(self.feedback, response_id, score)

    def close(self) -> None:
        """Close the sync clients built here and the pending store (not ``log``, which the app owns). Later
        calls raise :class:`UpstreamError` before sending anything (``feedback``: :class:`EvalLogError`)."""
        self._closed = True
        for c in self._clients.values():
            if c.owned and c.sync is not None:
                c.sync.close()
        if self._pending is not None:
            self._pending.close()
        self._budgets.close()

    async def aclose(self) -> None:
        """:meth:`close`, and the async clients built here."""
        for c in self._clients.values():
            if c.owned and c.async_ is not None:
                await c.async_.close()
        self.close()

    def __enter__(self) -> RoutedChat:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _chunk_error(model: str, exc: Exception) -> UpstreamError:
    return UpstreamError(f"{model} sent a stream event that is not a chat completion chunk ({type(exc).__name__}: "
                         f"{str(exc)[:200]})", status=None, kind="invalid_response")


def _checked_chunks(stream, model: str):
    """The chunks of ``stream``; one that does not parse or is not a ``ChatCompletionChunk`` ends it
    with :class:`UpstreamError` (kind ``invalid_response``; the chunks before it were passed on)."""
    try:
        for chunk in stream:
            if not isinstance(chunk, ChatCompletionChunk):
                raise _NotACompletion(f"a {type(chunk).__name__}")
            yield chunk
    except _GARBAGE as exc:
        raise _chunk_error(model, exc) from exc


async def _achecked_chunks(stream, model: str):
    """Async :func:`_checked_chunks`."""
    try:
        async for chunk in stream:
            if not isinstance(chunk, ChatCompletionChunk):
                raise _NotACompletion(f"a {type(chunk).__name__}")
            yield chunk
    except _GARBAGE as exc:
        raise _chunk_error(model, exc) from exc


class RoutedStream:
    """Iterator of ``ChatCompletionChunk`` that records the call when the stream ends.

    Raises :class:`~sdk.errors.UpstreamError` (kind ``"invalid_response"``) during iteration when
    the upstream sends an event that is not a chunk (the chunks before it were passed on).

    ``route`` is known at once; ``outcome`` (:class:`CallOutcome`) once the stream is exhausted or
    closed. Use as an iterator, optionally in a ``with`` block (closing it ends the upstream stream).
    """

    def __init__(self, stream, route: Route, chat: RoutedChat, strip_usage: bool, t0: float) -> None:
        self._stream, self.route, self._chat, self._strip, self._t0 = stream, route, chat, strip_usage, t0
        self.outcome: CallOutcome | None = None
        self._chunks = self._run()

    def _run(self):
        usage = response_id = upstream_id = None
        try:
            for chunk in _checked_chunks(self._stream, self.route.model):
                if response_id is None and chunk.id:
                    upstream_id = chunk.id
                    response_id = self._chat._reserve_id(upstream_id, self.route)
                if response_id != upstream_id and chunk.id == upstream_id:
                    chunk.id = response_id
                if chunk.usage is not None:
                    usage = chunk.usage
                    if self._strip and not chunk.choices:
                        continue
                yield chunk
        finally:
            self.outcome = self._chat._finish(self.route, response_id, usage, _ms(self._t0))

    def __iter__(self):
        return self._chunks

    def __next__(self):
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()
        self._stream.close()

    def __enter__(self) -> RoutedStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncRoutedStream:
    """Async iterator of ``ChatCompletionChunk``; as :class:`RoutedStream`."""

    def __init__(self, stream, route: Route, chat: RoutedChat, strip_usage: bool, t0: float) -> None:
        self._stream, self.route, self._chat, self._strip, self._t0 = stream, route, chat, strip_usage, t0
        self.outcome: CallOutcome | None = None
        self._chunks = self._run()

    async def _run(self):
        usage = response_id = upstream_id = None
        try:
            async for chunk in _achecked_chunks(self._stream, self.route.model):
                if response_id is None and chunk.id:
                    upstream_id = chunk.id
                    response_id = await asyncio.to_thread(self._chat._reserve_id, upstream_id, self.route)
                if response_id != upstream_id and chunk.id == upstream_id:
                    chunk.id = response_id
                if chunk.usage is not None:
                    usage = chunk.usage
                    if self._strip and not chunk.choices:
                        continue
                yield chunk
        finally:
            self.outcome = await asyncio.to_thread(self._chat._finish, self.route, response_id, usage, _ms(self._t0))

    def __aiter__(self):
        return self._chunks

    async def __anext__(self):
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()
        await self._stream.close()


# ---------------------------------------------------------------------------------------------


def check_budget(budget: object) -> float:
    """``budget`` (USD per 1,000 queries) as a float if it is a finite real > 0.

    Raises
    ------
    InvalidInputError
        Not a real number (bools included), NaN, inf, <= 0 or below :data:`sdk.budget.MIN_BUDGET_USD_PER_1K`.
    """
    value = finite_float(budget)
    if value is None or value <= 0:
        raise InvalidInputError(f"budget_usd_per_1k must be a finite number > 0 (USD per 1,000 queries), "
                                f"got {shown(budget)}")
    check_budget_floor(value, budget)  # refused here, not by the controller at the first call
    return value


def _as_messages(messages: object) -> object:
    """A str as one user message; anything else as it is (checked by routing or :func:`_check_messages`)."""
    return [{"role": "user", "content": messages}] if isinstance(messages, str) else messages


def _check_messages(messages: object) -> None:
    """The checks of :func:`sdk.chat_text.routing_text` but the one for routable text (a pass-through call
    needs none: an image-only message may go to a model named by the caller).

    Raises
    ------
    InvalidQueryError
        Not a non-empty sequence of messages, or a message that is not one.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or len(messages) == 0:
        raise InvalidQueryError(f"messages must be a non-empty list of chat messages, got {shown(messages)}")
    for i, m in enumerate(messages):
        message_text(m, i)


def _check_stream_kwargs(kwargs: dict) -> None:
    """Refuse a ``stream`` that is not a bool (OpenAI's API takes a boolean only: ``"yes"`` was read as
    true) or a ``stream_options`` that is not a mapping, before anything is routed or sent."""
    if kwargs.get("stream") is not None and not isinstance(kwargs["stream"], (bool, openai.NotGiven, openai.Omit)):
        raise InvalidInputError(f"stream must be a boolean (true or false), got {type(kwargs['stream']).__name__} "
                                f"{kwargs['stream']!r:.80}", param="stream")
    if kwargs.get("stream_options") is not None and not isinstance(kwargs["stream_options"], Mapping):
        raise InvalidInputError(f"stream_options must be a mapping (a JSON object), got "
                                f"{type(kwargs['stream_options']).__name__}", param="stream_options")


def _call_kwargs(messages: object, kwargs: dict) -> tuple[dict, bool, bool]:
    """The keyword arguments of ``chat.completions.create``, whether to stream, and whether to strip the
    usage-only chunk. ``messages`` (checked already) go in ``extra_body``, which the ``openai`` package sends
    as it is: given by name they pass through its per-field type transform (for plain JSON a no-op) at 1.9 ms
    per message against 0.009 ms (docs/openai_proxy.md, HTTP limits)."""
    kwargs = dict(kwargs, messages=openai.omit, extra_body={**(kwargs.get("extra_body") or {}), "messages": messages})
    stream = bool(kwargs.get("stream"))
    strip = False
    if stream:
        options = dict(kwargs.get("stream_options") or {})
        strip = not options.get("include_usage")
        options["include_usage"] = True
        kwargs["stream_options"] = options
    return kwargs, stream, strip


def _unsendable(exc: UnicodeEncodeError) -> InvalidInputError:
    """The request's own fault, raised before anything is sent: text the ``openai`` client cannot encode
    (a lone surrogate such as a JSON body's ``"\\ud800"`` in a message it does not route, or in ``user``)."""
    return InvalidInputError(f"the request holds text that is not valid Unicode ({exc.reason}: "
                             f"{exc.object[exc.start:exc.end]!r}); nothing was sent")


def _clients_for(model: str, spec: object) -> _UpstreamClients:
    if isinstance(spec, str):
        spec = Upstream(base_url=spec)
    if isinstance(spec, openai.OpenAI):
        return _UpstreamClients(model, spec, None)
    if isinstance(spec, openai.AsyncOpenAI):
        return _UpstreamClients(model, None, spec)
    if not isinstance(spec, Upstream):
        raise InvalidInputError(f"the upstream of {model!r} must be a base URL str, an Upstream, an openai.OpenAI or "
                                f"an openai.AsyncOpenAI, got {type(spec).__name__}")
    if not isinstance(spec.timeout_s, (int, float)) or isinstance(spec.timeout_s, bool) or not spec.timeout_s > 0:
        raise InvalidInputError(f"the upstream of {model!r}: timeout_s must be a number > 0, got {spec.timeout_s!r}")
    name = spec.model or model
    sync, async_ = spec.client, spec.async_client
    if spec.base_url is not None:
        options = dict(base_url=spec.base_url, api_key=spec.api_key, timeout=float(spec.timeout_s), max_retries=0)
        try:
            sync = sync or openai.OpenAI(**options)
            async_ = async_ or openai.AsyncOpenAI(**options)
        except openai.OpenAIError as exc:
            raise InvalidInputError(f"cannot build the client of {model!r} ({spec.base_url}): {exc}") from exc
    if sync is None and async_ is None:
        raise InvalidInputError(f"the upstream of {model!r} has neither base_url nor a client")
    return _UpstreamClients(name, sync, async_, owned=spec.base_url is not None)


class _NotACompletion(Exception):
    """An upstream answer that parsed but is not a chat completion (a JSON list, text, no choices)."""


#: What a garbage answer raises out of ``chat.completions.create``: a body that is not JSON or
#: not text, JSON nested too deeply, or not a completion (:func:`_check_completion`).
_GARBAGE = (json.JSONDecodeError, UnicodeDecodeError, RecursionError, _NotACompletion)


def _check_completion(response: object) -> None:
    """Raise :class:`_NotACompletion` unless ``response`` is a ``ChatCompletion`` with a ``choices`` list
    (the ``openai`` package returns a non-JSON body as text and a JSON list as a list, unvalidated)."""
    if not isinstance(response, ChatCompletion) or not isinstance(getattr(response, "choices", None), list):
        raise _NotACompletion(f"the answer is not a chat completion (a {type(response).__name__} "
                              "without a 'choices' list)")


def _classify(exc: Exception) -> tuple[str, int | None]:
    if isinstance(exc, (*_GARBAGE, openai.APIResponseValidationError)):
        return "invalid_response", None
    if isinstance(exc, openai.APITimeoutError):
        return "timeout", None
    if isinstance(exc, openai.APIConnectionError):
        return "connection", None
    if isinstance(exc, openai.APIStatusError):
        status = int(exc.status_code)
        if status == 429:
            return "rate_limit", status
        if status >= 500:
            return "server_error", status
        return "client_error", status
    return "client_error", None


def _exhausted(failed: list[FailedAttempt]) -> UpstreamError:
    last = failed[-1]
    tried = ", ".join(f"{a.model} ({a.kind}{f' {a.status}' if a.status else ''})" for a in failed)
    return UpstreamError(f"every model tried failed: {tried}", status=last.status, kind=last.kind, attempts=tuple(failed))


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3
