"""The proxy's JSON config, validated, and the :class:`sdk.routed_chat.RoutedChat` it builds.

Example (paths relative to the config file)::

    {
      "bundle": "bundles/kmeans", "public_key": "keys/signing.pub",
      "log": "proxy_log.sqlite",
      "lam": 100,
      "max_fallbacks": 2, "context_chars": 300,
      "upstreams": {
        "gpt-4-1106-preview": {"base_url": "https://api.openai.com/v1", "api_key_env": "OPENAI_API_KEY",
                               "model": "gpt-4-turbo", "input_usd_per_1m": 10.0, "output_usd_per_1m": 30.0},
        "mistralai/mistral-7b-chat": {"base_url": "http://127.0.0.1:8000/v1", "api_key_env": "LOCAL_KEY",
                                      "input_usd_per_1m": 0.2, "output_usd_per_1m": 0.2, "timeout_s": 20}
      },
      "passthrough": {"gpt-4o": {"base_url": "https://api.openai.com/v1", "api_key_env": "OPENAI_API_KEY",
                                 "input_usd_per_1m": 2.5, "output_usd_per_1m": 10.0}}
    }

``upstreams`` keys are router model ids (the routing pool); ``passthrough`` keys are other models
callable by name. Prices per upstream (USD per 1M tokens) override the bundle's; an upstream with
neither is a :class:`sdk.errors.PriceError`. ``api_key_env`` names the environment variable holding
the key (the key itself never sits in the file); without it the ``openai`` package reads
``OPENAI_API_KEY``. Exactly one of ``lam`` (USD^-1) and ``budget_usd_per_1k`` is the default for
``model="fedroute"``. ``log`` is the device's :class:`sdk.EvalLog` (the file ``fedroute-sync`` reads);
scored calls are appended to it; without ``log`` (or with ``null``) the proxy keeps no log, and an empty
path is an error. Unknown keys are errors (a typo is not silently ignored).

Limits and upkeep (optional; defaults in brackets): ``max_messages`` [4096], the most messages in one
chat request (400 above, naming it); ``max_budgets_per_caller`` [16], ``fedroute:budget=Y`` controllers
kept per caller token (least recently used dropped); ``budget_state`` [``<log stem>.budgets.sqlite``
beside the log, none without a log; ``null``: none], the SQLite file the controllers' state is saved to
every ``budget_save_s`` [5] seconds and at shutdown, and restored from after a restart;
``reload_s`` [30], seconds between checks for a newer bundle installed at ``bundle`` (0: never).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from sdk.errors import InvalidInputError
from sdk.eval_log import EvalLog
from sdk.router import Router
from sdk.routed_chat import DEFAULT_MAX_FALLBACKS, DEFAULT_TIMEOUT_S, RoutedChat, Upstream
from sdk.caller_budgets import DEFAULT_MAX_PER_CALLER
from sdk.chat_text import DEFAULT_CONTEXT_CHARS
from sdk.token_prices import TokenPrice

_TOP = {"bundle", "public_key", "log", "lam", "budget_usd_per_1k", "max_fallbacks", "context_chars", "upstreams",
        "passthrough", "precision", "max_messages", "max_budgets_per_caller", "budget_state", "budget_save_s",
        "reload_s"}
#: Options of the app (:func:`sdk.proxy.app.create_app`) and their defaults.
_APP = {"max_messages": 4096, "budget_save_s": 5.0, "reload_s": 30.0}
#: What each path key names (relative to the config's folder), for the message refusing an empty one.
_PATHS = {"bundle": "the bundle folder written by `fedroute export`",
          "public_key": "the signing.pub file written by `fedroute keygen`",
          "log": "the EvalLog file the proxy appends scored calls to (omit \"log\" or give null to keep no log)",
          "budget_state": "the SQLite file of the budget controllers' state (null: keep it in memory only)"}
_UPSTREAM = {"base_url", "api_key_env", "model", "timeout_s", "input_usd_per_1m", "output_usd_per_1m"}


@dataclass(frozen=True)
class ProxyConfig:
    """A validated proxy config (see the module docstring); build with :meth:`load`."""

    path: Path
    raw: dict

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ProxyConfig:
        """Read and check ``path``.

        Raises
        ------
        InvalidInputError
            Unreadable or not JSON, unknown keys, missing ``bundle`` / ``public_key`` / ``upstreams``,
            a ``bundle`` / ``public_key`` / ``log`` that is not a path string or is empty, an upstream that is not
            an object with ``base_url``, an ``api_key_env`` or ``model`` that is not a string.
        """
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidInputError(f"proxy config {path}: cannot read it as JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise InvalidInputError(f"proxy config {path}: expected a JSON object")
        unknown = sorted(set(raw) - _TOP)
        if unknown:
            raise InvalidInputError(f"proxy config {path}: unknown keys {unknown}; valid: {sorted(_TOP)}")
        for key in ("bundle", "public_key", "upstreams"):
            if key not in raw:
                raise InvalidInputError(f"proxy config {path}: {key!r} is required")
        for key in ("bundle", "public_key", "log", "budget_state"):  # paths, joined to the config's folder
            if key in raw and not (isinstance(raw[key], str) or (key in ("log", "budget_state") and raw[key] is None)):
                raise InvalidInputError(f"proxy config {path}: {key!r} must be a path string, got "
                                        f"{type(raw[key]).__name__} {raw[key]!r:.80}")
            if isinstance(raw.get(key), str) and not raw[key].strip():  # "" named the config's own folder
                raise InvalidInputError(f"proxy config {path}: {key!r} is an empty path; expected "
                                        + _PATHS[key])
        for key in ("max_messages", "max_budgets_per_caller"):
            if key in raw and (isinstance(raw[key], bool) or not isinstance(raw[key], int) or raw[key] < 1):
                raise InvalidInputError(f"proxy config {path}: {key!r} must be an int >= 1, got {raw[key]!r:.80}")
        for key in ("budget_save_s", "reload_s"):
            value = raw.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise InvalidInputError(f"proxy config {path}: {key!r} must be a finite number of seconds >= 0, "
                                        f"got {value!r:.80}")
        for section in ("upstreams", "passthrough"):
            entries = raw.get(section, {})
            if not isinstance(entries, dict):
                raise InvalidInputError(f"proxy config {path}: {section!r} must be an object {{model id: upstream}}")
            for model, entry in entries.items():
                if not isinstance(entry, dict) or not isinstance(entry.get("base_url"), str):
                    raise InvalidInputError(f"proxy config {path}: {section}[{model!r}] must be an object with a "
                                            "base_url string")
                bad = sorted(set(entry) - _UPSTREAM)
                if bad:
                    raise InvalidInputError(f"proxy config {path}: {section}[{model!r}] has unknown keys {bad}; "
                                            f"valid: {sorted(_UPSTREAM)}")
                for key in ("api_key_env", "model"):
                    if entry.get(key) is not None and not isinstance(entry[key], str):
                        raise InvalidInputError(f"proxy config {path}: {section}[{model!r}][{key!r}] must be a "
                                                f"string, got {type(entry[key]).__name__} {entry[key]!r:.80}")
        return cls(path, raw)

    def _file(self, key: str) -> Path:
        path = self.path.parent / self.raw[key]
        # The bundle path is kept as a link: the sync job installs a new version by replacing it (reload_s).
        return path.absolute() if key == "bundle" else path.resolve()

    def app_options(self) -> dict:
        """The keyword arguments of :func:`sdk.proxy.app.create_app` this config sets (``max_messages``,
        ``budget_save_s``, ``reload_s``), defaults filled in."""
        return {k: self.raw.get(k, default) for k, default in _APP.items()}

    def build_chat(self, *, observer=None) -> RoutedChat:
        """Load the bundle (signature verified), open the log and build the :class:`RoutedChat`.

        Raises
        ------
        BundleError, EvalLogError, PriceError, UnknownModelError, InvalidInputError
            As :meth:`sdk.Router.load`, :class:`sdk.EvalLog` and :class:`RoutedChat`; an
            ``api_key_env`` naming an unset variable.
        """
        raw = self.raw
        router = Router.load(self._file("bundle"), self._file("public_key"), precision=raw.get("precision", "auto"))
        upstreams, prices = self._upstreams("upstreams")
        passthrough, more = self._upstreams("passthrough")
        log = EvalLog(self._file("log"), router.model_ids) if raw.get("log") else None
        budget_state = (self._file("budget_state") if raw.get("budget_state") else
                        log.path.with_suffix(".budgets.sqlite") if log is not None and "budget_state" not in raw else None)
        return RoutedChat(router, upstreams=upstreams, passthrough=passthrough, prices={**prices, **more},
                          max_budgets_per_caller=raw.get("max_budgets_per_caller", DEFAULT_MAX_PER_CALLER),
                          budget_state=budget_state,
                          lam=raw.get("lam"), budget_usd_per_1k=raw.get("budget_usd_per_1k"), log=log,
                          max_fallbacks=raw.get("max_fallbacks", DEFAULT_MAX_FALLBACKS),
                          context_chars=raw.get("context_chars", DEFAULT_CONTEXT_CHARS), observer=observer)

    def _upstreams(self, section: str) -> tuple[dict[str, Upstream], dict[str, TokenPrice]]:
        upstreams, prices = {}, {}
        for model, entry in self.raw.get(section, {}).items():
            key = None
            if entry.get("api_key_env") is not None:
                key = os.environ.get(entry["api_key_env"])
                if not key:
                    raise InvalidInputError(f"proxy config {self.path}: {section}[{model!r}] reads its key from "
                                            f"${entry['api_key_env']}, which is not set")
            upstreams[model] = Upstream(entry["base_url"], api_key=key, model=entry.get("model"),
                                        timeout_s=entry.get("timeout_s", DEFAULT_TIMEOUT_S))
            given = [entry.get("input_usd_per_1m"), entry.get("output_usd_per_1m")]
            if any(v is not None for v in given):
                if any(v is None for v in given):
                    raise InvalidInputError(f"proxy config {self.path}: {section}[{model!r}] gives one of "
                                            "input_usd_per_1m / output_usd_per_1m; give both")
                prices[model] = TokenPrice(*given)
        return upstreams, prices
