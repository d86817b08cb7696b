"""GPU: each tenant's replica seconds, busy (its share of each engine step, by tokens) and idle (its share
of the time the replicas waited between its requests), as billing/gpu_shares.py splits them."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from billing.gpu_usage import TenantGpuTime, gpu_seconds_per_tenant
from billing.money import amount_text
from gateway.dashboard.charts import hbar_chart, seconds_tick
from gateway.dashboard.exports import export
from gateway.dashboard.filter_choices import filter_choices
from gateway.dashboard.guard import admin_page, admin_session, gateway
from gateway.dashboard.outage_page import OutagePageRoute
from gateway.dashboard.query_params import ViewQuery
from gateway.dashboard.render import seconds
from gateway.dashboard.session import AdminSession

router = APIRouter(route_class=OutagePageRoute)
FIELDS = ("tenant", "model", "since", "until")
COLUMNS = ["tenant", "busy_s", "idle_s", "total_s", "share", "gpu_cost_usd"]
BUSY, IDLE = "#2f6fde", "#a9c4f5"


def as_row(r: TenantGpuTime, all_s: Decimal) -> dict[str, Any]:
    return {"tenant": r.tenant, "busy_s": r.busy_s, "idle_s": r.idle_s, "total_s": r.total_s,
            "share": round(float(r.total_s / all_s), 6) if all_s else 0.0, "gpu_cost_usd": amount_text(r.cost_usd)}


@router.get("/gpu")
async def gpu(request: Request, session: AdminSession = Depends(admin_session)) -> Response:
    q = ViewQuery(request, FIELDS)
    events = q.events()  # the same checks; GPU time is filtered by the intervals' start
    db = gateway(request).db
    rows = await run_in_threadpool(lambda: gpu_seconds_per_tenant(db, model=events.model, tenant=events.tenant,
                                                                  since=events.since, until=events.until))
    all_s = sum((r.total_s for r in rows), Decimal(0))
    everyone = TenantGpuTime("All", sum((r.busy_s for r in rows), Decimal(0)),
                             sum((r.idle_s for r in rows), Decimal(0)), sum((r.cost_usd for r in rows), Decimal(0)))
    if q.format != "html":
        return export(q.format, "gpu-seconds", COLUMNS, (as_row(r, all_s) for r in rows))
    chart = hbar_chart([r.tenant for r in rows], [("busy", [r.busy_s for r in rows]), ("idle", [r.idle_s for r in rows])],
                       [BUSY, IDLE], seconds, [seconds(r.total_s) for r in rows], seconds_tick) if rows else None
    choices = await run_in_threadpool(filter_choices, db, q.params)
    return admin_page(request, session, "gpu.html", title="GPU time", q=q, rows=[(r, as_row(r, all_s)) for r in rows],
                      everyone=everyone, chart=chart, choices=choices, filter_fields=FIELDS)
