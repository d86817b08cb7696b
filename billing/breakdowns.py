"""Spend broken down by key, end user, tag, tenant or model, with requests and tokens beside the dollars:
one GROUP BY over the filtered usage events. End users and tags belong to a tenant (tenant beta's `alice` is
not tenant acme's `alice`), so those group by (tenant, name). An event counts once under each of its tags;
events without an end user (or key, or tenant) form the group None (per tenant for end users and tags)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import Engine, case, func, select, true

from billing.asked_model import asked_model
from billing.event_filter import EventFilter, tag_elements
from billing.models import ApiKey, Tenant, UsageEvent

BREAKDOWNS = ("key", "user", "tag", "tenant", "model")
PER_TENANT = ("key", "user", "tag")  # the breakdowns whose groups belong to one tenant


@dataclass(frozen=True)
class BreakdownRow:
    group: str | None  # the key's display prefix, the end user, tag, tenant or model; None: events without one
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_hits: int
    cost_usd: Decimal
    key_id: int | None = None  # by key: the key (its name below)
    key_name: str | None = None
    tenant: str | None = None  # by key, end user or tag: the group's tenant


def breakdown(engine: Engine, by: str, events: EventFilter, limit: int | None = None) -> list[BreakdownRow]:
    """Most spend first (then most requests, then the tenant's and the group's name); at most `limit` groups."""
    if by not in BREAKDOWNS:
        raise ValueError(f"by: expected one of {', '.join(BREAKDOWNS)}, got {by!r}")
    ev = UsageEvent
    dialect = engine.dialect.name
    sums = [func.count().label("requests"),
            func.coalesce(func.sum(ev.prompt_tokens), 0).label("prompt_tokens"),
            func.coalesce(func.sum(ev.completion_tokens), 0).label("completion_tokens"),
            func.coalesce(func.sum(ev.cached_tokens), 0).label("cached_tokens"),
            func.coalesce(func.sum(case((ev.cache_hit.is_(True), 1), else_=0)), 0).label("cache_hits"),
            func.coalesce(func.sum(ev.cost_usd), 0).label("cost_usd")]
    if by == "tag":
        tags = tag_elements(dialect)
        key = tags.c.value
        grouped = select(key.label("grp"), ev.tenant_id.label("tid"), *sums).select_from(ev).join(tags, true())
        group_by = (ev.tenant_id, key)
    elif by == "user":
        key = ev.end_user
        grouped = select(key.label("grp"), ev.tenant_id.label("tid"), *sums).select_from(ev)
        group_by = (ev.tenant_id, key)
    else:
        key = {"key": ev.api_key_id, "tenant": ev.tenant_id, "model": asked_model()}[by]
        grouped = select(key.label("grp"), *sums).select_from(ev)
        group_by = (key,)
    inner = events.apply(grouped, dialect).group_by(*group_by).subquery()
    columns = [inner.c[c] for c in ("requests", "prompt_tokens", "completion_tokens", "cached_tokens",
                                    "cache_hits", "cost_usd")]
    order = [inner.c.cost_usd.desc(), inner.c.requests.desc()]
    if by == "key":
        q = (select(ApiKey.prefix, *columns, inner.c.grp, ApiKey.name, Tenant.name)
             .select_from(inner).outerjoin(ApiKey, ApiKey.id == inner.c.grp)
             .outerjoin(Tenant, Tenant.id == ApiKey.tenant_id))
    elif by in ("user", "tag"):
        q = (select(inner.c.grp, *columns, Tenant.name).select_from(inner)
             .outerjoin(Tenant, Tenant.id == inner.c.tid))
        order.append(Tenant.name)
    elif by == "tenant":
        q = select(Tenant.name, *columns).select_from(inner).outerjoin(Tenant, Tenant.id == inner.c.grp)
    else:
        q = select(inner.c.grp, *columns)
    q = q.order_by(*order, inner.c.grp)
    if limit is not None:
        q = q.limit(limit)
    with engine.connect() as conn:
        rows = conn.execute(q).all()
    return [_row(by, r) for r in rows]


def _row(by: str, r) -> BreakdownRow:  # type: ignore[no-untyped-def]
    group, counts, cost = r[0], (int(v) for v in r[1:6]), r[6]
    if by == "key":
        return BreakdownRow(group, *counts, cost, key_id=r[7], key_name=r[8], tenant=r[9])
    if by in ("user", "tag"):
        return BreakdownRow(group, *counts, cost, tenant=r[7])
    return BreakdownRow(group, *counts, cost)
