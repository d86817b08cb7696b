"""budget and tpm reservations; tenant uids

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import uuid
from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("uid", sa.String(length=32), nullable=True))
    tenants = sa.table("tenants", sa.column("id", sa.Integer), sa.column("uid", sa.String))
    conn = op.get_bind()
    for (tenant_id,) in conn.execute(sa.select(tenants.c.id)).all():
        conn.execute(tenants.update().where(tenants.c.id == tenant_id).values(uid=uuid.uuid4().hex))
    with op.batch_alter_table("tenants") as batch:
        batch.alter_column("uid", existing_type=sa.String(length=32), nullable=False)
        batch.create_unique_constraint(op.f("uq_tenants_uid"), ["uid"])
    with op.batch_alter_table("spend_counters") as batch:
        batch.add_column(sa.Column("reserved_usd", sa.Float(), nullable=False, server_default="0"))
    op.create_table(
        "reservations",
        sa.Column("request_id", sa.String(length=100), nullable=False),
        sa.Column("owner", sa.String(length=100), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=False),
        sa.Column("period", sa.String(length=7), nullable=False),
        sa.Column("tenant_usd", sa.Float(), nullable=True),
        sa.Column("key_usd", sa.Float(), nullable=True),
        sa.Column("minute", sa.BigInteger(), nullable=True),
        sa.Column("tokens", sa.BigInteger(), nullable=True),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("endpoint", sa.String(length=50), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_reservations")),
    )
    op.create_index(op.f("ix_reservations_owner"), "reservations", ["owner"])
    op.create_table(
        "gateway_processes",
        sa.Column("id", sa.String(length=100), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gateway_processes")),
    )


def downgrade() -> None:
    op.drop_table("gateway_processes")
    op.drop_index(op.f("ix_reservations_owner"), table_name="reservations")
    op.drop_table("reservations")
    with op.batch_alter_table("spend_counters") as batch:
        batch.drop_column("reserved_usd")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_constraint(op.f("uq_tenants_uid"), type_="unique")
        batch.drop_column("uid")
