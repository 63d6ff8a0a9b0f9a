"""``RoutedChat``: an OpenAI-compatible chat client that routes each call, falls back, and keeps the books.

Per call: route the :func:`sdk.chat_text.routing_text` of ``messages`` by utility ``A - lam * C``
(paper 002) or a per-caller :class:`sdk.budget.BudgetController`, call the first model with an
upstream through the ``openai`` package, fall back on a timeout, connection failure, 429, 5xx or an
answer that is not a chat completion (at most ``max_fallbacks`` times), and record the observed cost
(:mod:`sdk.token_prices`) and latency; with a ``log``, :meth:`RoutedChat.feedback` writes the scored
call to the :class:`sdk.eval_log.EvalLog`. With ``explore``, an :class:`sdk.Explorer` over the pool picks
the model tried first, and a row answered by that model keeps its policy and propensity.
Behaviour in full: docs/openai_proxy.md. Requires the ``openai`` package (``pip install 'fedroute[proxy]'``).
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
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn, cast
from urllib.parse import urlsplit

import numpy as np
import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from sdk.budget import BudgetController, check_budget_floor
from sdk.caller_budgets import DEFAULT_MAX_PER_CALLER, CallerBudgets
from sdk.chat_text import DEFAULT_CONTEXT_CHARS, message_texts, routing_text
from sdk.errors import (BundleError, EvalLogError, InvalidInputError, ShapeError, UnknownModelError,
                        UnknownResponseError, UpstreamError)
from sdk.eval_log import MAX_COST_PER_QUERY_USD, EvalLog
from sdk.explorer import Explorer
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
    """An OpenAI-compatible endpoint serving one model: ``base_url`` (clients built from it, sync and
    async, ``max_retries=0``) or ready ``client`` / ``async_client``; ``api_key`` (None: the ``openai``
    package reads ``OPENAI_API_KEY``); ``model``, its name at the endpoint (default: the router's id);
    ``timeout_s`` > 0, seconds per call for clients built here."""

    base_url: str | None = None
    api_key: str | None = None
    model: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    client: openai.OpenAI | None = None
    async_client: openai.AsyncOpenAI | None = None


@dataclass(frozen=True)
class FailedAttempt:
    """One failed try: ``kind`` is ``"timeout"``, ``"connection"``, ``"rate_limit"``, ``"server_error"``,
    ``"invalid_response"`` or ``"client_error"``; ``status`` the HTTP status or None; ``elapsed_ms`` its wall time."""

    model: str
    kind: str
    status: int | None
    message: str
    elapsed_ms: float


@dataclass(frozen=True)
class Plan:
    """The routing decision for one call: the routed ``text``, the router's ``choice`` (or the Explorer's,
    with its ``policy`` and ``propensity``), the models to try (``order``, best first), ``lam`` used
    (USD^-1), the budget asked for (USD per 1k queries, or None), ``routing_ms`` and the budget
    ``controller`` that chose (or None)."""

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
    """An answered call as recorded: latency in ms (to the last chunk when streaming); token counts and
    observed ``cost_usd`` None when the answer had no ``usage``; ``awaiting_score`` when it waits for
    :meth:`RoutedChat.feedback` under ``response_id``."""

    route: Route
    response_id: str | None
    latency_ms: float
    prompt_tokens: int | None
    completion_tokens: int | None
    cost_usd: float | None
    awaiting_score: bool


@dataclass(frozen=True)
class RoutedResponse:
    """:meth:`RoutedChat.create_routed`'s answer: the ``ChatCompletion`` and its :class:`CallOutcome`."""

    completion: ChatCompletion
    outcome: CallOutcome


class ChatObserver:
    """Hooks called as a call goes (no-ops here; the proxy's metrics subclass it); thread-safe, never raising."""

    def routed(self, plan: Plan) -> None:
        """A call was routed (before any upstream is called)."""

    def failed(self, attempt: FailedAttempt) -> None:
        """One try failed (fallen back from, or ending the call)."""

    def answered(self, outcome: CallOutcome) -> None:
        """A call was answered and recorded."""


@dataclass
class _UpstreamClients:
    name: str
    sync: openai.OpenAI | None
    async_: openai.AsyncOpenAI | None
    owned: bool = False  # built here from a base URL: closed by RoutedChat.close / aclose


