"""The operator's dashboard under /admin: server-rendered pages, signed session cookie, CSRF tokens."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI

from gateway.dashboard import (auth_routes, budgets_routes, cache_routes, gpu_routes, invoices_routes, keys_routes,
                               models_routes, pages_routes, requests_routes, usage_routes)
from gateway.dashboard.guard import Refused, send_refusal
from gateway.dashboard.session import session_secret

dashboard_router = APIRouter(include_in_schema=False)
for _module in (auth_routes, pages_routes, usage_routes, requests_routes, budgets_routes, gpu_routes, cache_routes,
                invoices_routes, keys_routes, models_routes):
    dashboard_router.include_router(_module.router, prefix="/admin")


def install_dashboard(app: FastAPI) -> None:
    """The /admin pages, and the redirects and error pages their guards raise."""
    app.include_router(dashboard_router)
    app.add_exception_handler(Refused, send_refusal)


__all__ = ["dashboard_router", "install_dashboard", "session_secret"]
