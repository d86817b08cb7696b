"""Spend across all tenants per UTC day, split by tenant or by model: what the ledger billed (cost_usd),
with requests and tokens beside it. Two GROUP BY queries: the groups that spent most in the window, then
each day's sums for those groups, the rest summed as one "others" group (None)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, timedelta
from decimal import Decimal

from sqlalchemy import Connection, Engine, case, func, select

from billing.asked_model import asked_model
from billing.models import Tenant, UsageEvent
from billing.money import ZERO
from billing.report_query import day_of, within

GROUPINGS = ("tenant", "model")
NO_TENANT = "(no tenant)"


@dataclass(frozen=True)
class Spend:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: Decimal = ZERO

    def __add__(self, other: Spend) -> Spend:
        return Spend(self.requests + other.requests, self.prompt_tokens + other.prompt_tokens,
                     self.completion_tokens + other.completion_tokens, self.cost_usd + other.cost_usd)


@dataclass(frozen=True)
class SpendSeries:
    by: str  # tenant | model
    days: list[date]  # every day of the window, oldest first
    groups: list[str | None]  # most spend first; None: all other groups together
    cells: dict[tuple[date, str | None], Spend] = field(default_factory=dict)

    def cell(self, day: date, group: str | None) -> Spend:
        return self.cells.get((day, group), Spend())

    def total(self, group: str | None) -> Spend:
        return sum((self.cell(d, group) for d in self.days), Spend())

    @property
    def grand_total(self) -> Spend:
        return sum((self.total(g) for g in self.groups), Spend())


def spend_by_day(engine: Engine, by: str, first: date, last: date, top: int | None = None) -> SpendSeries:
    """Days first..last (UTC, both included). `top`: at most that many groups, the rest as None; None: all."""
    if by not in GROUPINGS:
        raise ValueError(f"by: expected one of {', '.join(GROUPINGS)}, got {by!r}")
    ev = UsageEvent
    until = last + timedelta(days=1)
    # tenants are grouped by id (names are only labels); events of no tenant as id -1
    key = func.coalesce(ev.tenant_id, -1) if by == "tenant" else asked_model()
    spent = func.coalesce(func.sum(ev.cost_usd), 0)
    ranked = within(select(key, spent).group_by(key).order_by(spent.desc(), key), ev.created_at, first, until)
    with engine.connect() as conn:
        chosen = [k for k, _ in conn.execute(ranked if top is None else ranked.limit(top))]
        bucket = key if top is None else case((key.in_(chosen), key), else_=None)
        day, group = day_of(ev.created_at).label("day"), bucket.label("grp")
        daily = within(select(day, group, func.count(), func.coalesce(func.sum(ev.prompt_tokens), 0),
                              func.coalesce(func.sum(ev.completion_tokens), 0), spent)
                       .group_by(day, group), ev.created_at, first, until)
        rows = conn.execute(daily).all()
        label = _tenant_names(conn, chosen) if by == "tenant" else {k: k for k in chosen}
    cells = {(date.fromisoformat(d), None if g is None else label[g]): Spend(int(n), int(p), int(c), s)
             for d, g, n, p, c, s in rows}
    groups: list[str | None] = [label[k] for k in chosen]
    if any(g is None for _, g in cells):
        groups.append(None)
    days = [first + timedelta(n) for n in range((last - first).days + 1)]
    return SpendSeries(by, days, groups, cells)


def _tenant_names(conn: Connection, ids: list[int]) -> dict[int, str]:
    names = {i: n for i, n in conn.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(ids)))}
    return {**names, -1: NO_TENANT}
