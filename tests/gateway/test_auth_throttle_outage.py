"""The failed-authentication throttle counts refused keys only: the 503 an unknown key gets while the
key database is unreachable is neither counted nor turned into a 429."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.auth_throttle import FailedAuthThrottle
from gateway.errors import APIError, database_unavailable
from gateway.settings import Settings
from tests.billing.outage import outage_of
from tests.gateway.live import start

LIMIT = 3


def _refused(status: int) -> APIError:
    return APIError(status, "Incorrect or revoked API key provided.", "invalid_request_error", "invalid_api_key")


def test_only_refused_keys_count() -> None:
    throttle = FailedAuthThrottle(limit=LIMIT, window_s=60, clock=lambda: 1000.0)
    unavailable = database_unavailable()
    for _ in range(LIMIT * 3):
        assert throttle.throttled(unavailable, "a") is unavailable
    assert throttle.failed("b") is None and "a" not in throttle._failures
    statuses = [throttle.throttled(_refused(s), "a").status for s in (401, 403, 401, 401, 403)]
    assert statuses == [401, 403, 401, 429, 429]  # the admin API's 403 (not an admin key) counts too
    assert throttle.throttled(unavailable, "a") is unavailable  # even over the limit, a 503 stays a 503


def test_unknown_keys_during_a_database_outage_get_503_and_are_not_counted(db_url: str, tmp_path: Path) -> None:
    if db_url.startswith("sqlite"):
        pytest.skip("SQLite in WAL mode still reads keys while locked: no 503 (run with TOLLGATE_TEST_DATABASE_URL)")
    with outage_of(db_url, busy_timeout_s=0.3) as outage:
        settings = Settings(database_url=outage.url, key_cache_ttl_s=0.0, semantic_cache=False,
                            admission_db_timeout_s=0.3, auth_fail_limit=LIMIT, ledger_spill_dir=tmp_path / "spill")
        live = start(create_app(settings, outage.engine, {}, []))
        url = live.url + "/v1/models"
        try:
            with outage.down():
                for i in range(LIMIT * 3):
                    r = httpx.get(url, headers={"Authorization": f"Bearer tg-unknown-{i}"}, timeout=30)
                    assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
            # the 503s left nothing behind: the address gets its full allowance of 401s, then 429
            statuses = [httpx.get(url, headers={"Authorization": f"Bearer tg-wrong-{i}"}, timeout=30).status_code
                        for i in range(LIMIT + 1)]
            assert statuses == [401] * LIMIT + [429]
        finally:
            live.stop()
