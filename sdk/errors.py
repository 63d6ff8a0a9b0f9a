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

Library exceptions that cross our boundary are re-raised as the most specific class here with
``raise ... from exc``.
"""

from __future__ import annotations


class FedrouteError(Exception):
    """Base class of every error raised on purpose by fedroute."""


class InvalidInputError(FedrouteError, ValueError):
    """An argument has a value the function cannot accept; the message names it and the fix.

    ``param`` (keyword, optional): the request parameter at fault where there is one (``"stream"``),
    which the OpenAI-compatible proxy reports as the error's ``param``."""

    def __init__(self, *args, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class InvalidLambdaError(InvalidInputError):
    """The cost trade-off ``lam`` (USD^-1) is negative, NaN, infinite or not a real number."""


class InvalidQueryError(InvalidInputError):
    """A query is not a ``str`` or is empty / whitespace only (over-long queries are truncated, not rejected)."""


class ShapeError(InvalidInputError):
    """An array has the wrong shape or dtype, or holds NaN/inf where finite values are required."""


class PrivacyError(InvalidInputError):
    """An update that breaks the privacy rule (ARCHITECTURE.md §6): an entry or a cell mean over
    fewer than ``min_count`` samples, or a change since the last upload smaller than that."""


class PayloadError(InvalidInputError):
    """A message or file whose bytes do not decode as the format it claims (not safetensors, not
    an ``.npz``, an envelope that is not a JSON object)."""


class UnknownModelError(FedrouteError, KeyError):
    """A model id is not in the router's (or log's) model pool; the message lists the known ids."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class BundleError(FedrouteError):
    """A bundle cannot be used: missing file, hash or signature mismatch, bad manifest, or router,
    embedder and price table that disagree. Nothing of the bundle is loaded when this is raised."""


class BudgetError(InvalidInputError):
    """A cost budget that no ``lam >= 0`` meets (below the cost of always choosing the cheapest model)."""


class EvalLogError(FedrouteError):
    """The evaluation log file cannot be opened or has a schema this version does not understand."""


class SyncError(FedrouteError):
    """The federated sync could not complete: the server stayed unreachable or kept failing (5xx)
    after the retries, sent a malformed answer, or the local sync state is unusable. Nothing is lost:
    the evaluation log is only read, and the bundle in use is replaced only by a verified one."""


class SyncRejectedError(SyncError):
    """The server refused a request with a 4xx status (not retried).

    Attributes
    ----------
    status : int, the HTTP status (401 bad token, 403 acting for another client, 409 wrong round,
        413 body too large, 422 invalid update).
    detail : str, the server's explanation.
    """

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"server rejected the request ({status}): {detail}")
        self.status = int(status)
        self.detail = str(detail)


class PriceError(InvalidInputError):
    """A model that may be called has no token price, so the cost of its answers could not be observed
    (raised at construction of :class:`sdk.routed_chat.RoutedChat`, never guessed from a prediction)."""


class ModelSpecError(InvalidInputError):
    """A ``model=`` string that is neither a known model id nor a valid ``fedroute[:lam=X | :budget=Y]``."""


class UnknownResponseError(InvalidInputError):
    """A score was given for a response id that no answered routed call awaits: unknown, already
    scored, expired from the pending store, or a pass-through / unpriced call (never logged)."""


class UpstreamError(FedrouteError):
    """An OpenAI-compatible endpoint failed: a non-retryable answer (4xx other than 429), or every
    model tried (the choice and its bounded fallbacks) timed out, answered 5xx or 429, or was unreachable.

    Attributes
    ----------
    status : int or None, the HTTP status of the last failed attempt (None: timeout or no connection).
    kind : str, the last failure: ``"timeout"``, ``"connection"``, ``"rate_limit"``, ``"server_error"``,
        ``"invalid_response"`` (an answer that is not a chat completion) or ``"client_error"``.
    attempts : tuple of ``sdk.routed_chat.FailedAttempt``, every failed attempt in order.
    """

    def __init__(self, message: str, *, status: int | None, kind: str, attempts: tuple = ()) -> None:
        super().__init__(message)
        self.status = None if status is None else int(status)
        self.kind = str(kind)
        self.attempts = tuple(attempts)