class RoutedChat:
    """Route, call, fall back and record (the module docstring; docs/openai_proxy.md).

    Parameters
    ----------
    router : :class:`sdk.Router`.
    upstreams : {router model id: base URL | :class:`Upstream` | ``openai.OpenAI`` | ``openai.AsyncOpenAI``},
        the routing pool.
    lam : float, USD^-1, finite >= 0, the default trade-off; or ``budget_usd_per_1k`` (float > 0, USD per
        1,000 queries): route by a budget controller by default (exactly one of the two).
    passthrough : {model id the router does not know: as ``upstreams``}, callable by name.
    prices : {model id: :class:`sdk.token_prices.TokenPrice`} overriding the bundle's price table.
    log : an :class:`sdk.EvalLog` over ``router.model_ids``; None records nothing for the sync job.
    pending : :class:`PendingOutcomes` or its path (default: ``<log stem>.pending.sqlite``).
    max_fallbacks : int >= 0; context_chars : int >= 0 (:func:`sdk.chat_text.routing_text`).
    observer : a :class:`ChatObserver`; budget_seed : seed of the budget controllers' mixing.
    max_budgets_per_caller : int >= 1; budget_state : SQLite file of the controllers' state, or None.
    explore : None (greedy), a policy name of :class:`sdk.Explorer` (unseeded) or an ``Explorer`` whose
        settings (policy, seed, n_draws, max_regret) are copied: each routed call tries first the model
        drawn by an Explorer of those settings over the pool (:attr:`explorer`, renewed by :meth:`reload`).

    Raises
    ------
    UnknownModelError
        An ``upstreams`` key the router does not know.
    PriceError
        A callable model without a token price.
    InvalidInputError
        Not exactly one of ``lam`` / ``budget_usd_per_1k``, either out of range, an empty ``upstreams``,
        an upstream of another type, a bad ``passthrough`` key, ``max_fallbacks`` or ``context_chars``,
        a ``log`` over other models, an ``openai`` client that cannot be built, or an ``explore`` that
        :class:`sdk.Explorer` refuses (an MLP bundle, an unknown policy).
    """

    def __init__(self, router: Router, *, upstreams: Mapping[str, object], lam: float | None = None,
                 budget_usd_per_1k: float | None = None, passthrough: Mapping[str, object] | None = None,
                 prices: Mapping[str, TokenPrice] | None = None, log: EvalLog | None = None,
                 pending: PendingOutcomes | str | Path | None = None, max_fallbacks: int = DEFAULT_MAX_FALLBACKS,
                 context_chars: int = DEFAULT_CONTEXT_CHARS, observer: ChatObserver | None = None,
                 budget_seed: int | None = None, max_budgets_per_caller: int = DEFAULT_MAX_PER_CALLER,
                 budget_state: str | Path | None = None, explore: str | Explorer | None = None) -> None:
        pass_ok = passthrough is None or isinstance(passthrough, Mapping)
        bad_keys = [n for n in (passthrough or {}) if pass_ok and (not isinstance(n, str) or not n.strip()
                    or n.startswith(ROUTED_MODEL) or n in router.model_ids)]
        rules = (  # parameter, accepted, what it must be
            ("lam", (lam is None) != (budget_usd_per_1k is None), "give exactly one of lam (USD^-1) and budget_usd_per_1k "
             f"(USD per 1,000 queries), got lam={lam!r}, budget_usd_per_1k={budget_usd_per_1k!r}"),
            ("max_fallbacks", not isinstance(max_fallbacks, bool) and isinstance(max_fallbacks, numbers.Integral)
             and max_fallbacks >= 0, f"max_fallbacks must be an int >= 0, got {max_fallbacks!r}"),
            ("upstreams", isinstance(upstreams, Mapping) and bool(upstreams),
             "upstreams must be a non-empty mapping {router model id: base URL or Upstream}"),
            ("passthrough", pass_ok, "passthrough must be a mapping {model id: base URL or Upstream}, got "
             f"{type(passthrough).__name__}"),
            ("passthrough", not bad_keys, f"passthrough keys {bad_keys!r} must be model ids the router does not know, "
             "not starting with 'fedroute' (router models go in upstreams=)"),
            ("log", log is None or tuple(log.models) == tuple(router.model_ids),
             "log must be an sdk.EvalLog opened with router.model_ids"),
            ("explore", explore is None or isinstance(explore, (str, Explorer)),
             f"explore must be None, a policy name or an sdk.Explorer, got {type(explore).__name__}"))
        for param, accepted, message in rules:
            if not accepted:
                raise InvalidInputError(message, param=param)
        self._lam: float | None = None if lam is None else check_lambda(lam)
        self._budget: float | None = None if budget_usd_per_1k is None else check_budget(budget_usd_per_1k)
        routing_text([{"role": "user", "content": "x"}], context_chars)  # validates context_chars
        unknown = [m for m in upstreams if m not in router.model_ids]
        if unknown:
            raise UnknownModelError(f"upstreams names {unknown}, not in the router's models {list(router.model_ids)} "
                                    "(models the router does not know go in passthrough=)")
        passthrough = dict(passthrough or {})
        self._router: Router = router
        self._pool: tuple[str, ...] = tuple(m for m in router.model_ids if m in upstreams)  # router order
        self._pool_ids: frozenset[str] = frozenset(self._pool)
        self._callable_ids: tuple[str, ...] = (*self._pool, *passthrough)
        self._given_prices: Mapping[str, TokenPrice] | None = prices  # for reload(): the bundle's prices may change
        self._prices: dict[str, TokenPrice] = price_table(self._callable_ids, prices, router.models)
        self._clients: dict[str, _UpstreamClients] = {m: _clients_for(m, spec) for m, spec in (*upstreams.items(), *passthrough.items())}
        self._max_fallbacks: int = int(max_fallbacks)
        self._context_chars: int = int(context_chars)
        self._log: EvalLog | None = log
        if log is not None and not isinstance(pending, PendingOutcomes):
            pending = PendingOutcomes(pending if pending is not None else log.path.with_suffix(".pending.sqlite"))
        self._pending: PendingOutcomes | None = pending if isinstance(pending, PendingOutcomes) and log is not None else None
        self._observer: ChatObserver = observer or ChatObserver()
        self._budgets: CallerBudgets = CallerBudgets(lambda b: BudgetController(self.router, b, seed=budget_seed),
                                      max_per_caller=max_budgets_per_caller, path=budget_state)
        self._explore: dict[str, Any] | None = (None if explore is None else {"policy": explore}
                                                if isinstance(explore, str) else _settings(explore))
        self._explorer: Explorer | None = (None if self._explore is None
                                           else _explorer(router, self._explore, self._pool))
        self._closed: bool = False
        self._feedback_lock: threading.Lock = threading.Lock()
        self._id_lock: threading.Lock = threading.Lock()
        self._reserved_ids: set[str] = set()  # routed answers between their id's check and their pending entry
        # Drop-in shape of openai.OpenAI: chat.chat.completions.create(model=..., messages=...).
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

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
    def explorer(self) -> Explorer | None:
        """The :class:`sdk.Explorer` choosing the first model of each routed call (None: greedy)."""
        return self._explorer

    @property
    def pending(self) -> PendingOutcomes | None:
        """The store of calls awaiting a score (None without a log)."""
        return self._pending

    def budget_controllers(self, caller: str = "") -> dict[float, BudgetController]:
        """{budget USD per 1k queries: its :class:`sdk.budget.BudgetController`} kept for ``caller``."""
        return {b: c for (who, b), c in self._budgets.controllers().items() if who == caller}

    def save_budgets(self) -> int:
        """Save the budget controllers' state to ``budget_state``; rows written (0 without one).
        Raises :class:`EvalLogError` when the file cannot be written (the previous save stays)."""
        return self._budgets.save()

    def reload(self) -> bool:
        """Swap in a newer bundle installed where the router was loaded from (:meth:`sdk.Router.reloaded`);
        calls already routed finish on the old one. True if one was swapped in.

        Raises
        ------
        BundleError
            The newer bundle does not verify, or routes other models (the old one stays).
        PriceError
            A model has no price in the newer bundle nor in ``prices`` (the old one stays).
        InvalidInputError
            The router was not built by :meth:`sdk.Router.load`, or ``explore`` is on and the newer
            bundle is not a K-means one (the old one stays).
        """
        new = self._router.reloaded()
        if new is None:
            return False
        if new.model_ids != self._router.model_ids:
            raise BundleError(f"bundle version {new.bundle_version} routes {list(new.model_ids)}, not this client's "
                              f"{list(self._router.model_ids)} (its log and upstreams): not swapped in; restart with it")
        prices = price_table(self._callable_ids, self._given_prices, new.models)
        explorer = None if self._explore is None else _explorer(new, self._explore, self._pool)  # the new table
        old = self._router.bundle_version
        self._router, self._explorer, self._prices = new, explorer, prices
        log.info("routing with bundle version %d (was %d)", new.bundle_version, old)
        return True

    # -- routing -----------------------------------------------------------------------------

    def choose(self, messages: object, *, model: str | None = None, caller: str = "") -> Plan:
        """The :class:`Plan` for ``messages`` (chat messages, or a str as one user message) under ``model=``
        (``None``, ``"fedroute"``, ``"fedroute:lam=X"`` or ``"fedroute:budget=Y"``), without calling;
        ``caller`` picks the budget controllers.

        Raises
        ------
        ModelSpecError, InvalidQueryError, InvalidInputError
            A malformed ``model``, a pass-through id, no user text, or no model of the pool with an estimate.
        """
        spec = parse_model_spec(model)
        if not spec.routed:
            raise InvalidInputError(f"choose() routes; model={model!r} names a model to call directly")
        return self._plan(_as_messages(messages), spec, caller)

    async def achoose(self, messages: object, *, model: str | None = None, caller: str = "") -> Plan:
        """:meth:`choose` in a worker thread (the ONNX embedder would block the event loop)."""
        return await asyncio.to_thread(self.choose, messages, model=model, caller=caller)

    def _plan(self, messages: object, spec: ModelSpec, caller: str) -> Plan:
        text = routing_text(messages, self._context_chars)
        t0 = time.perf_counter()
        budget = spec.budget_usd_per_1k if spec.budget_usd_per_1k is not None else (
            self._budget if spec.lam is None else None)
        first: str | None = None
        controller: BudgetController | None = None
        explorer = self._explorer  # one bundle per call, also when reload() swaps it meanwhile
        router = self._router if explorer is None else explorer.router
        choose = router.choose if explorer is None else explorer.choose
        if budget is not None:
            # The controller picks among the models with an upstream only (NaN = no estimate), so its
            # spend curve is that of the models this client can call.
            controller = self._budgets.get(caller, budget)
            choice = choose(text, float(controller.lam))
            pool = self._pool_ids
            first = controller.choose_from_predictions(
                np.array([s.accuracy if s.model in pool else math.nan for s in choice.scores]),
                np.array([s.cost_usd if s.model in pool else math.nan for s in choice.scores]))
        else:
            lam = self._lam if spec.lam is None else spec.lam
            assert lam is not None  # exactly one of lam / budget is set at construction
            choice = choose(text, lam)
        if explorer is not None:  # the explored model goes first; the controller (if any) still sees every cost
            first = choice.model
        ranked = self._ranked(choice)
        if first in self._pool_ids:
            ranked = [first] + [m for m in ranked if m != first]
        if not ranked:
            raise InvalidInputError(f"the router has no estimate for any model with an upstream {list(self._pool)}")
        order = tuple(ranked[: 1 + self._max_fallbacks])
        plan = Plan(text, choice, order, choice.lam, budget, _ms(t0), controller)
        self._observer.routed(plan)
        return plan

    def _ranked(self, choice: Choice) -> list[str]:
        u = np.array([[s.utility for s in choice.scores]], dtype=np.float64)
        cost = np.array([[s.cost_usd for s in choice.scores]], dtype=np.float64)
        return [choice.scores[j].model for j in _rank_unchecked(u, cost)[0]
                if choice.scores[j].model in self._pool_ids and not (math.isnan(u[0, j]) or math.isnan(cost[0, j]))]

    # -- calling -----------------------------------------------------------------------------

    def create(self, *, messages: object, model: str | None = None, caller: str = "",
               **kwargs: Any) -> ChatCompletion | RoutedStream:
        """Route (or pass through) and call: the ``ChatCompletion``, or with ``stream=True`` a
        :class:`RoutedStream` of ``ChatCompletionChunk``. ``kwargs`` go to ``chat.completions.create``
        (``model`` becomes the upstream's name); ``caller`` names whose budget controllers
        ``fedroute:budget=Y`` uses (the proxy: the token's digest).

        Raises
        ------
        ModelSpecError, UnknownModelError, InvalidQueryError, InvalidInputError
            Bad ``model=`` (malformed, or an id with no upstream) or ``messages``, a ``stream`` that is not
            a bool, a ``stream_options`` that is not a mapping, or text that cannot be sent (lone surrogates).
        UpstreamError
            A non-retryable upstream error, or every try failed (``.attempts``).
        """
        result = self.create_routed(messages=messages, model=model, caller=caller, **kwargs)
        return result if isinstance(result, RoutedStream) else result.completion

    def create_routed(self, *, messages: object, model: str | None = None, caller: str = "",
                      **kwargs: Any) -> RoutedResponse | RoutedStream:
        """:meth:`create`, returning a :class:`RoutedResponse` (completion + :class:`CallOutcome`) or a
        :class:`RoutedStream` (``route`` known at once, ``outcome`` after the last chunk)."""
        _check_stream_kwargs(kwargs)
        requested, plan, order, listed = self._prepare(messages, model, caller)
        call, stream, strip = _call_kwargs(listed, kwargs)
        failed: list[FailedAttempt] = []
        for m in order:
            client = self._clients[m]
            sync = client.sync or _no_client(m, "acreate")
            t0 = time.perf_counter()
            try:
                response = _checked(sync.chat.completions.create(model=client.name, **call), stream)
            except _FAILURES as exc:
                failed.append(self._failure(m, exc, t0, order, failed))
                continue
            route = Route(requested, plan, m, tuple(failed))
            if stream:
                return RoutedStream(response, route, self, strip, t0)
            return RoutedResponse(response, self._finish_response(route, response, _ms(t0)))
        raise _exhausted(failed)

    async def acreate(self, *, messages: object, model: str | None = None, caller: str = "",
                      **kwargs: Any) -> ChatCompletion | AsyncRoutedStream:
        """Async :meth:`create` (``openai.AsyncOpenAI``; routing and bookkeeping in a worker thread):
        the ``ChatCompletion``, or with ``stream=True`` an :class:`AsyncRoutedStream`. Same errors."""
        result = await self.acreate_routed(messages=messages, model=model, caller=caller, **kwargs)
        return result if isinstance(result, AsyncRoutedStream) else result.completion

    async def acreate_routed(self, *, messages: object, model: str | None = None, caller: str = "",
                             **kwargs: Any) -> RoutedResponse | AsyncRoutedStream:
        """Async :meth:`create_routed`."""
        _check_stream_kwargs(kwargs)
        requested, plan, order, listed = await asyncio.to_thread(self._prepare, messages, model, caller)
        call, stream, strip = _call_kwargs(listed, kwargs)
        failed: list[FailedAttempt] = []
        for m in order:
            client = self._clients[m]
            async_ = client.async_ or _no_client(m, "create")
            t0 = time.perf_counter()
            try:
                response = _checked(await async_.chat.completions.create(model=client.name, **call), stream)
            except _FAILURES as exc:
                failed.append(self._failure(m, exc, t0, order, failed))
                continue
            route = Route(requested, plan, m, tuple(failed))
            if stream:
                return AsyncRoutedStream(response, route, self, strip, t0)
            outcome = await asyncio.to_thread(self._finish_response, route, response, _ms(t0))
            return RoutedResponse(response, outcome)
        raise _exhausted(failed)

    def _prepare(self, messages: object, model: str | None,
                 caller: str) -> tuple[str, Plan | None, tuple[str, ...], list[object]]:
        """The ``model=`` string answered, the plan (None: pass-through), the models to try and the checked
        ``messages`` as a list (a str as one user message)."""
        if self._closed:  # nothing is sent: an answer could not be recorded (the pending store is closed)
            raise UpstreamError("this RoutedChat is closed (close() shut its clients and its pending store); "
                                "create a new one", status=None, kind="connection")
        spec = parse_model_spec(model)
        listed = _as_messages(messages)
        if spec.routed:
            plan = self._plan(listed, spec, caller)
            return model or ROUTED_MODEL, plan, plan.order, list(cast(Sequence[object], listed))  # checked by routing
        name = spec.passthrough
        assert name is not None  # not routed: a pass-through id
        if name not in self._clients:
            raise UnknownModelError(f"model {name!r} has no upstream; callable: {list(self._clients)} "
                                    "or 'fedroute' to route")
        message_texts(listed)  # no text needed: an image-only message may go to a model named by the caller
        return name, None, (name,), list(cast(Sequence[object], listed))

    def _failure(self, model: str, exc: Exception, t0: float, order: tuple[str, ...],
                 failed: list[FailedAttempt]) -> FailedAttempt:
        """The failed try, logged and told to the observer; raises for a request that is itself wrong."""
        if isinstance(exc, UnicodeEncodeError):  # text the client cannot encode (a lone surrogate): nothing sent
            raise InvalidInputError(f"the request holds text that is not valid Unicode ({exc.reason}: "
                                    f"{exc.object[exc.start:exc.end]!r}); nothing was sent") from exc
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

    # -- recording ---------------------------------------------------------------------------

    def _reserve_id(self, response_id: str, route: Route) -> str:
        """The id a routed answer waits under: the upstream's, or ``<id>-fedroute-<12 hex>`` when that one
        already awaits a score or is reserved by a call still being answered (an upstream that repeats
        ids); reserved until :meth:`_finish` has stored it."""
        if route.plan is None or self._pending is None or not storable_id(response_id):
            return response_id
        with self._id_lock:
            key = response_id
            while key in self._reserved_ids or self._pending.get(key) is not None:
                key = f"{response_id}-fedroute-{secrets.token_hex(6)}"
            self._reserved_ids.add(key)
        return key

    def _finish_response(self, route: Route, response: ChatCompletion, latency_ms: float) -> CallOutcome:
        """:meth:`_finish` for a whole completion, whose ``id`` becomes the reserved one."""
        key = self._reserve_id(response.id, route) if response.id else response.id
        if key != response.id:
            response.id = key
        return self._finish(route, key, response.usage, latency_ms)

    def _finish(self, route: Route, response_id: str | None, usage: object, latency_ms: float) -> CallOutcome:
        """Record an answered call, then release ``response_id`` from the reserved ids."""
        try:
            return self._record(route, response_id, usage, latency_ms)
        finally:
            if response_id is not None:
                with self._id_lock:
                    self._reserved_ids.discard(response_id)

    def _record(self, route: Route, response_id: str | None, usage: object, latency_ms: float) -> CallOutcome:
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
        awaiting = self._await_score(plan, route, response_id, cost, latency_ms)
        outcome = CallOutcome(route, response_id, latency_ms, prompt_tokens, completion_tokens, cost, awaiting)
        self._observer.answered(outcome)
        return outcome

    def _await_score(self, plan: Plan | None, route: Route, response_id: str | None, cost: float | None,
                     latency_ms: float) -> bool:
        """Store the answer until :meth:`feedback` scores it; False where it cannot be scored later."""
        if plan is None or self._pending is None or cost is None or not response_id:
            return False
        if not storable_id(response_id):  # e.g. lone surrogates from the upstream: the answer still stands
            log.warning("the answer of %s has an id that cannot be stored (%r): it cannot be scored later",
                        route.model, str(response_id)[:80])
            return False
        if cost > MAX_COST_PER_QUERY_USD:  # no log row may hold it: feedback could never record it
            log.warning("the answer of %s (id %s) cost %.6g USD by its usage, above the %g USD per query a log row "
                        "holds (absurd token counts or prices?): it cannot be scored later", route.model,
                        response_id, cost, MAX_COST_PER_QUERY_USD)
            return False
        c = plan.choice
        # An explored choice answered by a fallback is logged without policy nor propensity (docs/openai_proxy.md).
        explored = c.policy != "greedy" and route.model == c.model
        self._pending.add(PendingOutcome(response_id, time.time(), route.model, cost, latency_ms, c.embedding,
                                         c.cell, c.bundle_version, c.policy if explored else None,
                                         c.propensity if explored else None))
        return True

    def feedback(self, response_id: str, score: object) -> int:
        """Record the score in [0, 1] of the answered routed call ``response_id`` (the completion's ``id``):
        one :class:`sdk.EvalLog` row (the model that answered, ``score``, observed cost and latency,
        embedding, cell, bundle version, the time of the answer). Returns the row id.

        Raises
        ------
        InvalidInputError
            This client has no log, or ``score`` is not a real in [0, 1].
        UnknownResponseError
            No routed call awaits a score under ``response_id`` (unknown, already scored, expired,
            a pass-through, an answer without usage or one costing over 1000 USD).
        EvalLogError
            The log or the pending store cannot be written, or was closed, or the waiting answer cannot
            go in the log; the entry stays pending.
        """
        value = finite_float(score)
        if self._log is None or self._pending is None or value is None or not 0.0 <= value <= 1.0:
            raise InvalidInputError(f"score must be a real number in [0, 1], got {shown(score)}" if self._log is not None
                                    else "this RoutedChat has no EvalLog (log=None): there is nowhere to record a score")
        eval_log = self._log

        def record(pending: PendingOutcome) -> int:
            try:  # a clock set back since the answer: the row takes the time of the feedback (not a future one)
                return eval_log.record(pending.model, value, pending.cost_usd, latency_ms=pending.latency_ms,
                                       embedding=pending.embedding, cell=pending.cell,
                                       bundle_version=pending.bundle_version, policy=pending.policy,
                                       propensity=pending.propensity, timestamp=min(pending.timestamp, time.time()))
            except (InvalidInputError, UnknownModelError, ShapeError) as exc:  # the stored outcome, not the score
                raise EvalLogError(f"the answer awaiting a score under id {response_id!r} cannot be recorded in "
                                   f"{str(eval_log.path)!r} (it stays pending): {exc}") from exc

        # The entry is removed once its row is committed, under the pending store's write lock (another client
        # or process scoring the same id waits, then finds none); a crash in between re-scores, never loses.
        with self._feedback_lock:
            row = self._pending.take(response_id, record)
        if row is None:
            raise UnknownResponseError(f"no routed call awaits a score under id {response_id!r:.80} (unknown, "
                                       "already scored, expired, a pass-through or an answer without usage)")
        return row

    async def afeedback(self, response_id: str, score: object) -> int:
        """:meth:`feedback` in a worker thread."""
        return await asyncio.to_thread(self.feedback, response_id, score)

    def close(self) -> None:
        """Close the sync clients built here, the pending store and the budget state (not ``log``); later
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

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StreamBooks:
    """What a routed stream keeps as its chunks pass: the reserved id and the usage."""

    def __init__(self, route: Route, chat: RoutedChat, strip_usage: bool, t0: float) -> None:
        self.route, self._chat, self._strip, self._t0 = route, chat, strip_usage, t0
        self.outcome: CallOutcome | None = None
        self._usage: object = None
        self._upstream_id: str | None = None
        self._response_id: str | None = None

    def _passes(self, chunk: object) -> bool:
        """Rename the chunk's id to the reserved one, keep its usage; False for a usage-only chunk to strip.
        Raises :class:`_NotACompletion` for an event that is not a chunk."""
        if not isinstance(chunk, ChatCompletionChunk):
            raise _NotACompletion(f"a {type(chunk).__name__}")
        if self._response_id != self._upstream_id and chunk.id == self._upstream_id:
            chunk.id = self._response_id or chunk.id
        if chunk.usage is None:
            return True
        self._usage = chunk.usage
        return not (self._strip and not chunk.choices)

    def _failed(self, exc: Exception) -> UpstreamError:
        return UpstreamError(f"{self.route.model} sent a stream event that is not a chat completion chunk "
                             f"({type(exc).__name__}: {str(exc)[:200]})", status=None, kind="invalid_response")

    def _record(self) -> None:
        self.outcome = self._chat._finish(self.route, self._response_id, self._usage, _ms(self._t0))


class RoutedStream(_StreamBooks):
    """Iterator of ``ChatCompletionChunk`` that records the call when the stream ends: ``route`` known at
    once, ``outcome`` (:class:`CallOutcome`) once exhausted or closed (closing ends the upstream stream).
    Raises :class:`~sdk.errors.UpstreamError` (kind ``"invalid_response"``) for an event that is not a
    chunk (the chunks before it were passed on)."""

    def __init__(self, stream: openai.Stream[ChatCompletionChunk], route: Route, chat: RoutedChat,
                 strip_usage: bool, t0: float) -> None:
        super().__init__(route, chat, strip_usage, t0)
        self._stream = stream
        self._chunks = self._run()

    def _run(self) -> Generator[ChatCompletionChunk, None, None]:
        try:
            for chunk in self._stream:
                if self._upstream_id is None and getattr(chunk, "id", None):
                    self._upstream_id = chunk.id
                    self._response_id = self._chat._reserve_id(chunk.id, self.route)
                if self._passes(chunk):
                    yield chunk
        except _GARBAGE as exc:
            raise self._failed(exc) from exc
        finally:
            self._record()

    def __iter__(self) -> Iterator[ChatCompletionChunk]:
        return self._chunks

    def __next__(self) -> ChatCompletionChunk:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()
        self._stream.close()

    def __enter__(self) -> RoutedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRoutedStream(_StreamBooks):
    """Async iterator of ``ChatCompletionChunk``; as :class:`RoutedStream`."""

    def __init__(self, stream: openai.AsyncStream[ChatCompletionChunk], route: Route, chat: RoutedChat,
                 strip_usage: bool, t0: float) -> None:
        super().__init__(route, chat, strip_usage, t0)
        self._stream = stream
        self._chunks = self._run()

    async def _run(self) -> AsyncGenerator[ChatCompletionChunk, None]:
        try:
            async for chunk in self._stream:
                if self._upstream_id is None and getattr(chunk, "id", None):
                    self._upstream_id = chunk.id
                    self._response_id = await asyncio.to_thread(self._chat._reserve_id, chunk.id, self.route)
                if self._passes(chunk):
                    yield chunk
        except _GARBAGE as exc:
            raise self._failed(exc) from exc
        finally:
            await asyncio.to_thread(self._record)

    def __aiter__(self) -> AsyncIterator[ChatCompletionChunk]:
        return self._chunks

    async def __anext__(self) -> ChatCompletionChunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()
        await self._stream.close()


def check_budget(budget: object) -> float:
    """``budget`` (USD per 1,000 queries) as a float. Raises :class:`InvalidInputError` unless a finite
    real > 0 (bools refused) and at least :data:`sdk.budget.MIN_BUDGET_USD_PER_1K`."""
    value = finite_float(budget)
    if value is None or value <= 0:
        raise InvalidInputError(f"budget_usd_per_1k must be a finite number > 0 (USD per 1,000 queries), "
                                f"got {shown(budget)}")
    check_budget_floor(value, budget)  # refused here, not by the controller at the first call
    return value


def _as_messages(messages: object) -> object:
    """A str as one user message; anything else as it is (checked by routing or :func:`message_texts`)."""
    return [{"role": "user", "content": messages}] if isinstance(messages, str) else messages


def _check_stream_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse a ``stream`` that is not a bool (OpenAI's API takes a boolean only) or a ``stream_options``
    that is not a mapping, before anything is routed or sent."""
    stream, options = kwargs.get("stream"), kwargs.get("stream_options")
    for param, accepted, what in (("stream", stream is None or isinstance(stream, (bool, openai.NotGiven, openai.Omit)),
                                   f"a boolean (true or false), got {type(stream).__name__} {stream!r:.80}"),
                                  ("stream_options", options is None or isinstance(options, Mapping),
                                   f"a mapping (a JSON object), got {type(options).__name__}")):
        if not accepted:
            raise InvalidInputError(f"{param} must be {what}", param=param)


