"""The proxy's JSON config (docs/openai_proxy.md, "Config"), validated by one pydantic model, and the
:class:`sdk.routed_chat.RoutedChat` it builds. Paths are relative to the config file; unknown keys are errors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from sdk.caller_budgets import DEFAULT_MAX_PER_CALLER
from sdk.chat_text import DEFAULT_CONTEXT_CHARS
from sdk.errors import InvalidInputError
from sdk.eval_log import EvalLog
from sdk.explorer import Explorer
from sdk.router import Router
from sdk.routed_chat import DEFAULT_MAX_FALLBACKS, DEFAULT_TIMEOUT_S, ChatObserver, RoutedChat, Upstream
from sdk.token_prices import TokenPrice

#: What each path key names, for the message refusing an empty one ("" would name the config's own folder).
_PATHS = {"bundle": "the bundle folder written by `fedroute export`",
          "public_key": "the signing.pub file written by `fedroute keygen`",
          "log": "the EvalLog file the proxy appends scored calls to (omit \"log\" or give null to keep no log)",
          "budget_state": "the SQLite file of the budget controllers' state (null: keep it in memory only)"}


def _path(key: str) -> Any:
    def check(value: str) -> str:
        if not value.strip():
            raise ValueError(f"{key!r} is an empty path; expected {_PATHS[key]}")
        return value
    return AfterValidator(check)


def _http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"base_url must be an http(s) URL such as https://api.openai.com/v1, got {value!r:.80}")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class UpstreamConfig(_Strict):
    """One entry of ``upstreams`` / ``passthrough``; prices in USD per 1M tokens (both or neither)."""

    base_url: Annotated[str, AfterValidator(_http_url)]
    api_key_env: str | None = None
    model: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    input_usd_per_1m: float | None = None
    output_usd_per_1m: float | None = None


class ExploreConfig(_Strict):
    """``explore``: the settings of the :class:`sdk.Explorer` that picks each routed call's first model
    (ranges checked by it)."""

    policy: str = "thompson"
    seed: int | None = None
    n_draws: int = 1000
    max_regret: float | None = None


class ProxySettings(_Strict):
    """The config's keys, types and defaults; range checks of ``lam``, the budget and the upstreams are
    :class:`RoutedChat`'s."""

    bundle: Annotated[str, _path("bundle")]
    public_key: Annotated[str, _path("public_key")]
    upstreams: dict[str, UpstreamConfig]
    passthrough: dict[str, UpstreamConfig] = {}
    log: Annotated[str, _path("log")] | None = None
    lam: float | None = None
    budget_usd_per_1k: float | None = None
    max_fallbacks: int = DEFAULT_MAX_FALLBACKS
    context_chars: int = DEFAULT_CONTEXT_CHARS
    precision: str = "auto"
    max_messages: int = Field(4096, ge=1)
    max_budgets_per_caller: int = Field(DEFAULT_MAX_PER_CALLER, ge=1)
    budget_state: Annotated[str, _path("budget_state")] | None = None
    budget_save_s: float = Field(5.0, ge=0, allow_inf_nan=False)
    reload_s: float = Field(30.0, ge=0, allow_inf_nan=False)
    explore: ExploreConfig | None = None


