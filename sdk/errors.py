"""The one exception hierarchy of fedroute.

Every error the SDK raises on purpose derives from :class:`FedrouteError`, and input errors also
derive from the built-in class a caller would expect, so ``except ValueError`` keeps working::

    FedrouteError
    ├── InvalidInputError (ValueError)      bad argument values at a public boundary
    │   ├── InvalidLambdaError              lam negative, NaN, inf or not a real number
    │   └── ShapeError                      array of the wrong shape, dtype or with non-finite values
    └── UnknownModelError (KeyError)        a model id the router or log does not know

Library exceptions that cross our boundary are re-raised as the most specific class here with
``raise ... from exc``.
"""

from __future__ import annotations


class FedrouteError(Exception):
    """Base class of every error raised on purpose by fedroute."""


class InvalidInputError(FedrouteError, ValueError):
    """An argument has a value the function cannot accept; the message names it and the fix."""


class InvalidLambdaError(InvalidInputError):
    """The cost trade-off ``lam`` (USD^-1) is negative, NaN, infinite or not a real number."""


class ShapeError(InvalidInputError):
    """An array has the wrong shape or dtype, or holds NaN/inf where finite values are required."""


class UnknownModelError(FedrouteError, KeyError):
    """A model id is not in the router's (or log's) model pool; the message lists the known ids."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""
