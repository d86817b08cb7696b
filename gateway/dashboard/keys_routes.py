"""Keys: list tenants' API keys (as CSV or JSON too: never a secret, only display prefixes), create one (its
secret is shown on this one response only), revoke one, change its limits."""

from __future__ import annotations

import logging
import math

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from billing.accounts import AccountError, CreatedKey, KeyInfo, create_key, list_keys, list_tenants, revoke_key
from billing.key_limits import set_key_limits
from billing.money import amount_text
from gateway.dashboard.exports import export
from gateway.dashboard.outage_page import OutagePageRoute
from gateway.dashboard.guard import AdminForm, admin_form, admin_page, admin_session, gateway, redirect
from gateway.dashboard.query_params import ViewQuery
from gateway.dashboard.session import AdminSession

log = logging.getLogger("tollgate.dashboard")
router = APIRouter(route_class=OutagePageRoute)
NOTICES = {"revoked": "Key revoked.", "limits": "Limits saved."}
COLUMNS = ["key_id", "key_prefix", "tenant", "name", "project", "status", "rpm", "tpm", "budget_usd", "alert_at",
           "created_at"]


def as_row(k: KeyInfo) -> dict[str, Any]:
    return {"key_id": k.id, "key_prefix": k.prefix, "tenant": k.tenant, "name": k.name, "project": k.project,
            "status": "revoked" if k.revoked else "active", "rpm": k.rpm, "tpm": k.tpm,
            "budget_usd": None if k.budget_usd is None else amount_text(k.budget_usd), "alert_at": k.alert_at,
            "created_at": k.created_at}


class FormError(ValueError):
    pass


def _optional_number(fields: dict[str, str], name: str, kind: type[int] | type[float]) -> int | float | None:
    text = fields.get(name, "").strip()
    if not text:
        return None
    try:
        value = kind(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise FormError(f"{name}: expected a number or nothing, got {text[:40]!r}")
    return value


def _int(value: int | float | None) -> int | None:
    return None if value is None else int(value)


async def _keys_page(request: Request, session: AdminSession, status_code: int = 200, *,
                     created: CreatedKey | None = None, error: str | None = None,
                     notice: str | None = None) -> Response:
    db = gateway(request).db
    keys = await run_in_threadpool(list_keys, db)
    tenants = await run_in_threadpool(list_tenants, db)
    return admin_page(request, session, "keys.html", status_code, title="Keys", keys=keys,
                      tenants=[t.name for t in tenants], created=created, error=error, notice=notice)


@router.get("/keys")
async def keys(request: Request, session: AdminSession = Depends(admin_session)) -> Response:
    q = ViewQuery(request, ("done",))
    done = q.choice("done", tuple(NOTICES), "")
    if q.format != "html":
        if done:
            q.refuse("done", "is the page's notice; an export has every key, so leave it out")
        keys = await run_in_threadpool(list_keys, gateway(request).db)
        return export(q.format, "keys", COLUMNS, map(as_row, keys))
    return await _keys_page(request, session, notice=NOTICES.get(done))


@router.post("/keys")
async def create(request: Request, form: AdminForm = Depends(admin_form)) -> Response:
    session, fields = form.session, form.fields
    try:
        created = await run_in_threadpool(
            lambda: create_key(gateway(request).db, fields.get("tenant", ""),
                               rpm=_int(_optional_number(fields, "rpm", int)),
                               tpm=_int(_optional_number(fields, "tpm", int)),
                               budget_usd=_optional_number(fields, "budget_usd", float),
                               name=fields.get("name", "").strip() or None,
                               project=fields.get("project", "").strip() or None))
    except (AccountError, FormError) as e:
        return await _keys_page(request, session, 400, error=str(e))
    log.info("dashboard: key id %d created for a tenant", created.id)
    return await _keys_page(request, session, created=created)


@router.post("/keys/{key_id}/revoke")
async def revoke(request: Request, key_id: int, form: AdminForm = Depends(admin_form)) -> Response:
    session = form.session
    try:
        await run_in_threadpool(revoke_key, gateway(request).db, str(key_id))
    except AccountError as e:
        return await _keys_page(request, session, 404, error=str(e))
    log.info("dashboard: key id %d revoked", key_id)
    return redirect(request, "/admin/keys?done=revoked")


@router.post("/keys/{key_id}/limits")
async def limits(request: Request, key_id: int, form: AdminForm = Depends(admin_form)) -> Response:
    session, fields = form.session, form.fields
    try:
        rpm, tpm = _optional_number(fields, "rpm", int), _optional_number(fields, "tpm", int)
        budget = _optional_number(fields, "budget_usd", float)
        await run_in_threadpool(lambda: set_key_limits(gateway(request).db, key_id, rpm=_int(rpm), tpm=_int(tpm),
                                                       budget_usd=budget))
    except (AccountError, FormError) as e:
        return await _keys_page(request, session, 400, error=str(e))
    return redirect(request, "/admin/keys?done=limits")
