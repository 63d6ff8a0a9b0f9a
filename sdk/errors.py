"""The one exception hierarchy of fedroute.

Every error the SDK raises on purpose derives from :class:`FedrouteError`, and input errors also
derive from the built-in class a caller would expect, so ``except ValueError`` keeps working::

    FedrouteError
    ├── InvalidInputError (ValueError)      bad argument values at a public boundary
    │   ├── InvalidLambdaError              lam negative, NaN, inf or not a real number
    │   ├── InvalidQueryError               a query that is not a str, or is empty / whitespace only
    │   ├── ShapeError                      array of the wrong shape, dtype or with non-finite values
    │   ├── PrivacyError                    an update that would report fewer than min_count samples
    │   ├── PayloadError                    bytes that do not decode as the format they claim (safetensors, .npz)
    │   ├── BudgetError                     a cost budget that no lambda can meet
    │   ├── PriceError                      a model the app may call that has no token price (cost cannot be observed)
    │   ├── ModelSpecError                  a malformed ``model=`` string (``fedroute:lam=...``, ``fedroute:budget=...``)
    │   └── UnknownResponseError            feedback for a response id that awaits no score (unknown, scored, expired)
    ├── UnknownModelError (KeyError)        a model id the router or log does not know
    ├── BundleError                         a bundle that is missing, corrupt, tampered or inconsistent
    ├── EvalLogError                        the evaluation log file is unusable (not SQLite, wrong schema)
    ├── SyncError                           the federated sync could not complete (network, server, state)
    │   └── SyncRejectedError               the server answered with a 4xx; ``status`` and ``detail`` say why
    └── UpstreamError                       an LLM endpoint failed (after the bounded fallbacks); ``status``, ``attempts``
"""

from __future__ import annotations


class FedrouteError(Exception):
    """Base class of every error raised on purpose by fedroute."""


class InvalidInputError(FedrouteError, ValueError):
    """An argument has a value the function cannot accept; the message names it. ``param``: the
    request parameter at fault, if any (the OpenAI-compatible proxy reports it as the error's ``param``)."""

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class InvalidLambdaError(InvalidInputError):
    """The cost trade-off ``lam`` (USD^-1) is negative, NaN, infinite or not a real number."""


class InvalidQueryError(InvalidInputError):
    """A query is not a ``str`` or is empty / whitespace only (over-long queries are truncated, not rejected)."""


class ShapeError(InvalidInputError):
    """An array has the wrong shape or dtype, or holds NaN/inf where finite values are required."""


class PrivacyError(InvalidInputError):
    """An update that breaks the ``min_count`` privacy rule (ARCHITECTURE.md §6)."""


class PayloadError(InvalidInputError):
    """Bytes that do not decode as the format they claim (safetensors, ``.npz``, a JSON envelope)."""


class UnknownModelError(FedrouteError, KeyError):
    """A model id is not in the router's (or log's) model pool; the message lists the known ids."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class BundleError(FedrouteError):
    """A bundle cannot be used (missing file, bad hash, signature or manifest, parts that disagree)."""


class BudgetError(InvalidInputError):
    """A cost budget that no ``lam >= 0`` meets (below the cost of always choosing the cheapest model)."""


class EvalLogError(FedrouteError):
    """The evaluation log file cannot be opened or has a schema this version does not understand."""


class SyncError(FedrouteError):
    """The federated sync could not complete (server unreachable or failing after the retries, a
    malformed answer, unusable local state); the log is only read, the bundle replaced only by a verified one."""


class SyncRejectedError(SyncError):
    """The server refused a request with a 4xx ``status`` (not retried); ``detail`` is its explanation."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"server rejected the request ({status}): {detail}")
        self.status = int(status)
        self.detail = str(detail)


class PriceError(InvalidInputError):
    """A model that may be called has no token price, so the cost of its answers cannot be observed."""


class ModelSpecError(InvalidInputError):
    """A ``model=`` string that is neither a known model id nor a valid ``fedroute[:lam=X | :budget=Y]``."""


class UnknownResponseError(InvalidInputError):
    """A score for a response id that no answered routed call awaits (unknown, scored, expired, unlogged)."""


class UpstreamError(FedrouteError):
    """An OpenAI-compatible endpoint failed: a non-retryable answer, or every model tried (the choice
    and its fallbacks) failed. ``status``: HTTP status of the last attempt (None: timeout, no connection);
    ``kind``: ``"timeout"``, ``"connection"``, ``"rate_limit"``, ``"server_error"``, ``"invalid_response"``
    or ``"client_error"``; ``attempts``: every ``sdk.routed_chat.FailedAttempt`` in order."""

    def __init__(self, message: str, *, status: int | None, kind: str, attempts: tuple[object, ...] = ()) -> None:
        super().__init__(message)
        self.status = None if status is None else int(status)
        self.kind = str(kind)
        self.attempts = tuple(attempts)
