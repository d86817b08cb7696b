"""The SQL schema: tenants, API keys, deployments, usage events, replica intervals and the counters
that limits and budgets read. Alembic (migrations/) owns the tables; this module is their source.
Money columns (Money: budgets, prices, costs, spend) hold whole nano-dollars; Python sees Decimal dollars."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from decimal import Decimal

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from billing.fixed_point import Seconds
from billing.money import Money

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # a random identity no other database shares: caches and KV salts key tenants by it, never by id, so a
    # cache directory reused with another database never serves one's tenant another's entries
    uid: Mapped[str] = mapped_column(String(32), unique=True, default=lambda: uuid.uuid4().hex)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    budget_usd: Mapped[Decimal | None] = mapped_column(Money())  # monthly, None: unlimited
    alert_at: Mapped[float | None] = mapped_column(Float)  # soft budget: alert once at this share of budget_usd
    # the semantic cache's bound on answers served to a different question (cache/bounds.py); None: the default
    cache_max_false_hit_rate: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the whole key
    prefix: Mapped[str] = mapped_column(String(16))  # shown in listings: "tg-AbCdEfG"
    name: Mapped[str | None] = mapped_column(String(200))
    project: Mapped[str | None] = mapped_column(String(200))  # becomes a tag on every usage event
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(Integer)
    budget_usd: Mapped[Decimal | None] = mapped_column(Money())  # monthly, None: unlimited
    alert_at: Mapped[float | None] = mapped_column(Float)  # soft budget: alert once at this share of budget_usd
    cache_max_false_hit_rate: Mapped[float | None] = mapped_column(Float)  # None: the tenant's
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    tenant: Mapped[Tenant] = relationship(back_populates="keys")


class ModelDeployment(Base):
    __tablename__ = "model_deployments"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    spec: Mapped[dict] = mapped_column(JSON)
    input_per_1m: Mapped[Decimal] = mapped_column(Money(), default=0)
    output_per_1m: Mapped[Decimal] = mapped_column(Money(), default=0)
    gpu_hour: Mapped[Decimal] = mapped_column(Money(), default=0)
    cached_input_per_1m: Mapped[Decimal | None] = mapped_column(Money())  # None: the input price
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)


class ModelAdapter(Base):
    """A LoRA adapter added at run time (`platform adapters add`) over a deployed model: every gateway on this
    database serves it, and every replica of the model loads it. Adapters a spec lists live in the spec."""

    __tablename__ = "model_adapters"
    __table_args__ = (UniqueConstraint("model", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(200))
    name: Mapped[str] = mapped_column(String(100))
    source: Mapped[str] = mapped_column(Text)  # the checked, absolute adapter directory
    tenants: Mapped[list | None] = mapped_column(JSON)  # tenant names allowed; None: every tenant
    # its own prices (all four set or none); None: the base model's
    input_per_1m: Mapped[Decimal | None] = mapped_column(Money())
    output_per_1m: Mapped[Decimal | None] = mapped_column(Money())
    gpu_hour: Mapped[Decimal | None] = mapped_column(Money())
    cached_input_per_1m: Mapped[Decimal | None] = mapped_column(Money())  # None: the input price
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class UsageEvent(Base):
    __tablename__ = "usage_events"
    __table_args__ = (
        Index("ix_usage_events_tenant_created", "tenant_id", "created_at"),
        Index("ix_usage_events_created", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id"))
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"))
    end_user: Mapped[str | None] = mapped_column(String(200))  # the request's OpenAI `user` field
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    model: Mapped[str] = mapped_column(String(200))
    adapter: Mapped[str | None] = mapped_column(String(100))  # the LoRA adapter served over `model`, if any
    endpoint: Mapped[str] = mapped_column(String(50))  # chat.completions | completions
    route: Mapped[str | None] = mapped_column(String(50))
    status: Mapped[str] = mapped_column(String(20))  # ok | failed | cancelled | interrupted
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cache_hit: Mapped[bool] = mapped_column(Boolean, default=False)
    latency_s: Mapped[float] = mapped_column(Float, default=0.0)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    cost_usd: Mapped[Decimal] = mapped_column(Money(), default=0)
    # the list prices (per 1M tokens) the request was charged at, kept with it so that invoices and reports never
    # re-price past usage when a spec's prices change (billing/charged_prices.py); None only on rows that predate them
    input_per_1m: Mapped[Decimal | None] = mapped_column(Money())
    cached_input_per_1m: Mapped[Decimal | None] = mapped_column(Money())
    output_per_1m: Mapped[Decimal | None] = mapped_column(Money())
    error: Mapped[str | None] = mapped_column(Text)


class ReplicaInterval(Base):
    __tablename__ = "replica_intervals"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(200), index=True)
    replica: Mapped[str] = mapped_column(String(200))
    start: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    end: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # exact microseconds: busy_s + idle_s + asleep_s is the row's span, and its GpuShare rows add up to busy_s and
    # idle_s; asleep_s is time the engine slept (engine/sleep.py) with its GPU memory given back: billed to no one
    busy_s: Mapped[Decimal] = mapped_column(Seconds(), default=0)
    idle_s: Mapped[Decimal] = mapped_column(Seconds(), default=0)
    asleep_s: Mapped[Decimal] = mapped_column(Seconds(), default=0, server_default="0")
    # the model's gpu_hour price when the row was written (see UsageEvent.input_per_1m)
    gpu_hour: Mapped[Decimal | None] = mapped_column(Money())


class GpuShare(Base):
    """One tenant's part of a replica interval (billing/gpu_shares.py says how time is split)."""

    __tablename__ = "gpu_shares"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    interval_id: Mapped[int] = mapped_column(ForeignKey("replica_intervals.id", ondelete="CASCADE"), index=True)
    tenant_uid: Mapped[str | None] = mapped_column(String(32), index=True)  # None: no tenant (see gpu_shares.py)
    busy_s: Mapped[Decimal] = mapped_column(Seconds(), default=0)
    idle_s: Mapped[Decimal] = mapped_column(Seconds(), default=0)


