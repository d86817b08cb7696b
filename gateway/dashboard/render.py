"""Jinja2 rendering with autoescaping everywhere, number filters, and the headers every dashboard
response carries: no caching (keys are shown once), no framing, and a CSP that allows nothing
from outside (no scripts at all; styles only from this server)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.responses import HTMLResponse, Response

from billing.budget_use import alert_threshold
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


def cents(value: int) -> str:
    return usd(Decimal(value).scaleb(-2))


def pct(value: float) -> str:
    return f"{value * 100:.1f}%"


def count(value: int | float | None) -> str:
    return "—" if value is None else f"{value:,}"


def seconds(value: float | Decimal | int) -> str:
    """Replica time: 3,600.25 s, 0.000125 s (to the microsecond below one second, the millisecond above)."""
    text = f"{value:,.{6 if abs(value) < 1 else 3}f}".rstrip("0").rstrip(".")
    return f"{text} s"


_env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=True, undefined=StrictUndefined,
                   trim_blocks=True, lstrip_blocks=True)
_env.filters.update(usd=usd, cents=cents, pct=pct, count=count, seconds=seconds, alert_usd=alert_threshold)


def page(name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    return HTMLResponse(_env.get_template(name).render(**context), status_code=status_code,
                        headers=SECURITY_HEADERS)


def secure(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response
