"""Operator endpoints, behind the admin key (TOLLGATE_ADMIN_KEY); tenants' API keys are refused."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field, field_validator
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from billing.field_checks import text_field
from billing.models import Tenant
from gateway.auth_throttle import client_address
from gateway.errors import APIError, invalid_request
from gateway.key_db_outage import checked_admin_key
from gateway.service import Gateway

admin_router = APIRouter(prefix="/admin")


async def require_admin(request: Request) -> Gateway:
    """Admits TOLLGATE_ADMIN_KEY or a key made by `platform admin create-key`; tenants' API keys get 403.
    Other keys get a 503 (uncounted by the auth throttle) while the key database is unreachable."""
    gw: Gateway = request.app.state.gateway
    header = request.headers.get("authorization") or ""
    given = header[len("Bearer "):] if header.startswith("Bearer ") else ""
    if not given or await run_in_threadpool(checked_admin_key, gw.db, given, request.app.state.admin_key) is None:
        refusal = APIError(403 if given else 401, "This endpoint needs the admin key.", "invalid_request_error",
                           "admin_required")
        raise request.app.state.auth_throttle.throttled(refusal, client_address(request))
    return gw


class CacheFlush(BaseModel):
    tenant: str = Field(min_length=1, max_length=200)

    @field_validator("tenant")
    @classmethod
    def _comparable(cls, v: str) -> str:
        text_field("tenant", v)
        return v


@admin_router.post("/cache/flush")
async def flush_tenant_cache(body: CacheFlush, gw: Gateway = Depends(require_admin)) -> dict[str, Any]:
    """Removes every semantic-cache entry of one tenant (by name)."""
    cache = gw.reuse.cache
    if cache is None:
        raise invalid_request("the semantic cache is not enabled on this gateway")

    def tenant_uid() -> str | None:
        with Session(gw.db) as s:
            return s.scalar(select(Tenant.uid).where(Tenant.name == body.tenant))

    found = await run_in_threadpool(tenant_uid)
    if found is None:
        raise invalid_request(f"tenant: no tenant named {body.tenant!r}", "tenant", "tenant_not_found")
    removed = await run_in_threadpool(cache.flush, found)
    return {"tenant": body.tenant, "flushed": removed}
