"""One tenant never reaches another's usage or keys over HTTP, and /admin/* refuses tenants' API keys
(the semantic cache's isolation is in tests/gateway/test_answer_reuse.py and tests/cache/). Repeated bad
keys from one address are throttled; keys and prompts never reach the logs."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import fastapi.routing
import httpx
import pytest
from sqlalchemy import Engine
from uvicorn.logging import AccessFormatter

from billing.accounts import create_key, create_tenant
from billing.admin_keys import create_admin_key
from billing.db import make_engine
from gateway.auth_throttle import FailedAuthThrottle
from tests.billing.dbutil import fresh_database
from tests.gateway.conftest import MODEL, make_server
from tests.gateway.live import LiveServer

ENV_ADMIN_KEY = "tga-isolation-env-admin-key"
FAIL_LIMIT = 8
# reachable without any key by design: the sign-in form, its stylesheet, and a redirect to /admin
PUBLIC_ADMIN_PATHS = {"/admin/login", "/admin/static/dashboard.css", "/admin/"}


@dataclass
class Tenants:
    live: LiveServer
    db: Engine
    alpha: str
    beta: str
    admin: str  # made by `platform admin create-key`

    def get(self, path: str, key: str | None = None, **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.live.url + path, headers=headers, timeout=30, **kw)

    def chat(self, key: str, content: str = "hi", **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
        return httpx.post(self.live.url + "/v1/chat/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {key}"}, **kw)


@pytest.fixture(scope="module")
def tenants(tmp_path_factory, backend, spec) -> Iterator[Tenants]:
    with fresh_database(tmp_path_factory.mktemp("isolation")) as url:
        live = make_server(url, backend, spec, admin_key=ENV_ADMIN_KEY, auth_fail_limit=FAIL_LIMIT)
        db = make_engine(url)
        create_tenant(db, "alpha")
        create_tenant(db, "beta")
        yield Tenants(live, db, create_key(db, "alpha").key, create_key(db, "beta").key, create_admin_key(db).key)
        live.stop()
        db.dispose()


@pytest.fixture(autouse=True)
def fresh_throttle(tenants) -> None:
    """Each test starts with no failed authentications counted against the test client's address."""
    tenants.live.app.state.auth_throttle._failures.clear()


def assert_openai_error(r: httpx.Response, *statuses: int) -> dict:
    assert r.status_code in statuses, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def admin_routes(live: LiveServer) -> list[tuple[str, str]]:
    """(method, path) of every /admin route, path parameters filled in. Newer FastAPI keeps included
    routers nested (iter_route_contexts flattens them); older versions list every route in app.routes."""
    flatten = getattr(fastapi.routing, "iter_route_contexts", None)
    out = []
    for route in flatten(live.app.routes) if flatten else live.app.routes:
        path = getattr(route, "path", "")
        if path.startswith("/admin") and path not in PUBLIC_ADMIN_PATHS:
            filled = re.sub(r"\{[^}:]+(:[^}]+)?\}", "1", path)
            out += [(m, filled) for m in sorted(getattr(route, "methods", None) or ()) if m != "HEAD"]
    return out


def test_every_admin_route_refuses_tenant_keys_in_openai_shape(tenants):
    routes = admin_routes(tenants.live)
    assert len(routes) >= 10 and ("POST", "/admin/cache/flush") in routes
    state = tenants.live.app.state
    throttle = state.auth_throttle
    try:
        for method, path in routes:
            # each route gets a fresh bad-key throttle: the walk presents more bad keys than one client may in a minute
            state.auth_throttle = FailedAuthThrottle(throttle.limit, throttle.window_s)
            for key in (tenants.alpha, "tg-not-a-key"):
                r = httpx.request(method, tenants.live.url + path, headers={"Authorization": f"Bearer {key}"},
                                  data={"tenant": "beta", "csrf_token": "x"}, timeout=30, follow_redirects=False)
                err = assert_openai_error(r, 403)
                assert err["code"] == "admin_required", (method, path)
            anonymous = httpx.request(method, tenants.live.url + path, timeout=30, follow_redirects=False)
            assert anonymous.status_code in (303, 401), (method, path)  # pages send browsers to the sign-in form
    finally:
        state.auth_throttle = throttle
    # the admin API takes admin keys only, and an admin key is no tenant key
    flush = {"tenant": "beta"}
    for admin in (ENV_ADMIN_KEY, tenants.admin):
        r = httpx.post(tenants.live.url + "/admin/cache/flush", json=flush, timeout=30,
                       headers={"Authorization": f"Bearer {admin}"})
        assert_openai_error(r, 400)  # past the key check: this gateway runs no semantic cache
        assert_openai_error(tenants.chat(admin), 401)
        assert_openai_error(tenants.get("/v1/models", admin), 401)


