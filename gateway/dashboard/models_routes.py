"""Models: state and replicas from the gateway's backends; scaling through the optional
`app.state.scale_model(name, min_replicas, max_replicas)` hook that the Ray platform provides."""

from __future__ import annotations

import inspect
import logging

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from billing.money import amount_text
from gateway.dashboard.exports import export
from gateway.dashboard.outage_page import OutagePageRoute
from gateway.dashboard.guard import AdminForm, admin_form, admin_page, admin_session, gateway, redirect
from gateway.dashboard.models_view import ModelRow, model_rows
from gateway.dashboard.query_params import ViewQuery
from gateway.dashboard.session import AdminSession

log = logging.getLogger("tollgate.dashboard")
router = APIRouter(route_class=OutagePageRoute)
NO_SCALING = ("Scaling needs the Ray platform (`platform up`): this gateway runs its models in-process, "
              "one engine each.")
NOTICES = {"scaled": "Scaling requested."}
COLUMNS = ["model", "state", "reason", "live_replicas", "max_model_len", "min_replicas", "max_replicas",
           "input_per_1m_usd", "cached_input_per_1m_usd", "output_per_1m_usd", "gpu_hour_usd"]


def as_row(m: ModelRow) -> dict[str, Any]:
    """Prices as billed: a model whose spec sets no cached-input price bills cached input at its input price."""
    cached = m.input_per_1m if m.cached_input_per_1m is None else m.cached_input_per_1m
    return {"model": m.name, "state": m.state, "reason": m.reason, "live_replicas": m.live_replicas,
            "max_model_len": m.max_model_len, "min_replicas": m.min_replicas, "max_replicas": m.max_replicas,
            "input_per_1m_usd": amount_text(m.input_per_1m), "cached_input_per_1m_usd": amount_text(cached),
            "output_per_1m_usd": amount_text(m.output_per_1m), "gpu_hour_usd": amount_text(m.gpu_hour)}


async def _models_page(request: Request, session: AdminSession, status_code: int = 200,
                       error: str | None = None, notice: str | None = None) -> Response:
    gw = gateway(request)
    rows = await run_in_threadpool(model_rows, gw.db, gw.backends)
    can_scale = callable(getattr(request.app.state, "scale_model", None))
    return admin_page(request, session, "models.html", status_code, title="Models", models=rows,
                      can_scale=can_scale, no_scaling=NO_SCALING, error=error, notice=notice)


@router.get("/models")
async def models(request: Request, session: AdminSession = Depends(admin_session)) -> Response:
    q = ViewQuery(request, ("done",))
    done = q.choice("done", tuple(NOTICES), "")
    if q.format != "html":
        if done:
            q.refuse("done", "is the page's notice; an export has every model, so leave it out")
        gw = gateway(request)
        rows = await run_in_threadpool(model_rows, gw.db, gw.backends)
        return export(q.format, "models", COLUMNS, map(as_row, rows))
    return await _models_page(request, session, notice=NOTICES.get(done))


@router.post("/models/{name:path}/scale")
async def scale(request: Request, name: str, form: AdminForm = Depends(admin_form)) -> Response:
    session, fields = form.session, form.fields
    hook = getattr(request.app.state, "scale_model", None)
    if not callable(hook):
        return await _models_page(request, session, 409, error=NO_SCALING)
    if name not in gateway(request).backends:
        return await _models_page(request, session, 404, error=f"no model named {name!r}")
    try:
        low, high = int(fields.get("min_replicas", "")), int(fields.get("max_replicas", ""))
    except ValueError:
        return await _models_page(request, session, 400, error="min and max replicas must be whole numbers")
    if low < 0 or high < max(low, 1):
        return await _models_page(request, session, 400, error="need 0 ≤ min ≤ max and max ≥ 1")
    try:
        if inspect.iscoroutinefunction(hook):
            await hook(name, low, high)
        else:
            await run_in_threadpool(hook, name, low, high)
    except Exception as e:  # the platform's own message (a bad bound, Ray unavailable) is the useful one
        log.warning("dashboard: scaling %s failed: %s", name, type(e).__name__)
        return await _models_page(request, session, 502, error=f"scaling failed: {e}")
    log.info("dashboard: %s scaled to %d..%d", name, low, high)
    return redirect(request, "/admin/models?done=scaled")
