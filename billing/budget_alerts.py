"""Soft budgets: a key, tenant, end-user or tag budget with `alert_at` (a share of its monthly budget,
0 < alert_at <= 1) raises one alert the first time its spend this month reaches alert_at × budget. The ledger checks the counters a batch
touched inside the batch's transaction and claims each crossing with a `budget_alerts` row (primary key:
scope, id, month), so that the alert fires once however many gateways share the database; the claimed
alerts go to the ledger's `on_alert` callback (gateway/budget_webhook.py) after the transaction commits."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import Connection, Engine, and_, literal, select

from billing.db import dialect_insert
from billing.models import ApiKey, BudgetAlert, ScopedBudget, SpendCounter, Tenant
from billing.money import amount_text


@dataclass(frozen=True)
class SoftBudgetCrossed:
    scope: str  # key | tenant | user | tag
    scope_id: int
    name: str  # the tenant's name, the key's display prefix, the end user's or the tag's name
    tenant: str
    period: str  # YYYY-MM
    spent_usd: Decimal
    budget_usd: Decimal
    alert_at: float

    def as_json(self) -> dict[str, object]:
        return {"type": "budget.soft_limit_reached", "scope": self.scope, "name": self.name, "tenant": self.tenant,
                "period": self.period, "spent_usd": amount_text(self.spent_usd),
                "budget_usd": amount_text(self.budget_usd),
                "alert_at": self.alert_at, "used_ratio": float(self.spent_usd / self.budget_usd)}


def claim_crossings(conn: Connection, db: Engine, touched: set[tuple[str, int, str]]) -> list[SoftBudgetCrossed]:
    """The soft budgets among `touched` (scope, id, month) whose spend now reaches alert_at × budget, each
    claimed in this transaction; those another process claimed already are not returned."""
    out: list[SoftBudgetCrossed] = []
    c = SpendCounter.__table__.c
    b = ScopedBudget
    # (the counter scopes a budget table holds, the table, its budgets' label, their counters' scope)
    for scopes, owner, label, scope in ((("tenant",), Tenant, Tenant.name, literal("tenant")),
                                        (("key",), ApiKey, ApiKey.prefix, literal("key")),
                                        (("user", "tag"), b, b.name, b.scope)):
        ids = {i for s, i, _ in touched if s in scopes}
        if not ids:
            continue
        q = (select(scope, owner.id, label, Tenant.name, owner.budget_usd, owner.alert_at, c.period, c.spent_usd)
             .select_from(owner).join(SpendCounter, and_(c.scope == scope, c.scope_id == owner.id))
             .where(owner.id.in_(ids), owner.alert_at.is_not(None), owner.budget_usd > 0))
        if owner is not Tenant:
            q = q.join(Tenant, Tenant.id == owner.tenant_id)
        for scope_name, scope_id, name, tenant_name, budget, alert_at, period, spent in conn.execute(q):
            if (scope_name, scope_id, period) not in touched or spent < budget * Decimal(repr(alert_at)):
                continue
            claimed = conn.execute(dialect_insert(db, BudgetAlert).values(
                scope=scope_name, scope_id=scope_id, period=period, spent_usd=spent, budget_usd=budget)
                .on_conflict_do_nothing(index_elements=["scope", "scope_id", "period"])
                .returning(BudgetAlert.scope)).first()
            if claimed is not None:
                out.append(SoftBudgetCrossed(scope_name, scope_id, name, tenant_name, period, spent, budget, alert_at))
    return out
