"""Money, exact: Decimal dollars in Python, whole nano-dollars (BIGINT, up to $9.2 billion) in SQL. A
request's cost is rounded half-even to the nano-dollar once, when it is computed; sums of costs, budgets
and spend counters are then exact, so counters and invoices agree."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from billing.fixed_point import FixedPoint, exact

NANO_PLACES = 9
ZERO = Decimal(0)


class Money(FixedPoint):
    """A money column: whole nano-dollars in SQL, Decimal dollars in Python."""

    cache_ok = True

    def __init__(self) -> None:
        super().__init__(NANO_PLACES)


def dollars(value: Any) -> Decimal:
    """An amount in dollars, exact to the nano-dollar."""
    return exact(value, NANO_PLACES)


def usd(amount: Any) -> str:
    """$5.00, $4.9012, $0.000123, $0.000000001: as many decimals as the amount has (to the nano-dollar,
    at least cents), never a sub-cent amount shown as "$0.00"."""
    return _text(amount, "$", ",")


def amount_text(amount: Any) -> str:
    """usd() for machines (CSV, JSON): "5.00", "-0.000123", "1234.5678"; no "$", no thousands separator."""
    return _text(amount, "", "")


def _text(amount: Any, symbol: str, grouping: str) -> str:
    value = dollars(amount)
    sign = "-" if value < 0 else ""
    text = f"{abs(value):{grouping}.9f}".rstrip("0")
    whole, _, decimals = text.partition(".")
    return f"{sign}{symbol}{whole}.{decimals.ljust(2, '0')}"
