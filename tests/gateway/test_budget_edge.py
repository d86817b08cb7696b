"""A hostile tenant at its budget's edge: 50 requests at once through one gateway, then through two gateways
sharing the database (PostgreSQL in CI), against a budget that fits about 5 of them at their worst case.
The ledger's spend never passes the budget, and every refused request was refused before the model ran."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from sqlalchemy import func, select

from billing.accounts import create_key, create_tenant
from billing.models import Reservation, SpendCounter, UsageEvent
from gateway.specs import ModelSpec
from tests.gateway.conftest import MODEL, make_server

# at these prices a "hi" with max_tokens 4 may cost at most 31 x 0.001 + 4 x 0.002 = $0.039 (31: its tokens with
# SmolLM2's chat template, what admission holds)
PRICED = {"input_per_1m": 1000.0, "output_per_1m": 2000.0}
WORST = 0.039
BUDGET = 5 * WORST + 0.001


@pytest.mark.parametrize("gateways", [1, 2])
def test_fifty_requests_at_once_never_overspend(shared_db_url, shared_db, backend, spec: ModelSpec, gateways):
    priced = spec.model_copy(update={"pricing": spec.pricing.model_copy(update=PRICED)})
    tenant = f"edge-{gateways}"
    create_tenant(shared_db, tenant)
    created = create_key(shared_db, tenant, budget_usd=BUDGET)
    servers = [make_server(shared_db_url, backend, priced) for _ in range(gateways)]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}

    def call(i: int) -> httpx.Response:
        url = servers[i % gateways].url + "/v1/chat/completions"
        return httpx.post(url, json=body, headers={"Authorization": f"Bearer {created.key}"}, timeout=120)

    try:
        with concurrent.futures.ThreadPoolExecutor(50) as pool:
            responses = list(pool.map(call, range(50)))
    finally:
        for s in servers:
            s.stop()  # their ledgers flush on shutdown
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == 50 and len(ok) >= 5
    for r in refused:
        error = r.json()["error"]
        assert error["code"] == "insufficient_quota" and "left" in error["message"]
    with shared_db.connect() as conn:
        events = conn.execute(select(UsageEvent.request_id, UsageEvent.cost_usd, UsageEvent.status)
                              .where(UsageEvent.api_key_id == created.id)).all()
        spent, reserved = conn.execute(select(SpendCounter.spent_usd, SpendCounter.reserved_usd).where(
            SpendCounter.scope == "key", SpendCounter.scope_id == created.id)).one()
        held = conn.execute(select(func.count()).select_from(Reservation)
                            .where(Reservation.api_key_id == created.id)).scalar_one()
    # one event per answered request and none for a refused one: refused before the model ran
    assert sorted(e.request_id for e in events) == sorted(r.json()["id"] for r in ok)
    assert all(e.status == "ok" for e in events)
    total = sum(e.cost_usd for e in events)
    assert total <= BUDGET and spent == pytest.approx(total) and reserved == pytest.approx(0.0, abs=1e-9)
    assert held == 0
    print(f"{gateways} gateway(s): {len(ok)} answered, {len(refused)} refused, spend ${total:.4f} of ${BUDGET:.4f}")
