"""Every refusal has its status and OpenAI's error shape, and leaves no usage event."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from billing.accounts import create_key, create_tenant, revoke_key
from billing.models import UsageEvent
from gateway.direct_routes import DirectRoutes
from gateway.errors import APIError, install
from tests.gateway.conftest import MODEL, SERVER_ADMIN_KEY

CHAT = "/v1/chat/completions"


def _events(server, db) -> int:
    server.gateway.ledger.flush(10)
    with Session(db) as s:
        return s.scalar(select(func.count()).select_from(UsageEvent))


def _assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


@pytest.fixture(scope="module")
def http(server, tenant_key):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tenant_key}"}, timeout=120) as c:
        yield c


def test_bad_requests(http, server, shared_db):
    before = _events(server, shared_db)
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = http.post(CHAT, content=b'{"model": "x", "messages": [', headers={"Content-Type": "application/json"})
    _assert_error(r, 400, "invalid_json")
    for empty_or_not_an_object in (b"", b"null", b"[]", b'"hi"'):
        r = http.post(CHAT, content=empty_or_not_an_object, headers={"Content-Type": "application/json"})
        _assert_error(r, 400, "invalid_body")
    assert http.get(CHAT).status_code == 405  # the route is the app's too: other methods answered as before
    err = _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": 5}), 400, param="prompt")
    assert "must be a string, a list of strings" in err["message"]  # the field, not a branch of its union
    nan = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    err = _assert_error(http.post(CHAT, content=nan, headers={"Content-Type": "application/json"}), 400,
                        param="temperature")
    assert "finite number" in err["message"]
    _assert_error(http.post(CHAT, json={"model": MODEL}), 400, param="messages")
    _assert_error(http.post(CHAT, json={**ok, "max_tokens": "five"}), 400, param="max_tokens")
    _assert_error(http.post(CHAT, json={**ok, "max_tokens": 0}), 400, param="max_tokens")
    _assert_error(http.post(CHAT, json={**ok, "temperature": 7}), 400, param="temperature")
    _assert_error(http.post(CHAT, json={**ok, "messages": [{"role": "wizard", "content": "x"}]}), 400)
    _assert_error(http.post(CHAT, json={**ok, "messages": []}), 400, param="messages")
    _assert_error(http.post(CHAT, json={**ok, "n": 100}), 400, param="n")
    _assert_error(http.post(CHAT, json={**ok, "stop": ["a", "b", "c", "d", "e"]}), 400, param="stop")
    _assert_error(http.post(CHAT, json={**ok, "model": "gpt-9"}), 404, "model_not_found", "model")
    _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]}), 400, param="prompt")
    long_prompt = "hello " * 1100
    _assert_error(http.post(CHAT, json={**ok, "messages": [{"role": "user", "content": long_prompt}]}), 400,
                  "context_length_exceeded")
    _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "stream": True}), 400,
                  "context_length_exceeded")
    huge = {**ok, "messages": [{"role": "user", "content": "x" * 70_000}]}
    _assert_error(http.post(CHAT, json=huge), 413, "request_too_large")

    def chunked():
        yield b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 10_000
        yield b'"}]}'

    _assert_error(http.post(CHAT, content=chunked(), headers={"Content-Type": "application/json"}), 413,
                  "request_too_large")
    assert _events(server, shared_db) == before
    # each refusal counts in /metrics, those of the body included
    scrape = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {SERVER_ADMIN_KEY}"}).text
    counted = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in scrape.splitlines()
               if line.startswith("tollgate_rejected_requests_total{")}
    assert counted.get('code="invalid_body",status="400"', 0) >= 4 and counted.get('code="invalid_json",status="400"')


def test_keys_and_quota(server, shared_db):
    before = _events(server, shared_db)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    _assert_error(httpx.post(server.url + CHAT, json=body), 401, "invalid_api_key")
    _assert_error(httpx.post(server.url + CHAT, json=body, headers={"Authorization": "Bearer tg-nope"}), 401)
    _assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer tg-nope"}), 401)
    create_tenant(shared_db, "broke")
    revoked = create_key(shared_db, "broke")
    revoke_key(shared_db, str(revoked.id))
    _assert_error(httpx.post(server.url + CHAT, json=body, headers={"Authorization": f"Bearer {revoked.key}"}), 401)
    spent = create_key(shared_db, "broke", budget_usd=0.0)
    err = _assert_error(httpx.post(server.url + CHAT, json=body, headers={"Authorization": f"Bearer {spent.key}"}),
                        429, "insufficient_quota")
    assert err["type"] == "insufficient_quota"
    limited = create_key(shared_db, "broke", rpm=0)
    r = httpx.post(server.url + CHAT, json=body, headers={"Authorization": f"Bearer {limited.key}"})
    _assert_error(r, 429, "rate_limit_exceeded")
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert _events(server, shared_db) == before


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(
    st.sampled_from(["model", "messages", "max_tokens", "temperature", "n", "stop", "top_p", "stream", "seed"]),
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=5),
              st.lists(st.integers(), max_size=2), st.just([{"role": "user"}])),
))
def test_fuzzed_bodies_get_an_error_shape_never_a_500(http, body):
    r = http.post(CHAT, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code in (400, 404), r.text
    _assert_error(r, r.status_code)


def test_max_tokens_beyond_the_context_is_a_400_not_a_silent_cap(server, shared_db, http):
    """vLLM's answer: the context is 1024 tokens here, so a 30-token prompt with max_tokens 1000 is refused,
    naming max_tokens."""
    before = _events(server, shared_db)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1020}
    err = _assert_error(http.post(CHAT, json=body), 400, "context_length_exceeded", "max_tokens")
    assert "maximum context length is 1024 tokens" in err["message"]
    body = {"model": MODEL, "prompt": list(range(100, 130)), "max_tokens": 995}
    _assert_error(http.post("/v1/completions", json=body), 400, "context_length_exceeded", "max_tokens")
    assert http.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200
    assert _events(server, shared_db) == before + 1


def test_every_response_carries_one_request_id_and_echoes_the_clients(server, http):
    responses = [http.get("/v1/models"), httpx.get(server.url + "/v1/models"),  # 200, 401
                 http.post(CHAT, json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})]  # 404
    for r in responses:
        assert len(r.headers.get_list("x-request-id")) == 1, (r.status_code, r.headers)
    r = http.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.headers.get_list("x-request-id") == [r.json()["id"]]  # the completion's own id
    r = http.get("/v1/models", headers={"x-request-id": "trace-42"})
    assert r.headers.get_list("x-request-id") == ["trace-42"]


def test_an_unexpected_error_on_a_direct_route_is_a_500_in_openais_shape() -> None:
    """gateway/direct_routes.py answers the completion routes past FastAPI's handlers: a bug there still gets the
    OpenAI-shaped 500, and an APIError its own status."""

    async def fails(request) -> None:
        raise RuntimeError("a bug")

    async def refuses(request) -> None:
        raise APIError(429, "slow down", "requests", "rate_limit_exceeded")

    app = DirectRoutes(FastAPI(), {"/fails": fails, "/refuses": refuses})
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/fails")
        assert r.headers["content-type"] == "application/json"
        _assert_error(r, 500, "internal_error")
        _assert_error(client.post("/refuses"), 429, "rate_limit_exceeded")
        assert client.get("/fails").status_code == 404  # not a POST: the app's own routing


def test_an_unexpected_error_is_a_500_in_openais_shape_not_plain_text() -> None:
    """Starlette's last resort answers a plain-text "Internal Server Error" that OpenAI's clients cannot read."""
    app = FastAPI()
    install(app)

    @app.get("/fails")
    async def fails() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/fails")
    assert r.headers["content-type"] == "application/json"
    _assert_error(r, 500, "internal_error")
