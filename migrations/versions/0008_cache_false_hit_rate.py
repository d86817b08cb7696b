"""cache_max_false_hit_rate on tenants and keys: the bound each one chooses for its semantic cache

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for table in ("tenants", "api_keys"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("cache_max_false_hit_rate", sa.Float(), nullable=True))


def downgrade() -> None:
    for table in ("tenants", "api_keys"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("cache_max_false_hit_rate")
