"""Monthly invoices: line items per model and kind, in integer cents.

Kinds: input tokens (computed), cached_input (prompt tokens read from the KV prefix cache, at the model's
`cached_input_per_1m` price, else its input price), output tokens, cache_hit (requests answered from the
semantic cache, at the cache price, 0 by default, with what they saved at list price) and gpu_time (the
tenant's share of the model's replica time, busy and idle, billing/gpu_shares.py, where the model prices
`gpu_hour`). Prices are the models' current list prices (ModelDeployment).

Rounding rule (ROUNDING_RULE): the exact Decimal total of all lines is rounded half-up to cents; each
line gets its exact amount's whole cents, and the cents left go to the lines with the largest remainders.
The lines add up to the total, and the total is within half a cent of the exact amount, so it agrees to
the cent with the spend counters (which add each request's cost exact to the nano-dollar).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import date
from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal

from sqlalchemy import Engine, func, select

from billing.field_checks import text_field
from billing.models import GpuShare, ModelDeployment, ReplicaInterval, Tenant, UsageEvent
from billing.money import dollars
from billing.report_query import Db, connect_engine, within

ROUNDING_RULE = ("the exact total is rounded half-up to cents; each line has its exact amount's whole cents, "
                 "and the cents left go to the lines with the largest remainders")
CURRENCY = "USD"
KINDS = ("input", "cached_input", "output", "cache_hit", "gpu_time")
_MONTH = re.compile(r"(\d{4})-(0[1-9]|1[0-2])")
_MILLION = Decimal(1_000_000)


@dataclass(frozen=True)
class InvoiceLine:
    model: str
    kind: str  # one of KINDS
    tokens: int  # 0 on gpu_time lines
    unit_price_per_1m: Decimal  # per 1M tokens; per GPU-hour on gpu_time lines
    amount_cents: int
    savings_cents: int = 0  # cache_hit lines: list-price value of the tokens minus what was charged
    gpu_seconds: Decimal = Decimal(0)  # gpu_time lines
    exact_usd: Decimal = Decimal(0)  # the line's amount before its cents are allocated, to the nano-dollar
    exact_savings_usd: Decimal = Decimal(0)  # likewise its savings

    @property
    def unit(self) -> str:
        return "GPU-hour" if self.kind == "gpu_time" else "1M tokens"


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

    @property
    def exact_usd(self) -> Decimal:
        """The lines' exact amounts added up, each to the nano-dollar (total_cents is within half a cent of it)."""
        return sum((line.exact_usd for line in self.lines), Decimal(0))


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
        tenant_id, tenant_uid = _tenant(engine, tenant)
        usage = _usage(engine, tenant_id, start, end)
        gpu = _gpu_seconds(engine, tenant_uid, start, end)
        prices = _prices(engine, sorted({row[0].partition(":")[0] for row in usage} | set(gpu)))
    exact: list[tuple[InvoiceLine, Decimal, Decimal]] = []  # (line, exact amount, exact savings)
    requests = 0
    for model, hit, n, prompt, completion, cached in sorted(usage, key=lambda r: (r[0], bool(r[1]))):
        requests += n
        price = prices.get(model, _NO_PRICE)
        if hit:
            if prompt + completion:
                listed = (prompt * price.input + completion * price.output) / _MILLION
                charged = (prompt + completion) * cache_price_per_1m / _MILLION
                exact.append((InvoiceLine(model, "cache_hit", prompt + completion, cache_price_per_1m, 0),
                              charged, listed - charged))
            continue
        for kind, tokens, per_1m in (("input", prompt - cached, price.input), ("cached_input", cached, price.cached),
                                     ("output", completion, price.output)):
            if tokens:
                exact.append((InvoiceLine(model, kind, tokens, per_1m, 0), tokens * per_1m / _MILLION, Decimal(0)))
    for model, seconds in sorted(gpu.items()):
        per_hour = prices.get(model, _NO_PRICE).gpu_hour
        if seconds and per_hour:
            exact.append((InvoiceLine(model, "gpu_time", 0, per_hour, 0, gpu_seconds=seconds),
                          seconds * per_hour / 3600, Decimal(0)))
    amounts = allocate_cents([a for _, a, _ in exact])
    savings = allocate_cents([s for _, _, s in exact])
    lines = tuple(replace(line, amount_cents=a, savings_cents=s, exact_usd=dollars(x), exact_savings_usd=dollars(y))
                  for (line, x, y), a, s in zip(exact, amounts, savings))
    return Invoice(f"{month}-{tenant_id:06d}", tenant, month, start, end, requests, lines)


