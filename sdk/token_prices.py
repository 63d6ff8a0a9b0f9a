"""Token prices and the observed cost of an answer: price per token x the tokens in the response's ``usage``.

Per model, the app's :class:`TokenPrice` (``prices=`` of :class:`sdk.routed_chat.RoutedChat`, or the proxy
config's ``input_usd_per_1m`` / ``output_usd_per_1m``) wins over the bundle's price table (USD per 1k tokens,
``fedroute export --prices``); a callable model with neither is a :class:`sdk.errors.PriceError`: a cost
is never guessed. Every prompt token costs the input price and every completion token (reasoning tokens
included) the output price; cached-prompt discounts are not modelled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sdk.errors import InvalidInputError, PriceError
from sdk.real_numbers import finite_float, shown

if TYPE_CHECKING:
    from sdk.router import ModelInfo


@dataclass(frozen=True)
class TokenPrice:
    """List price of one model, USD per 1,000,000 prompt / completion tokens; :class:`InvalidInputError`
    unless each is a finite real number >= 0."""

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
        """Cost in USD of ``prompt_tokens`` in and ``completion_tokens`` out; :class:`InvalidInputError` for a
        negative count (an upstream's ``usage``) or counts whose cost is beyond the float range."""
        n_in, n_out = finite_float(prompt_tokens), finite_float(completion_tokens)  # None: beyond the float range
        cost = None if n_in is None or n_out is None or min(n_in, n_out) < 0 else finite_float(
            (n_in * self.input_usd_per_1m + n_out * self.output_usd_per_1m) / 1e6)
        if cost is None:
            raise InvalidInputError(f"token counts {shown(prompt_tokens)} in, {shown(completion_tokens)} out must be "
                                    "ints >= 0 and not give a cost beyond the float range")
        return cost


def price_table(models: Sequence[str], given: Mapping[str, TokenPrice] | None, bundle_models: Sequence[ModelInfo]) -> dict[str, TokenPrice]:
    """{model id: TokenPrice} for each of ``models`` (the callable ids): ``given`` first, else the bundle's
    per-1k prices (``bundle_models``: :attr:`sdk.Router.models`) x 1000.

    Raises
    ------
    PriceError
        A model with no price in ``given`` nor a complete one in the bundle (the message names each).
    InvalidInputError
        ``given`` is not a mapping of ``models`` to ``TokenPrice``.
    """
    wrong = [] if not isinstance(given, Mapping) else [m for m, p in given.items()
                                                         if m not in models or not isinstance(p, TokenPrice)]
    if (given is not None and not isinstance(given, Mapping)) or wrong:
        raise InvalidInputError(f"prices must be a mapping {{model id: TokenPrice}}, got {type(given).__name__}"
                                f"{f'; prices names {wrong}' if wrong else ''} (models with an upstream: {list(models)})",
                                param="prices")
    given = dict(given or {})
    bundle = {m.id: m for m in bundle_models}
    table: dict[str, TokenPrice] = {}
    missing: list[str] = []
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
