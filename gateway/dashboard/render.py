"""Jinja2 rendering with autoescaping everywhere, number filters, and the headers every dashboard
response carries: no caching (keys are shown once), no framing, and a CSP that allows nothing
from outside (no scripts at all; styles only from this server)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.responses import HTMLResponse, Response

from billing.money import usd as money_text

TEMPLATES = Path(__file__).resolve().parent / "templates"

SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
                                "frame-ancestors 'none'; base-uri 'none'"),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def usd(value: float | Decimal | None) -> str:
    """Money with the precision it has ($0.000123, never $0.0000)."""
    return "—" if value is None else money_text(value)


def pct(value: float) -> str:
    return f"{value * 100:.1f}%"


def count(value: int | float | None) -> str:
    return "—" if value is None else f"{value:,}"


_env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=True, undefined=StrictUndefined,
                   trim_blocks=True, lstrip_blocks=True)
_env.filters.update(usd=usd, pct=pct, count=count)


def page(name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    return HTMLResponse(_env.get_template(name).render(**context), status_code=status_code,
                        headers=SECURITY_HEADERS)


def secure(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response
