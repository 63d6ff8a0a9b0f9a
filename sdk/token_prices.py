"""Token prices and the observed cost of an answer: price per token x the tokens in the response's ``usage``.

The router *predicts* a cost per query; what an answer *cost* is observed from the endpoint's
``usage`` (``prompt_tokens``, ``completion_tokens``) and a price table. The table comes, per model,
from (first match wins):

1. a :class:`TokenPrice` given by the app (``prices=`` of :class:`sdk.routed_chat.RoutedChat`, or
   ``input_usd_per_1m`` / ``output_usd_per_1m`` in the proxy config), USD per 1M tokens;
2. the bundle's price table (``price_per_1k_input_usd`` / ``price_per_1k_output_usd`` in
   ``manifest.json``, written by ``fedroute export --prices``), USD per 1k tokens, times 1000.

A model that may be called and has neither is a :class:`sdk.errors.PriceError` at construction: its
cost is never guessed (the router's prediction is not an observation). Cached-prompt discounts and
other per-token tiers are not modelled: every prompt token costs the input price and every completion
token (reasoning tokens included, as OpenAI counts them) the output price.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sdk.errors import InvalidInputError, PriceError
from sdk.real_numbers import finite_float, shown


@dataclass(frozen=True)
class TokenPrice:
    """List price of one model.

    Attributes
    ----------
    input_usd_per_1m : float >= 0, USD per 1,000,000 prompt tokens.
    output_usd_per_1m : float >= 0, USD per 1,000,000 completion tokens.

    Raises
    ------
    InvalidInputError
        A price that is not a finite real number >= 0 (bools rejected).
    """

    input_usd_per_1m: float
    output_usd_per_1m: float

    def __post_init__(self) -> None:
        for name in ("input_usd_per_1m", "output_usd_per_1m"):
            value = getattr(self, name)
            price = finite_float(value)
            if price is None or price < 0:
                raise InvalidInputError(f"{name} must be a finite number >= 0 (USD per 1M tokens), got {shown(value)}")
            object.__setattr__(self, name, price)

    def cost_usd(self, prompt_tokens: int, completion_tokens: int) -> float:
        """Cost in USD of ``prompt_tokens`` in and ``completion_tokens`` out (ints >= 0).

        Raises
        ------
        InvalidInputError
            A token count that is not an int >= 0, or counts so large that the cost is not a
            finite float.
        """
        for name, n in (("prompt_tokens", prompt_tokens), ("completion_tokens", completion_tokens)):
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
                raise InvalidInputError(f"{name} must be an int >= 0, got {shown(n)}")
        n_in, n_out = finite_float(prompt_tokens), finite_float(completion_tokens)  # None: beyond the float range
        cost = None if n_in is None or n_out is None else finite_float(
            (n_in * self.input_usd_per_1m + n_out * self.output_usd_per_1m) / 1e6)
        if cost is None:
            raise InvalidInputError(f"token counts {shown(prompt_tokens)} in, {shown(completion_tokens)} out "
                                    "give a cost beyond the float range")
        return cost


def price_table(models: Sequence[str], given: Mapping[str, TokenPrice] | None, bundle_models: Sequence) -> dict[str, TokenPrice]:
    """The price of each of ``models``: ``given`` first, else the bundle's per-1k prices x 1000.

    Parameters
    ----------
    models : model ids that may be called (the routing pool and the pass-through ids).
    given : {model id: TokenPrice} from the app, or None. Every key must be one of ``models``.
    bundle_models : :attr:`sdk.Router.models` (``ModelInfo`` with ``price_per_1k_*_usd``), or ().

    Returns
    -------
    dict {model id: TokenPrice}, one entry per id of ``models``.

    Raises
    ------
    PriceError
        A model of ``models`` with no price in ``given`` nor a complete one in the bundle (the
        message names every such model and both ways to give a price).
    InvalidInputError
        ``given`` is not a mapping, names a model that is not in ``models``, or has a value that is
        not a ``TokenPrice``.
    """
    if given is not None and not isinstance(given, Mapping):
        raise InvalidInputError(f"prices must be a mapping {{model id: TokenPrice}}, got {type(given).__name__}")
    given = dict(given or {})
    for model, price in given.items():
        if model not in models:
            raise InvalidInputError(f"prices names {model!r}, which has no upstream; models with an upstream: {list(models)}")
        if not isinstance(price, TokenPrice):
            raise InvalidInputError(f"prices[{model!r}] must be a TokenPrice, got {type(price).__name__}")
    bundle = {m.id: m for m in bundle_models}
    table, missing = {}, []
    for model in models:
        if model in given:
            table[model] = given[model]
            continue
        info = bundle.get(model)
        if info is None or info.price_per_1k_input_usd is None or info.price_per_1k_output_usd is None:
            missing.append(model)
            continue
        table[model] = TokenPrice(info.price_per_1k_input_usd * 1000.0, info.price_per_1k_output_usd * 1000.0)
    if missing:
        raise PriceError(
            f"no token price for {missing}: the cost of their answers could not be observed. Give "
            "prices={model: TokenPrice(input_usd_per_1m, output_usd_per_1m)} (proxy config: input_usd_per_1m / "
            "output_usd_per_1m per upstream) or export the bundle with `fedroute export --prices`"
        )
    return table
