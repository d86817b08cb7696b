"""Cost of a request from a model's per-million-token prices, exact to the nano-dollar."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from billing.money import ZERO, dollars

MILLION = Decimal(1_000_000)


@dataclass(frozen=True)
class Prices:
    input_per_1m: Decimal = ZERO
    output_per_1m: Decimal = ZERO
    gpu_hour: Decimal = ZERO
    # prompt tokens served from the KV prefix cache; None: the input price
    cached_input_per_1m: Decimal | None = None

    @property
    def cached_input(self) -> Decimal:
        return self.input_per_1m if self.cached_input_per_1m is None else self.cached_input_per_1m


def request_cost(prices: Prices, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Decimal:
    """Dollars, rounded half-even to the nano-dollar; `cached_tokens` of the prompt at the cached-input price."""
    cached = min(max(cached_tokens, 0), prompt_tokens)
    total = ((prompt_tokens - cached) * prices.input_per_1m + cached * prices.cached_input
             + completion_tokens * prices.output_per_1m)
    return dollars(total / MILLION)
