"""LoRA adapters added at run time (model_adapters): they outlive the gateway that added them

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-17
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "model_adapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("tenants", sa.JSON(), nullable=True),
        sa.Column("input_per_1m", sa.BigInteger(), nullable=True),
        sa.Column("output_per_1m", sa.BigInteger(), nullable=True),
        sa.Column("gpu_hour", sa.BigInteger(), nullable=True),
        sa.Column("cached_input_per_1m", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_adapters")),
        sa.UniqueConstraint("model", "name", name=op.f("uq_model_adapters_model")),
    )


def downgrade() -> None:
    op.drop_table("model_adapters")
