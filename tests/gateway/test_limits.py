import threading
import time

import pytest

from billing.accounts import create_key, create_tenant, revoke_key
from billing.db import make_engine
from billing.ledger import Ledger
from billing.models import UsageEvent
from gateway.auth import KeyStore
from gateway.errors import APIError
from gateway.limits import Limiter

NOW = 1_800_000_010.0  # 10 s into a minute


def _principal(db, **key_limits):
    create_tenant(db, "acme")
    created = create_key(db, "acme", **key_limits)
    return KeyStore(db).authenticate(f"Bearer {created.key}"), created


def test_rpm_holds_across_two_instances_sharing_one_database(db, db_url):
    p, _ = _principal(db, rpm=10)
    engines = [make_engine(db_url), make_engine(db_url)]  # two gateways: separate pools, one database
    limiters = [Limiter(e) for e in engines]
    admitted, rejected = [], []

    def hammer(limiter: Limiter) -> None:
        for _ in range(15):
            try:
                limiter.admit(p, NOW)
                admitted.append(1)
            except APIError as e:
                assert e.status == 429 and e.code == "rate_limit_exceeded"
                assert e.headers["Retry-After"] == "50"
                rejected.append(1)

    threads = [threading.Thread(target=hammer, args=(lim,)) for lim in limiters for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 10 and len(rejected) == 50
    limiters[0].admit(p, NOW + 60)  # the next minute starts fresh
    for e in engines:
        e.dispose()


def test_tpm_counts_tokens_written_by_the_ledger(db):
    p, created = _principal(db, tpm=100)
    ledger = Ledger(db).start()
    limiter = Limiter(db, ledger)
    limiter.admit(p)
    ledger.record(UsageEvent(request_id="r1", tenant_id=p.tenant_id, api_key_id=p.key_id, model="m",
                             endpoint="completions", status="ok", prompt_tokens=60, completion_tokens=40))
    with pytest.raises(APIError) as info:  # seen at once, from the ledger's queue
        limiter.admit(p)
    assert info.value.code == "rate_limit_exceeded" and "tokens per minute" in info.value.message
    ledger.close()
    with pytest.raises(APIError):  # and from the database, by another process
        Limiter(db).admit(p)


def test_key_and_tenant_budgets(db):
    tenant = create_tenant(db, "acme", budget_usd=1.0)
    k1 = create_key(db, "acme", budget_usd=0.5)
    k2 = create_key(db, "acme")
    store = KeyStore(db)
    p1, p2 = store.authenticate(f"Bearer {k1.key}"), store.authenticate(f"Bearer {k2.key}")
    ledger = Ledger(db).start()
    limiter = Limiter(db, ledger)
    limiter.admit(p1)
    ledger.record(UsageEvent(request_id="a", tenant_id=tenant.id, api_key_id=k1.id, model="m", endpoint="completions",
                             status="ok", cost_usd=0.5))
    ledger.flush()
    with pytest.raises(APIError) as info:
        Limiter(db).admit(p1)
    assert (info.value.status, info.value.code) == (429, "insufficient_quota")
    limiter.admit(p2)  # the tenant still has budget
    ledger.record(UsageEvent(request_id="b", tenant_id=tenant.id, api_key_id=k2.id, model="m", endpoint="completions",
                             status="ok", cost_usd=0.5))
    with pytest.raises(APIError) as info:
        limiter.admit(p2)
    assert info.value.code == "insufficient_quota" and "Tenant" in info.value.message
    ledger.close()


def test_auth_rejects_unknown_malformed_and_revoked(db):
    create_tenant(db, "acme")
    created = create_key(db, "acme")
    store = KeyStore(db, ttl_s=0.0)
    assert store.authenticate(f"Bearer {created.key}").tenant == "acme"
    for header in (None, "", "Bearer", "Basic abc", "Bearer tg-unknown"):
        with pytest.raises(APIError) as info:
            store.authenticate(header)
        assert info.value.status == 401
    revoke_key(db, str(created.id))
    with pytest.raises(APIError):
        store.authenticate(f"Bearer {created.key}")


def test_revocation_reaches_a_caching_process_within_the_ttl(db):
    create_tenant(db, "acme")
    created = create_key(db, "acme")
    store = KeyStore(db, ttl_s=0.2)
    store.authenticate(f"Bearer {created.key}")
    revoke_key(db, created.prefix)
    time.sleep(0.25)
    with pytest.raises(APIError):
        store.authenticate(f"Bearer {created.key}")