def _call_kwargs(messages: list[object], kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool, bool]:
    """The keyword arguments of ``chat.completions.create``, whether to stream, and whether to strip the
    usage-only chunk. ``messages`` go in ``extra_body``, sent as they are: by name they would pass the
    ``openai`` package's per-field transform, 1.9 ms per message against 0.009 ms (docs/openai_proxy.md)."""
    kwargs = dict(kwargs, messages=openai.omit, extra_body={**(kwargs.get("extra_body") or {}), "messages": messages})
    stream = bool(kwargs.get("stream"))
    strip = False
    if stream:
        options = dict(kwargs.get("stream_options") or {})
        strip = not options.get("include_usage")
        options["include_usage"] = True
        kwargs["stream_options"] = options
    return kwargs, stream, strip


def _settings(explorer: Explorer) -> dict[str, Any]:
    """The keyword arguments that build an :class:`sdk.Explorer` like ``explorer``."""
    p = explorer.policy
    return {"policy": p.name, "seed": p.seed, "n_draws": p.n_draws, "max_regret": explorer.max_regret}


def _explorer(router: Router, settings: Mapping[str, Any], pool: Sequence[str]) -> Explorer:
    """An :class:`sdk.Explorer` of ``settings`` over ``router`` that explores only ``pool``: the other models'
    posteriors are NaN ("no estimate": never chosen, propensity 0) before its first choice."""
    explorer = Explorer(router, **settings)
    off = [j for j, m in enumerate(router.model_ids) if m not in pool]
    explorer.alpha_[:, off] = explorer.beta_[:, off] = np.nan
    return explorer


