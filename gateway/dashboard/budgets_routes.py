"""Budgets: each tenant's, key's, end user's and tag's monthly budget against what is spent and what the
requests in flight hold (their reservations' worst cases), from the spend counters that admission itself
checks, with its soft alert (`alert_at`: the share of the budget at which one alert fires a month). An end
user's or tag's line links to the request log filtered to its tenant, its user or tag, and the month."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from billing.budget_use import BudgetLine, budget_lines
from billing.invoice import month_bounds
from billing.money import amount_text
from gateway.dashboard.charts import meter
from gateway.dashboard.exports import export
from gateway.dashboard.guard import admin_page, admin_session, gateway
from gateway.dashboard.outage_page import OutagePageRoute
from gateway.dashboard.query_params import ViewQuery
from gateway.dashboard.session import AdminSession
from gateway.dashboard.stats import today_utc

router = APIRouter(route_class=OutagePageRoute)
COLUMNS = ["month", "scope", "tenant", "key_id", "key_prefix", "key_name", "name", "budget_usd", "spent_usd",
           "reserved_usd", "in_flight", "left_usd", "used_ratio", "alert_at", "alert_usd"]


def as_row(month: str, b: BudgetLine) -> dict[str, Any]:
    return {"month": month, "scope": b.scope, "tenant": b.tenant, "key_id": b.scope_id if b.scope == "key" else None,
            "key_prefix": b.key_prefix, "key_name": b.key_name, "name": b.name, "budget_usd": amount_text(b.budget_usd),
            "spent_usd": amount_text(b.spent_usd), "reserved_usd": amount_text(b.reserved_usd),
            "in_flight": b.in_flight, "left_usd": amount_text(b.left_usd), "used_ratio": round(b.used_ratio, 6),
            "alert_at": b.alert_at, "alert_usd": None if b.alert_usd is None else amount_text(b.alert_usd)}


def log_link(q: ViewQuery, month: str, b: BudgetLine) -> str | None:
    """The request log of the events an end user's or tag's budget counts: its tenant's, that month."""
    if b.scope not in ("user", "tag"):
        return None
    first, next_month = month_bounds(month)
    return q.link("/admin/requests", tenant=b.tenant, **{b.scope: b.name}, since=first.isoformat(),
                  until=(next_month - timedelta(days=1)).isoformat())


@router.get("/budgets")
async def budgets(request: Request, session: AdminSession = Depends(admin_session)) -> Response:
    q = ViewQuery(request, ("month",))
    month = q.month("month", today_utc().strftime("%Y-%m"))
    lines = await run_in_threadpool(budget_lines, gateway(request).db, month)
    if q.format != "html":
        return export(q.format, f"budgets-{month}", COLUMNS, (as_row(month, b) for b in lines))
    rows = [(b, meter(b.spent_usd, b.reserved_usd, b.budget_usd, b.alert_at), log_link(q, month, b)) for b in lines]
    return admin_page(request, session, "budgets.html", title="Budgets", q=q, month=month, rows=rows)
