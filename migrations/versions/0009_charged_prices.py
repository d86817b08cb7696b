"""the prices each usage event and replica interval was charged at, so a price change never re-prices the past

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import json
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_EVENT_PRICES = ("input_per_1m", "cached_input_per_1m", "output_per_1m")


def upgrade() -> None:
    with op.batch_alter_table("usage_events") as batch:
        for column in _EVENT_PRICES:
            batch.add_column(sa.Column(column, sa.BigInteger(), nullable=True))
    with op.batch_alter_table("replica_intervals") as batch:
        batch.add_column(sa.Column("gpu_hour", sa.BigInteger(), nullable=True))
    # rows already there were charged at the prices in force now (the only prices known): they keep them for good
    conn = op.get_bind()
    price = "(SELECT {column} FROM model_deployments d WHERE d.name = {table}.model)"
    cached = "COALESCE(d.cached_input_per_1m, d.input_per_1m)"
    conn.execute(sa.text(
        "UPDATE usage_events SET "
        f"input_per_1m = {price.format(column='d.input_per_1m', table='usage_events')}, "
        f"cached_input_per_1m = {price.format(column=cached, table='usage_events')}, "
        f"output_per_1m = {price.format(column='d.output_per_1m', table='usage_events')} "
        "WHERE input_per_1m IS NULL"))
    conn.execute(sa.text(f"UPDATE replica_intervals SET gpu_hour = {price.format(column='d.gpu_hour', table='replica_intervals')} "
                         "WHERE gpu_hour IS NULL"))
    # a LoRA adapter priced in its model's spec: its requests were charged its own prices
    for name, spec in conn.execute(sa.text("SELECT name, spec FROM model_deployments")):
        spec = json.loads(spec) if isinstance(spec, str) else spec or {}
        for adapter in spec.get("adapters") or []:
            pricing = adapter.get("pricing")
            if not pricing:
                continue
            given = pricing.get("cached_input_per_1m")
            prices = {"i": _nano(pricing.get("input_per_1m", 0)), "o": _nano(pricing.get("output_per_1m", 0))}
            prices["c"] = prices["i"] if given is None else _nano(given)
            conn.execute(sa.text("UPDATE usage_events SET input_per_1m = :i, cached_input_per_1m = :c, "
                                 "output_per_1m = :o WHERE model = :m AND adapter = :a"),
                         {**prices, "m": name, "a": adapter.get("name")})


def _nano(amount: object) -> int:
    """Whole nano-dollars, as billing/money.py stores money."""
    return int((Decimal(repr(amount) if isinstance(amount, float) else str(amount)) * 10**9)
               .to_integral_value(rounding=ROUND_HALF_EVEN))


def downgrade() -> None:
    with op.batch_alter_table("replica_intervals") as batch:
        batch.drop_column("gpu_hour")
    with op.batch_alter_table("usage_events") as batch:
        for column in reversed(_EVENT_PRICES):
            batch.drop_column(column)
