"""Admin keys stored in the database while it is unreachable: the admin API answers 503 in OpenAI's
shape with Retry-After, the dashboard's sign-in a 503 page saying so, never a 500; the auth throttle
counts none of them; TOLLGATE_ADMIN_KEY (no database needed) still works; once the database is back,
the stored key works again. PostgreSQL is cut with a TCP proxy; the SQLite file's directory is moved
away (every connection is opened anew, so none can reach the file), because a locked SQLite file in WAL
mode still answers reads."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import httpx
from sqlalchemy import Engine
from sqlalchemy.pool import NullPool

from billing.admin_keys import create_admin_key
from billing.db import make_engine
from gateway.app import create_app
from gateway.settings import Settings
from tests.billing.dbutil import fresh_database
from tests.billing.outage import outage_of
from tests.gateway.live import start

LIMIT = 3
ENV_ADMIN_KEY = "tga-env-configured-secret"
FLUSH = {"tenant": "acme"}


@contextmanager
def unreachable_database(db_url: str) -> Iterator[tuple[str, Engine, Callable[[], AbstractContextManager[None]]]]:
    """(url, engine, down): the database at db_url through `engine`; `down()` takes it away for a with-block."""
    if not db_url.startswith("sqlite"):
        with outage_of(db_url, busy_timeout_s=0.3) as outage:
            yield outage.url, outage.engine, outage.down
        return
    folder = Path(db_url.split("///", 1)[1]).parent
    engine = make_engine(db_url, busy_timeout_s=0.3, poolclass=NullPool)

    @contextmanager
    def down() -> Iterator[None]:
        away = folder.with_name(folder.name + "-away")
        folder.rename(away)
        try:
            yield
        finally:
            away.rename(folder)

    try:
        yield db_url, engine, down
    finally:
        engine.dispose()


def _flush(url: str, key: str) -> httpx.Response:
    return httpx.post(url + "/admin/cache/flush", json=FLUSH, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def _sign_in(url: str, key: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=30) as client:
        form = client.get("/admin/login")
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
        assert form.status_code == 200 and csrf, form.text
        return client.post("/admin/login", data={"csrf_token": csrf.group(1), "key": key})


def _passed_the_admin_check(r: httpx.Response) -> bool:
    # no semantic cache on this gateway: past require_admin, the flush itself answers 400
    return r.status_code == 400 and "semantic cache is not enabled" in r.json()["error"]["message"]


def test_stored_admin_keys_get_503_during_an_outage_and_work_after(tmp_path: Path) -> None:
    (tmp_path / "db").mkdir()
    with fresh_database(tmp_path / "db") as db_url, unreachable_database(db_url) as (url, engine, down):
        stored_key = create_admin_key(engine, "ops").key
        settings = Settings(database_url=url, key_cache_ttl_s=0.0, semantic_cache=False, admin_key=ENV_ADMIN_KEY,
                            auth_fail_limit=LIMIT, ledger_spill_dir=tmp_path / "spill")
        live = start(create_app(settings, engine, {}, []))
        try:
            assert _passed_the_admin_check(_flush(live.url, stored_key))
            with down():
                for _ in range(LIMIT * 2):
                    r = _flush(live.url, stored_key)
                    assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
                    assert r.json()["error"]["type"] == "server_error"
                    assert r.json()["error"]["code"] == "service_unavailable"
                    page = _sign_in(live.url, stored_key)
                    assert page.status_code == 503 and page.headers["Retry-After"] == "5", page.text
                    assert "The database is unavailable" in page.text and 'role="alert"' in page.text
                    assert 'name="csrf_token"' in page.text  # the form is there to try again
                assert _passed_the_admin_check(_flush(live.url, ENV_ADMIN_KEY))  # needs no database
                assert _sign_in(live.url, ENV_ADMIN_KEY).status_code == 303
            assert _passed_the_admin_check(_flush(live.url, stored_key))
            signed_in = _sign_in(live.url, stored_key)
            assert signed_in.status_code == 303 and signed_in.headers["location"] == "/admin", signed_in.text
            # the 503s were not counted: this address still has its full allowance of refusals
            statuses = [_flush(live.url, f"tga-wrong-{i}").status_code for i in range(LIMIT + 1)]
            assert statuses == [403] * LIMIT + [429]
        finally:
            live.stop()
