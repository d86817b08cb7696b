"""Cache: what the semantic cache (answers billed at $0) and the KV prefix cache (prompt tokens at the
cached-input price) saved each tenant, per model, at the models' list prices; and the semantic cache per tenant: its
bound δ, hit rate, savings, the threshold it serves from and the answers its clients flagged (CSV / JSON under
/admin/cache/bounds and /admin/cache/flags)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import RedirectResponse, Response

from billing.cache_savings import NOTHING, TenantSavings, savings_by_tenant_model
from billing.money import amount_text
from billing.spend_series import NO_TENANT
from gateway.dashboard.cache_bounds import (BOUND_COLUMNS, FLAG_COLUMNS, bound_row, flag_row, flag_rows,
                                            tenant_bounds)
from gateway.dashboard.charts import hbar_chart
from gateway.dashboard.exports import export
from gateway.dashboard.filter_choices import filter_choices
from gateway.dashboard.guard import admin_page, admin_session, gateway
from gateway.dashboard.outage_page import OutagePageRoute
from gateway.dashboard.query_params import ViewQuery
from gateway.dashboard.render import usd
from gateway.dashboard.session import AdminSession

router = APIRouter(route_class=OutagePageRoute)
FIELDS = ("tenant", "model", "since", "until")
COLUMNS = ["tenant", "model", "requests", "cache_hits", "hit_rate", "hit_tokens", "semantic_savings_usd",
           "prefix_cached_tokens", "prefix_savings_usd", "savings_usd"]
CHART_ROWS = 15
SEMANTIC, PREFIX = "#3a9b5b", "#9bd3ad"
FLAGS_SHOWN = 20  # on the page; the exports carry up to FLAGS_EXPORTED
FLAGS_EXPORTED = 10_000


def as_row(r: TenantSavings) -> dict[str, Any]:
    s = r.savings
    return {"tenant": r.tenant, "model": r.model, "requests": s.requests, "cache_hits": s.cache_hits,
            "hit_rate": round(s.hit_rate, 6), "hit_tokens": s.hit_tokens,
            "semantic_savings_usd": amount_text(s.semantic_usd), "prefix_cached_tokens": s.prefix_tokens,
            "prefix_savings_usd": amount_text(s.prefix_usd), "savings_usd": amount_text(s.total_usd)}


@router.get("/cache")
async def cache(request: Request, session: AdminSession = Depends(admin_session)) -> Response:
    q = ViewQuery(request, FIELDS)
    events = q.events()
    db = gateway(request).db
    rows = await run_in_threadpool(savings_by_tenant_model, db, events)
    if q.format != "html":
        return export(q.format, "cache-savings", COLUMNS, map(as_row, rows))
    total = sum((r.savings for r in rows), NOTHING)
    top = [r for r in rows if r.savings.total_usd > 0][:CHART_ROWS]
    names = [f"{r.tenant or NO_TENANT} · {r.model}" for r in top]
    chart = hbar_chart(names, [("semantic cache", [r.savings.semantic_usd for r in top]),
                               ("KV prefix cache", [r.savings.prefix_usd for r in top])],
                       [SEMANTIC, PREFIX], usd, [usd(r.savings.total_usd) for r in top]) if top else None
    choices = await run_in_threadpool(filter_choices, db, q.params)
    bounds, flags = await _semantic(request, rows, q.text("tenant"), FLAGS_SHOWN)
    return admin_page(request, session, "cache.html", title="Cache savings", q=q, rows=rows, total=total,
                      chart=chart, choices=choices, filter_fields=FIELDS, no_tenant=NO_TENANT, bounds=bounds,
                      flags=flags)


async def _semantic(request: Request, savings: list, tenant: str | None, flags_limit: int) -> tuple[list, list]:
    """(per-tenant bound rows, flagged answers) for the tenant filter, or every tenant."""
    gw = gateway(request)
    report = await gw.reuse.tenant_report()
    bounds = await run_in_threadpool(tenant_bounds, gw.db, savings, report, tenant)
    uid = None if tenant is None else next((b.uid for b in bounds), "")
    flags = await gw.reuse.flagged(uid, flags_limit) if uid != "" else []
    return bounds, flag_rows(flags, {b.uid: b.tenant for b in bounds})


@router.get("/cache/bounds")
async def cache_bounds(request: Request, session: AdminSession = Depends(admin_session)) -> Response:
    q = ViewQuery(request, FIELDS)
    if q.format == "html":
        return RedirectResponse(q.filtered_link("/admin/cache") + "#cache-bounds", status_code=303)
    savings = await run_in_threadpool(savings_by_tenant_model, gateway(request).db, q.events())
    bounds, _ = await _semantic(request, savings, q.text("tenant"), 0)
    return export(q.format, "cache-bounds", BOUND_COLUMNS, map(bound_row, bounds))


@router.get("/cache/flags")
async def cache_flags(request: Request, session: AdminSession = Depends(admin_session)) -> Response:
    q = ViewQuery(request, ("tenant",))
    if q.format == "html":
        return RedirectResponse(q.filtered_link("/admin/cache") + "#cache-flags", status_code=303)
    _, flags = await _semantic(request, [], q.text("tenant"), FLAGS_EXPORTED)
    return export(q.format, "cache-flags", FLAG_COLUMNS, map(flag_row, flags))
