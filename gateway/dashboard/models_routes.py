"""Models: state and replicas from the gateway's backends; scaling through the optional
`app.state.scale_model(name, min_replicas, max_replicas)` hook that the Ray platform provides."""

from __future__ import annotations

import inspect
import logging

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from gateway.dashboard.outage_page import OutagePageRoute
from gateway.dashboard.guard import AdminForm, admin_form, admin_page, admin_session, gateway, redirect
from gateway.dashboard.models_view import model_rows
from gateway.dashboard.session import AdminSession

log = logging.getLogger("tollgate.dashboard")
router = APIRouter(route_class=OutagePageRoute)
NO_SCALING = ("Scaling needs the Ray platform (`platform up`): this gateway runs its models in-process, "
              "one engine each.")


async def _models_page(request: Request, session: AdminSession, status_code: int = 200,
                       error: str | None = None) -> Response:
    gw = gateway(request)
    rows = await run_in_threadpool(model_rows, gw.db, gw.backends)
    can_scale = callable(getattr(request.app.state, "scale_model", None))
    notice = "Scaling requested." if request.query_params.get("done") == "scaled" else None
    return admin_page(request, session, "models.html", status_code, title="Models", models=rows,
                      can_scale=can_scale, no_scaling=NO_SCALING, error=error, notice=notice)


@router.get("/models")
async def models(request: Request, session: AdminSession = Depends(admin_session)) -> Response:
    return await _models_page(request, session)


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
