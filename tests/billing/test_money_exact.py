"""Money is exact: costs rounded once to the nano-dollar, stored as whole nano-dollars, so the ledger's
spend counters, the sum of its events and the invoices agree over 100,000 events (SQLite, or PostgreSQL
with TOLLGATE_TEST_DATABASE_URL)."""

from __future__ import annotations

import random
from datetime import datetime, timezone
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from billing.accounts import create_key, create_tenant
from billing.deployments import record_deployments
from billing.invoice import allocate_cents, build_invoice
from billing.ledger import Ledger
from billing.models import SpendCounter, UsageEvent
from billing.money import dollars, usd
from billing.pricing import Prices, request_cost

EVENTS = 100_000
WHEN = datetime(2026, 11, 15, 12, tzinfo=timezone.utc)
# list prices per 1M tokens with the decimals real price lists have (0.15, 0.075, 2.5, 0.0375...)
MODELS = {
    "small": {"input_per_1m": 0.15, "cached_input_per_1m": 0.075, "output_per_1m": 0.6},
    "large": {"input_per_1m": 2.5, "cached_input_per_1m": 1.25, "output_per_1m": 10.0},
    "odd": {"input_per_1m": 0.0375, "output_per_1m": 0.333},
}


def _prices(model: str) -> Prices:
    p = MODELS[model]
    cached = p.get("cached_input_per_1m")
    return Prices(dollars(p["input_per_1m"]), dollars(p["output_per_1m"]), cached_input_per_1m=(
        None if cached is None else dollars(cached)))


def _exact_cost(model: str, tokens: tuple[int, int, int]) -> Fraction:
    """Exact dollars for (uncached prompt, cached prompt, completion) tokens at the model's decimal prices."""
    p = MODELS[model]
    per_1m = [Fraction(str(p["input_per_1m"])), Fraction(str(p.get("cached_input_per_1m", p["input_per_1m"]))),
              Fraction(str(p["output_per_1m"]))]
    return sum((n * price for n, price in zip(tokens, per_1m)), Fraction(0)) / 1_000_000


def test_counters_events_and_invoices_agree_over_100k_events(db) -> None:
    record_deployments(db, [{"name": m, "pricing": p} for m, p in MODELS.items()])
    tenants = [create_tenant(db, f"t{i}") for i in range(3)]
    keys = [create_key(db, t.name) for t in tenants]
    rng = random.Random(20261202)
    prices = {m: _prices(m) for m in MODELS}
    # per tenant and model: uncached prompt, cached prompt and completion tokens (their exact cost comes at the end)
    tokens: dict[tuple[int, str], list[int]] = {(t.id, m): [0, 0, 0] for t in tenants for m in MODELS}
    rounded: dict[int, Decimal] = {t.id: Decimal(0) for t in tenants}
    ledger = Ledger(db, max_batch=5000, linger_s=0.5).start()
    for i in range(EVENTS):
        n = rng.randrange(3)
        model = rng.choice(list(MODELS))
        prompt = rng.choice([rng.randrange(1, 60), rng.randrange(1, 5000), rng.randrange(1, 120_000)])
        completion = rng.randrange(0, 2000)
        cached = rng.randrange(0, prompt + 1) if rng.random() < 0.3 else 0
        cost = request_cost(prices[model], prompt, completion, cached)
        counts = tokens[(tenants[n].id, model)]
        counts[0] += prompt - cached
        counts[1] += cached
        counts[2] += completion
        rounded[tenants[n].id] += cost
        ledger.record(UsageEvent(request_id=f"r{i}", tenant_id=tenants[n].id, api_key_id=keys[n].id, model=model,
                                 endpoint="chat.completions", status="ok", prompt_tokens=prompt,
                                 completion_tokens=completion, cached_tokens=cached, cost_usd=cost, created_at=WHEN))
    assert ledger.flush(timeout=600)  # a batch the database fails (a lock timeout, a deadlock) is retried
    ledger.close()
    assert ledger.inserted_total == EVENTS
    exact = {t.id: sum((_exact_cost(m, tuple(tokens[(t.id, m)])) for m in MODELS), Fraction(0)) for t in tenants}
    with Session(db) as s:
        counters = {c.scope_id: c.spent_usd for c in s.scalars(select(SpendCounter).where(SpendCounter.scope == "tenant"))}
        summed = dict(s.execute(select(UsageEvent.tenant_id, func.sum(UsageEvent.cost_usd))
                                .group_by(UsageEvent.tenant_id)).tuples().all())
    for t in tenants:
        # the counter is the exact sum of the events' costs, each within half a nano-dollar of the true cost
        assert counters[t.id] == summed[t.id] == rounded[t.id]
        assert abs(Fraction(counters[t.id]) - exact[t.id]) <= Fraction(EVENTS, 2 * 10**9)
        invoice = build_invoice(db, t.name, "2026-11")
        # the invoice is the true total rounded to the cent: it and the counter agree to the cent
        assert abs(Fraction(invoice.total_cents, 100) - exact[t.id]) <= Fraction(1, 200)
        assert abs(Fraction(invoice.total_cents, 100) - Fraction(counters[t.id])) < Fraction(1, 100)
        assert invoice.total_cents == sum(line.amount_cents for line in invoice.lines)
        assert {line.kind for line in invoice.lines} == {"input", "cached_input", "output"}


@given(st.lists(st.decimals(min_value=0, max_value=10**6, places=9, allow_nan=False, allow_infinity=False),
                min_size=0, max_size=30))
def test_invoice_lines_add_up_to_the_rounded_exact_total(amounts: list[Decimal]) -> None:
    cents = allocate_cents(amounts)
    exact_cents = sum(amounts, Decimal(0)) * 100
    assert sum(cents) == int(exact_cents + Decimal("0.5")) if amounts else sum(cents) == 0
    for c, a in zip(cents, amounts):
        assert a * 100 - 1 < c < a * 100 + 1  # each line within a cent of its exact amount


@given(st.integers(0, 10**7), st.integers(0, 10**6), st.integers(0, 10**7),
       st.decimals(min_value=0, max_value=100, places=6), st.decimals(min_value=0, max_value=100, places=6))
def test_request_cost_is_the_exact_cost_rounded_half_even_to_the_nano_dollar(
        prompt: int, completion: int, cached: int, price_in: Decimal, price_out: Decimal) -> None:
    cached = min(cached, prompt)
    prices = Prices(price_in, price_out, cached_input_per_1m=price_in / 2)
    cost = request_cost(prices, prompt, completion, cached)
    true = (Fraction(price_in) * (prompt - cached) + Fraction(price_in / 2) * cached
            + Fraction(price_out) * completion) / 1_000_000
    assert abs(Fraction(cost) - true) <= Fraction(1, 2 * 10**9)
    assert cost == cost.quantize(Decimal("0.000000001"))


def test_amounts_are_read_from_their_decimal_text() -> None:
    assert dollars(0.1) + dollars(0.2) == dollars("0.3")
    assert dollars(1e-10) == 0 and dollars(6e-10) == Decimal("0.000000001")
    for bad in (float("nan"), float("inf"), "ten", None):
        with pytest.raises((ValueError, TypeError)):
            dollars(bad)


def test_usd_shows_the_precision_the_amount_has() -> None:
    assert [usd(x) for x in (5, Decimal("4.9012"), Decimal("0.000123"), Decimal("0.000000001"), 1234.5, -0.25)] == [
        "$5.00", "$4.9012", "$0.000123", "$0.000000001", "$1,234.50", "-$0.25"]
