"""A prompt far too long for the model (well under the body limit) is refused by its length alone: a 400 naming
the field and the bound in plain words, before it is tokenized and before anything is reserved (the key's rate
window does not count it; no usage event, no reservation)."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import func, select

from billing.accounts import create_key, create_tenant
from billing.models import RateWindow, Reservation, UsageEvent
from billing.reservations import LEASE_ENDPOINT
from gateway.specs import ModelSpec
from tests.gateway.conftest import MODEL, make_server

# reservations held by requests (a gateway's budget lease, billing/budget_leases.py, is none)
REQUEST_HOLDS = select(func.count()).select_from(Reservation).where(Reservation.endpoint != LEASE_ENDPOINT)

HUGE = "word " * 200_000  # 1,000,000 characters


@pytest.fixture
def live(db_url, db, backend, spec: ModelSpec):
    server = make_server(db_url, backend, spec, max_body_bytes=4 * 1024 * 1024)
    create_tenant(db, "acme")
    key = create_key(db, "acme", rpm=100, budget_usd=5).key
    yield server, {"Authorization": f"Bearer {key}"}
    server.stop()


@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": HUGE}]}, "messages"),
    ("/v1/completions", {"prompt": HUGE}, "prompt"),
    ("/v1/completions", {"prompt": [100] * 5000}, "prompt"),
])
def test_a_huge_prompt_is_refused_by_its_length_before_tokenizing_or_reserving(live, db, path, body, field):
    server, headers = live
    r = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 4, **body}, headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("context_length_exceeded", field, "invalid_request_error")
    limit = server.gateway.backends[MODEL].info().max_model_len
    assert error["message"].startswith(f"{field}: the prompt is ")
    assert f"reads at most {limit:,} tokens" in error["message"]
    if isinstance(body.get("prompt"), list):
        assert "5,000 tokens" in error["message"]
    else:
        longest = server.gateway.backends[MODEL].info().longest_token_chars
        assert f"a prompt of {limit * longest:,} characters or more cannot fit" in error["message"]
    assert server.gateway.ledger.flush(10)
    with db.connect() as conn:
        assert conn.execute(select(func.coalesce(func.sum(RateWindow.requests), 0))).scalar_one() == 0
        assert conn.execute(REQUEST_HOLDS).scalar_one() == 0
        assert conn.execute(select(func.count()).select_from(UsageEvent)).scalar_one() == 0


def test_a_long_prompt_that_may_fit_still_gets_the_exact_check(live):
    server, headers = live
    info = server.gateway.backends[MODEL].info()
    text = "a " * (info.max_model_len * 2)  # few characters a token for the bound, too many tokens in fact
    assert len(text) // info.longest_token_chars < info.max_model_len
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 4},
                   headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
