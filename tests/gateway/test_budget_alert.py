"""Soft budgets: a tenant or key with --alert-at fires one webhook POST the month its spend reaches that share
of its budget, however many concurrent requests and gateways cross it together."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Iterator
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from billing.accounts import create_key, create_tenant
from billing.budget_alerts import SoftBudgetCrossed
from billing.field_checks import FieldError
from billing.models import BudgetAlert, SpendCounter, Tenant
from gateway.budget_webhook import BudgetWebhook
from gateway.specs import ModelSpec
from tests.gateway.conftest import MODEL, make_server

PRICED = {"input_per_1m": 1000.0, "output_per_1m": 2000.0}  # a "hi" costs a few cents here


class Receiver:
    """An operator's webhook endpoint on loopback: keeps every JSON body POSTed to it."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


def test_a_soft_budget_alerts_once_across_two_gateways(shared_db_url, shared_db, backend, spec: ModelSpec,
                                                       receiver: Receiver) -> None:
    priced = spec.model_copy(update={"pricing": spec.pricing.model_copy(update=PRICED)})
    create_tenant(shared_db, "soft", budget_usd=1.0, alert_at=0.5)
    key = create_key(shared_db, "soft", budget_usd=0.8, alert_at=0.9)
    servers = [make_server(shared_db_url, backend, priced, budget_alert_webhook=receiver.url) for _ in range(2)]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}

    def call(i: int) -> httpx.Response:
        return httpx.post(servers[i % 2].url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key.key}"})

    responses: list[httpx.Response] = []
    try:
        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            for _ in range(12):  # waves of 20 at once, until the key's budget admits no more
                wave = list(pool.map(call, range(20)))
                responses += wave
                if not any(r.status_code == 200 for r in wave):
                    break
    finally:
        for s in servers:
            s.stop()  # flushes the ledgers and the webhook queues
    assert {r.status_code for r in responses} <= {200, 429}
    with shared_db.connect() as conn:
        tenant_id = conn.execute(select(Tenant.id).where(Tenant.name == "soft")).scalar_one()
        mine = {("key", key.id), ("tenant", tenant_id)}
        spent = {s: v for s, i, v in conn.execute(select(SpendCounter.scope, SpendCounter.scope_id,
                                                         SpendCounter.spent_usd)) if (s, i) in mine}
        claimed = [(s, i) for s, i in conn.execute(select(BudgetAlert.scope, BudgetAlert.scope_id)) if (s, i) in mine]
    assert spent["key"] >= Decimal("0.72")  # both soft budgets were crossed: the key's 90% of 0.8, the tenant's 50%
    tenant_alerts = [b for b in receiver.bodies if b["scope"] == "tenant" and b["name"] == "soft"]
    key_alerts = [b for b in receiver.bodies if b["scope"] == "key" and b["name"] == key.prefix]
    assert len(tenant_alerts) == 1 and len(key_alerts) == 1, receiver.bodies  # once, not once per gateway
    [t], [k] = tenant_alerts, key_alerts
    assert t["type"] == "budget.soft_limit_reached" and t["alert_at"] == 0.5 and t["budget_usd"] == "1.00"
    assert Decimal(t["spent_usd"]) >= Decimal("0.5") and t["used_ratio"] >= 0.5 and t["tenant"] == "soft"
    assert Decimal(k["spent_usd"]) >= Decimal("0.72") and k["tenant"] == "soft"
    assert sorted(claimed) == sorted(mine)  # one row each: what makes it once across gateways


def test_a_soft_budget_needs_a_budget_and_a_share() -> None:
    for bad in (0, 1.5, -0.1, float("nan"), True):
        with pytest.raises(FieldError, match="^alert_at:"):
            create_tenant(None, "x", budget_usd=1.0, alert_at=bad)  # type: ignore[arg-type]
    with pytest.raises(FieldError, match="^alert_at: needs a budget"):
        create_tenant(None, "x", alert_at=0.8)  # type: ignore[arg-type]


def test_the_webhook_posts_money_as_the_shortest_exact_decimal_like_the_cli(receiver: Receiver) -> None:
    webhook = BudgetWebhook(receiver.url)
    webhook([SoftBudgetCrossed("user", 1, "alice", "acme", "2026-03", Decimal("0.000031650"), Decimal("0.0000400"),
                               0.75)])
    webhook.close()
    [body] = receiver.bodies
    assert (body["spent_usd"], body["budget_usd"]) == ("0.00003165", "0.00004")  # as `platform budgets list --json`
