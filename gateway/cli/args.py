"""Argument types shared by the `platform` subcommands."""

from __future__ import annotations

import argparse
from datetime import datetime, timezone


def date_arg(text: str) -> datetime:
    """YYYY-MM-DD as midnight UTC (or an ISO date and time, UTC unless it names its zone)."""
    try:
        moment = datetime.fromisoformat(text)
        return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected YYYY-MM-DD, got {text!r}") from None
