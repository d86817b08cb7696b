"""What the Overview and Tenants pages show, read from SQL (sync; call through a thread pool).
Spend is the ledger's billed cost (UsageEvent.cost_usd); days are UTC."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

from sqlalchemy import Engine, case, func, select

from billing.asked_model import asked_model
from billing.cache_savings import NOTHING, Savings, savings_by_tenant_model
from billing.event_filter import EventFilter
from billing.models import ApiKey, Tenant, UsageEvent
from billing.money import ZERO
from billing.report_query import day_of, within
from billing.reports import gpu_by_model


def today_utc() -> date:
    return datetime.now(timezone.utc).date()


def month_start(day: date) -> date:
    return day.replace(day=1)


@dataclass(frozen=True)
class Totals:
    spend_usd: Decimal
    requests: int
    tokens: int


@dataclass(frozen=True)
class Overview:
    month_start: date
    today: Totals
    month: Totals
    # this month, at list prices: the semantic cache's hits and what they saved, and apart from them the prompt
    # tokens models read from their KV prefix caches and what the cached-input price saved on them
    cache: Savings
    gpu_alive_h: float  # this month
    gpu_idle_rate: float


def _totals(db: Engine, since: date) -> Totals:
    ev = UsageEvent
    q = select(func.coalesce(func.sum(ev.cost_usd), 0), func.count(ev.id),
               func.coalesce(func.sum(ev.prompt_tokens + ev.completion_tokens), 0))
    with db.connect() as conn:
        spend, requests, tokens = conn.execute(within(q, ev.created_at, since, None)).one()
    return Totals(spend, int(requests), int(tokens))


def overview(db: Engine) -> Overview:
    day = today_utc()
    start = month_start(day)
    cache = sum((r.savings for r in savings_by_tenant_model(db, EventFilter(since=start))), NOTHING)
    gpu = gpu_by_model(db, since=start)
    alive, busy = float(gpu["alive_h"].sum()), float(gpu["busy_h"].sum())
    return Overview(start, _totals(db, day), _totals(db, start), cache, alive,
                    (alive - busy) / alive if alive else 0.0)


@dataclass(frozen=True)
class TenantRow:
    name: str
    budget_usd: Decimal | None
    active_keys: int
    requests_month: int
    spend_month_usd: Decimal
    spend_total_usd: Decimal
    alert_at: float | None = None  # soft budget: the share of budget_usd at which one alert fires a month


def tenant_rows(db: Engine) -> list[TenantRow]:
    ev = UsageEvent
    start = month_start(today_utc())
    in_month = ev.created_at >= datetime(start.year, start.month, 1, tzinfo=timezone.utc)
    spend = (select(ev.tenant_id.label("tid"), func.sum(ev.cost_usd).label("total"),
                    func.sum(case((in_month, ev.cost_usd), else_=0)).label("month"),
                    func.sum(case((in_month, 1), else_=0)).label("requests"))
             .group_by(ev.tenant_id).subquery())
    keys = (select(ApiKey.tenant_id.label("tid"), func.count(ApiKey.id).label("n"))
            .where(ApiKey.revoked.is_(False)).group_by(ApiKey.tenant_id).subquery())
    q = (select(Tenant.name, Tenant.budget_usd, keys.c.n, spend.c.requests, spend.c.month, spend.c.total,
                Tenant.alert_at)
         .outerjoin(spend, spend.c.tid == Tenant.id).outerjoin(keys, keys.c.tid == Tenant.id)
         .order_by(Tenant.name))
    with db.connect() as conn:
        return [TenantRow(n, b, int(k or 0), int(r or 0), m or ZERO, t or ZERO, a)
                for n, b, k, r, m, t, a in conn.execute(q)]


@dataclass(frozen=True)
class DailyCost:
    day: date
    cost_usd: Decimal


def tenant_daily_cost(db: Engine, tenant: str, days: int) -> list[DailyCost]:
    """One entry per UTC day of the last `days` days (today included), zero where nothing was spent."""
    end = today_utc()
    first = end - timedelta(days=days - 1)
    ev = UsageEvent
    day = day_of(ev.created_at).label("day")
    q = (select(day, func.sum(ev.cost_usd)).join(Tenant, Tenant.id == ev.tenant_id)
         .where(Tenant.name == tenant).group_by(day))
    with db.connect() as conn:
        spent = {d: c for d, c in conn.execute(within(q, ev.created_at, first, end + timedelta(days=1)))}
    return [DailyCost(d, spent.get(d.isoformat(), ZERO)) for d in (first + timedelta(n) for n in range(days))]


def tenant_cost_by_model(db: Engine, tenant: str, since: date) -> list[tuple[str, Decimal]]:
    ev = UsageEvent
    model = asked_model()
    q = (select(model, func.sum(ev.cost_usd)).join(Tenant, Tenant.id == ev.tenant_id)
         .where(Tenant.name == tenant).group_by(model).order_by(model))
    with db.connect() as conn:
        return [(m, c) for m, c in conn.execute(within(q, ev.created_at, since, None))]
