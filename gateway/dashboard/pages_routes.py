"""Overview and Tenants."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from billing.money import ZERO
from gateway.dashboard import stats
from gateway.dashboard.outage_page import OutagePageRoute
from gateway.dashboard.charts import bar_chart
from gateway.dashboard.guard import admin_page, admin_session, gateway, redirect
from gateway.dashboard.session import AdminSession
from gateway.dashboard.models_view import model_rows

router = APIRouter(route_class=OutagePageRoute)
CHART_DAYS = (7, 30, 90)


@router.get("")
async def overview(request: Request, session: AdminSession = Depends(admin_session)) -> Response:
    gw = gateway(request)
    summary = await run_in_threadpool(stats.overview, gw.db)
    models = await run_in_threadpool(model_rows, gw.db, gw.backends)
    return admin_page(request, session, "overview.html", title="Overview", o=summary, models=models)


@router.get("/")
async def overview_slash(request: Request) -> Response:
    return redirect(request, "/admin")


@router.get("/tenants")
async def tenants(request: Request, tenant: str | None = None, days: int = 30, session: AdminSession = Depends(admin_session)) -> Response:
    days = days if days in CHART_DAYS else 30
    db = gateway(request).db
    rows = await run_in_threadpool(stats.tenant_rows, db)
    names = [r.name for r in rows]
    chosen = tenant if tenant in names else (names[0] if names else None)
    chart = daily = by_model = None
    if chosen is not None:
        daily = await run_in_threadpool(stats.tenant_daily_cost, db, chosen, days)
        chart = bar_chart([d.day.strftime("%b %d") for d in daily], [float(d.cost_usd) for d in daily])
        first = stats.today_utc() - timedelta(days=days - 1)
        by_model = await run_in_threadpool(stats.tenant_cost_by_model, db, chosen, first)
    total = sum((d.cost_usd for d in daily), ZERO) if daily else ZERO
    return admin_page(request, session, "tenants.html", title="Tenants", rows=rows, chosen=chosen, days=days,
                      day_choices=CHART_DAYS, chart=chart, daily=daily, by_model=by_model, total=total)
