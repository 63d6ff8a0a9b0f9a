"""Errors of policy alignment; they extend the one hierarchy of :mod:`sdk.errors`::

    FedrouteError
    ├── InvalidInputError (ValueError)
    │   └── AlignmentConfigError        a DPO setting or preference row the trainer cannot use
    └── PolicyUnavailableError          a causal LM or tokenizer that cannot be loaded (path absent,
                                        hub offline, not a causal LM)

Library exceptions (transformers, huggingface_hub, OSError) that cross this boundary are re-raised as
one of these with ``raise ... from exc``.
"""

from __future__ import annotations

from sdk.errors import FedrouteError, InvalidInputError


class AlignmentConfigError(InvalidInputError):
    """A DPO setting (beta, steps, device, dtype) or a preference row (empty prompt, identical chosen and
    rejected) that the trainer cannot use; the message names the field and the value received."""


class PolicyUnavailableError(FedrouteError):
    """A policy model or tokenizer cannot be loaded from the given path or hub id."""
