"""Monthly invoices: line items per model and kind, in integer cents.

Kinds: input tokens (computed), cached_input (prompt tokens read from the KV prefix cache, at the model's
`cached_input_per_1m` price, else its input price), output tokens, cache_hit (requests answered from the
semantic cache, at the cache price, 0 by default, with what they saved at list price) and gpu_time (the
tenant's share of the model's replica time, busy and idle, billing/gpu_shares.py, where the model prices
`gpu_hour`). Each line is priced as its usage was charged (billing/charged_prices.py): the prices stored with
each usage event and replica interval, so a later price change never alters a past invoice; a month in which
a price changed has one line per kind and price.

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

from billing.asked_model import asked_name
from billing.field_checks import text_field
from billing.charged_prices import (event_cached_input_price, event_input_price, event_output_price,
                                    interval_gpu_hour, join_list_prices)
from billing.models import GpuShare, ReplicaInterval, Tenant, UsageEvent
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
    # (model, kind, unit price) -> [tokens, exact amount, exact savings, GPU seconds]
    sums: dict[tuple[str, str, Decimal], list] = {}

    def add(model: str, kind: str, price: Decimal, tokens: int, amount: Decimal, saved: Decimal = Decimal(0),
            seconds: Decimal = Decimal(0)) -> None:
        line = sums.setdefault((model, kind, price), [0, Decimal(0), Decimal(0), Decimal(0)])
        line[0] += tokens
        line[1] += amount
        line[2] += saved
        line[3] += seconds

    requests = 0
    for u in usage:
        requests += u.requests
        if u.cache_hit:
            if u.prompt + u.completion:
                listed = (u.prompt * u.input + u.completion * u.output) / _MILLION
                charged = (u.prompt + u.completion) * cache_price_per_1m / _MILLION
                add(u.model, "cache_hit", cache_price_per_1m, u.prompt + u.completion, charged, listed - charged)
            continue
        for kind, tokens, per_1m in (("input", u.prompt - u.cached, u.input), ("cached_input", u.cached, u.cached_input),
                                     ("output", u.completion, u.output)):
            if tokens:
                add(u.model, kind, per_1m, tokens, tokens * per_1m / _MILLION)
    for model, per_hour, seconds in gpu:
        if seconds and per_hour:
            add(model, "gpu_time", per_hour, 0, seconds * per_hour / 3600, seconds=seconds)
    # token lines per model (input, cached input, output, cache hits), then GPU lines; a changed price: a line each
    order = {kind: i for i, kind in enumerate(("input", "cached_input", "output", "cache_hit", "gpu_time"))}
    keys = sorted(sums, key=lambda k: (k[1] == "gpu_time", k[0], order[k[1]], k[2]))
    exact = [(InvoiceLine(model, kind, sums[(model, kind, price)][0], price, 0,
                          gpu_seconds=sums[(model, kind, price)][3]), sums[(model, kind, price)][1],
              sums[(model, kind, price)][2]) for model, kind, price in keys]
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


@dataclass(frozen=True)
class _Usage:
    """One model's usage at one set of charged prices, cache hits apart."""

    model: str
    cache_hit: bool
    input: Decimal
    cached_input: Decimal
    output: Decimal
    requests: int
    prompt: int
    completion: int
    cached: int


def _usage(engine: Engine, tenant_id: int, start: date, end: date) -> list[_Usage]:
    """Tokens per model, cache hit and the prices they were charged at (billing/charged_prices.py); a LoRA
    adapter's requests are a model of their own, `model:adapter`."""
    ev = UsageEvent
    prices = (event_input_price(), event_cached_input_price(), event_output_price())
    q = (select(ev.model, ev.adapter, ev.cache_hit, *prices, func.count(),
                func.coalesce(func.sum(ev.prompt_tokens), 0), func.coalesce(func.sum(ev.completion_tokens), 0),
                func.coalesce(func.sum(ev.cached_tokens), 0))
         .select_from(ev)
         .where(ev.tenant_id == tenant_id)
         .group_by(ev.model, ev.adapter, ev.cache_hit, *prices))
    q = within(join_list_prices(q, ev.model), ev.created_at, start, end)
    with engine.connect() as conn:
        return [_Usage(asked_name(m, a), bool(h), i, c, o, int(n), int(p), int(k), min(int(x), int(p)))
                for m, a, h, i, c, o, n, p, k, x in conn.execute(q)]


def _gpu_seconds(engine: Engine, tenant_uid: str, start: date, end: date) -> list[tuple[str, Decimal, Decimal]]:
    """(model, gpu_hour charged, the tenant's replica seconds, busy and idle), by the interval's start."""
    price = interval_gpu_hour()
    q = (select(ReplicaInterval.model, price, func.sum(GpuShare.busy_s + GpuShare.idle_s))
         .select_from(GpuShare)
         .join(ReplicaInterval, ReplicaInterval.id == GpuShare.interval_id)
         .where(GpuShare.tenant_uid == tenant_uid)
         .group_by(ReplicaInterval.model, price))
    q = within(join_list_prices(q, ReplicaInterval.model), ReplicaInterval.start, start, end)
    with engine.connect() as conn:
        return [(model, per_hour, seconds) for model, per_hour, seconds in conn.execute(q) if seconds]
