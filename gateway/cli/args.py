"""Argument types shared by the `platform` subcommands."""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
from decimal import ROUND_DOWN, Decimal, InvalidOperation

# the CLI's window is [--since, --until): the dashboard's filter form takes its To day as included instead
UNTIL_HELP = ("YYYY-MM-DD: the first UTC day NOT counted (exclusive: --since 2026-11-01 --until 2026-12-01 is "
              "all of November; the dashboard's To field includes its day instead)")


def date_arg(text: str) -> datetime:
    """YYYY-MM-DD as midnight UTC (or an ISO date and time, UTC unless it names its zone)."""
    try:
        moment = datetime.fromisoformat(text)
        return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected YYYY-MM-DD, got {text!r}") from None


MONEY_RESOLUTION = Decimal("0.000000001")  # the ledger keeps dollars to the nano-dollar (billing/money.py)


def money_arg(text: str) -> Decimal:
    """An amount in USD as exact decimal text: no float rounding, and nothing finer than the ledger keeps (its range is
    checked where it is stored, naming the field)."""
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"expected an amount in USD such as 12.50, got {text!r}") from None
    if value.is_finite() and value != value.quantize(MONEY_RESOLUTION, rounding=ROUND_DOWN):
        raise argparse.ArgumentTypeError(f"{text} has more decimals than the ledger keeps: amounts are stored to the "
                                         f"nano-dollar ({MONEY_RESOLUTION:f}), so give at most 9 decimals")
    return value


NO_ALERT = "none"


def alert_arg(text: str) -> float | str:
    """A soft budget's share (0.8), or `none` to clear the alert."""
    if text.strip().lower() == NO_ALERT:
        return NO_ALERT
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share of the budget such as 0.8, or {NO_ALERT!r}, got {text!r}"
                                         ) from None
