"""Budgets within a tenant for one end user (the requests' OpenAI `user` field) or one tag (a key's project or a
request's metadata.tags): monthly, in exact dollars, optionally soft (`alert_at`). Admission reserves against them
like key and tenant budgets (billing/reservations.py); the ledger adds each event's cost to the counters of the
budgets it matches (`matching()`), in the transaction that writes the event.

A budget created mid-month starts from what its user or tag already spent this month: `set_budget` sums the
month's events in the transaction that creates it, with the ledger's writes held off until it commits (the
SQLite write lock; a SHARE lock on usage_events in PostgreSQL), so no event is counted twice or missed."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal

from sqlalchemy import Connection, Engine, and_, delete, func, or_, select, text, update

from billing.db import dialect_insert
from billing.field_checks import FieldError, alert_share, text_field, usd_amount
from billing.models import ScopedBudget, SpendCounter, Tenant, UsageEvent
from billing.money import ZERO
from billing.periods import month_of
from billing.event_filter import has_tag

SCOPES = ("user", "tag")
SCOPE_WORDS = {"user": "end user", "tag": "tag"}
_NAMES_PER_QUERY = 500  # names in one IN list: far below SQLite's bound-parameter limit


@dataclass(frozen=True)
class ScopedLimit:
    """One end-user or tag budget that applies to a request."""

    scope: str  # user | tag
    id: int
    name: str
    budget_usd: Decimal


@dataclass(frozen=True)
class ScopedBudgetUse:
    tenant: str
    scope: str
    name: str
    budget_usd: Decimal
    alert_at: float | None
    period: str
    spent_usd: Decimal
    reserved_usd: Decimal

    @property
    def left_usd(self) -> Decimal:
        return max(ZERO, self.budget_usd - self.spent_usd - self.reserved_usd)


def applicable(conn: Connection, tenant_id: int, end_user: str | None, tags: Iterable[str]) -> tuple[ScopedLimit, ...]:
    """The budgets of this tenant for this end user and these tags (each budget once)."""
    tags = set(tags)
    wanted = []
    if end_user is not None:
        wanted.append(and_(ScopedBudget.scope == "user", ScopedBudget.name == end_user))
    if tags:
        wanted.append(and_(ScopedBudget.scope == "tag", ScopedBudget.name.in_(sorted(tags))))
    if not wanted:
        return ()
    b = ScopedBudget
    rows = conn.execute(select(b.scope, b.id, b.name, b.budget_usd)
                        .where(b.tenant_id == tenant_id, or_(*wanted)))
    return tuple(ScopedLimit(*row) for row in rows)


def matching(conn: Connection, events: list[dict]) -> list[list[tuple[str, int]]]:
    """For each usage event (tenant_id, end_user, tags), the (scope, id) of each budget it counts against."""
    by_tenant: dict[int, set[str]] = defaultdict(set)
    for e in events:
        if e["tenant_id"] is not None:
            by_tenant[e["tenant_id"]].update(_names(e))
    found: dict[tuple[int, str, str], int] = {}
    names = sorted({n for ns in by_tenant.values() for n in ns})
    b = ScopedBudget
    for i in range(0, len(names), _NAMES_PER_QUERY):
        q = select(b.tenant_id, b.scope, b.name, b.id).where(b.tenant_id.in_(sorted(by_tenant)),
                                                             b.name.in_(names[i:i + _NAMES_PER_QUERY]))
        found.update({(tenant_id, scope, name): budget_id for tenant_id, scope, name, budget_id in conn.execute(q)})
    out = []
    for e in events:
        keys = [("user", e["end_user"])] if e["end_user"] is not None else []
        keys += [("tag", t) for t in e["tags"] or ()]
        ids = {(s, found[(e["tenant_id"], s, n)]) for s, n in keys if (e["tenant_id"], s, n) in found}
        out.append(sorted(ids))
    return out


def _names(event: dict) -> list[str]:
    return ([event["end_user"]] if event["end_user"] is not None else []) + list(event["tags"] or ())


def checked_scope(user: str | None, tag: str | None) -> tuple[str, str]:
    if (user is None) == (tag is None):
        raise FieldError("user, tag: give one of them (--user NAME or --tag NAME)")
    scope, name = ("user", user) if user is not None else ("tag", tag)
    text_field(scope, name)
    if not name.strip():
        raise FieldError(f"{scope}: must not be empty")
    return scope, name


def set_budget(engine: Engine, tenant: str, *, user: str | None = None, tag: str | None = None,
               budget_usd: float | Decimal, alert_at: float | None = None, now: float | None = None) -> ScopedBudgetUse:
    """Creates or replaces the monthly budget of one end user or tag of `tenant` (an `alert_at` not given is
    cleared). A new budget's counter starts at what its user or tag spent this month."""
    text_field("tenant", tenant)
    scope, name = checked_scope(user, tag)
    not_positive = (isinstance(budget_usd, (int, float, Decimal)) and not isinstance(budget_usd, bool)
                    and not (isinstance(budget_usd, Decimal) and budget_usd.is_nan()) and budget_usd <= 0)
    if budget_usd is None or not_positive or usd_amount("budget_usd", budget_usd) <= 0:
        raise FieldError(f"budget_usd: must be > 0, got {budget_usd}")
    alert_share("alert_at", alert_at, budget_usd)
    period = month_of(now if now is not None else datetime.now(timezone.utc).timestamp())
    b = ScopedBudget.__table__.c
    with engine.begin() as conn:
        # a write first: on SQLite it takes the write lock, so the sum in _start_counter sees every event there is
        budget_id = conn.execute(update(ScopedBudget).where(b.tenant_id == _tenant_id_of(tenant), b.scope == scope,
                                                            b.name == name)
                                 .values(budget_usd=budget_usd, alert_at=alert_at).returning(b.id)).scalar()
        if budget_id is None:
            tenant_id = _tenant_id(conn, tenant)
            budget_id = conn.execute(dialect_insert(engine, ScopedBudget).values(
                tenant_id=tenant_id, scope=scope, name=name, budget_usd=budget_usd, alert_at=alert_at,
                created_at=datetime.now(timezone.utc)).returning(b.id)).scalar_one()
            _start_counter(conn, engine, tenant_id, scope, name, budget_id, period)
    return next(u for u in list_budgets(engine, tenant, period=period) if (u.scope, u.name) == (scope, name))


