"""soft budgets: alert_at on tenants and keys, budget_alerts (each fired once per month)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for table in ("tenants", "api_keys"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("alert_at", sa.Float(), nullable=True))
    op.create_table(
        "budget_alerts",
        sa.Column("scope", sa.String(length=10), nullable=False),
        sa.Column("scope_id", sa.Integer(), nullable=False),
        sa.Column("period", sa.String(length=7), nullable=False),
        sa.Column("spent_usd", sa.BigInteger(), nullable=False),
        sa.Column("budget_usd", sa.BigInteger(), nullable=False),
        sa.Column("fired_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("scope", "scope_id", "period", name=op.f("pk_budget_alerts")),
    )


def downgrade() -> None:
    op.drop_table("budget_alerts")
    for table in ("api_keys", "tenants"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("alert_at")
