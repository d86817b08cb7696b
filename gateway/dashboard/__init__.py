"""The operator's dashboard under /admin: server-rendered pages, signed session cookie, CSRF tokens."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.dashboard import auth_routes, keys_routes, models_routes, pages_routes
from gateway.dashboard.session import session_secret

dashboard_router = APIRouter(include_in_schema=False)
for _module in (auth_routes, pages_routes, keys_routes, models_routes):
    dashboard_router.include_router(_module.router, prefix="/admin")

__all__ = ["dashboard_router", "session_secret"]
