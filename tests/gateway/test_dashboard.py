"""The admin dashboard over HTTP: sign-in with admin keys only, the session cookie's flags, CSRF on
every POST, escaping, keys shown once, scaling through the optional hook (the spend, usage, budget,
GPU, cache, request-log and invoice views: test_dashboard_views.py). No model is loaded: the gateway
gets a stub backend that only answers info() for each of the seed's two priced models; the data is
tests/gateway/dashboard_seed.py's."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from billing.accounts import create_key, hash_key
from billing.admin_keys import create_admin_key
from billing.db import make_engine
from billing.models import ApiKey
from billing.money import usd
from gateway.app import create_app
from gateway.backends import BackendInfo, GenerationChunk, GenerationRequest
from gateway.settings import Settings
from gateway.specs import Pricing, load_spec
from tests.billing.dbutil import fresh_database
from tests.gateway.dashboard_seed import BIG, BIG_PRICING, EVIL_TENANT, SEEDED, chart_total, hold_reservations, seed
from tests.gateway.live import LiveServer, start

SPEC_PATH = Path(__file__).resolve().parents[2] / "platform" / "models" / "smollm2-135m.yaml"
ENV_ADMIN_KEY = "tga-env-configured-secret"
PAGES = ("/admin", "/admin/usage", "/admin/requests", "/admin/budgets", "/admin/gpu", "/admin/cache", "/admin/invoices",
         "/admin/tenants", "/admin/keys", "/admin/models")


class StubBackend:
    def __init__(self, name: str) -> None:
        self.name = name

    def info(self) -> BackendInfo:
        return BackendInfo(self.name, 2048, "ready")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        raise RuntimeError("the dashboard tests run no model")
        yield  # pragma: no cover

    async def abort(self, request_id: str) -> None:
        return None


@dataclass
class Dashboard:
    live: LiveServer
    db: Engine
    admin_key: str
    tenant_key: str
    keys: dict[str, int]  # the seeded keys' ids by name

    @property
    def url(self) -> str:
        return self.live.url


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory) -> Iterator[Dashboard]:
    with fresh_database(tmp_path_factory.mktemp("dashdb")) as url:
        yield from _serve(url)


def _serve(url: str) -> Iterator[Dashboard]:
    db = make_engine(url)
    keys = seed(db)
    tenant_key = create_key(db, "acme", name="seeded").key
    admin_key = create_admin_key(db, "tests").key
    settings = Settings(database_url=url, key_cache_ttl_s=0.0, semantic_cache=False, admin_key=ENV_ADMIN_KEY)
    spec = load_spec(SPEC_PATH)
    big = spec.model_copy(update={"name": BIG, "size": "large", "pricing": Pricing(**BIG_PRICING)})  # the seed's
    backends = {m.name: StubBackend(m.name) for m in (spec, big)}
    live = start(create_app(settings, make_engine(url), backends, [spec, big]))
    hold_reservations(db, live.gateway.limiter.owner, keys)
    try:
        yield Dashboard(live, db, admin_key, tenant_key, keys)
    finally:
        live.stop()
        db.dispose()


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert found, "no CSRF field on the page"
    return found.group(1)


def signed_in_client(d: Dashboard, key: str | None = None) -> httpx.Client:
    client = httpx.Client(base_url=d.url, timeout=10)
    form = client.get("/admin/login")
    r = client.post("/admin/login", data={"csrf_token": csrf_of(form.text), "key": key or d.admin_key})
    assert r.status_code == 303 and r.headers["location"] == "/admin", r.text
    return client


def test_pages_and_exports_need_a_session(dashboard):
    for path in (*PAGES, "/admin/cache/bounds", "/admin/cache/flags"):
        for query in ("", "?format=csv", "?format=json"):
            r = httpx.get(dashboard.url + path + query)
            assert r.status_code == 303 and r.headers["location"] == "/admin/login", path + query
            r = httpx.get(dashboard.url + path + query, headers={"Authorization": f"Bearer {dashboard.tenant_key}"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"


def test_cookie_is_signed_httponly_strict_and_ends_at_sign_out(dashboard):
    client = httpx.Client(base_url=dashboard.url, timeout=10)
    form = client.get("/admin/login")
    cookie = form.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/admin" in cookie
    r = client.post("/admin/login", data={"csrf_token": csrf_of(form.text), "key": dashboard.admin_key})
    assert r.status_code == 303 and dashboard.admin_key not in r.headers["set-cookie"]
    session_cookie = client.cookies["tollgate_admin"]
    page = client.get("/admin")
    assert page.status_code == 200 and "Spend today" in page.text

    tampered = session_cookie[:-2] + ("AA" if not session_cookie.endswith("AA") else "BB")
    assert httpx.get(dashboard.url + "/admin", cookies={"tollgate_admin": tampered}).status_code == 303

    assert client.post("/admin/logout", data={"csrf_token": csrf_of(page.text)}).status_code == 303
    replay = httpx.get(dashboard.url + "/admin", cookies={"tollgate_admin": session_cookie})
    assert replay.status_code == 303 and replay.headers["location"] == "/admin/login"


def test_the_configured_admin_key_signs_in_and_tenant_keys_do_not(dashboard):
    assert signed_in_client(dashboard, ENV_ADMIN_KEY).get("/admin/keys").status_code == 200
    client = httpx.Client(base_url=dashboard.url, timeout=10)
    for wrong in (dashboard.tenant_key, "", "tga-not-a-key"):
        form = client.get("/admin/login")
        r = client.post("/admin/login", data={"csrf_token": csrf_of(form.text), "key": wrong})
        assert r.status_code == 401 and "not an admin key" in r.text
        assert client.get("/admin").status_code == 303


def test_posts_without_the_csrf_token_are_refused(dashboard):
    client = signed_in_client(dashboard)
    before = _key_count(dashboard.db)
    for data in ({"tenant": "acme"}, {"tenant": "acme", "csrf_token": "0" * 64}):
        r = client.post("/admin/keys", data=data)
        assert r.status_code == 403 and "security token" in r.text
    assert client.post("/admin/keys/1/revoke", data={}).status_code == 403
    assert client.post("/admin/logout", data={}).status_code == 403
    assert _key_count(dashboard.db) == before
    # a token from another session is no good either
    other = signed_in_client(dashboard)
    foreign = csrf_of(other.get("/admin/keys").text)
    assert client.post("/admin/keys", data={"tenant": "acme", "csrf_token": foreign}).status_code == 403
    # nor is a sign-in form posted without one
    anonymous = httpx.Client(base_url=dashboard.url, timeout=10)
    anonymous.get("/admin/login")
    assert anonymous.post("/admin/login", data={"key": dashboard.admin_key}).status_code == 403


def _key_count(db: Engine) -> int:
    with Session(db) as s:
        return len(list(s.scalars(select(ApiKey.id))))


def test_key_is_shown_once_then_revoked_and_limits_saved(dashboard):
    client = signed_in_client(dashboard)
    token = csrf_of(client.get("/admin/keys").text)
    r = client.post("/admin/keys", data={"csrf_token": token, "tenant": "acme", "name": "http", "rpm": "60",
                                         "tpm": "", "budget_usd": "5"})
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    key = re.search(r'<code id="new-key">([^<]+)</code>', r.text).group(1)
    with Session(dashboard.db) as s:
        row = s.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
        assert row is not None and (row.rpm, row.tpm, row.budget_usd) == (60, None, 5.0)
    assert key not in client.get("/admin/keys").text
    assert httpx.get(dashboard.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200

    r = client.post(f"/admin/keys/{row.id}/limits", data={"csrf_token": token, "rpm": "", "tpm": "1000",
                                                          "budget_usd": ""})
    assert r.status_code == 303
    assert client.post(f"/admin/keys/{row.id}/limits", data={"csrf_token": token, "rpm": "nan?"}).status_code == 400
    assert client.post(f"/admin/keys/{row.id}/revoke", data={"csrf_token": token}).status_code == 303
    with Session(dashboard.db) as s:
        row = s.get(ApiKey, row.id)
        assert row.revoked and (row.rpm, row.tpm, row.budget_usd) == (None, 1000, None)
    assert httpx.get(dashboard.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 401


def test_tenant_names_are_escaped_and_totals_add_up(dashboard):
    client = signed_in_client(dashboard)
    r = client.get("/admin/tenants", params={"tenant": EVIL_TENANT})
    assert r.status_code == 200 and "<script>" not in r.text and "&lt;script&gt;" in r.text
    total = re.search(r'<strong id="chart-total">([^<]+)</strong>', r.text).group(1)
    assert chart_total(EVIL_TENANT) == 0.75 and total == "$0.75"  # money with the precision it has
    assert r.text.count('class="bar"') == 30
    r = client.get("/admin/tenants", params={"tenant": "acme", "days": 7})
    assert r.text.count('class="bar"') == 7
    assert re.search(r'id="chart-total">([^<]+)<', r.text).group(1) == "$2.6875" and chart_total("acme", 7) == 2.6875


def test_pages_fetch_nothing_from_outside(dashboard):
    client = signed_in_client(dashboard)
    pages = [client.get(p) for p in PAGES]
    for r in [*pages, httpx.get(dashboard.url + "/admin/login")]:
        assert r.status_code == 200
        assert "default-src 'none'" in r.headers["content-security-policy"]
        assert "<script" not in r.text.lower()
        assert not re.search(r'(src|href|action)="(https?:)?//', r.text)


def test_overview_numbers(dashboard):
    client = signed_in_client(dashboard)
    r = client.get("/admin")
    today = sum(s.cost_usd for s in SEEDED if s.ago == 0)
    assert re.search(r'id="spend-today">([^<]+)<', r.text).group(1) == usd(today)
    assert "smollm2-135m" in r.text and "ready" in r.text


def test_scaling_uses_the_hook_when_the_platform_provides_one(dashboard):
    client = signed_in_client(dashboard)
    token = csrf_of(client.get("/admin/models").text)
    r = client.post("/admin/models/smollm2-135m/scale", data={"csrf_token": token, "min_replicas": "0",
                                                                "max_replicas": "3"})
    assert r.status_code == 409 and "needs the Ray platform" in r.text
    calls: list[tuple[str, int, int]] = []
    dashboard.live.app.state.scale_model = lambda name, low, high: calls.append((name, low, high))
    try:
        page = client.get("/admin/models")
        assert 'name="max_replicas"' in page.text
        r = client.post("/admin/models/smollm2-135m/scale", data={"csrf_token": token, "min_replicas": "1",
                                                                    "max_replicas": "3"})
        assert r.status_code == 303 and calls == [("smollm2-135m", 1, 3)]
        bad = client.post("/admin/models/smollm2-135m/scale", data={"csrf_token": token, "min_replicas": "4",
                                                                      "max_replicas": "3"})
        assert bad.status_code == 400 and len(calls) == 1
    finally:
        del dashboard.live.app.state.scale_model
