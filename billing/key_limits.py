"""Changing an API key's limits after it was created (the admin dashboard's Keys page)."""

from __future__ import annotations

from decimal import Decimal

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from billing.accounts import AccountError
from billing.field_checks import MAX_SQL_INT, count_limit, usd_amount
from billing.models import ApiKey


def set_key_limits(engine: Engine, key_id: int, *, rpm: int | None, tpm: int | None,
                   budget_usd: float | Decimal | None) -> None:
    """Sets all three limits; None means unlimited."""
    count_limit("rpm", rpm)
    count_limit("tpm", tpm)
    usd_amount("budget_usd", budget_usd)
    if not 0 < key_id <= MAX_SQL_INT:
        raise AccountError(f"no key {key_id}")
    with Session(engine) as s, s.begin():
        row = s.get(ApiKey, key_id)
        if row is None:
            raise AccountError(f"no key {key_id}")
        row.rpm, row.tpm, row.budget_usd = rpm, tpm, budget_usd
