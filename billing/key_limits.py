"""Changing an API key's limits after it was created (the admin dashboard's Keys page)."""

from __future__ import annotations

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from billing.accounts import AccountError
from billing.models import ApiKey


def set_key_limits(engine: Engine, key_id: int, *, rpm: int | None, tpm: int | None,
                   budget_usd: float | None) -> None:
    """Sets all three limits; None means unlimited."""
    for field, value in (("rpm", rpm), ("tpm", tpm), ("budget_usd", budget_usd)):
        if value is not None and value < 0:
            raise AccountError(f"{field} must not be negative")
    with Session(engine) as s, s.begin():
        row = s.get(ApiKey, key_id)
        if row is None:
            raise AccountError(f"no key {key_id}")
        row.rpm, row.tpm, row.budget_usd = rpm, tpm, budget_usd
