"""A request sent right after another one completed is admitted against what that one really cost: the finished
request's reservation is settled to its exact cost before its response completes, not when the ledger writes its
event later. Sequential requests through the official openai client, whole and streamed."""

from __future__ import annotations

from decimal import Decimal

import openai
import pytest
from openai import OpenAI
from sqlalchemy import select

from billing.accounts import create_key, create_tenant
from billing.models import SpendCounter
from billing.pricing import request_cost
from gateway.routes import chat_prompt_bound
from gateway.specs import ModelSpec
from tests.gateway.conftest import MODEL, make_server

PRICED = {"input_per_1m": 1000.0, "output_per_1m": 2000.0}
MESSAGES = [{"role": "user", "content": "hi"}]
MAX_TOKENS = 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_right_after_another_is_admitted_against_its_settled_cost(shared_db_url, shared_db, backend,
                                                                            spec: ModelSpec, stream: bool):
    priced = spec.model_copy(update={"pricing": spec.pricing.model_copy(update=PRICED)})
    worst = request_cost(priced.pricing.prices(), chat_prompt_bound(MESSAGES), MAX_TOKENS)
    tenant = f"back-to-back-{stream}"
    create_tenant(shared_db, tenant)
    budget = 2 * worst + Decimal("0.001")  # room for a few requests at their real cost, two at their worst case
    created = create_key(shared_db, tenant, budget_usd=budget)
    server = make_server(shared_db_url, backend, priced)
    client = OpenAI(base_url=server.url + "/v1", api_key=created.key, max_retries=0)
    answered = 0
    try:
        for _ in range(10):
            try:
                if stream:
                    for _chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                                  max_tokens=MAX_TOKENS, temperature=0):
                        pass
                else:
                    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                   temperature=0)
            except openai.RateLimitError as e:
                assert e.code == "insufficient_quota"
                break
            answered += 1
        assert server.gateway.ledger.flush(30)
    finally:
        server.stop()
    with shared_db.connect() as conn:
        spent, reserved = conn.execute(select(SpendCounter.spent_usd, SpendCounter.reserved_usd).where(
            SpendCounter.scope == "key", SpendCounter.scope_id == created.id)).one()
    assert reserved == Decimal(0) and spent <= budget
    # refused only when what the finished requests spent leaves no room for one more worst case
    assert answered >= 2 and spent + worst > budget, (answered, spent, worst, budget)


def test_a_budget_under_a_cent_is_quoted_with_its_real_precision(server, shared_db):
    create_tenant(shared_db, "sub-cent")
    created = create_key(shared_db, "sub-cent", budget_usd=Decimal("0.000001"))
    client = OpenAI(base_url=server.url + "/v1", api_key=created.key, max_retries=0)
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS)
    assert refused.value.code == "insufficient_quota"
    assert "has $0.000001 left of its monthly budget of $0.000001" in refused.value.message


def test_a_budget_that_cannot_fit_the_request_is_not_retried_by_the_official_client(server, shared_db):
    """openai's client retries a 429 twice by default; a budget that has no room even with every request in flight
    settled says `x-should-retry: false`, so the client sends the request once and gives up."""
    import httpx

    create_tenant(shared_db, "no-retry")
    created = create_key(shared_db, "no-retry", budget_usd=Decimal("0.000001"))
    sent = []
    http_client = httpx.Client(event_hooks={"request": [sent.append]})
    client = OpenAI(base_url=server.url + "/v1", api_key=created.key, http_client=http_client)  # default retries
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS)
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert len(sent) == 1


def test_a_budget_refusal_that_a_finishing_request_may_lift_leaves_retrying_to_the_client():
    from billing.reservations import Refusal
    from gateway.limits import refusal_error

    principal = type("P", (), {"tenant": "t"})()
    held = Refusal("budget", "key", Decimal("1"), Decimal("0.5"), Decimal("0.4"), Decimal("0.2"), 0)
    spent = Refusal("budget", "key", Decimal("1"), Decimal("0.9"), Decimal("0"), Decimal("0.2"), 0)
    assert "x-should-retry" not in refusal_error(principal, held).headers  # fits once the $0.4 held settles
    assert refusal_error(principal, spent).headers["x-should-retry"] == "false"
