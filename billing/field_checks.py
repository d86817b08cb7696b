"""Checks for the names, filters and limits that operators and clients give and that reach SQL:
what the columns can hold on both SQLite and PostgreSQL (PostgreSQL refuses NUL characters in text,
neither database can store unpaired UTF-16 surrogates, INTEGER columns stop at 2**31 - 1). A value
that fails is a ValueError naming its field, raised before any SQL runs. SQL metacharacters need no
check: every value travels as a bound parameter and is compared with `=`, never LIKE."""

from __future__ import annotations

import math
from decimal import Decimal

from billing.money import dollars
from tollgate.false_hit_bounds import is_offered, offered_text

MAX_NAME_CHARS = 200  # the String(200) columns: tenant, key name, project, end user, model
MAX_SQL_INT = 2**31 - 1
MAX_USD = 1_000_000_000  # money columns hold nano-dollars in a BIGINT (to $9.2 billion); sums need headroom


class FieldError(ValueError):
    """A value that the database cannot store or compare; the message starts with the field's name."""


def text_field(field: str, value: str, max_chars: int = MAX_NAME_CHARS) -> str:
    if not isinstance(value, str):
        raise FieldError(f"{field}: expected text, got {type(value).__name__}")
    if len(value) > max_chars:
        raise FieldError(f"{field}: at most {max_chars} characters, got {len(value)}")
    if "\x00" in value:
        raise FieldError(f"{field}: must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise FieldError(f"{field}: contains an unpaired UTF-16 surrogate") from None
    return value


def optional_text_field(field: str, value: str | None, max_chars: int = MAX_NAME_CHARS) -> str | None:
    return None if value is None else text_field(field, value, max_chars)


def count_limit(field: str, value: int | None) -> int | None:
    """An rpm or tpm limit: None (unlimited) or a whole number 0 .. 2**31 - 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SQL_INT:
        raise FieldError(f"{field}: must be a whole number from 0 to {MAX_SQL_INT}, got {value!r}")
    return value


def usd_amount(field: str, value: float | Decimal | None) -> Decimal | None:
    """A budget in USD: None (unlimited) or a finite amount from 0 to MAX_USD, exact to the nano-dollar."""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float, Decimal))
            or (isinstance(value, float) and not math.isfinite(value))
            or (isinstance(value, Decimal) and not value.is_finite()) or not 0 <= value <= MAX_USD):
        raise FieldError(f"{field}: must be a finite amount from 0 to {MAX_USD:,}, got {value}")
    return dollars(value)


def alert_share(field: str, value: float | None, budget: object) -> float | None:
    """A soft budget: None, or a share of the budget (0 < share <= 1) at which to alert; needs a budget."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise FieldError(f"{field}: must be a share of the budget, above 0 and at most 1 (0.8: at 80%), got {value!r}")
    if budget is None:
        raise FieldError(f"{field}: needs a budget (--budget-usd) to be a share of")
    return float(value)


def cache_bound(field: str, value: float | None) -> float | None:
    """A semantic-cache false-hit bound: None (the tenant's, else the default) or one of the offered ones."""
    if value is None:
        return None
    if not is_offered(value):
        raise FieldError(f"{field}: one of {offered_text()} expected (0.01: at most 1% of different questions served "
                         f"a cached answer), got {value!r}")
    return float(value)
