"""Monthly invoices: line items per model and token kind, in integer cents.

Rounding rule (ROUNDING_RULE): each line's exact Decimal amount (tokens × price per 1M / 1,000,000) is
rounded half-up to whole cents; the total is the sum of the rounded lines, so the lines always add up
to the total. Prices are the models' current list prices (ModelDeployment); requests answered from the
semantic cache are their own line at the cache price (0 by default), with what they saved at list price.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date
from decimal import ROUND_HALF_UP, Decimal

from sqlalchemy import Engine, func, select

from billing.field_checks import text_field
from billing.models import ModelDeployment, Tenant, UsageEvent
from billing.report_query import Db, connect_engine, within

ROUNDING_RULE = "each line's exact amount is rounded half-up to cents; the total is the sum of the rounded lines"
CURRENCY = "USD"
KINDS = ("input", "output", "cache_hit")
_MONTH = re.compile(r"(\d{4})-(0[1-9]|1[0-2])")
_MILLION = Decimal(1_000_000)


@dataclass(frozen=True)
class InvoiceLine:
    model: str
    kind: str  # input | output | cache_hit
    tokens: int
    unit_price_per_1m: Decimal
    amount_cents: int
    savings_cents: int = 0  # cache_hit lines: list-price value of the tokens minus what was charged


@dataclass(frozen=True)
class Invoice:
    number: str
    tenant: str
    month: str
    period_start: date
    period_end: date  # exclusive
    requests: int
    lines: tuple[InvoiceLine, ...]
    currency: str = CURRENCY
    rounding: str = ROUNDING_RULE

    @property
    def total_cents(self) -> int:
        return sum(line.amount_cents for line in self.lines)

    @property
    def savings_cents(self) -> int:
        return sum(line.savings_cents for line in self.lines)


def to_cents(amount: Decimal) -> int:
    return int((amount * 100).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def month_bounds(month: str) -> tuple[date, date]:
    match = _MONTH.fullmatch(month) if isinstance(month, str) else None
    if match is None:
        raise ValueError(f"month: expected YYYY-MM, got {month!r}")
    year, mon = int(match[1]), int(match[2])
    return date(year, mon, 1), date(year + mon // 12, mon % 12 + 1, 1)


def build_invoice(db: Db, tenant: str, month: str, cache_price_per_1m: Decimal = Decimal(0)) -> Invoice:
    start, end = month_bounds(month)
    with connect_engine(db) as engine:
        tenant_id = _tenant_id(engine, tenant)
        usage = _usage(engine, tenant_id, start, end)
        prices = _prices(engine, sorted({row[0] for row in usage}))
    lines: list[InvoiceLine] = []
    requests = 0
    for model, hit, n, prompt, completion in sorted(usage, key=lambda r: (r[0], bool(r[1]))):
        requests += n
        price_in, price_out = prices.get(model, (Decimal(0), Decimal(0)))
        if hit:
            if prompt + completion:
                listed = (prompt * price_in + completion * price_out) / _MILLION
                charged = (prompt + completion) * cache_price_per_1m / _MILLION
                lines.append(InvoiceLine(model, "cache_hit", prompt + completion, cache_price_per_1m,
                                         to_cents(charged), to_cents(listed - charged)))
            continue
        for kind, tokens, price in (("input", prompt, price_in), ("output", completion, price_out)):
            if tokens:
                lines.append(InvoiceLine(model, kind, tokens, price, to_cents(tokens * price / _MILLION)))
    return Invoice(f"{month}-{tenant_id:06d}", tenant, month, start, end, requests, tuple(lines))


def _tenant_id(engine: Engine, name: str) -> int:
    with engine.connect() as conn:
        tenant_id = conn.scalar(select(Tenant.id).where(Tenant.name == text_field("tenant", name)))
    if tenant_id is None:
        raise ValueError(f"tenant: unknown tenant {name!r}")
    return int(tenant_id)


def _usage(engine: Engine, tenant_id: int, start: date, end: date) -> list[tuple[str, bool, int, int, int]]:
    ev = UsageEvent
    q = (select(ev.model, ev.cache_hit, func.count(), func.coalesce(func.sum(ev.prompt_tokens), 0),
                func.coalesce(func.sum(ev.completion_tokens), 0))
         .where(ev.tenant_id == tenant_id)
         .group_by(ev.model, ev.cache_hit))
    q = within(q, ev.created_at, start, end)
    with engine.connect() as conn:
        return [(m, bool(h), int(n), int(p), int(c)) for m, h, n, p, c in conn.execute(q).all()]


def _prices(engine: Engine, models: list[str]) -> dict[str, tuple[Decimal, Decimal]]:
    """Prices are stored as floats; their shortest decimal repr (0.05 → Decimal('0.05')) is the price."""
    if not models:
        return {}
    q = select(ModelDeployment.name, ModelDeployment.input_per_1m, ModelDeployment.output_per_1m).where(
        ModelDeployment.name.in_(models))
    with engine.connect() as conn:
        return {name: (Decimal(repr(float(i or 0))), Decimal(repr(float(o or 0)))) for name, i, o in conn.execute(q)}