def _no_client(model: str, other: str) -> NoReturn:
    raise InvalidInputError(f"the upstream of {model!r} has no client for this call; use {other}()")


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
    timeout = finite_float(spec.timeout_s)
    sync, async_ = spec.client, spec.async_client
    url = urlsplit(str(spec.base_url or "http://client"))
    if timeout is None or timeout <= 0 or (spec.base_url is None and sync is None and async_ is None) \
            or url.scheme not in ("http", "https") or not url.netloc:
        raise InvalidInputError(f"the upstream of {model!r} needs timeout_s a number > 0 and a base_url "
                                "(http(s)://host/...) or a client, "
                                f"got timeout_s={spec.timeout_s!r}, base_url={spec.base_url!r}")
    if spec.base_url is not None:
        try:
            sync = sync or openai.OpenAI(base_url=spec.base_url, api_key=spec.api_key, timeout=timeout, max_retries=0)
            async_ = async_ or openai.AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, timeout=timeout,
                                                  max_retries=0)
        except openai.OpenAIError as exc:
            raise InvalidInputError(f"cannot build the client of {model!r} ({spec.base_url}): {exc}") from exc
    return _UpstreamClients(spec.model or model, sync, async_, owned=spec.base_url is not None)


class _NotACompletion(Exception):
    """An upstream answer that parsed but is not a chat completion (a JSON list, text, no choices)."""