class ProxyConfig:
    """A validated proxy config; build with :meth:`load`."""

    def __init__(self, path: Path, settings: ProxySettings) -> None:
        self.path, self.settings = path, settings

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ProxyConfig:
        """Read and check ``path``.

        Raises
        ------
        InvalidInputError
            Unreadable or not JSON, or not :class:`ProxySettings` (unknown or missing keys, a value of
            another type, an empty path, a count < 1, a period < 0); the message names each key.
        """
        path = Path(path)
        try:
            return cls(path, ProxySettings.model_validate(json.loads(path.read_text())))
        except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            raise InvalidInputError(f"proxy config {path}: " + (_problems(exc) if isinstance(exc, ValidationError)
                                                                else f"cannot read it as JSON ({exc})")) from exc

    def _file(self, name: str) -> Path:
        path = self.path.parent / name
        return path.resolve()

    def app_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`sdk.proxy.app.create_app` this config sets."""
        s = self.settings
        return {"max_messages": s.max_messages, "budget_save_s": s.budget_save_s, "reload_s": s.reload_s}

    def build_chat(self, *, observer: ChatObserver | None = None) -> RoutedChat:
        """Load the bundle (signature verified), open the log and build the :class:`RoutedChat`.

        Raises
        ------
        BundleError, EvalLogError, PriceError, UnknownModelError, InvalidInputError
            As :meth:`sdk.Router.load`, :class:`sdk.EvalLog`, :class:`sdk.Explorer` and :class:`RoutedChat`; an
            ``api_key_env`` naming an unset variable, or one of two prices of an upstream.
        """
        s = self.settings
        # The bundle path is kept as a link: the sync job installs a new version by replacing it (reload_s).
        router = Router.load((self.path.parent / s.bundle).absolute(), self._file(s.public_key), precision=s.precision)
        upstreams, prices = self._upstreams("upstreams", s.upstreams)
        passthrough, more = self._upstreams("passthrough", s.passthrough)
        log = EvalLog(self._file(s.log), router.model_ids) if s.log else None
        budget_state = (self._file(s.budget_state) if s.budget_state else log.path.with_suffix(".budgets.sqlite")
                        if log is not None and "budget_state" not in s.model_fields_set else None)
        return RoutedChat(router, upstreams=upstreams, passthrough=passthrough, prices={**prices, **more},
                          max_budgets_per_caller=s.max_budgets_per_caller, budget_state=budget_state,
                          lam=s.lam, budget_usd_per_1k=s.budget_usd_per_1k, log=log, max_fallbacks=s.max_fallbacks,
                          context_chars=s.context_chars, observer=observer,
                          explore=None if s.explore is None else Explorer(router, **s.explore.model_dump()))

    def _upstreams(self, section: str, entries: dict[str, UpstreamConfig]
                   ) -> tuple[dict[str, object], dict[str, TokenPrice]]:
        upstreams: dict[str, object] = {}
        prices: dict[str, TokenPrice] = {}
        for model, entry in entries.items():
            key = None if entry.api_key_env is None else os.environ.get(entry.api_key_env)
            given = (entry.input_usd_per_1m, entry.output_usd_per_1m)
            problem = (f"reads its key from ${entry.api_key_env}, which is not set" if entry.api_key_env is not None
                       and not key else "gives one of input_usd_per_1m / output_usd_per_1m; give both"
                       if given.count(None) == 1 else None)
            if problem:
                raise InvalidInputError(f"proxy config {self.path}: {section}[{model!r}] {problem}")
            upstreams[model] = Upstream(entry.base_url, api_key=key, model=entry.model, timeout_s=entry.timeout_s)
            if given[0] is not None and given[1] is not None:
                prices[model] = TokenPrice(given[0], given[1])
        return upstreams, prices


def _problems(exc: ValidationError) -> str:
    """One clause per pydantic error, naming the key (``upstreams['m']['model']``); unknown keys together."""
    unknown = [str(e["loc"][-1]) for e in exc.errors() if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]
    clauses = [f"unknown keys {sorted(unknown)}; valid: {sorted(ProxySettings.model_fields)}"] if unknown else []
    for e in exc.errors():
        if e["type"] == "extra_forbidden" and len(e["loc"]) == 1:
            continue
        if not e["loc"]:  # the document itself: a list, a number, a string
            clauses.append(f"expected a JSON object, got {type(e['input']).__name__} {e['input']!r:.80}")
            continue
        head, *rest = [str(part) for part in e["loc"]]
        where = head + "".join(f"[{part!r}]" for part in rest) if rest else repr(head)
        if e["type"] == "missing":
            clauses.append(f"{where} is required")
        elif e["type"] == "value_error":
            clauses.append(str(e["msg"]).removeprefix("Value error, "))
        else:
            clauses.append(f"{where}: {e['msg']}, got {type(e['input']).__name__} {e['input']!r:.80}")
    return "; ".join(clauses)
