"""Limits reserve a request's worst case at admission and settle when its usage event is written: rpm, tpm
and budgets hold across gateway processes that share one database, with no read-then-write race."""

import itertools
import threading
import time
from datetime import datetime, timezone

import pytest
from sqlalchemy import select

from billing.accounts import create_key, create_tenant, revoke_key
from billing.db import make_engine
from billing.ledger import Ledger
from billing.models import GatewayProcess, Reservation, SpendCounter, UsageEvent
from billing.reservations import DEAD_AFTER_S, Worst, heartbeat, sweep_orphans
from gateway.auth import KeyStore
from gateway.errors import APIError
from gateway.limits import Limiter

NOW = 1_800_000_010.0  # 10 s into a minute
_ids = itertools.count()


def _principal(db, **key_limits):
    create_tenant(db, "acme", budget_usd=key_limits.pop("tenant_budget_usd", None))
    created = create_key(db, "acme", **key_limits)
    return KeyStore(db).authenticate(f"Bearer {created.key}"), created


def _admit(limiter: Limiter, p, cost: float = 0.0, tokens: int = 0, now: float | None = None,
           request_id: str | None = None):
    rid = request_id or f"r{next(_ids)}"
    limiter.admit(p, rid, Worst(cost, tokens), model="m", endpoint="chat.completions", now=now)
    return rid


def _event(rid: str, p, cost: float = 0.0, prompt: int = 0, completion: int = 0) -> UsageEvent:
    return UsageEvent(request_id=rid, tenant_id=p.tenant_id, api_key_id=p.key_id, model="m",
                      endpoint="chat.completions", status="ok", prompt_tokens=prompt, completion_tokens=completion,
                      cost_usd=cost)


def _counters(db, p) -> dict[str, tuple[float, float]]:
    with db.connect() as conn:
        rows = conn.execute(select(SpendCounter.scope, SpendCounter.spent_usd, SpendCounter.reserved_usd)
                            .where(SpendCounter.scope_id.in_([p.key_id, p.tenant_id]))).all()
    # exact Decimal amounts: as floats they compare equal to the decimal literals in the tests
    return {scope: (float(spent), float(reserved)) for scope, spent, reserved in rows}


