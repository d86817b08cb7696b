"""Invoices: hand-computed cents, lines that add up, byte-identical re-runs, safe renderers."""

import csv
import io
import json
from datetime import datetime, timezone
from decimal import Decimal

import pytest
from sqlalchemy.orm import Session

from billing.event_filter import EventFilter
from billing.invoice import build_invoice, month_bounds, to_cents
from billing.invoice_render import render
from billing.models import ModelDeployment, Tenant, UsageEvent
from billing.reports import usage_by_tenant_day_model
from billing.request_log import log_page
from billing.usage import usage_frame

EVIL = "<script>alert(1)</script>'; DROP TABLE usage_events; --"
MARCH = datetime(2026, 3, 10, tzinfo=timezone.utc)


@pytest.fixture
def seeded(db):
    with Session(db) as s:
        acme, evil = Tenant(name="acme"), Tenant(name=EVIL)
        s.add_all([acme, evil,
                   ModelDeployment(name="small", spec={}, input_per_1m=0.05, output_per_1m=0.10),
                   ModelDeployment(name="large", spec={}, input_per_1m=3.0, output_per_1m=15.0)])
        s.flush()
        rows = [  # (tenant, model, prompt, completion, cache hit, when)
            (acme, "small", 150_000, 50_000, False, MARCH),  # 0.75 ¢ + 0.5 ¢
            (acme, "small", 150_000, 25_000, False, MARCH),  # input 300k → 1.5 ¢ → 2; output 75k → 0.75 ¢ → 1
            (acme, "large", 1_001, 333, False, MARCH),       # 0.3003 ¢ → 0; 0.4995 ¢ → 0
            (acme, "large", 1_000_000, 100_000, True, MARCH),  # cache hit: saves 300 + 150 ¢
            (acme, "large", 5, 5, False, datetime(2026, 4, 1, tzinfo=timezone.utc)),  # next month
            (evil, "small", 1_000_000, 0, False, MARCH),
        ]
        s.add_all(UsageEvent(request_id=f"r{i}", tenant_id=t.id, model=m, endpoint="completions", status="ok",
                             prompt_tokens=p, completion_tokens=c, cache_hit=h, created_at=w)
                  for i, (t, m, p, c, h, w) in enumerate(rows))
        s.commit()
    return db


def test_lines_cents_and_total(seeded):
    inv = build_invoice(seeded, "acme", "2026-03")
    got = [(l.model, l.kind, l.tokens, l.amount_cents, l.savings_cents) for l in inv.lines]
    assert got == [
        ("large", "input", 1_001, 0, 0),
        ("large", "output", 333, 0, 0),
        ("large", "cache_hit", 1_100_000, 0, 450),
        ("small", "input", 300_000, 2, 0),
        ("small", "output", 75_000, 1, 0),
    ]
    assert inv.total_cents == 3 == sum(l.amount_cents for l in inv.lines)
    assert inv.savings_cents == 450
    assert inv.requests == 4
    assert inv.lines[3].unit_price_per_1m == Decimal("0.05")


def test_cache_price_is_charged_and_savings_shrink(seeded):
    inv = build_invoice(seeded, "acme", "2026-03", cache_price_per_1m=Decimal("0.01"))
    hit = next(l for l in inv.lines if l.kind == "cache_hit")
    assert (hit.amount_cents, hit.savings_cents) == (1, 449)  # 1.1 ¢ → 1; 450 − 1.1 = 448.9 → 449


def test_rounding_is_half_up():
    assert [to_cents(Decimal(x)) for x in ("0.005", "0.0049", "0.015", "1.234999")] == [1, 0, 2, 123]


def test_renders_are_byte_identical_and_agree(seeded):
    for fmt in ("csv", "json", "html"):
        assert render(build_invoice(seeded, "acme", "2026-03"), fmt) == render(
            build_invoice(seeded, "acme", "2026-03"), fmt)
    inv = build_invoice(seeded, "acme", "2026-03")
    data = json.loads(render(inv, "json"))
    assert data["total_cents"] == sum(l["amount_cents"] for l in data["lines"]) == 3
    assert data["total"] == "0.03" and data["savings"] == "4.50"
    rows = list(csv.DictReader(io.StringIO(render(inv, "csv"))))
    assert rows[-1]["kind"] == "total" and rows[-1]["amount_usd"] == "0.03"
    assert sum(Decimal(r["amount_usd"]) for r in rows[:-1]) == Decimal("0.03")


