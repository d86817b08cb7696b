"""End-user and tag budgets at their edge, through real HTTP: 50 requests at once from one tenant's keys, where end
user 'alice' and tag 'search' (a key's project, or a request's metadata.tags) each have a budget that fits about 5
of them at their worst case, on one gateway and on two sharing the database (PostgreSQL in CI). Neither budget is
overspent in the ledger, every refused request was refused before the model ran, the key's other users and
untagged requests are not touched, and a soft budget's webhook fires once."""

from __future__ import annotations

import concurrent.futures
from decimal import Decimal

import httpx
import pytest
from sqlalchemy import and_, func, or_, select

from billing.accounts import create_key, create_tenant
from billing.models import Reservation, ScopedBudget, SpendCounter, Tenant, UsageEvent
from billing.scoped_budgets import set_budget
from gateway.specs import ModelSpec
from tests.gateway.conftest import MODEL, make_server
from tests.gateway.test_budget_alert import Receiver, receiver  # noqa: F401 - the webhook receiver fixture

# at these prices a "hi" with max_tokens 1 may cost at most 31 x 0.001 + 1 x 0.002 = $0.033 (31: its tokens with
# SmolLM2's chat template, what admission holds)
PRICED = {"input_per_1m": 1000.0, "output_per_1m": 2000.0}
WORST = Decimal("0.033")
BUDGET = 5 * WORST + Decimal("0.001")
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}


@pytest.fixture
def priced(spec: ModelSpec) -> ModelSpec:
    return spec.model_copy(update={"pricing": spec.pricing.model_copy(update=PRICED)})


@pytest.mark.parametrize("gateways", [1, 2])
def test_fifty_requests_at_once_never_overspend_an_end_user_or_a_tag_budget(
        shared_db_url, shared_db, backend, priced: ModelSpec, receiver: Receiver, gateways: int) -> None:
    tenant = f"scoped-edge-{gateways}"
    create_tenant(shared_db, tenant)
    plain = create_key(shared_db, tenant)  # alice's, bob's, and the requests tagged in their metadata
    project = create_key(shared_db, tenant, project="search")  # every request of this key carries the tag
    set_budget(shared_db, tenant, user="alice", budget_usd=BUDGET, alert_at=0.3)
    set_budget(shared_db, tenant, tag="search", budget_usd=BUDGET)
    servers = [make_server(shared_db_url, backend, priced, budget_alert_webhook=receiver.url)
               for _ in range(gateways)]
    # 24 from alice, 10 through the project key, 10 tagged "search" in their metadata, 6 from bob (no budget)
    sent = ([(plain.key, {"user": "alice"})] * 24 + [(project.key, {})] * 10
            + [(plain.key, {"metadata": {"tags": ["search"]}})] * 10 + [(plain.key, {"user": "bob"})] * 6)

    def call(i: int) -> httpx.Response:
        key, extra = sent[i]
        return httpx.post(servers[i % gateways].url + "/v1/chat/completions", json={**BODY, **extra}, timeout=120,
                          headers={"Authorization": f"Bearer {key}"})

    try:
        with concurrent.futures.ThreadPoolExecutor(50) as pool:
            responses = list(pool.map(call, range(50)))
    finally:
        for s in servers:
            s.stop()  # flushes the ledgers and the webhook queues
    alice, tagged, bob = responses[:24], responses[24:44], responses[44:]
    assert {r.status_code for r in responses} <= {200, 429}
    assert all(r.status_code == 200 for r in bob)  # the key's other users are not touched
    for group, who in ((alice, "End user 'alice'"), (tagged, "Tag 'search'")):
        assert sum(r.status_code == 200 for r in group) >= 5  # 5 worst cases fit at once
        for r in (r for r in group if r.status_code == 429):
            error = r.json()["error"]
            assert error["code"] == "insufficient_quota" and error["message"].startswith(f"{who} has $")
    with shared_db.connect() as conn:
        tenant_id = conn.execute(select(Tenant.id).where(Tenant.name == tenant)).scalar_one()
        events = conn.execute(select(UsageEvent.request_id, UsageEvent.end_user, UsageEvent.tags,
                                     UsageEvent.cost_usd).where(UsageEvent.tenant_id == tenant_id)).all()
        counters = {name: conn.execute(select(SpendCounter.spent_usd, SpendCounter.reserved_usd).where(
            SpendCounter.scope == scope, SpendCounter.scope_id == ScopedBudget.id, ScopedBudget.tenant_id == tenant_id,
            ScopedBudget.scope == scope, ScopedBudget.name == name)).one() for scope, name in (("user", "alice"),
                                                                                              ("tag", "search"))}
        held = conn.execute(select(func.count()).select_from(Reservation)
                            .where(Reservation.tenant_id == tenant_id)).scalar_one()
    # one event per answered request and none for a refused one: refused before the model ran
    assert sorted(e.request_id for e in events) == sorted(r.json()["id"] for r in responses if r.status_code == 200)
    alice_spent = sum(e.cost_usd for e in events if e.end_user == "alice")
    search_spent = sum(e.cost_usd for e in events if "search" in e.tags)
    assert alice_spent <= BUDGET and search_spent <= BUDGET  # 0 overspend
    assert counters["alice"] == (alice_spent, 0) and counters["search"] == (search_spent, 0)  # exact, all settled
    assert held == 0
    alerts = [b for b in receiver.bodies if b["tenant"] == tenant]
    assert [(a["scope"], a["name"]) for a in alerts] == [("user", "alice")]  # once, not once per gateway
    assert Decimal(alerts[0]["spent_usd"]) >= BUDGET * Decimal("0.3")
    assert Decimal(alerts[0]["budget_usd"]) == BUDGET
    print(f"{gateways} gateway(s): alice ${alice_spent} and tag search ${search_spent} of ${BUDGET} each; "
          f"{sum(r.status_code == 429 for r in responses)} refused")


