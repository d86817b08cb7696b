"""Sign in with an admin key (never a tenant's API key), sign out, and the stylesheet."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import FileResponse, Response

from gateway.dashboard.outage_page import OutagePageRoute
from gateway.dashboard.guard import (AdminForm, admin_form, checked_form, codec, gateway, read_session, redirect,
                                     set_cookie)
from gateway.auth_throttle import client_address
from gateway.dashboard.render import TEMPLATES, page, secure
from gateway.errors import APIError
from gateway.key_db_outage import checked_admin_key
from gateway.dashboard.session import COOKIE

log = logging.getLogger("tollgate.dashboard")
router = APIRouter(route_class=OutagePageRoute)


def _login_page(request: Request, status_code: int = 200, error: str | None = None) -> Response:
    session = read_session(request)
    if session is None or session.signed_in:
        session = codec(request).new(None)
    response = page("login.html", status_code, title="Sign in", csrf=codec(request).csrf_token(session), error=error)
    set_cookie(request, response, session)
    return response


@router.get("/login")
async def login_form(request: Request) -> Response:
    session = read_session(request)
    if session is not None and session.signed_in:
        return redirect(request, "/admin")
    return _login_page(request)


@router.post("/login")
async def login(request: Request) -> Response:
    session = read_session(request)
    if session is None:
        return _login_page(request, 403, "Your sign-in form expired. Please try again.")
    fields = await checked_form(request, session)
    key = fields.get("key", "").strip()
    try:
        key_id = await run_in_threadpool(checked_admin_key, gateway(request).db, key, request.app.state.admin_key)
    except APIError as unavailable:  # the key database is unreachable: neither refused nor counted
        response = _login_page(request, unavailable.status, "The database is unavailable, so this key cannot be "
                               "checked right now. Please try again in a few seconds.")
        response.headers.update(unavailable.headers)
        return response
    if key_id is None:
        log.info("dashboard sign-in refused")
        refusal = APIError(401, "That is not an admin key. Tenants' API keys cannot sign in here.", "invalid_request_error")
        refusal = request.app.state.auth_throttle.throttled(refusal, client_address(request))
        response = _login_page(request, refusal.status, refusal.message)
        response.headers.update(refusal.headers)
        return response
    codec(request).end(session)
    log.info("dashboard sign-in with admin key id %d", key_id)
    response = redirect(request, "/admin")
    set_cookie(request, response, codec(request).new(key_id))  # a fresh session id after sign-in
    return response


@router.post("/logout")
async def logout(request: Request, form: AdminForm = Depends(admin_form)) -> Response:
    session = form.session
    codec(request).end(session)
    response = redirect(request, "/admin/login")
    response.delete_cookie(COOKIE, path="/admin", httponly=True, samesite="strict")
    return response


@router.get("/static/dashboard.css")
async def stylesheet() -> Response:
    response = secure(FileResponse(TEMPLATES / "dashboard.css", media_type="text/css"))
    response.headers["Cache-Control"] = "max-age=3600"
    return response
