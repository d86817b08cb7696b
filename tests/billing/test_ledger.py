import threading
import time

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from billing.accounts import create_key, create_tenant
from billing.ledger import Ledger
from billing.models import RateWindow, SpendCounter, UsageEvent
from billing.periods import month_of


def _event(rid: str, key_id: int | None = None, tenant_id: int | None = None, cost: float = 0.001,
           status: str = "ok") -> UsageEvent:
    return UsageEvent(request_id=rid, tenant_id=tenant_id, api_key_id=key_id, model="m", endpoint="chat.completions",
                      status=status, prompt_tokens=10, completion_tokens=5, latency_s=0.01, cost_usd=cost)


def _count(db) -> int:
    with Session(db) as s:
        return s.scalar(select(func.count()).select_from(UsageEvent))


def test_thousand_events_then_shutdown_leaves_exactly_a_thousand(db):
    ledger = Ledger(db).start()
    def worker(offset: int) -> None:
        for i in range(250):
            ledger.record(_event(f"req-{offset + i}"))
    threads = [threading.Thread(target=worker, args=(n * 250,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ledger.close()
    assert _count(db) == 1000
    assert ledger.backlog == 0


def test_record_does_not_block_on_the_database(db):
    ledger = Ledger(db).start()
    start = time.perf_counter()
    for i in range(1000):
        ledger.record(_event(f"fast-{i}"))
    elapsed = time.perf_counter() - start
    ledger.close()
    assert elapsed < 0.5, elapsed  # no SQL on the request path
    assert _count(db) == 1000


def test_idempotent_on_request_id_and_counts_spend_once(db):
    tenant = create_tenant(db, "acme")
    key = create_key(db, "acme")
    ledger = Ledger(db).start()
    ledger.record(_event("dup", key.id, tenant.id, cost=0.25))
    ledger.record(_event("dup", key.id, tenant.id, cost=0.25))  # same batch
    ledger.flush()
    ledger.record(_event("dup", key.id, tenant.id, cost=0.25))  # a later batch
    ledger.record(_event("other", key.id, tenant.id, cost=0.5))
    ledger.close()
    assert _count(db) == 2
    with Session(db) as s:
        spend = {(c.scope, c.scope_id): c.spent_usd for c in s.scalars(select(SpendCounter))}
        tokens = s.scalar(select(func.sum(RateWindow.tokens)).where(RateWindow.api_key_id == key.id))
    assert spend == {("key", key.id): 0.75, ("tenant", tenant.id): 0.75}
    assert tokens == 30


def test_pending_spend_is_visible_before_the_write(db):
    tenant = create_tenant(db, "acme")
    key = create_key(db, "acme")
    ledger = Ledger(db)  # not started: nothing is written
    ledger.record(_event("a", key.id, tenant.id, cost=1.0))
    assert ledger.pending_spend("key", key.id) == 1.0
    assert ledger.pending_spend("tenant", tenant.id) == 1.0
    assert ledger.pending_tokens(key.id) == 15
    ledger.start().flush()
    assert ledger.pending_spend("key", key.id) == 0.0
    with Session(db) as s:
        counter = s.get(SpendCounter, ("key", key.id, month_of(time.time())))
    assert counter is not None and counter.spent_usd == 1.0
    ledger.close()


def test_failed_and_cancelled_events_are_kept(db):
    ledger = Ledger(db).start()
    ledger.record(_event("x1", status="failed"))
    ledger.record(_event("x2", status="cancelled"))
    ledger.close()
    with Session(db) as s:
        assert sorted(s.scalars(select(UsageEvent.status))) == ["cancelled", "failed"]
