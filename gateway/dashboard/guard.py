"""Who may see the dashboard: a signed-in session whose admin key is still valid, and POSTs whose
hidden CSRF field matches the session's token. Failures become pages or redirects (not JSON)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import RedirectResponse, Response

from billing.admin_keys import ENV_KEY_ID, admin_key_active
from gateway.dashboard.render import page, secure
from gateway.dashboard.session import COOKIE, AdminSession, SessionCodec
from gateway.errors import APIError
from gateway.service import Gateway

MAX_FORM_BYTES = 64 * 1024
LOGIN_PATH = "/admin/login"


def codec(request: Request) -> SessionCodec:
    state = request.app.state
    found: SessionCodec | None = getattr(state, "dashboard_sessions", None)
    if found is None:
        found = state.dashboard_sessions = SessionCodec(state.session_secret)
    return found


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def read_session(request: Request) -> AdminSession | None:
    return codec(request).decode(request.cookies.get(COOKIE))


def set_cookie(request: Request, response: Response, session: AdminSession) -> None:
    response.set_cookie(COOKIE, codec(request).encode(session), max_age=max(0, session.expires - _now()),
                        path="/admin", httponly=True, samesite="strict", secure=request.url.scheme == "https")


def redirect(request: Request, path: str) -> Response:
    return secure(RedirectResponse(path, status_code=303))


class Refused(Exception):
    """Raised by the dashboard's guards: the response (a redirect or an error page) to send instead."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


async def send_refusal(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, Refused)
    return exc.response


async def admin_session(request: Request) -> AdminSession:
    """Dependency: the signed-in session; otherwise a redirect to the sign-in page, or for an API client
    (one that sent an Authorization header: pages take no keys) a 403 in OpenAI's error shape."""
    session = read_session(request)
    if session is None or session.key_id is None or not await _key_valid(request, session.key_id):
        if "authorization" in request.headers:
            raise APIError(403, "Dashboard pages need a signed-in session (/admin/login), not a key.",
                           "invalid_request_error", "admin_required")
        raise Refused(redirect(request, LOGIN_PATH))
    return session


@dataclass
class AdminForm:
    session: AdminSession
    fields: dict[str, str]


async def admin_form(request: Request, session: AdminSession = Depends(admin_session)) -> AdminForm:
    """Dependency for POSTs: the signed-in session and its form's fields, CSRF token checked."""
    return AdminForm(session, await checked_form(request, session))


async def _key_valid(request: Request, key_id: int) -> bool:
    if key_id == ENV_KEY_ID:
        return bool(request.app.state.admin_key)
    return await run_in_threadpool(admin_key_active, gateway(request).db, key_id)


async def checked_form(request: Request, session: AdminSession) -> dict[str, str]:
    """The urlencoded form's fields; Refused with a 403 page when the CSRF token is missing or wrong."""
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise Refused(page("error.html", 413, title="Form too large", message="The form is too large."))
    try:
        fields = {k: v[0] for k, v in parse_qs(body.decode("utf-8"), keep_blank_values=True).items()}
    except UnicodeDecodeError:
        fields = {}
    if not codec(request).csrf_ok(session, fields.get("csrf_token")):
        raise Refused(page("error.html", 403, title="Form refused",
                           message="This form's security token is missing or out of date. "
                                   "Reload the page and try again."))
    return fields


def _now() -> int:
    return int(time.time())


def admin_page(request: Request, session: AdminSession, name: str, status_code: int = 200, **context: Any) -> Response:
    """A signed-in page: the layout needs the session's CSRF token (sign-out form) and the current path."""
    return page(name, status_code, session=session, csrf=codec(request).csrf_token(session),
                path=request.url.path, **context)