def test_rpm_holds_across_two_instances_sharing_one_database(db, db_url):
    p, _ = _principal(db, rpm=10)
    engines = [make_engine(db_url), make_engine(db_url)]  # two gateways: separate pools, one database
    limiters = [Limiter(e) for e in engines]
    admitted, rejected = [], []

    def hammer(limiter: Limiter) -> None:
        for _ in range(15):
            try:
                _admit(limiter, p, now=NOW)
                admitted.append(1)
            except APIError as e:
                assert e.status == 429 and e.code == "rate_limit_exceeded"
                assert e.headers["Retry-After"] == "50" and e.headers["x-ratelimit-remaining-requests"] == "0"
                rejected.append(1)

    threads = [threading.Thread(target=hammer, args=(lim,)) for lim in limiters for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 10 and len(rejected) == 50
    _admit(limiters[0], p, now=NOW + 60)  # the next minute starts fresh
    for e in engines:
        e.dispose()


def test_tpm_reserves_at_admission_and_settles_to_the_tokens_used(db):
    p, _ = _principal(db, tpm=100)
    ledger = Ledger(db).start()
    limiter = Limiter(db, ledger)
    first = _admit(limiter, p, tokens=60)
    with pytest.raises(APIError) as info:  # 60 held by the first request: another 60 would pass the limit
        _admit(limiter, p, tokens=60)
    assert info.value.code == "rate_limit_exceeded" and "tokens per minute" in info.value.message
    assert info.value.type == "tokens" and info.value.headers["Retry-After"]  # it fits once the first one settles
    assert "x-should-retry" not in info.value.headers
    assert info.value.headers["x-ratelimit-remaining-tokens"] == "40"
    ledger.record(_event(first, p, prompt=20, completion=10))  # it used 30
    ledger.flush()
    _admit(Limiter(db), p, tokens=60)  # 30 + 60: room, seen by another process too
    with pytest.raises(APIError):
        _admit(limiter, p, tokens=20)  # 30 + 60 + 20
    with pytest.raises(APIError) as info:  # more than the limit on its own: waiting cannot help
        _admit(limiter, p, tokens=101, now=time.time() + 60)
    assert info.value.type == "tokens" and "Request too large for tokens per minute" in info.value.message
    assert info.value.headers["x-should-retry"] == "false" and "Retry-After" not in info.value.headers
    ledger.close()


def test_budgets_hold_the_worst_case_and_settle_to_the_exact_cost(db):
    p, _ = _principal(db, budget_usd=0.5, tenant_budget_usd=0.8)
    ledger = Ledger(db).start()
    limiter = Limiter(db, ledger)
    first = _admit(limiter, p, cost=0.3)
    assert _counters(db, p) == {"key": (0.0, 0.3), "tenant": (0.0, 0.3)}
    with pytest.raises(APIError) as info:
        _admit(limiter, p, cost=0.3)
    err = info.value
    assert (err.status, err.code) == (429, "insufficient_quota")
    assert ("This API key has $0.20 left of its monthly budget of $0.50 ($0.00 spent, $0.30 held by requests in "
            "flight)") in err.message
    assert "may cost up to $0.30" in err.message
    assert _counters(db, p) == {"key": (0.0, 0.3), "tenant": (0.0, 0.3)}  # the refusal changed nothing
    ledger.record(_event(first, p, cost=0.1))
    ledger.flush()
    assert _counters(db, p) == {"key": (0.1, 0.0), "tenant": (0.1, 0.0)}
    with ledger._engine.connect() as conn:
        assert conn.execute(select(Reservation)).first() is None
    second = _admit(limiter, p, cost=0.4)  # 0.1 spent + 0.4: exactly the key's budget
    limiter.release(second)  # refused after admission: it goes back whole
    assert _counters(db, p) == {"key": (0.1, 0.0), "tenant": (0.1, 0.0)}
    ledger.close()


def test_the_tenant_budget_binds_across_its_keys(db):
    create_tenant(db, "acme", budget_usd=1.0)
    keys = [create_key(db, "acme"), create_key(db, "acme", budget_usd=5.0)]
    store = KeyStore(db)
    p1, p2 = (store.authenticate(f"Bearer {k.key}") for k in keys)
    limiter = Limiter(db)
    _admit(limiter, p1, cost=0.6)
    with pytest.raises(APIError) as info:
        _admit(limiter, p2, cost=0.6)
    assert info.value.code == "insufficient_quota" and "Tenant 'acme'" in info.value.message


def test_concurrent_requests_at_the_budget_edge_never_overspend(db, db_url):
    """50 requests at once from four threads on two 'gateways' (their own connection pools), each worth a
    fifth of the budget at worst: exactly 5 are admitted, and once they settle the spend is within budget."""
    p, _ = _principal(db, budget_usd=1.0)
    engines = [make_engine(db_url), make_engine(db_url)]
    limiters = [Limiter(e) for e in engines]
    admitted: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def hammer(limiter: Limiter, tries: int) -> None:
        barrier.wait()
        for _ in range(tries):
            try:
                rid = _admit(limiter, p, cost=0.2)
                with lock:
                    admitted.append(rid)
            except APIError as e:
                assert e.code == "insufficient_quota"

    threads = [threading.Thread(target=hammer, args=(lim, tries)) for lim, tries in zip(limiters * 2, (13, 13, 12, 12))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 5
    assert _counters(db, p)["key"] == (0.0, 1.0)
    ledger = Ledger(db).start()
    for rid in admitted:
        ledger.record(_event(rid, p, cost=0.15))
    ledger.close()
    spent, reserved = _counters(db, p)["key"]
    assert spent == 0.75 and reserved == 0.0  # exact: 5 × 0.15
    for e in engines:
        e.dispose()


def test_a_dead_gateways_reservations_are_released_and_recorded_as_interrupted(db):
    p, _ = _principal(db, budget_usd=1.0)
    dead = Limiter(db, owner="host:1:dead")
    now = time.time()
    heartbeat(db, dead.owner, now=now - DEAD_AFTER_S - 5)  # it beat once, long ago
    rid = _admit(dead, p, cost=0.7, now=now - DEAD_AFTER_S - 5)
    live = Limiter(db)
    heartbeat(db, live.owner, now=now)
    held = _admit(live, p, cost=0.1)
    with pytest.raises(APIError):
        _admit(live, p, cost=0.3)  # 0.7 + 0.1 held
    assert sweep_orphans(db, now=now) == 1  # the live gateway's own reservation stays
    assert _counters(db, p)["key"] == (0.0, 0.1)
    with db.connect() as conn:
        event = conn.execute(select(UsageEvent).where(UsageEvent.request_id == rid)).one()
        assert {r.request_id for r in conn.execute(select(Reservation))} == {held}
        assert conn.execute(select(GatewayProcess.id)).scalars().all()
    assert (event.status, event.completion_tokens, event.cost_usd) == ("interrupted", 0, 0.0)
    # the request finished after all (its gateway was only slow): its real event replaces the placeholder
    ledger = Ledger(db).start()
    ledger.record(UsageEvent(request_id=rid, tenant_id=p.tenant_id, api_key_id=p.key_id, model="m",
                             endpoint="chat.completions", status="ok", completion_tokens=9, cost_usd=0.05,
                             created_at=datetime.now(timezone.utc)))
    ledger.close()
    with db.connect() as conn:
        event = conn.execute(select(UsageEvent).where(UsageEvent.request_id == rid)).one()
    assert (event.status, event.completion_tokens) == ("ok", 9)
    assert _counters(db, p)["key"] == (0.05, 0.1)


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
