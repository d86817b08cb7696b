"""Usage summaries for `platform usage`: one SQL aggregate query, returned as a DataFrame. End users and tags
belong to a tenant (tenant beta's `alice` is not tenant acme's `alice`), so grouping by user or tag groups by
tenant too; an event counts once under each of its tags. Names stay text (a user called "NaN" is that string)
and cost_usd is exact (Decimal dollars)."""

from __future__ import annotations

from datetime import datetime

import pandas as pd
from sqlalchemy import Engine, String, cast, func, select, true

from billing.asked_model import asked_model
from billing.event_filter import has_tag, tag_elements
from billing.field_checks import text_field
from billing.models import ApiKey, Tenant, UsageEvent
from billing.money import Money

GROUPS = ("day", "month", "model", "tenant", "key", "user", "tag", "status", "endpoint")  # model: as asked
PER_TENANT = ("user", "tag")  # groups whose names belong to one tenant


def usage_frame(
    engine: Engine,
    *,
    tenant: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    group_by: tuple[str, ...] = ("day", "model"),
    user: str | None = None,
    tag: str | None = None,
) -> pd.DataFrame:
    """Filters match exactly (`=`, never LIKE): `tag` is one element of an event's tags."""
    unknown = [g for g in group_by if g not in GROUPS]
    if unknown:
        raise ValueError(f"group_by: unknown {unknown}; choose from {GROUPS}")
    if any(g in PER_TENANT for g in group_by) and "tenant" not in group_by:
        first = min(group_by.index(g) for g in PER_TENANT if g in group_by)
        group_by = (*group_by[:first], "tenant", *group_by[first:])
    created = UsageEvent.created_at
    tags = tag_elements(engine.dialect.name)
    columns = {
        "day": func.substr(cast(created, String), 1, 10),
        "month": func.substr(cast(created, String), 1, 7),
        "model": asked_model(),
        "tenant": Tenant.name,
        "key": ApiKey.prefix,
        "user": UsageEvent.end_user,
        "tag": tags.c.value,
        "status": UsageEvent.status,
        "endpoint": UsageEvent.endpoint,
    }
    keys = [columns[g].label(g) for g in group_by]
    q = (
        select(
            *keys,
            func.count().label("requests"),
            func.coalesce(func.sum(UsageEvent.prompt_tokens), 0).label("prompt_tokens"),
            func.coalesce(func.sum(UsageEvent.completion_tokens), 0).label("completion_tokens"),
            func.coalesce(func.sum(UsageEvent.cached_tokens), 0).label("cached_tokens"),
            func.coalesce(func.sum(UsageEvent.cost_usd), 0, type_=Money()).label("cost_usd"),
        )
        .select_from(UsageEvent)
        .outerjoin(Tenant, Tenant.id == UsageEvent.tenant_id)
        .outerjoin(ApiKey, ApiKey.id == UsageEvent.api_key_id)
    )
    if "tag" in group_by:
        q = q.join(tags, true())
    if tenant is not None:
        q = q.where(Tenant.name == text_field("tenant", tenant))
    if user is not None:
        q = q.where(UsageEvent.end_user == text_field("user", user))
    if tag is not None:
        q = q.where(has_tag(engine.dialect.name, text_field("tag", tag)))
    if since is not None:
        q = q.where(created >= since)
    if until is not None:
        q = q.where(created < until)
    if keys:
        q = q.group_by(*keys).order_by(*keys)
    with engine.connect() as conn:
        rows = conn.execute(q).mappings().all()
    frame = pd.DataFrame(rows, columns=[*group_by, "requests", "prompt_tokens", "completion_tokens",
                                        "cached_tokens", "cost_usd"])
    for c in ("requests", "prompt_tokens", "completion_tokens", "cached_tokens"):
        frame[c] = frame[c].astype("int64")
    for c in group_by:
        if c not in ("day", "month"):
            frame[c] = frame[c].astype("object")  # text and None as they are, never coerced
    frame["cost_usd"] = frame["cost_usd"].astype("object")
    return frame