class RateWindow(Base):
    """Requests and tokens one key used in one minute; rows are upserted atomically by every gateway."""

    __tablename__ = "rate_windows"

    api_key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True)
    minute: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # unix time // 60
    requests: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class ScopedBudget(Base):
    """A monthly budget within a tenant for one end user (the requests' OpenAI `user` field) or one tag (a key's
    project or a request's metadata.tags). Ids are never reused: spend counters and alerts are keyed by them."""

    __tablename__ = "scoped_budgets"
    __table_args__ = (UniqueConstraint("tenant_id", "scope", "name"), {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    scope: Mapped[str] = mapped_column(String(10))  # user | tag
    name: Mapped[str] = mapped_column(String(200))
    budget_usd: Mapped[Decimal] = mapped_column(Money())
    alert_at: Mapped[float | None] = mapped_column(Float)  # soft budget: alert once at this share of budget_usd
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class SpendCounter(Base):
    """Spend of one key, tenant, or scoped budget (user | tag: ScopedBudget.id) in one calendar month (UTC), kept
    by the ledger writer."""

    __tablename__ = "spend_counters"

    scope: Mapped[str] = mapped_column(String(10), primary_key=True)  # key | tenant | user | tag
    scope_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    period: Mapped[str] = mapped_column(String(7), primary_key=True)  # YYYY-MM
    spent_usd: Mapped[Decimal] = mapped_column(Money(), default=0)
    # the worst cases of admitted requests not yet settled (billing/reservations.py)
    reserved_usd: Mapped[Decimal] = mapped_column(Money(), default=0, server_default="0")


class BudgetAlert(Base):
    """A soft budget crossed: one row per budget and month, so the alert fires once across gateways."""

    __tablename__ = "budget_alerts"

    scope: Mapped[str] = mapped_column(String(10), primary_key=True)  # key | tenant | user | tag
    scope_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    period: Mapped[str] = mapped_column(String(7), primary_key=True)  # YYYY-MM
    spent_usd: Mapped[Decimal] = mapped_column(Money())  # when it fired
    budget_usd: Mapped[Decimal] = mapped_column(Money())
    fired_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Reservation(Base):
    """One admitted request's hold on its budgets and tpm until its usage event is written."""

    __tablename__ = "reservations"

    request_id: Mapped[str] = mapped_column(String(100), primary_key=True)
    owner: Mapped[str] = mapped_column(String(100), index=True)  # the gateway process (GatewayProcess.id)
    tenant_id: Mapped[int] = mapped_column(Integer)
    api_key_id: Mapped[int] = mapped_column(Integer)
    period: Mapped[str] = mapped_column(String(7))
    tenant_usd: Mapped[Decimal | None] = mapped_column(Money())  # held against the tenant's budget
    key_usd: Mapped[Decimal | None] = mapped_column(Money())  # held against the key's budget
    # held against each end-user or tag budget in `scoped_holds` ([[scope, ScopedBudget.id], ...])
    scoped_usd: Mapped[Decimal | None] = mapped_column(Money())
    scoped_holds: Mapped[list[list[str | int]] | None] = mapped_column(JSON)
    minute: Mapped[int | None] = mapped_column(BigInteger)  # the rate window its tokens are held in
    tokens: Mapped[int | None] = mapped_column(BigInteger)
    model: Mapped[str] = mapped_column(String(200))
    endpoint: Mapped[str] = mapped_column(String(50))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class GatewayProcess(Base):
    """A live gateway process beats here; one whose beat stopped holds no reservation."""

    __tablename__ = "gateway_processes"

    id: Mapped[str] = mapped_column(String(100), primary_key=True)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class AdminKey(Base):
    """An operator's key for the admin dashboard and API; stored only as its SHA-256 hash."""

    __tablename__ = "admin_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    name: Mapped[str | None] = mapped_column(String(200))
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