def test_no_http_route_shows_one_tenant_another_tenants_usage(tenants):
    assert tenants.chat(tenants.beta).status_code == 200  # beta spends
    for path in ("/v1/usage", "/v1/organization/usage/completions", "/v1/dashboard/billing/usage", "/usage",
                 "/v1/keys", "/v1/tenants", "/admin/tenants?tenant=beta", "/admin/keys"):
        r = tenants.get(path, tenants.alpha)
        assert r.status_code in (403, 404), (path, r.status_code)
        assert_openai_error(r, 403, 404)
        assert "beta" not in r.text
    # /metrics only for a scrape with an admin key: every series there moves with other tenants' traffic
    for key in (None, tenants.alpha, "tg-not-a-key"):
        r = tenants.get("/metrics", key)
        assert_openai_error(r, 401)
        assert "tollgate_" not in r.text and "beta" not in r.text
    for admin in (ENV_ADMIN_KEY, tenants.admin):
        assert 'tollgate_tenant_spend_usd_total{tenant="beta"}' in tenants.get("/metrics", admin).text


def test_one_tenants_prompt_prefix_is_never_another_tenants_cache_hit(tenants):
    """The KV prefix cache is salted per tenant: beta sending alpha's long prefix computes it afresh
    (cached_tokens 0, so neither timing nor usage tells beta what alpha sent), while alpha's own repeat hits."""
    def long_prefix(title: str) -> str:  # prefixes that differ from their first word: right after the chat template
        return f"{title} rules. " + " ".join(f"clause {i}: the {uuid.uuid4().hex[:6]} rule applies." for i in range(40))

    def cached(key: str, prefix: str, question: str) -> int:
        r = tenants.chat(key, f"{prefix}\n{question}")
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    alphas = long_prefix("Orange")
    assert cached(tenants.alpha, alphas, "Which rule is first?") < 32  # new: at most the chat template's block
    assert cached(tenants.alpha, alphas, "Which rule is last?") >= 256  # within a tenant the prefix is reused
    # for beta, alpha's prefix is exactly as cached as a prefix no one ever sent (once beta's own chat-template block
    # is cached, whichever test sent beta's first request)
    cached(tenants.beta, long_prefix("Green"), "Which rule is first?")
    fresh = cached(tenants.beta, long_prefix("Purple"), "Which rule is last?")
    assert cached(tenants.beta, alphas, "Which rule is last?") == fresh < 32
    assert cached(tenants.beta, alphas, "Which rule is second?") >= 256  # beta's own copy, cached for beta


# ---- repeated bad keys --------------------------------------------------------------------------

def test_throttle_counts_failures_per_address_within_the_window():
    now = [1000.0]
    throttle = FailedAuthThrottle(limit=3, window_s=10, max_clients=2, clock=lambda: now[0])
    assert [throttle.failed("a") for _ in range(3)] == [None, None, None]
    assert throttle.failed("a") == 10 and throttle.failed("b") is None
    now[0] += 4
    assert throttle.failed("a") == 6  # the oldest of the last three failures ages out in 6 s
    now[0] += 10.5
    assert throttle.failed("a") is None  # the window has passed
    throttle.failed("c")  # a third address evicts the least recently failing one: memory stays bounded
    assert len(throttle._failures) == 2


