"""Invoices: a tenant's invoice for a month (billing/invoice.py, as `platform invoice` builds it), each
line linked to the request log filtered to the events behind it (the tenant's requests of that model in
that month: run by the model for token and GPU-time lines, answered from the cache for cache-hit lines)."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from billing.accounts import list_tenants
from billing.invoice import Invoice, InvoiceLine, build_invoice
from billing.invoice_render import render
from gateway.dashboard.exports import MEDIA_TYPES
from gateway.dashboard.guard import admin_page, admin_session, gateway
from gateway.dashboard.outage_page import OutagePageRoute
from gateway.dashboard.query_params import ViewQuery
from gateway.dashboard.render import secure
from gateway.dashboard.session import AdminSession
from gateway.dashboard.stats import today_utc

router = APIRouter(route_class=OutagePageRoute)
KIND_LABELS = {"input": "input tokens", "cached_input": "cached input tokens", "output": "output tokens",
               "cache_hit": "cache hits", "gpu_time": "GPU time"}


def events_link(q: ViewQuery, invoice: Invoice, line: InvoiceLine) -> str:
    last_day = invoice.period_end - timedelta(days=1)
    return q.link("/admin/requests", tenant=invoice.tenant, model=line.model,
                  cache="hit" if line.kind == "cache_hit" else "miss",
                  since=invoice.period_start.isoformat(), until=last_day.isoformat())


def gpu_link(q: ViewQuery, invoice: Invoice, line: InvoiceLine) -> str | None:
    if line.kind != "gpu_time":
        return None
    last_day = invoice.period_end - timedelta(days=1)
    return q.link("/admin/gpu", tenant=invoice.tenant, model=line.model, since=invoice.period_start.isoformat(),
                  until=last_day.isoformat())


@router.get("/invoices")
async def invoices(request: Request, session: AdminSession = Depends(admin_session)) -> Response:
    q = ViewQuery(request, ("tenant", "month"))
    month = q.month("month", today_utc().strftime("%Y-%m"))
    db = gateway(request).db
    tenants = [t.name for t in await run_in_threadpool(list_tenants, db)]
    tenant = q.text("tenant") or (min(tenants) if tenants else None)
    invoice = None
    if tenant is not None:
        try:
            invoice = await run_in_threadpool(build_invoice, db, tenant, month)
        except ValueError as e:  # an unknown tenant, or a name no column can hold
            q.refuse("tenant", str(e).split(": ", 1)[-1])
    if q.format != "html":
        if invoice is None:
            q.refuse("tenant", "there are no tenants yet")
        response = Response(render(invoice, q.format), media_type=MEDIA_TYPES[q.format])
        response.headers["Content-Disposition"] = f'attachment; filename="invoice-{invoice.number}.{q.format}"'
        return secure(response)
    lines = [] if invoice is None else [(line, KIND_LABELS[line.kind], events_link(q, invoice, line),
                                         gpu_link(q, invoice, line)) for line in invoice.lines]
    return admin_page(request, session, "invoices.html", title="Invoices", q=q, tenants=tenants, tenant=tenant,
                      month=month, invoice=invoice, lines=lines)
