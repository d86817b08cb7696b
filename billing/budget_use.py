"""Each budgeted tenant's spend this month against its monthly budget, read from the spend counters the
ledger keeps (one indexed lookup per tenant, no scan of usage events)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import Engine, Float, and_, cast, func, select

from billing.models import SpendCounter, Tenant


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
