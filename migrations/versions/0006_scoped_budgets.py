"""end-user and tag budgets within a tenant (scoped_budgets); reservations hold against them

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "scoped_budgets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("scope", sa.String(length=10), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("budget_usd", sa.BigInteger(), nullable=False),
        sa.Column("alert_at", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_scoped_budgets_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_scoped_budgets")),
        sa.UniqueConstraint("tenant_id", "scope", "name", name=op.f("uq_scoped_budgets_tenant_id")),
        sqlite_autoincrement=True,  # ids are never reused: spend counters and alerts are keyed by them
    )
    with op.batch_alter_table("reservations") as batch:
        batch.add_column(sa.Column("scoped_usd", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("scoped_holds", sa.JSON(), nullable=True))


def downgrade() -> None:
    # requests in flight keep their key and tenant holds; what they held on end-user and tag budgets goes with them
    with op.batch_alter_table("reservations") as batch:
        batch.drop_column("scoped_holds")
        batch.drop_column("scoped_usd")
    conn = op.get_bind()
    for table in ("spend_counters", "budget_alerts"):
        conn.execute(sa.text(f"DELETE FROM {table} WHERE scope IN ('user', 'tag')"))
    op.drop_table("scoped_budgets")
