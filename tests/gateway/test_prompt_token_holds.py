"""Budgets and tpm hold a prompt's real tokens (its chat template rendered, tools included, and tokenized by the
model's tokenizer), not its UTF-8 byte bound: a budget or a tpm that fits N requests admits N, and never more."""

from __future__ import annotations

import time
from decimal import Decimal

import httpx
import pytest

from billing.accounts import create_key, create_tenant
from billing.money import usd
from billing.pricing import request_cost
from gateway.specs import ModelSpec
from tests.gateway.conftest import MODEL, make_server

PRICED = {"input_per_1m": 1000.0, "output_per_1m": 2000.0}
MAX_TOKENS = 4
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}]


@pytest.fixture(scope="module")
def priced_server(shared_db_url, backend, spec: ModelSpec):
    priced = spec.model_copy(update={"pricing": spec.pricing.model_copy(update=PRICED)})
    live = make_server(shared_db_url, backend, priced)
    yield live, priced
    live.stop()


def _ask(url: str, key: str, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi to the whole team, please."}],
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _prompt_tokens(shared_db, url: str, tenant: str, **extra: object) -> int:
    unlimited = create_key(shared_db, tenant).key
    r = _ask(url, unlimited, **extra)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_a_budget_that_fits_four_requests_admits_four(priced_server, shared_db):
    live, priced = priced_server
    create_tenant(shared_db, "tokhold-budget")
    prompt = _prompt_tokens(shared_db, live.url, "tokhold-budget")
    one = request_cost(priced.pricing.prices(), prompt, MAX_TOKENS)  # what each request costs, exactly its worst case
    key = create_key(shared_db, "tokhold-budget", budget_usd=4 * one).key
    codes = [_ask(live.url, key).status_code for _ in range(5)]
    assert codes == [200, 200, 200, 200, 429]


def test_a_tpm_that_fits_four_requests_with_tools_admits_four(priced_server, shared_db):
    live, _ = priced_server
    create_tenant(shared_db, "tokhold-tpm")
    prompt = _prompt_tokens(shared_db, live.url, "tokhold-tpm", tools=WEATHER)
    key = create_key(shared_db, "tokhold-tpm", tpm=4 * (prompt + MAX_TOKENS)).key
    if time.time() % 60 > 48:  # all five inside one minute's window (a clean-clone CI run once straddled two)
        time.sleep(61 - time.time() % 60)
    responses = [_ask(live.url, key, tools=WEATHER) for _ in range(5)]
    assert [r.status_code for r in responses] == [200, 200, 200, 200, 429]
    message = responses[-1].json()["error"]["message"]
    assert f"this request needs up to {prompt + MAX_TOKENS}" in message  # its prompt's tokens, not its bytes
    assert all(r.json()["usage"]["prompt_tokens"] == prompt for r in responses[:4])


def test_refused_budget_names_the_real_worst_case(priced_server, shared_db):
    live, priced = priced_server
    create_tenant(shared_db, "tokhold-msg")
    prompt = _prompt_tokens(shared_db, live.url, "tokhold-msg")
    key = create_key(shared_db, "tokhold-msg", budget_usd=Decimal("0.000001")).key
    r = _ask(live.url, key)
    assert r.status_code == 429
    worst = request_cost(priced.pricing.prices(), prompt, MAX_TOKENS)
    assert f"may cost up to {usd(worst)} (its prompt's {prompt} tokens" in r.json()["error"]["message"]
