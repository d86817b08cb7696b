"""Requests: the request log (usage events) filtered by tenant, key, model, status, end user, tag, cache
and time, newest first, a page at a time, with the totals of everything the filters pass. The export has
every passing event, read in batches."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from billing.money import amount_text
from billing.request_log import LoggedRequest, iter_log, log_page, log_totals
from gateway.dashboard.exports import export
from gateway.dashboard.filter_choices import filter_choices
from gateway.dashboard.guard import admin_page, admin_session, gateway
from gateway.dashboard.outage_page import OutagePageRoute
from gateway.dashboard.query_params import FILTERS, ViewQuery
from gateway.dashboard.session import AdminSession

router = APIRouter(route_class=OutagePageRoute)
PER_PAGE = 50
MAX_PAGE = 1_000_000
COLUMNS = ["created_at", "request_id", "tenant", "key_id", "key_prefix", "end_user", "tags", "model", "endpoint",
           "route", "status", "prompt_tokens", "completion_tokens", "cached_tokens", "cache_hit", "latency_s",
           "ttft_s", "cost_usd", "error"]


def as_row(r: LoggedRequest) -> dict[str, Any]:
    return {c: getattr(r, c) for c in COLUMNS} | {"cost_usd": amount_text(r.cost_usd)}


@router.get("/requests")
async def requests(request: Request, session: AdminSession = Depends(admin_session)) -> Response:
    q = ViewQuery(request, (*FILTERS, "page"))
    events = q.events()
    page = q.whole("page", 1, 1, MAX_PAGE)
    db = gateway(request).db
    if q.format != "html":
        if "page" in q.params:
            q.refuse("page", "an export has every request that passes the filters; leave page out")
        return export(q.format, "requests", COLUMNS, map(as_row, iter_log(db, events)))
    totals = await run_in_threadpool(log_totals, db, events)
    rows = await run_in_threadpool(lambda: log_page(db, events, offset=(page - 1) * PER_PAGE, limit=PER_PAGE))
    pages = max(1, -(-totals.requests // PER_PAGE))
    choices = await run_in_threadpool(filter_choices, db, q.params)
    return admin_page(request, session, "requests.html", title="Requests", q=q, rows=rows, totals=totals,
                      page=page, pages=pages, choices=choices, filter_fields=FILTERS)
