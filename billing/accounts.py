"""Tenants and API keys: create, list, revoke. Keys are stored only as SHA-256 hashes."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from billing.field_checks import (
    MAX_SQL_INT,
    FieldError,
    alert_share,
    cache_bound,
    count_limit,
    optional_text_field,
    text_field,
    usd_amount,
)
from billing.models import ApiKey, Tenant, utcnow

KEY_PREFIX = "tg-"
DISPLAY_CHARS = 10


# a refused account operation; a bad value is refused the same way, before any SQL runs
AccountError = FieldError


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class CreatedKey:
    id: int
    key: str  # shown once, never stored
    prefix: str
    tenant: str


def create_tenant(engine: Engine, name: str, budget_usd: float | Decimal | None = None,
                  alert_at: float | None = None, cache_max_false_hit_rate: float | None = None) -> Tenant:
    """`alert_at`: a soft budget, the share of budget_usd at which one alert fires a month (billing/budget_alerts.py).
    `cache_max_false_hit_rate`: the semantic cache's bound for the tenant's keys (None: the platform's default)."""
    text_field("name", name)
    if not name.strip():
        raise AccountError("name: a tenant name must not be empty")
    usd_amount("budget_usd", budget_usd)
    alert_share("alert_at", alert_at, budget_usd)
    cache_bound("cache_max_false_hit_rate", cache_max_false_hit_rate)
    with Session(engine, expire_on_commit=False) as s, s.begin():
        if s.scalar(select(Tenant).where(Tenant.name == name)) is not None:
            raise AccountError(f"tenant {name!r} already exists")
        tenant = Tenant(name=name, budget_usd=budget_usd, alert_at=alert_at,
                        cache_max_false_hit_rate=cache_max_false_hit_rate)
        s.add(tenant)
    return tenant


def get_or_create_tenant(engine: Engine, name: str) -> Tenant:
    text_field("name", name)
    with Session(engine, expire_on_commit=False) as s:
        tenant = s.scalar(select(Tenant).where(Tenant.name == name))
    return tenant if tenant is not None else create_tenant(engine, name)


def list_tenants(engine: Engine) -> list[Tenant]:
    with Session(engine, expire_on_commit=False) as s:
        return list(s.scalars(select(Tenant).order_by(Tenant.id)))


def set_tenant_budget(engine: Engine, name: str, budget_usd: float | Decimal | None) -> None:
    text_field("name", name)
    usd_amount("budget_usd", budget_usd)
    with Session(engine) as s, s.begin():
        tenant = s.scalar(select(Tenant).where(Tenant.name == name))
        if tenant is None:
            raise AccountError(f"no tenant named {name!r}")
        tenant.budget_usd = budget_usd


def set_cache_bound(engine: Engine, tenant: str, value: float | None, key: str | None = None) -> None:
    """Sets the semantic cache's false-hit bound of a tenant, or of one of its keys (by id or display prefix); None
    clears it (a key then follows its tenant, a tenant the platform's default)."""
    text_field("tenant", tenant)
    cache_bound("cache_max_false_hit_rate", value)
    with Session(engine) as s, s.begin():
        owner = s.scalar(select(Tenant).where(Tenant.name == tenant))
        if owner is None:
            raise AccountError(f"no tenant named {tenant!r}")
        if key is None:
            owner.cache_max_false_hit_rate = value
            return
        text_field("key", key)
        if key.isascii() and key.isdigit():
            which = ApiKey.id == min(int(key), MAX_SQL_INT + 1)  # past the column's range: matches nothing
        else:
            which = ApiKey.prefix == key[:DISPLAY_CHARS]
        rows = list(s.scalars(select(ApiKey).where(which, ApiKey.tenant_id == owner.id)))
        if len(rows) != 1:
            raise AccountError(f"no key {key!r} of tenant {tenant!r}" if not rows else
                               f"key prefix {key!r} is ambiguous; use the key's id")
        rows[0].cache_max_false_hit_rate = value


def create_key(
    engine: Engine,
    tenant: str,
    *,
    rpm: int | None = None,
    tpm: int | None = None,
    budget_usd: float | Decimal | None = None,
    name: str | None = None,
    project: str | None = None,
    alert_at: float | None = None,
    cache_max_false_hit_rate: float | None = None,
) -> CreatedKey:
    text_field("tenant", tenant)
    optional_text_field("name", name)
    optional_text_field("project", project)
    count_limit("rpm", rpm)
    count_limit("tpm", tpm)
    usd_amount("budget_usd", budget_usd)
    alert_share("alert_at", alert_at, budget_usd)
    cache_bound("cache_max_false_hit_rate", cache_max_false_hit_rate)
    key = new_key()
    prefix = key[:DISPLAY_CHARS]
    with Session(engine) as s, s.begin():
        owner = s.scalar(select(Tenant).where(Tenant.name == tenant))
        if owner is None:
            raise AccountError(f"no tenant named {tenant!r}")
        row = ApiKey(tenant_id=owner.id, key_hash=hash_key(key), prefix=prefix, name=name, project=project,
                     rpm=rpm, tpm=tpm, budget_usd=budget_usd, alert_at=alert_at,
                     cache_max_false_hit_rate=cache_max_false_hit_rate)
        s.add(row)
        s.flush()
        key_id = row.id
    return CreatedKey(id=key_id, key=key, prefix=prefix, tenant=tenant)


def key_is_active(engine: Engine, key: str) -> bool:
    with Session(engine) as s:
        row = s.scalar(select(ApiKey.revoked).where(ApiKey.key_hash == hash_key(key)))
    return row is not None and not row


@dataclass(frozen=True)
class KeyInfo:
    id: int
    prefix: str
    tenant: str
    name: str | None
    project: str | None
    rpm: int | None
    tpm: int | None
    budget_usd: Decimal | None
    revoked: bool
    created_at: datetime
    alert_at: float | None = None  # soft budget: the share of budget_usd at which one alert fires a month
    cache_max_false_hit_rate: float | None = None  # None: the tenant's


def list_keys(engine: Engine, tenant: str | None = None) -> list[KeyInfo]:
    q = select(ApiKey, Tenant.name).join(Tenant).order_by(ApiKey.id)
    if tenant is not None:
        text_field("tenant", tenant)
        q = q.where(Tenant.name == tenant)
    with Session(engine) as s:
        return [KeyInfo(k.id, k.prefix, t, k.name, k.project, k.rpm, k.tpm, k.budget_usd, k.revoked, k.created_at,
                        k.alert_at, k.cache_max_false_hit_rate)
                for k, t in s.execute(q)]


def revoke_key(engine: Engine, key_id_or_prefix: str) -> int:
    """Revoke by numeric id or by display prefix; returns the key's id."""
    text_field("key", key_id_or_prefix)
    with Session(engine) as s, s.begin():
        if key_id_or_prefix.isascii() and key_id_or_prefix.isdigit():
            if int(key_id_or_prefix) > MAX_SQL_INT:
                raise AccountError(f"no key {key_id_or_prefix!r}")
            rows = list(s.scalars(select(ApiKey).where(ApiKey.id == int(key_id_or_prefix))))
        else:
            rows = list(s.scalars(select(ApiKey).where(ApiKey.prefix == key_id_or_prefix[:DISPLAY_CHARS])))
        if not rows:
            raise AccountError(f"no key {key_id_or_prefix!r}")
        if len(rows) > 1:
            raise AccountError(f"prefix {key_id_or_prefix!r} matches {len(rows)} keys; revoke by id")
        rows[0].revoked = True
        rows[0].revoked_at = utcnow()
        return rows[0].id
