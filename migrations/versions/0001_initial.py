"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-29
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('model_deployments',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('input_per_1m', sa.Float(), nullable=False),
    sa.Column('output_per_1m', sa.Float(), nullable=False),
    sa.Column('gpu_hour', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_model_deployments')),
    sa.UniqueConstraint('name', name=op.f('uq_model_deployments_name'))
    )
    op.create_table('replica_intervals',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('model', sa.String(length=200), nullable=False),
    sa.Column('replica', sa.String(length=200), nullable=False),
    sa.Column('start', sa.DateTime(timezone=True), nullable=False),
    sa.Column('end', sa.DateTime(timezone=True), nullable=True),
    sa.Column('busy_s', sa.Float(), nullable=False),
    sa.Column('idle_s', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_replica_intervals'))
    )
    with op.batch_alter_table('replica_intervals', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_replica_intervals_model'), ['model'], unique=False)

    op.create_table('spend_counters',
    sa.Column('scope', sa.String(length=10), nullable=False),
    sa.Column('scope_id', sa.Integer(), nullable=False),
    sa.Column('period', sa.String(length=7), nullable=False),
    sa.Column('spent_usd', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('scope', 'scope_id', 'period', name=op.f('pk_spend_counters'))
    )
    op.create_table('tenants',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('budget_usd', sa.Float(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenants')),
    sa.UniqueConstraint('name', name=op.f('uq_tenants_name'))
    )
    op.create_table('api_keys',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=True),
    sa.Column('project', sa.String(length=200), nullable=True),
    sa.Column('rpm', sa.Integer(), nullable=True),
    sa.Column('tpm', sa.Integer(), nullable=True),
    sa.Column('budget_usd', sa.Float(), nullable=True),
    sa.Column('revoked', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_api_keys_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_keys')),
    sa.UniqueConstraint('key_hash', name=op.f('uq_api_keys_key_hash'))
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('rate_windows',
    sa.Column('api_key_id', sa.Integer(), nullable=False),
    sa.Column('minute', sa.BigInteger(), nullable=False),
    sa.Column('requests', sa.Integer(), nullable=False),
    sa.Column('tokens', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['api_key_id'], ['api_keys.id'], name=op.f('fk_rate_windows_api_key_id_api_keys'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('api_key_id', 'minute', name=op.f('pk_rate_windows'))
    )
    op.create_table('usage_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('request_id', sa.String(length=100), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=True),
    sa.Column('api_key_id', sa.Integer(), nullable=True),
    sa.Column('end_user', sa.String(length=200), nullable=True),
    sa.Column('tags', sa.JSON(), nullable=False),
    sa.Column('model', sa.String(length=200), nullable=False),
    sa.Column('endpoint', sa.String(length=50), nullable=False),
    sa.Column('route', sa.String(length=50), nullable=True),
    sa.Column('status', sa.String(length=20), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('cached_tokens', sa.Integer(), nullable=False),
    sa.Column('cache_hit', sa.Boolean(), nullable=False),
    sa.Column('latency_s', sa.Float(), nullable=False),
    sa.Column('ttft_s', sa.Float(), nullable=True),
    sa.Column('cost_usd', sa.Float(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['api_key_id'], ['api_keys.id'], name=op.f('fk_usage_events_api_key_id_api_keys')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_usage_events_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_usage_events')),
    sa.UniqueConstraint('request_id', name=op.f('uq_usage_events_request_id'))
    )
    with op.batch_alter_table('usage_events', schema=None) as batch_op:
        batch_op.create_index('ix_usage_events_created', ['created_at'], unique=False)
        batch_op.create_index('ix_usage_events_tenant_created', ['tenant_id', 'created_at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('usage_events', schema=None) as batch_op:
        batch_op.drop_index('ix_usage_events_tenant_created')
        batch_op.drop_index('ix_usage_events_created')

    op.drop_table('usage_events')
    op.drop_table('rate_windows')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_tenant_id'))

    op.drop_table('api_keys')
    op.drop_table('tenants')
    op.drop_table('spend_counters')
    with op.batch_alter_table('replica_intervals', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_replica_intervals_model'))

    op.drop_table('replica_intervals')
    op.drop_table('model_deployments')
