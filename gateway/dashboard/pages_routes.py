"""Overview (spend across all tenants per day, stacked by tenant or by model) and Tenants."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from billing.money import ZERO, amount_text
from billing.spend_series import GROUPINGS, Spend, SpendSeries, spend_by_day
from gateway.dashboard import stats
from gateway.dashboard.outage_page import OutagePageRoute
from gateway.dashboard.charts import StackedChart, bar_chart, colors, stacked_chart
from gateway.dashboard.exports import export
from gateway.dashboard.query_params import ViewQuery
from gateway.dashboard.render import usd
from gateway.dashboard.guard import admin_page, admin_session, gateway, redirect
from gateway.dashboard.session import AdminSession
from gateway.dashboard.models_view import model_rows

router = APIRouter(route_class=OutagePageRoute)
CHART_DAYS = (7, 30, 90)
TOP_GROUPS = 8  # the overview's chart: the tenants (or models) that spent most, the rest as one
OTHERS = {"tenant": "other tenants", "model": "other models"}
SPEND_COLUMNS = ["requests", "prompt_tokens", "completion_tokens", "cost_usd"]
TENANT_COLUMNS = ["tenant", "budget_usd", "alert_at", "active_keys", "requests_month", "spend_month_usd",
                  "spend_total_usd"]


@router.get("")
async def overview(request: Request, session: AdminSession = Depends(admin_session)) -> Response:
    q = ViewQuery(request, ("by", "days"))
    by = q.choice("by", GROUPINGS, "tenant")
    days = int(q.choice("days", tuple(str(d) for d in CHART_DAYS), "30"))
    last = stats.today_utc()
    first = last - timedelta(days=days - 1)
    gw = gateway(request)
    if q.format != "html":
        series = await run_in_threadpool(spend_by_day, gw.db, by, first, last)
        return export(q.format, f"spend-by-{by}", ["day", by, *SPEND_COLUMNS], spend_rows(series))
    series = await run_in_threadpool(spend_by_day, gw.db, by, first, last, TOP_GROUPS)
    summary = await run_in_threadpool(stats.overview, gw.db)
    models = await run_in_threadpool(model_rows, gw.db, gw.backends)
    chart, groups = spend_chart(q, series)
    return admin_page(request, session, "overview.html", title="Overview", o=summary, models=models, q=q, by=by,
                      days=days, day_choices=CHART_DAYS, chart=chart, groups=groups, total=series.grand_total)


def spend_chart(q: ViewQuery, series: SpendSeries) -> tuple[StackedChart, list[tuple[str, Spend, str | None, str]]]:
    """The stacked chart, and per group: its name, totals, the request log of its events, its color."""
    names = [OTHERS[series.by] if g is None else g for g in series.groups]
    colors_ = colors(len(names), others_last=None in series.groups)
    chart = stacked_chart([d.strftime("%b %d") for d in series.days],
                          [(name, [series.cell(d, g).cost_usd for d in series.days])
                           for name, g in zip(names, series.groups)], colors_, usd)
    since, until = series.days[0].isoformat(), series.days[-1].isoformat()
    links = [None if g is None else q.link("/admin/requests", **{series.by: g}, since=since, until=until)
             for g in series.groups]
    return chart, [(name, series.total(g), link, color)
                   for name, g, link, color in zip(names, series.groups, links, colors_)]


def spend_rows(series: SpendSeries) -> Iterator[dict[str, Any]]:
    for (day, group), cell in sorted(series.cells.items(), key=lambda item: (item[0][0], item[0][1] or "")):
        yield {"day": day, series.by: group, "requests": cell.requests, "prompt_tokens": cell.prompt_tokens,
               "completion_tokens": cell.completion_tokens, "cost_usd": amount_text(cell.cost_usd)}


@router.get("/")
async def overview_slash(request: Request) -> Response:
    return redirect(request, "/admin")


@router.get("/tenants")
async def tenants(request: Request, session: AdminSession = Depends(admin_session)) -> Response:
    q = ViewQuery(request, ("tenant", "days"))
    tenant = q.text("tenant")
    days = int(q.choice("days", tuple(str(d) for d in CHART_DAYS), "30"))
    db = gateway(request).db
    rows = await run_in_threadpool(stats.tenant_rows, db)
    if q.format != "html":
        for chart_param in ("tenant", "days"):
            if chart_param in q.params:
                q.refuse(chart_param, "picks the chart; the export is the table of every tenant, so leave it out")
        return export(q.format, "tenants", TENANT_COLUMNS, (tenant_row(r) for r in rows))
    names = [r.name for r in rows]
    chosen = tenant if tenant in names else (names[0] if names else None)
    chart = daily = by_model = None
    if chosen is not None:
        daily = await run_in_threadpool(stats.tenant_daily_cost, db, chosen, days)
        chart = bar_chart([d.day.strftime("%b %d") for d in daily], [float(d.cost_usd) for d in daily])
        first = stats.today_utc() - timedelta(days=days - 1)
        by_model = await run_in_threadpool(stats.tenant_cost_by_model, db, chosen, first)
    total = sum((d.cost_usd for d in daily), ZERO) if daily else ZERO
    return admin_page(request, session, "tenants.html", title="Tenants", q=q, rows=rows, chosen=chosen, days=days,
                      day_choices=CHART_DAYS, chart=chart, daily=daily, by_model=by_model, total=total)


def tenant_row(r: stats.TenantRow) -> dict[str, Any]:
    return {"tenant": r.name, "budget_usd": None if r.budget_usd is None else amount_text(r.budget_usd),
            "alert_at": r.alert_at, "active_keys": r.active_keys, "requests_month": r.requests_month,
            "spend_month_usd": amount_text(r.spend_month_usd), "spend_total_usd": amount_text(r.spend_total_usd)}