def test_metacharacters_in_tenant_name_are_escaped(seeded):
    inv = build_invoice(seeded, EVIL, "2026-03")
    assert inv.total_cents == 5
    page = render(inv, "html")
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "http://" not in page and "https://" not in page and "src=" not in page
    assert json.loads(render(inv, "json"))["tenant"] == EVIL
    assert build_invoice(seeded, "acme", "2026-03").total_cents == 3  # the other tenant's rows are intact


@pytest.mark.parametrize("month", ["2026-13", "2026-3", "26-03", "2026-03-01", "", "march"])
def test_bad_month_names_the_field(seeded, month):
    with pytest.raises(ValueError, match="^month:"):
        build_invoice(seeded, "acme", month)


def test_unknown_tenant_names_the_field(seeded):
    with pytest.raises(ValueError, match="^tenant:"):
        build_invoice(seeded, "nobody' OR '1'='1", "2026-03")


def test_empty_month_and_december_bounds(seeded):
    inv = build_invoice(seeded, "acme", "2025-12")
    assert inv.lines == () and inv.total_cents == 0
    assert month_bounds("2025-12") == (datetime(2025, 12, 1).date(), datetime(2026, 1, 1).date())
    with pytest.raises(ValueError, match="^format:"):
        render(inv, "pdf")


def test_adapter_requests_are_lines_of_their_own_at_the_adapters_prices(db):
    with Session(db) as s:
        acme = Tenant(name="acme")
        spec = {"name": "small", "adapters": [{"name": "legal", "source": "/a", "pricing": {"input_per_1m": 1.0,
                                                                                             "output_per_1m": 2.0}},
                                              {"name": "plain", "source": "/b"}]}
        s.add_all([acme, ModelDeployment(name="small", spec=spec, input_per_1m=0.05, output_per_1m=0.10)])
        s.flush()
        # each event keeps the prices the gateway charged: the adapter's own where its spec sets them
        charged = {None: (0.05, 0.10), "legal": (1.0, 2.0), "plain": (0.05, 0.10)}
        s.add_all(UsageEvent(request_id=f"a{i}", tenant_id=acme.id, model="small", adapter=adapter,
                             endpoint="completions", status="ok", prompt_tokens=1_000_000, completion_tokens=1_000_000,
                             cache_hit=False, created_at=MARCH, input_per_1m=charged[adapter][0],
                             cached_input_per_1m=charged[adapter][0], output_per_1m=charged[adapter][1])
                  for i, adapter in enumerate([None, "legal", "plain"]))
        s.commit()
    inv = build_invoice(db, "acme", "2026-03")
    got = {(line.model, line.kind): line.amount_cents for line in inv.lines}
    assert got == {("small", "input"): 5, ("small", "output"): 10, ("small:legal", "input"): 100,
                   ("small:legal", "output"): 200, ("small:plain", "input"): 5, ("small:plain", "output"): 10}
    # each line's model names the same requests in the request log it links into, in usage groups and in reports
    # (a fresh-clone trial found the adapter lines' links empty and the base line's counting the adapters' too)
    start, end = month_bounds("2026-03")
    for model, request_id in (("small", "a0"), ("small:legal", "a1"), ("small:plain", "a2")):
        logged = log_page(db, EventFilter(tenant="acme", model=model, since=start, until=end), offset=0, limit=10)
        assert [(r.request_id, r.model) for r in logged] == [(request_id, model)]
    assert sorted(usage_frame(db, tenant="acme", group_by=("model",))["model"]) == ["small", "small:legal",
                                                                                   "small:plain"]
    assert sorted(usage_by_tenant_day_model(db)["model"]) == ["small", "small:legal", "small:plain"]