def allocate_cents(amounts: list[Decimal]) -> list[int]:
    """Whole cents per amount (each >= 0) adding up to the exact sum rounded half-up: each amount's whole cents,
    and the cents left (fewer than there are amounts) to the largest remainders, ties to the earlier one."""
    total = to_cents(sum(amounts, Decimal(0)))
    cents = [amount * 100 for amount in amounts]
    out = [int(c.to_integral_value(rounding=ROUND_FLOOR)) for c in cents]
    by_remainder = sorted(range(len(cents)), key=lambda i: (-(cents[i] - out[i]), i))
    for i in by_remainder[:total - sum(out)]:
        out[i] += 1
    return out


def _tenant(engine: Engine, name: str) -> tuple[int, str]:
    with engine.connect() as conn:
        row = conn.execute(select(Tenant.id, Tenant.uid).where(Tenant.name == text_field("tenant", name))).first()
    if row is None:
        raise ValueError(f"tenant: unknown tenant {name!r}")
    return int(row.id), row.uid


def _usage(engine: Engine, tenant_id: int, start: date, end: date) -> list[tuple[str, bool, int, int, int, int]]:
    """(model, cache hit, requests, prompt, completion, cached prompt tokens) per model and cache hit; a LoRA
    adapter's requests are a model of their own, `model:adapter`."""
    ev = UsageEvent
    q = (select(ev.model, ev.adapter, ev.cache_hit, func.count(), func.coalesce(func.sum(ev.prompt_tokens), 0),
                func.coalesce(func.sum(ev.completion_tokens), 0), func.coalesce(func.sum(ev.cached_tokens), 0))
         .where(ev.tenant_id == tenant_id)
         .group_by(ev.model, ev.adapter, ev.cache_hit))
    q = within(q, ev.created_at, start, end)
    with engine.connect() as conn:
        return [(m if a is None else f"{m}:{a}", bool(h), int(n), int(p), int(c), min(int(k), int(p)))
                for m, a, h, n, p, c, k in conn.execute(q)]


def _gpu_seconds(engine: Engine, tenant_uid: str, start: date, end: date) -> dict[str, Decimal]:
    """The tenant's replica seconds (busy and idle) per model, by the interval's start."""
    q = (select(ReplicaInterval.model, func.sum(GpuShare.busy_s + GpuShare.idle_s))
         .join(ReplicaInterval, ReplicaInterval.id == GpuShare.interval_id)
         .where(GpuShare.tenant_uid == tenant_uid)
         .group_by(ReplicaInterval.model))
    q = within(q, ReplicaInterval.start, start, end)
    with engine.connect() as conn:
        return {model: seconds for model, seconds in conn.execute(q) if seconds}


@dataclass(frozen=True)
class _Price:
    input: Decimal
    cached: Decimal
    output: Decimal
    gpu_hour: Decimal


_NO_PRICE = _Price(Decimal(0), Decimal(0), Decimal(0), Decimal(0))


def _prices(engine: Engine, models: list[str]) -> dict[str, _Price]:
    if not models:
        return {}
    d = ModelDeployment
    q = select(d.name, d.input_per_1m, d.cached_input_per_1m, d.output_per_1m, d.gpu_hour, d.spec
               ).where(d.name.in_(models))
    out: dict[str, _Price] = {}
    with engine.connect() as conn:
        for name, i, c, o, g, spec in conn.execute(q):
            out[name] = base = _Price(i, i if c is None else c, o, g)
            for adapter in (spec or {}).get("adapters") or []:  # an adapter's own prices, else its model's
                out[f"{name}:{adapter['name']}"] = _adapter_price(adapter.get("pricing"), base)
    return out


def _adapter_price(pricing: dict | None, base: _Price) -> _Price:
    if not pricing:
        return base
    i = dollars(pricing.get("input_per_1m", 0))
    c = pricing.get("cached_input_per_1m")
    return _Price(i, i if c is None else dollars(c), dollars(pricing.get("output_per_1m", 0)),
                  dollars(pricing.get("gpu_hour", 0)))
