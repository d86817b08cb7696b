"""Budgets against what is spent this month, read from the spend counters the ledger keeps (one indexed
lookup per budget, no scan of usage events): each budgeted tenant's use for /metrics, and every tenant's
and key's budget with the reservations of the requests in flight for the dashboard."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import Engine, Float, and_, cast, func, null, select

from billing.models import ApiKey, Reservation, SpendCounter, Tenant


@dataclass(frozen=True)
class BudgetUse:
    tenant: str
    spent_usd: Decimal
    budget_usd: Decimal

    @property
    def ratio(self) -> float:
        return float(self.spent_usd / self.budget_usd)


def tenant_budget_use(engine: Engine, month: str, limit: int = 500) -> list[BudgetUse]:
    """Tenants with a positive budget, highest use first, at most `limit` of them."""
    spent = func.coalesce(SpendCounter.spent_usd, 0)
    q = (
        select(Tenant.name, spent, Tenant.budget_usd)
        .outerjoin(SpendCounter, and_(SpendCounter.scope == "tenant", SpendCounter.scope_id == Tenant.id,
                                      SpendCounter.period == month))
        .where(Tenant.budget_usd > 0)
        .order_by((cast(spent, Float) / cast(Tenant.budget_usd, Float)).desc(), Tenant.name)
        .limit(limit)
    )
    with engine.connect() as conn:
        return [BudgetUse(name, s, b) for name, s, b in conn.execute(q)]


@dataclass(frozen=True)
class BudgetLine:
    """One monthly budget (a tenant's or a key's) with what is spent and what admitted requests still hold."""

    scope: str  # tenant | key
    scope_id: int
    tenant: str
    key_prefix: str | None  # key budgets
    key_name: str | None
    budget_usd: Decimal
    spent_usd: Decimal
    reserved_usd: Decimal  # the worst cases of requests in flight (billing/reservations.py)
    in_flight: int  # how many requests hold those reservations

    @property
    def left_usd(self) -> Decimal:
        return self.budget_usd - self.spent_usd - self.reserved_usd

    @property
    def used_ratio(self) -> float:
        """(spent + reserved) / budget; a zero budget is used up."""
        held = self.spent_usd + self.reserved_usd
        return float(held / self.budget_usd) if self.budget_usd > 0 else 1.0


def budget_lines(engine: Engine, month: str) -> list[BudgetLine]:
    """Every budget of a tenant, and of a key not revoked, in `month` (YYYY-MM), most used first."""
    lines = [_lines(engine, month, "tenant"), _lines(engine, month, "key")]
    return sorted((line for part in lines for line in part),
                  key=lambda b: (-b.used_ratio, b.scope != "tenant", b.tenant, b.key_prefix or ""))


def _lines(engine: Engine, month: str, scope: str) -> list[BudgetLine]:
    r, c = Reservation, SpendCounter
    owner = r.tenant_id if scope == "tenant" else r.api_key_id
    held = r.tenant_usd if scope == "tenant" else r.key_usd
    flying = (select(owner.label("sid"), func.count().label("n")).where(r.period == month, held.is_not(None))
              .group_by(owner).subquery())
    if scope == "tenant":
        q = select(Tenant.id, Tenant.name, null(), null(), Tenant.budget_usd).where(Tenant.budget_usd.is_not(None))
        sid = Tenant.id
    else:
        q = (select(ApiKey.id, Tenant.name, ApiKey.prefix, ApiKey.name, ApiKey.budget_usd)
             .join(Tenant, Tenant.id == ApiKey.tenant_id)
             .where(ApiKey.budget_usd.is_not(None), ApiKey.revoked.is_(False)))
        sid = ApiKey.id
    q = (q.add_columns(func.coalesce(c.spent_usd, 0), func.coalesce(c.reserved_usd, 0), func.coalesce(flying.c.n, 0))
         .outerjoin(c, and_(c.scope == scope, c.scope_id == sid, c.period == month))
         .outerjoin(flying, flying.c.sid == sid))
    with engine.connect() as conn:
        return [BudgetLine(scope, i, t, p, n, b, s, h, int(f)) for i, t, p, n, b, s, h, f in conn.execute(q)]
