"""Usage: spend per key, end user, tag, tenant or model, with requests and tokens beside the dollars; each
group links to the request log filtered to its events. Keys, end users and tags belong to a tenant: their rows
name it, and their links filter by it too."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from billing.breakdowns import BREAKDOWNS, PER_TENANT, BreakdownRow, breakdown
from billing.money import amount_text
from gateway.dashboard.charts import colors, hbar_chart
from gateway.dashboard.exports import export
from gateway.dashboard.filter_choices import filter_choices
from gateway.dashboard.guard import admin_page, admin_session, gateway
from gateway.dashboard.outage_page import OutagePageRoute
from gateway.dashboard.query_params import FILTERS, ViewQuery
from gateway.dashboard.render import usd
from gateway.dashboard.session import AdminSession

router = APIRouter(route_class=OutagePageRoute)
CHART_ROWS = 15
PAGE_ROWS = 200
COLUMNS = ["group", "key_id", "key_name", "tenant", "requests", "prompt_tokens", "completion_tokens",
           "cached_tokens", "cache_hits", "cost_usd"]
NONE_LABEL = {"key": "(no key)", "user": "(no end user)", "tag": "(no tag)", "tenant": "(no tenant)", "model": "—"}


def as_row(row: BreakdownRow) -> dict[str, Any]:
    return {"group": row.group, "key_id": row.key_id, "key_name": row.key_name, "tenant": row.tenant,
            "requests": row.requests, "prompt_tokens": row.prompt_tokens, "completion_tokens": row.completion_tokens,
            "cached_tokens": row.cached_tokens, "cache_hits": row.cache_hits, "cost_usd": amount_text(row.cost_usd)}


def label(by: str, row: BreakdownRow) -> str:
    if row.group is None:
        return NONE_LABEL[by]
    return f"{row.group}… {row.key_name or ''}".rstrip() if by == "key" else row.group


def chart_label(by: str, row: BreakdownRow) -> str:
    return f"{label(by, row)} ({row.tenant})" if by in PER_TENANT and row.tenant is not None else label(by, row)


def log_link(q: ViewQuery, by: str, row: BreakdownRow) -> str | None:
    """The request log of the group's events; none for the events without an end user or tag (the log cannot
    filter on "none"), nor for an end user or tag of events without a tenant (it would show other tenants')."""
    if row.group is None:
        return None
    if by == "key":
        return q.filtered_link("/admin/requests", key=row.key_id)
    if by in ("user", "tag"):
        return None if row.tenant is None else q.filtered_link("/admin/requests", tenant=row.tenant, **{by: row.group})
    return q.filtered_link("/admin/requests", **{by: row.group})


@router.get("/usage")
async def usage(request: Request, session: AdminSession = Depends(admin_session)) -> Response:
    q = ViewQuery(request, ("by", *FILTERS))
    by = q.choice("by", BREAKDOWNS, "key")
    events = q.events()
    db = gateway(request).db
    if q.format != "html":
        rows = await run_in_threadpool(breakdown, db, by, events)
        return export(q.format, f"usage-by-{by}", COLUMNS, map(as_row, rows))
    rows = await run_in_threadpool(breakdown, db, by, events, PAGE_ROWS + 1)
    more = len(rows) > PAGE_ROWS
    rows = rows[:PAGE_ROWS]
    top = rows[:CHART_ROWS]
    chart = hbar_chart([chart_label(by, r) for r in top], [("spend", [r.cost_usd for r in top])], colors(1), usd,
                       [usd(r.cost_usd) for r in top]) if top else None
    choices = await run_in_threadpool(filter_choices, db, q.params)
    return admin_page(request, session, "usage.html", title="Usage", q=q, by=by, breakdowns=BREAKDOWNS,
                      per_tenant=by in PER_TENANT, rows=[(r, label(by, r), log_link(q, by, r)) for r in rows],
                      more=more,
                      page_rows=PAGE_ROWS, chart=chart, choices=choices, filter_fields=FILTERS)
