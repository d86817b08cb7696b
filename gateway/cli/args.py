"""Argument types shared by the `platform` subcommands."""

from __future__ import annotations

import argparse
from datetime import datetime, timezone

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
