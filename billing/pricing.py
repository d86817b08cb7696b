"""Cost of a request from a model's per-million-token prices."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prices:
    input_per_1m: float = 0.0
    output_per_1m: float = 0.0
    gpu_hour: float = 0.0


def request_cost(prices: Prices, prompt_tokens: int, completion_tokens: int) -> float:
    return (prompt_tokens * prices.input_per_1m + completion_tokens * prices.output_per_1m) / 1_000_000
