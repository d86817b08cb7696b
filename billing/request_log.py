"""The request log: usage events that pass a filter, newest first, one page at a time, with the filter's
totals from one aggregate query; and every passing event for exports, read in batches by keyset (no
transaction held open while a client downloads)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from sqlalchemy import Engine, and_, case, func, or_, select

from billing.asked_model import asked_model
from billing.event_filter import EventFilter
from billing.models import ApiKey, Tenant, UsageEvent
from billing.report_query import as_datetime

EXPORT_BATCH = 1000


@dataclass(frozen=True)
class LoggedRequest:
    id: int
    created_at: datetime
    request_id: str
    tenant: str | None
    key_id: int | None
    key_prefix: str | None
    end_user: str | None
    tags: list[str]
    model: str
    endpoint: str
    route: str | None
    status: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_hit: bool
    latency_s: float
    ttft_s: float | None
    cost_usd: Decimal
    error: str | None


@dataclass(frozen=True)
class LogTotals:
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_hits: int
    cost_usd: Decimal


def log_totals(engine: Engine, events: EventFilter) -> LogTotals:
    ev = UsageEvent
    q = select(func.count(), func.coalesce(func.sum(ev.prompt_tokens), 0),
               func.coalesce(func.sum(ev.completion_tokens), 0), func.coalesce(func.sum(ev.cached_tokens), 0),
               func.coalesce(func.sum(case((ev.cache_hit.is_(True), 1), else_=0)), 0),
               func.coalesce(func.sum(ev.cost_usd), 0)).select_from(ev)
    with engine.connect() as conn:
        n, prompt, completion, cached, hits, cost = conn.execute(events.apply(q, engine.dialect.name)).one()
    return LogTotals(int(n), int(prompt), int(completion), int(cached), int(hits), cost)


def log_page(engine: Engine, events: EventFilter, *, offset: int, limit: int) -> list[LoggedRequest]:
    q = _listing(engine, events).offset(offset).limit(limit)
    with engine.connect() as conn:
        return [_row(r) for r in conn.execute(q)]


def iter_log(engine: Engine, events: EventFilter, batch: int = EXPORT_BATCH) -> Iterator[LoggedRequest]:
    """Every event that passes, newest first."""
    ev = UsageEvent
    after: tuple[datetime, int] | None = None
    while True:
        q = _listing(engine, events)
        if after is not None:
            at, last_id = after
            q = q.where(or_(ev.created_at < at, and_(ev.created_at == at, ev.id < last_id)))
        with engine.connect() as conn:
            rows = [_row(r) for r in conn.execute(q.limit(batch))]
        yield from rows
        if len(rows) < batch:
            return
        after = (rows[-1].created_at, rows[-1].id)


def _listing(engine: Engine, events: EventFilter):  # type: ignore[no-untyped-def]
    ev = UsageEvent
    q = (select(ev.id, ev.created_at, ev.request_id, Tenant.name, ev.api_key_id, ApiKey.prefix, ev.end_user,
                ev.tags, asked_model().label("model"), ev.endpoint, ev.route, ev.status, ev.prompt_tokens, ev.completion_tokens,
                ev.cached_tokens, ev.cache_hit, ev.latency_s, ev.ttft_s, ev.cost_usd, ev.error)
         .select_from(ev)
         .outerjoin(Tenant, Tenant.id == ev.tenant_id)
         .outerjoin(ApiKey, ApiKey.id == ev.api_key_id)
         .order_by(ev.created_at.desc(), ev.id.desc()))
    return events.apply(q, engine.dialect.name)


def _row(r) -> LoggedRequest:  # type: ignore[no-untyped-def]
    values = list(r)
    values[1] = as_datetime(values[1])  # SQLite hands back naive UTC
    values[7] = list(values[7] or [])
    return LoggedRequest(*values)