def test_the_refusal_names_the_budget_and_what_is_left(shared_db_url, shared_db, backend, priced: ModelSpec) -> None:
    tenant = "scoped-message"
    create_tenant(shared_db, tenant)
    key = create_key(shared_db, tenant, project="batch", budget_usd=10)
    set_budget(shared_db, tenant, user="carol", budget_usd=Decimal("0.03"))
    set_budget(shared_db, tenant, tag="batch", budget_usd=1)
    server = make_server(shared_db_url, backend, priced)

    def post(**extra: object) -> httpx.Response:
        return httpx.post(server.url + "/v1/chat/completions", json={**BODY, **extra}, timeout=120,
                          headers={"Authorization": f"Bearer {key.key}"})

    try:
        for_carol = post(user="carol")
        set_budget(shared_db, tenant, tag="batch", budget_usd=Decimal("0.0321"))  # less than one worst case
        tagged = post(user="dave")  # the key's project tag
        reserved = _reserved(shared_db, tenant, key.id)  # the refusals held nothing, not even on the key's budget
        set_budget(shared_db, tenant, tag="batch", budget_usd=1)
        dave = post(user="dave")
    finally:
        server.stop()
    assert reserved == 0
    assert (for_carol.status_code, tagged.status_code, dave.status_code) == (429, 429, 200)
    assert for_carol.json()["error"] == {
        "message": "End user 'carol' has $0.03 left of its monthly budget of $0.03 ($0.00 spent, $0.00 held by "
                   "requests in flight); this request may cost up to $0.033 (its prompt's 31 tokens and 1 for "
                   "max_tokens × n at the model's prices). Lower max_tokens.",  # waiting cannot help: nothing held
        "type": "insufficient_quota", "param": None, "code": "insufficient_quota"}
    assert tagged.json()["error"]["message"].startswith(
        "Tag 'batch' has $0.0321 left of its monthly budget of $0.0321 ($0.00 spent, $0.00 held")


def _reserved(db, tenant: str, key_id: int) -> Decimal:
    """What the key's budget and the tenant's end-user and tag budgets hold for requests in flight."""
    c, b = SpendCounter, ScopedBudget
    scoped = select(b.id).join(Tenant, Tenant.id == b.tenant_id).where(Tenant.name == tenant)
    with db.connect() as conn:
        return conn.execute(select(func.coalesce(func.sum(c.reserved_usd), 0)).where(or_(
            and_(c.scope == "key", c.scope_id == key_id),
            and_(c.scope.in_(["user", "tag"]), c.scope_id.in_(scoped))))).scalar_one()
