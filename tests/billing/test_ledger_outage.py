"""The ledger through a database outage (a locked SQLite file, or PostgreSQL behind a cut proxy):
events wait in a bounded memory buffer and spill to disk, and every one reaches the database once
it is back, counted once, also when the process stopped during the outage."""

from __future__ import annotations

from decimal import Decimal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from billing.accounts import create_key, create_tenant
from billing.ledger import Ledger
from billing.ledger_spill import SpillDir, read_segment
from billing.models import SpendCounter, UsageEvent
from tests.billing.outage import Outage, outage_of


@pytest.fixture
def outage(db_url: str) -> Iterator[Outage]:
    with outage_of(db_url) as o:
        yield o


def _event(rid: str, key_id: int, tenant_id: int, cost: float = 0.01) -> UsageEvent:
    return UsageEvent(request_id=rid, tenant_id=tenant_id, api_key_id=key_id, model="m", endpoint="chat.completions",
                      status="ok", prompt_tokens=7, completion_tokens=3, latency_s=0.01, cost_usd=cost)


def _count(db: Engine) -> int:
    with Session(db) as s:
        return s.scalar(select(func.count()).select_from(UsageEvent))


def _spend(db: Engine) -> dict[tuple[str, int], float]:
    with Session(db) as s:
        return {(c.scope, c.scope_id): round(c.spent_usd, 9) for c in s.scalars(select(SpendCounter))}


def _segments(spill: Path) -> list[Path]:
    return sorted(spill.glob("usage-*.jsonl"))


def _wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_events_wait_through_an_outage_then_all_arrive_once(outage: Outage, db: Engine, tmp_path: Path) -> None:
    tenant = create_tenant(db, "acme")
    key = create_key(db, "acme")
    spill = tmp_path / "spill"
    ledger = Ledger(outage.engine, spill_dir=spill, max_buffer=20, max_batch=10, retry_delay_s=0.1,
                    max_retry_delay_s=0.4).start()
    ledger.record(_event("before", key.id, tenant.id))
    assert ledger.flush(10)
    with outage.down():
        for i in range(100):
            ledger.record(_event(f"during-{i}", key.id, tenant.id))
            assert ledger.buffered <= 20  # bounded: the rest is on disk
        _wait(lambda: ledger.database_down and ledger.spilled_total >= 80, 15, "events spilled to disk")
        assert not ledger.flush(timeout=0.3)
        assert ledger.backlog == 100
        assert ledger.pending_spend("key", key.id) == 1  # limits still see the spend
        assert _count(db) == 1
        # the writer may still be moving the last batch from memory to disk: wait until disk and counter agree
        _wait(lambda: sum(len(read_segment(p)) for p in _segments(spill)) == ledger.spilled_total, 5,
              "the spill counter to match the segments on disk")
    assert ledger.flush(timeout=30)
    _wait(lambda: not ledger.database_down, 5, "the ledger to see the database back")
    assert ledger.backlog == 0
    assert _count(db) == 101
    assert _spend(db) == {("key", key.id): Decimal("1.01"), ("tenant", tenant.id): Decimal("1.01")}
    assert ledger.pending_spend("key", key.id) == 0
    assert _segments(spill) == []
    ledger.close()


def test_stopping_during_an_outage_spills_and_the_next_process_replays(outage: Outage, db: Engine,
                                                                        tmp_path: Path) -> None:
    tenant = create_tenant(db, "acme")
    key = create_key(db, "acme")
    spill = tmp_path / "spill"
    first = Ledger(outage.engine, spill_dir=spill, retry_delay_s=0.1).start()
    with outage.down():
        for i in range(30):
            first.record(_event(f"r-{i}", key.id, tenant.id))
        started = time.monotonic()
        first.close(timeout=20)
        assert time.monotonic() - started < 10  # it stops: one more try, then everything goes to disk
        assert sum(len(read_segment(p)) for p in _segments(spill)) == 30
        assert _count(db) == 0
    # one of them reached the database some other way before the replay: it is not counted twice
    Ledger(db).start().record(_event("r-0", key.id, tenant.id))
    _wait(lambda: _count(db) == 1, 10, "the first event")
    second = Ledger(db, spill_dir=spill).start()
    _wait(lambda: _count(db) == 30 and not _segments(spill), 20, "the replay")
    assert second.replayed_total == 30
    assert _spend(db) == {("key", key.id): Decimal("0.3"), ("tenant", tenant.id): Decimal("0.3")}
    second.close()
    assert not spill.exists()  # no segment, no lock file left behind


def test_a_live_process_segments_are_not_taken(tmp_path: Path) -> None:
    alive, other = SpillDir(tmp_path), SpillDir(tmp_path)
    row = {"request_id": "x", "created_at": None, "tags": ["a"]}
    alive.append([(1, row)])
    assert [segments for _, segments in other.orphans()] == []
    alive.close()  # its process stopped: now its segment is an orphan
    [(lock, segments)] = list(other.orphans())
    assert [read_segment(p) for p in segments] == [[(1, row)]]
    # a torn last line (a process killed mid-write) is skipped
    with segments[0].open("a") as f:
        f.write('{"request_id": "y", "crea')
    assert read_segment(segments[0]) == [(1, row)]
    other.close()
