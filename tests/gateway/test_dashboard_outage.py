"""Dashboard pages after sign-in while the database is unreachable: every page and form POST answers
a 503 page with Retry-After saying the database is unavailable (never a 500 or a dropped connection),
a POST changes nothing, and the admin stays signed in: once the database is back the same session
works without signing in again. SQLite, or PostgreSQL when TOLLGATE_TEST_DATABASE_URL is set."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from billing.accounts import create_key, create_tenant, list_keys
from billing.admin_keys import create_admin_key
from gateway.app import create_app
from gateway.dashboard.outage_page import OUTAGE_MESSAGE
from gateway.settings import Settings
from tests.billing.dbutil import fresh_database
from tests.gateway.live import start
from tests.gateway.test_admin_key_outage import ENV_ADMIN_KEY, unreachable_database

PAGES = ("/admin", "/admin/tenants?tenant=acme", "/admin/keys", "/admin/models")


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert found, html
    return found.group(1)


def _signed_in(url: str, key: str) -> httpx.Client:
    client = httpx.Client(base_url=url, timeout=30)
    form = client.get("/admin/login")
    r = client.post("/admin/login", data={"csrf_token": _csrf(form.text), "key": key})
    assert r.status_code == 303 and r.headers["location"] == "/admin", r.text
    return client


def _assert_outage_page(r: httpx.Response) -> None:
    assert r.status_code == 503 and r.headers["Retry-After"] == "5", (r.status_code, r.text)
    assert r.headers["content-type"].startswith("text/html")
    assert OUTAGE_MESSAGE in r.text and 'role="alert"' in r.text
    assert "set-cookie" not in r.headers  # the session cookie is neither replaced nor deleted


def test_signed_in_pages_answer_503_during_an_outage_and_the_session_survives(tmp_path: Path) -> None:
    (tmp_path / "db").mkdir()
    with fresh_database(tmp_path / "db") as db_url, unreachable_database(db_url) as (url, engine, down):
        create_tenant(engine, "acme")
        tenant_key = create_key(engine, "acme", name="existing")
        stored_admin_key = create_admin_key(engine, "ops").key
        settings = Settings(database_url=url, key_cache_ttl_s=0.0, semantic_cache=False, admin_key=ENV_ADMIN_KEY,
                            ledger_spill_dir=tmp_path / "spill")
        live = start(create_app(settings, engine, {}, []))
        stored, configured = _signed_in(live.url, stored_admin_key), _signed_in(live.url, ENV_ADMIN_KEY)
        try:
            for path in PAGES:
                assert stored.get(path).status_code == 200, path
            csrf = _csrf(stored.get("/admin/keys").text)
            with down():
                for path in PAGES:
                    _assert_outage_page(stored.get(path))
                # the configured key's session needs no database, but the page's data does
                _assert_outage_page(configured.get("/admin"))
                _assert_outage_page(stored.post("/admin/keys", data={"csrf_token": csrf, "tenant": "acme",
                                                                     "name": "made-during-outage"}))
                _assert_outage_page(stored.post(f"/admin/keys/{tenant_key.id}/revoke", data={"csrf_token": csrf}))
                _assert_outage_page(stored.post("/admin/logout", data={"csrf_token": csrf}))
            for path in PAGES:  # the same sessions, not signed in again
                r = stored.get(path)
                assert r.status_code == 200 and OUTAGE_MESSAGE not in r.text, (path, r.text)
            assert configured.get("/admin").status_code == 200
            keys = list_keys(engine)
            assert [(k.id, k.name, k.revoked) for k in keys] == [(tenant_key.id, "existing", False)]
        finally:
            stored.close()
            configured.close()
            live.stop()
