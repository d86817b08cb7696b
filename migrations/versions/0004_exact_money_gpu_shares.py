"""money as whole nano-dollars and GPU time as whole microseconds (BIGINT); cached-input prices; GPU
time per tenant (gpu_shares)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NANOS = 10**9
MICROS = 10**6
# (table, column, units per dollar or second, nullable)
SCALED = [
    ("tenants", "budget_usd", NANOS, True),
    ("api_keys", "budget_usd", NANOS, True),
    ("model_deployments", "input_per_1m", NANOS, False),
    ("model_deployments", "output_per_1m", NANOS, False),
    ("model_deployments", "gpu_hour", NANOS, False),
    ("usage_events", "cost_usd", NANOS, False),
    ("spend_counters", "spent_usd", NANOS, False),
    ("spend_counters", "reserved_usd", NANOS, False),
    ("reservations", "tenant_usd", NANOS, True),
    ("reservations", "key_usd", NANOS, True),
    ("replica_intervals", "busy_s", MICROS, False),
    ("replica_intervals", "idle_s", MICROS, False),
]


def _convert(to_units: bool) -> None:
    tables: dict[str, list[tuple[str, int, bool]]] = {}
    for table, column, units, nullable in SCALED:
        tables.setdefault(table, []).append((column, units, nullable))
    postgres = op.get_bind().dialect.name == "postgresql"
    for table, columns in tables.items():
        if not to_units:
            with op.batch_alter_table(table) as batch:
                for column, _, nullable in columns:
                    batch.alter_column(column, existing_type=sa.BigInteger(), type_=sa.Float(),
                                       existing_nullable=nullable)
        for column, units, _ in columns:
            value = f'ROUND("{column}" * {units})' if to_units else f'"{column}" * 1.0 / {units}'
            op.execute(f'UPDATE "{table}" SET "{column}" = {value}')
        if to_units:
            with op.batch_alter_table(table) as batch:
                for column, _, nullable in columns:
                    batch.alter_column(column, existing_type=sa.Float(), type_=sa.BigInteger(),
                                       existing_nullable=nullable,
                                       **({"postgresql_using": f'"{column}"::bigint'} if postgres else {}))


def upgrade() -> None:
    _convert(to_units=True)
    with op.batch_alter_table("model_deployments") as batch:
        batch.add_column(sa.Column("cached_input_per_1m", sa.BigInteger(), nullable=True))
    op.create_table(
        "gpu_shares",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("interval_id", sa.Integer(), nullable=False),
        sa.Column("tenant_uid", sa.String(length=32), nullable=True),
        sa.Column("busy_s", sa.BigInteger(), nullable=False),
        sa.Column("idle_s", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["interval_id"], ["replica_intervals.id"], ondelete="CASCADE",
                                name=op.f("fk_gpu_shares_interval_id_replica_intervals")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpu_shares")),
    )
    op.create_index(op.f("ix_gpu_shares_interval_id"), "gpu_shares", ["interval_id"])
    op.create_index(op.f("ix_gpu_shares_tenant_uid"), "gpu_shares", ["tenant_uid"])


def downgrade() -> None:
    op.drop_index(op.f("ix_gpu_shares_tenant_uid"), table_name="gpu_shares")
    op.drop_index(op.f("ix_gpu_shares_interval_id"), table_name="gpu_shares")
    op.drop_table("gpu_shares")
    with op.batch_alter_table("model_deployments") as batch:
        batch.drop_column("cached_input_per_1m")
    _convert(to_units=False)
