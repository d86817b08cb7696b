"""Budget leases (billing/budget_leases.py): far from its limits a key is admitted from memory out of a slice
reserved in SQL once; near them every request reserves on its own. Either way the counters every gateway reads
hold everything admitted, so nothing spends past a limit, and once the leases are given back the counters are
exactly the events' sums."""

import itertools
import threading
import time
from decimal import Decimal

import pytest
from sqlalchemy import func, select

from billing.accounts import create_key, create_tenant
from billing.db import make_engine
from billing.ledger import Ledger
from billing.models import RateWindow, Reservation, SpendCounter, UsageEvent
from billing.periods import minute_of
from billing.reservations import DEAD_AFTER_S, LEASE_ENDPOINT, Worst, sweep_orphans
from gateway.auth import KeyStore
from gateway.errors import APIError
from gateway.limits import Limiter

_ids = itertools.count()


def _principal(db, tenant_budget_usd=None, **key_limits):
    name = f"lease-{next(_ids)}"
    create_tenant(db, name, budget_usd=tenant_budget_usd)
    return KeyStore(db).authenticate(f"Bearer {create_key(db, name, **key_limits).key}")


def _event(rid, p, cost, tokens=0) -> UsageEvent:
    return UsageEvent(request_id=rid, tenant_id=p.tenant_id, api_key_id=p.key_id, model="m",
                      endpoint="chat.completions", status="ok", prompt_tokens=tokens, completion_tokens=0,
                      cost_usd=cost)


def _run(limiter: Limiter, ledger: Ledger, p, worst_usd, cost_usd, worst_tokens=0, tokens=0):
    """One request: admitted, its hold shrunk to `cost_usd`, its event recorded. Its id, or None if refused."""
    rid = f"r{next(_ids)}"
    try:
        limiter.admit(p, rid, Worst(Decimal(worst_usd), worst_tokens), model="m", endpoint="chat.completions")
    except APIError as e:
        assert e.status == 429
        return None
    limiter.shrink(rid, Decimal(cost_usd), tokens)
    ledger.record(_event(rid, p, cost_usd, tokens))
    return rid


def _rows(db):
    with db.connect() as conn:
        return list(conn.execute(select(Reservation.request_id, Reservation.endpoint)))


def _counter(db, scope, scope_id):
    with db.connect() as conn:
        row = conn.execute(select(SpendCounter.spent_usd, SpendCounter.reserved_usd).where(
            SpendCounter.scope == scope, SpendCounter.scope_id == scope_id)).one()
    return row.spent_usd, row.reserved_usd


def test_a_key_far_from_its_limits_is_admitted_from_a_lease_not_a_reservation_each(db):
    p = _principal(db, tenant_budget_usd=500.0, budget_usd=100.0, rpm=100_000, tpm=10**8)
    ledger = Ledger(db).start()
    limiter = Limiter(db, ledger, leases=True)
    done = [_run(limiter, ledger, p, "0.01", "0.001", 500, 40) for _ in range(60)]
    assert all(done)
    rows = _rows(db)
    assert rows and {endpoint for _, endpoint in rows} == {LEASE_ENDPOINT}  # no request has a row of its own
    assert limiter.leases.taken <= 3  # renewed when half used, in the background
    ledger.flush()
    limiter.close()
    ledger.close()
    assert _rows(db) == []  # given back
    assert _counter(db, "key", p.key_id) == (Decimal("0.060"), 0)  # exact: 60 × $0.001
    assert _counter(db, "tenant", p.tenant_id) == (Decimal("0.060"), 0)
    with db.connect() as conn:
        window = conn.execute(select(RateWindow.requests, RateWindow.tokens).where(
            RateWindow.api_key_id == p.key_id, RateWindow.minute == minute_of(time.time()))).one()
        events = conn.execute(select(func.count()).select_from(UsageEvent)
                              .where(UsageEvent.api_key_id == p.key_id)).scalar()
    # the rpm the leases did not use went back; the tokens are what the events used
    assert (window.requests, window.tokens) == (60, 60 * 40)
    assert events == 60


def test_near_a_limit_nothing_is_leased_and_each_request_reserves_in_sql(db):
    p = _principal(db, budget_usd=1.0)  # 100 worst cases of $0.01: a 16th of it holds fewer than 8
    ledger = Ledger(db).start()
    limiter = Limiter(db, ledger, leases=True)
    rid = f"r{next(_ids)}"
    limiter.admit(p, rid, Worst(Decimal("0.01"), 0), model="m", endpoint="chat.completions")
    assert _rows(db) == [(rid, "chat.completions")]
    assert limiter.leases.taken == 0
    limiter.release(rid)
    ledger.close()
    limiter.close()