def test_bad_keys_from_one_address_get_429_while_valid_keys_and_other_addresses_pass(tenants):
    url = tenants.live.url + "/v1/models"
    for i in range(FAIL_LIMIT):
        assert_openai_error(httpx.get(url, headers={"Authorization": f"Bearer tg-wrong-{i}"}), 401)
    r = httpx.get(url, headers={"Authorization": "Bearer tg-wrong-again"})
    err = assert_openai_error(r, 429)
    assert err["code"] == "too_many_failed_authentications" and 1 <= int(r.headers["Retry-After"]) <= 60
    assert assert_openai_error(httpx.get(url), 429)  # no key at all is a failure too
    admin = httpx.post(tenants.live.url + "/admin/cache/flush", json={"tenant": "x"},
                       headers={"Authorization": "Bearer tga-guess"})
    assert_openai_error(admin, 429)
    with httpx.Client(base_url=tenants.live.url, timeout=30) as browser:  # the dashboard's sign-in form too
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', browser.get("/admin/login").text).group(1)  # type: ignore[union-attr]
        login = browser.post("/admin/login", data={"csrf_token": csrf, "key": "tga-guess"})
        assert login.status_code == 429 and "Retry-After" in login.headers and "try again in" in login.text
    # only failures are throttled: a valid key from the same address is served
    assert httpx.get(url, headers={"Authorization": f"Bearer {tenants.alpha}"}).status_code == 200
    assert tenants.chat(tenants.beta).status_code == 200
    # another client address (127.0.0.2 is loopback too) is counted on its own
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30) as other:
        assert_openai_error(other.get(url, headers={"Authorization": "Bearer tg-wrong"}), 401)


# ---- nothing secret in the logs -------------------------------------------------------------------

@pytest.fixture
def every_log_record(caplog) -> Iterator[pytest.LogCaptureFixture]:
    """DEBUG from every logger, uvicorn's own included (they do not propagate to the root)."""
    caplog.set_level(logging.DEBUG)
    uvicorn_loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.access", "uvicorn.error")]
    levels = [lg.level for lg in uvicorn_loggers]
    for lg in uvicorn_loggers:
        lg.setLevel(logging.DEBUG)
        lg.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        for lg, level in zip(uvicorn_loggers, levels):
            lg.removeHandler(caplog.handler)
            lg.setLevel(level)


def test_keys_and_prompts_never_reach_the_logs(tenants, every_log_record):
    marker = f"prompt-marker-{uuid.uuid4().hex}"
    bad_key = f"tg-bad-{uuid.uuid4().hex}"
    live = tenants.live
    assert tenants.chat(tenants.alpha, f"Repeat after me: {marker}").status_code == 200
    assert tenants.chat(tenants.alpha, marker * 100).status_code == 400  # too long: an error path
    assert tenants.chat(bad_key, marker).status_code == 401
    with httpx.stream("POST", live.url + "/v1/completions", headers={"Authorization": f"Bearer {tenants.beta}"},
                      json={"model": MODEL, "prompt": marker, "max_tokens": 2, "stream": True}, timeout=30) as r:
        assert r.status_code == 200 and list(r.iter_lines())
    assert tenants.get(f"/v1/models?api_key={bad_key}&q={marker}", tenants.beta).status_code == 200
    for path in (f"/v1/chat/completions/{tenants.alpha}", f"/v1/{tenants.admin}/models", f"/{ENV_ADMIN_KEY}"):
        assert tenants.get(path).status_code in (401, 404, 405)  # a key pasted into the path
    httpx.post(live.url + "/admin/cache/flush", json={"tenant": marker}, timeout=30,
               headers={"Authorization": f"Bearer {tenants.admin}"})
    with httpx.Client(base_url=live.url, timeout=30) as browser:
        form = browser.get("/admin/login").text
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', form).group(1)  # type: ignore[union-attr]
        assert browser.post("/admin/login", data={"csrf_token": csrf, "key": ENV_ADMIN_KEY}).status_code == 303
    live.gateway.ledger.flush(10)

    records = [r for r in every_log_record.records if not r.name.startswith(("httpx", "httpcore"))]  # the client's
    access = [r for r in records if r.name == "uvicorn.access"]
    assert access, "uvicorn wrote no access log: the test would prove nothing about it"
    texts = [r.getMessage() for r in records] + [AccessFormatter(use_colors=False).format(r) for r in access]
    for secret in (tenants.alpha, tenants.beta, bad_key, tenants.admin, ENV_ADMIN_KEY, marker):
        leaked = [t for t in texts if secret in t]
        assert not leaked, f"{secret[:12]}... in the logs: {leaked[:2]}"
    assert any("/v1/models?[query removed]" in t for t in texts)
    assert any("/v1/chat/completions/[redacted]" in t for t in texts)
