"""Spend broken down by key, end user, tag, tenant or model, with requests and tokens beside the dollars:
one GROUP BY over the filtered usage events. An event counts once under each of its tags; events without
an end user (or key, or tenant) form the group None."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import Engine, case, func, select, true

from billing.event_filter import EventFilter, tag_elements
from billing.models import ApiKey, Tenant, UsageEvent

BREAKDOWNS = ("key", "user", "tag", "tenant", "model")


@dataclass(frozen=True)
class BreakdownRow:
    group: str | None  # the key's display prefix, the end user, tag, tenant or model; None: events without one
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_hits: int
    cost_usd: Decimal
    key_id: int | None = None  # by key: the key (its name and tenant below)
    key_name: str | None = None
    tenant: str | None = None


def breakdown(engine: Engine, by: str, events: EventFilter, limit: int | None = None) -> list[BreakdownRow]:
    """Most spend first (then most requests, then the group's name); at most `limit` groups."""
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
        grouped = select(key.label("grp"), *sums).select_from(ev).join(tags, true())
    else:
        key = {"key": ev.api_key_id, "user": ev.end_user, "tenant": ev.tenant_id, "model": ev.model}[by]
        grouped = select(key.label("grp"), *sums).select_from(ev)
    inner = events.apply(grouped, dialect).group_by(key).subquery()
    columns = [inner.c[c] for c in ("requests", "prompt_tokens", "completion_tokens", "cached_tokens",
                                    "cache_hits", "cost_usd")]
    if by == "key":
        q = (select(ApiKey.prefix, *columns, inner.c.grp, ApiKey.name, Tenant.name)
             .select_from(inner).outerjoin(ApiKey, ApiKey.id == inner.c.grp)
             .outerjoin(Tenant, Tenant.id == ApiKey.tenant_id))
    elif by == "tenant":
        q = select(Tenant.name, *columns).select_from(inner).outerjoin(Tenant, Tenant.id == inner.c.grp)
    else:
        q = select(inner.c.grp, *columns)
    q = q.order_by(inner.c.cost_usd.desc(), inner.c.requests.desc(), inner.c.grp)
    if limit is not None:
        q = q.limit(limit)
    with engine.connect() as conn:
        rows = conn.execute(q).all()
    return [BreakdownRow(r[0], *(int(v) for v in r[1:6]), r[6], *(r[7:] if by == "key" else ()))
            for r in rows]
