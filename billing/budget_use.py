"""Budgets against what is spent this month, read from the spend counters the ledger keeps (one indexed
lookup per budget, no scan of usage events): each budgeted tenant's use for /metrics, and every tenant's,
key's, end user's and tag's budget with the reservations of the requests in flight and its soft alert share
for the dashboard."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import JSON, Engine, Float, and_, cast, column, func, null, select, true

from billing.models import ApiKey, Reservation, ScopedBudget, SpendCounter, Tenant
from billing.money import dollars
from billing.reservations import LEASE_ENDPOINT


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


def alert_threshold(budget_usd: Decimal, alert_at: float) -> Decimal:
    """The spend at which a soft budget alerts, as billing/budget_alerts.py compares it, to the nano-dollar."""
    return dollars(budget_usd * Decimal(repr(alert_at)))


@dataclass(frozen=True)
class BudgetLine:
    """One monthly budget (a tenant's, a key's, or a tenant's end user's or tag's) with what is spent and what
    admitted requests still hold."""

    scope: str  # tenant | key | user | tag
    scope_id: int  # Tenant.id, ApiKey.id or ScopedBudget.id
    tenant: str
    key_prefix: str | None  # key budgets
    key_name: str | None
    name: str | None  # the end user's or the tag's (user and tag budgets)
    budget_usd: Decimal
    spent_usd: Decimal
    reserved_usd: Decimal  # the worst cases of requests in flight (billing/reservations.py)
    in_flight: int  # how many requests hold those reservations
    alert_at: float | None = None  # a soft budget: the share of budget_usd at which one alert fires a month

    @property
    def left_usd(self) -> Decimal:
        return self.budget_usd - self.spent_usd - self.reserved_usd

    @property
    def alert_usd(self) -> Decimal | None:
        return None if self.alert_at is None else alert_threshold(self.budget_usd, self.alert_at)

    @property
    def used_ratio(self) -> float:
        """(spent + reserved) / budget; a zero budget is used up."""
        held = self.spent_usd + self.reserved_usd
        return float(held / self.budget_usd) if self.budget_usd > 0 else 1.0


SCOPE_ORDER = ("tenant", "key", "user", "tag")


def budget_lines(engine: Engine, month: str) -> list[BudgetLine]:
    """Every budget of a tenant, of a key not revoked, and of a tenant's end user or tag, in `month` (YYYY-MM),
    most used first."""
    lines = [_lines(engine, month, "tenant"), _lines(engine, month, "key"), _scoped_lines(engine, month)]
    return sorted((line for part in lines for line in part),
                  key=lambda b: (-b.used_ratio, SCOPE_ORDER.index(b.scope), b.tenant, b.key_prefix or "", b.name or ""))


def _lines(engine: Engine, month: str, scope: str) -> list[BudgetLine]:
    r, c = Reservation, SpendCounter
    owner = r.tenant_id if scope == "tenant" else r.api_key_id
    held = r.tenant_usd if scope == "tenant" else r.key_usd
    flying = (select(owner.label("sid"), func.count().label("n"))
              .where(r.period == month, held.is_not(None), r.endpoint != LEASE_ENDPOINT)
              .group_by(owner).subquery())
    if scope == "tenant":
        q = (select(Tenant.id, Tenant.name, null(), null(), Tenant.budget_usd, Tenant.alert_at)
             .where(Tenant.budget_usd.is_not(None)))
        sid = Tenant.id
    else:
        q = (select(ApiKey.id, Tenant.name, ApiKey.prefix, ApiKey.name, ApiKey.budget_usd, ApiKey.alert_at)
             .join(Tenant, Tenant.id == ApiKey.tenant_id)
             .where(ApiKey.budget_usd.is_not(None), ApiKey.revoked.is_(False)))
        sid = ApiKey.id
    q = (q.add_columns(func.coalesce(c.spent_usd, 0), func.coalesce(c.reserved_usd, 0), func.coalesce(flying.c.n, 0))
         .outerjoin(c, and_(c.scope == scope, c.scope_id == sid, c.period == month))
         .outerjoin(flying, flying.c.sid == sid))
    with engine.connect() as conn:
        return [BudgetLine(scope, i, t, p, n, None, b, s, h, int(f), a)
                for i, t, p, n, b, a, s, h, f in conn.execute(q)]


def _scoped_lines(engine: Engine, month: str) -> list[BudgetLine]:
    b, c = ScopedBudget, SpendCounter
    flying = _scoped_in_flight(engine.dialect.name, month)
    q = (select(b.scope, b.id, Tenant.name, b.name, b.budget_usd, func.coalesce(c.spent_usd, 0),
                func.coalesce(c.reserved_usd, 0), func.coalesce(flying.c.n, 0), b.alert_at)
         .join(Tenant, Tenant.id == b.tenant_id)
         .outerjoin(c, and_(c.scope == b.scope, c.scope_id == b.id, c.period == month))
         .outerjoin(flying, and_(flying.c.scope == b.scope, flying.c.sid == b.id)))
    with engine.connect() as conn:
        return [BudgetLine(scope, i, t, None, None, n, budget, s, h, int(f), a)
                for scope, i, t, n, budget, s, h, f, a in conn.execute(q)]


def _scoped_in_flight(dialect: str, month: str):  # type: ignore[no-untyped-def]
    """(scope, sid, n): how many reservations of `month` hold against each end-user or tag budget, from each
    reservation's `scoped_holds` ([[scope, ScopedBudget.id], ...]) taken apart in SQL."""
    r = Reservation
    each = "json_array_elements" if dialect == "postgresql" else "json_each"
    holds = getattr(func, each)(r.scoped_holds).table_valued(column("value", JSON))
    scope, sid = holds.c.value[0].as_string(), holds.c.value[1].as_integer()
    # scoped_usd is set exactly when scoped_holds is a list (otherwise it holds JSON null, which has no elements)
    return (select(scope.label("scope"), sid.label("sid"), func.count().label("n"))
            .select_from(r).join(holds, true())
            .where(r.period == month, r.scoped_usd.is_not(None))
            .group_by(scope, sid).subquery())