def test_rate_limit_headers_count_down_through_a_lease(db):
    p = _principal(db, rpm=1000, tpm=10**6)
    limiter = Limiter(db, leases=True)
    remaining = []
    for _ in range(3):
        headers = limiter.admit(p, f"r{next(_ids)}", Worst(Decimal(0), 100), model="m", endpoint="chat.completions")
        remaining.append(int(headers.headers()["x-ratelimit-remaining-requests"]))
    assert remaining == [999, 998, 997]
    assert limiter.leases.taken == 1


def test_a_refused_request_gives_its_hold_back_to_the_lease(db):
    p = _principal(db, budget_usd=100.0)
    ledger = Ledger(db).start()
    limiter = Limiter(db, ledger, leases=True)
    rid = f"r{next(_ids)}"
    limiter.admit(p, rid, Worst(Decimal("0.5"), 0), model="m", endpoint="chat.completions")
    lease = limiter.leases._active[p.key_id]
    assert (lease.used_usd, lease.unsettled) == (Decimal("0.5"), 1)
    limiter.release(rid)
    assert (lease.used_usd, lease.unsettled) == (0, 0)
    limiter.close()
    ledger.close()
    assert _counter(db, "key", p.key_id) == (0, 0)


def test_leases_on_two_gateways_never_spend_past_a_budget(db, db_url):
    """Two gateways (their own pools and leases) run requests of $0.01 each, worth their worst case, against
    $6: they lease while far from the edge, reserve one by one near it, and together spend exactly the budget
    (600 requests), never more."""
    p = _principal(db, budget_usd=6.0)
    engines = [make_engine(db_url), make_engine(db_url)]
    ledgers = [Ledger(e).start() for e in engines]
    limiters = [Limiter(e, ledger, leases=True) for e, ledger in zip(engines, ledgers)]
    admitted, refused = [], []
    lock = threading.Lock()

    def hammer(limiter: Limiter, ledger: Ledger) -> None:
        misses = 0
        while misses < 40:  # refused 40 times in a row: the budget is spent (leases near the edge go back meanwhile)
            rid = _run(limiter, ledger, p, "0.01", "0.01")
            with lock:
                (admitted if rid else refused).append(rid)
            misses = 0 if rid else misses + 1
            if not rid:
                time.sleep(0.01)

    threads = [threading.Thread(target=hammer, args=(lim, led)) for lim, led in zip(limiters * 2, ledgers * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ledger, limiter in zip(ledgers, limiters):
        ledger.close()
        limiter.close()
    assert sum(lim.leases.taken for lim in limiters) >= 2  # they did lease
    spent, reserved = _counter(db, "key", p.key_id)
    assert spent <= Decimal("6.0") and reserved == 0
    assert spent == Decimal("0.01") * len(admitted)
    assert len(admitted) == 600  # every cent of it: near the edge each request reserved on its own
    for e in engines:
        e.dispose()


def test_a_dead_gateways_lease_is_released_and_leaves_no_event(db):
    p = _principal(db, budget_usd=100.0)
    dead = Limiter(db, owner="host:2:dead", leases=True)
    dead.admit(p, "r-dead", Worst(Decimal("0.1"), 0), model="m", endpoint="chat.completions")
    (lease_id, _), = _rows(db)
    assert _counter(db, "key", p.key_id)[1] > Decimal("0.1")  # the whole lease is held
    assert sweep_orphans(db, now=time.time() + DEAD_AFTER_S + 5) == 1
    assert _rows(db) == [] and _counter(db, "key", p.key_id) == (0, 0)
    with db.connect() as conn:
        assert conn.execute(select(UsageEvent).where(UsageEvent.request_id == lease_id)).first() is None


@pytest.mark.parametrize("limits", [{"budget_usd": 100.0}, {"rpm": 1000}, {"tpm": 10**6}])
def test_a_lease_expires_and_goes_back_once_its_requests_are_written(db, limits):
    p = _principal(db, **limits)
    ledger = Ledger(db).start()
    limiter = Limiter(db, ledger, leases=True)
    limiter.leases.ttl_s = 0.2
    rid = _run(limiter, ledger, p, "0.01", "0.002", 100, 10)
    assert rid and _rows(db)
    deadline = time.time() + 10
    while _rows(db) and time.time() < deadline:
        time.sleep(0.05)
    assert _rows(db) == []  # expired, its request written, and the lease given back by its thread
    assert limiter.leases.closed == 1
    limiter.close()
    ledger.close()


def test_a_burst_of_first_requests_takes_one_lease_not_one_each(db):
    p = _principal(db, budget_usd=1000.0, rpm=10**6)
    limiter = Limiter(db, leases=True)
    barrier = threading.Barrier(32)

    def first() -> None:
        barrier.wait()
        limiter.admit(p, f"r{next(_ids)}", Worst(Decimal("0.01"), 0), model="m", endpoint="chat.completions")

    threads = [threading.Thread(target=first) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert limiter.leases.taken == 1
    assert len(_rows(db)) == 1
