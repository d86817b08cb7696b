"""The time buckets limits and budgets count in."""

from __future__ import annotations

import math
from datetime import datetime, timezone


def minute_of(ts: float) -> int:
    return int(ts // 60)


def seconds_to_next_minute(ts: float) -> int:
    return max(1, math.ceil(60 - ts % 60))


def month_of(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m")