def delete_budget(engine: Engine, tenant: str, *, user: str | None = None, tag: str | None = None) -> None:
    """Requests in flight keep their hold on it until they settle; its counters stay (its id is never reused)."""
    text_field("tenant", tenant)
    scope, name = checked_scope(user, tag)
    b = ScopedBudget.__table__.c
    with engine.begin() as conn:
        gone = conn.execute(delete(ScopedBudget).where(b.tenant_id == _tenant_id_of(tenant), b.scope == scope,
                                                       b.name == name))
        if gone.rowcount != 1:
            _tenant_id(conn, tenant)
            raise FieldError(f"{scope}: tenant {tenant!r} has no budget for {SCOPE_WORDS[scope]} {name!r}")


def list_budgets(engine: Engine, tenant: str | None = None, *, period: str | None = None) -> list[ScopedBudgetUse]:
    """Every end-user and tag budget (of one tenant), with its spend and reservations in `period` (this month)."""
    period = period or month_of(datetime.now(timezone.utc).timestamp())
    b, c = ScopedBudget, SpendCounter
    q = (select(Tenant.name, b.scope, b.name, b.budget_usd, b.alert_at, func.coalesce(c.spent_usd, 0),
                func.coalesce(c.reserved_usd, 0))
         .join(Tenant, Tenant.id == b.tenant_id)
         .outerjoin(c, and_(c.scope == b.scope, c.scope_id == b.id, c.period == period))
         .order_by(Tenant.name, b.scope, b.name))
    with engine.connect() as conn:
        if tenant is not None:
            q = q.where(b.tenant_id == _tenant_id(conn, text_field("tenant", tenant)))
        return [ScopedBudgetUse(t, s, n, budget, alert, period, Decimal(spent), Decimal(reserved))
                for t, s, n, budget, alert, spent, reserved in conn.execute(q)]


def _tenant_id_of(tenant: str):  # type: ignore[no-untyped-def]
    return select(Tenant.id).where(Tenant.name == tenant).scalar_subquery()


def _tenant_id(conn: Connection, tenant: str) -> int:
    tenant_id = conn.execute(select(Tenant.id).where(Tenant.name == tenant)).scalar()
    if tenant_id is None:
        raise FieldError(f"tenant: no tenant named {tenant!r}")
    return tenant_id


def _start_counter(conn: Connection, engine: Engine, tenant_id: int, scope: str, name: str, budget_id: int,
                   period: str) -> None:
    """This month's counter of a new budget: what its user or tag spent so far this month. The budget's insert
    holds the SQLite write lock; PostgreSQL's ledgers wait on the SHARE lock, then see the budget."""
    if engine.dialect.name == "postgresql":
        conn.execute(text("LOCK TABLE usage_events IN SHARE MODE"))
    start = datetime.strptime(period, "%Y-%m").replace(tzinfo=timezone.utc)
    end = start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)
    e = UsageEvent
    match = e.end_user == name if scope == "user" else has_tag(engine.dialect.name, name)
    spent = conn.execute(select(func.coalesce(func.sum(e.cost_usd), 0)).where(
        e.tenant_id == tenant_id, e.created_at >= start, e.created_at < end, match)).scalar_one()
    conn.execute(dialect_insert(engine, SpendCounter).values(
        scope=scope, scope_id=budget_id, period=period, spent_usd=Decimal(spent), reserved_usd=0))