#: What a garbage answer raises: a body that is not JSON or not text, JSON nested too deeply, or not a completion.
_GARBAGE = (json.JSONDecodeError, UnicodeDecodeError, RecursionError, _NotACompletion)
#: What one try may raise that :meth:`RoutedChat._failure` sorts out.
_FAILURES = (UnicodeEncodeError, openai.OpenAIError, *_GARBAGE)


def _checked(response: Any, stream: bool) -> Any:
    """``response``; unless streaming, :class:`_NotACompletion` if it is no ``ChatCompletion`` with a
    ``choices`` list (the ``openai`` package returns a non-JSON body as text and a JSON list as a list)."""
    if not stream and not (isinstance(response, ChatCompletion) and isinstance(response.choices, list)):
        raise _NotACompletion(f"the answer is not a chat completion (a {type(response).__name__} "
                              "without a 'choices' list)")
    return response


def _classify(exc: Exception) -> tuple[str, int | None]:
    if isinstance(exc, (*_GARBAGE, openai.APIResponseValidationError)):
        return "invalid_response", None
    if isinstance(exc, openai.APITimeoutError):
        return "timeout", None
    if isinstance(exc, openai.APIConnectionError):
        return "connection", None
    if isinstance(exc, openai.APIStatusError):
        status = int(exc.status_code)
        kind = "rate_limit" if status == 429 else "server_error" if status >= 500 else "client_error"
        return kind, status
    return "client_error", None


def _exhausted(failed: list[FailedAttempt]) -> UpstreamError:
    last = failed[-1]
    tried = ", ".join(f"{a.model} ({a.kind}{f' {a.status}' if a.status else ''})" for a in failed)
    return UpstreamError(f"every model tried failed: {tried}", status=last.status, kind=last.kind, attempts=tuple(failed))


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3
