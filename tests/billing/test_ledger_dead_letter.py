"""Events the database refuses for their data (a constraint, a value a column cannot hold) are no
outage: the rest of their batch is written, they go to the dead-letter file next to the spill
segments, and later events keep flowing. SQLite, and PostgreSQL with TOLLGATE_TEST_DATABASE_URL."""

from __future__ import annotations

from decimal import Decimal
import json
import logging
from pathlib import Path

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from billing.accounts import create_key, create_tenant
from billing.ledger import Ledger
from billing.ledger_spill import DEAD_LETTER_FILE, ERROR_FIELD, SpillDir
from billing.models import SpendCounter, UsageEvent, utcnow

NO_SUCH_TENANT = 987_654
END_USER = "end-user-4f1c"  # what a refused row holds never reaches the log, only its request id


def _event(rid: str, key_id: int, tenant_id: int, **overrides: object) -> UsageEvent:
    fields = dict(request_id=rid, created_at=utcnow(), tenant_id=tenant_id, api_key_id=key_id, model="m",
                  endpoint="chat.completions", status="ok", tags=[], prompt_tokens=7, completion_tokens=3,
                  cached_tokens=0, cache_hit=False, latency_s=0.01, cost_usd=0.01)
    return UsageEvent(**{**fields, **overrides})


def _poison(key_id: int, tenant_id: int, postgresql: bool) -> dict[str, UsageEvent]:
    """Rows each dialect refuses: a missing tenant (foreign key), no model (NOT NULL); NUL in text on PostgreSQL."""
    poison = {"poison-fk": _event("poison-fk", key_id, NO_SUCH_TENANT, end_user=END_USER),
              "poison-null": _event("poison-null", key_id, tenant_id, model=None, end_user=END_USER)}
    if postgresql:
        poison["poison-nul"] = _event("poison-nul", key_id, tenant_id, end_user=END_USER + "\x00")
    return poison


def _stored(db: Engine) -> set[str]:
    with Session(db) as s:
        return set(s.scalars(select(UsageEvent.request_id)))


def _spend(db: Engine) -> dict[tuple[str, int], float]:
    with Session(db) as s:
        return {(c.scope, c.scope_id): round(c.spent_usd, 9) for c in s.scalars(select(SpendCounter))}


def _dead_letters(spill: Path) -> dict[str, dict]:
    lines = (spill / DEAD_LETTER_FILE).read_text(encoding="utf-8").splitlines()
    return {row["request_id"]: row for row in map(json.loads, lines)}


def test_a_refused_event_is_set_aside_and_the_rest_flow(db: Engine, db_url: str, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    tenant = create_tenant(db, "acme")
    key = create_key(db, "acme")
    spill = tmp_path / "spill"
    poison = _poison(key.id, tenant.id, db_url.startswith("postgresql"))
    # a long linger: everything recorded before flush() is one batch
    ledger = Ledger(db, spill_dir=spill, linger_s=5.0, retry_delay_s=0.1).start()
    caplog.set_level(logging.WARNING, logger="tollgate.ledger")
    good = [f"good-{i}" for i in range(6)]
    waiting = list(poison.values())
    for i, rid in enumerate(good):  # the poison among good events
        ledger.record(_event(rid, key.id, tenant.id))
        if i % 2 and waiting:
            ledger.record(waiting.pop(0))
    assert ledger.flush(timeout=20)  # the poison does not hold the batch up
    assert _stored(db) == set(good)
    assert not ledger.database_down and ledger.failed_batches == 0 and ledger.backlog == 0
    assert _spend(db) == {("key", key.id): Decimal("0.06"), ("tenant", tenant.id): Decimal("0.06")}  # refused events are not counted
    assert ledger.pending_spend("key", key.id) == pytest.approx(0.0, abs=1e-12)

    dead = _dead_letters(spill)
    assert set(dead) == set(poison) and ledger.dead_lettered_total == len(poison)
    assert dead["poison-fk"]["tenant_id"] == NO_SUCH_TENANT and "IntegrityError" in dead["poison-fk"][ERROR_FIELD]
    assert dead["poison-null"]["model"] is None and "IntegrityError" in dead["poison-null"][ERROR_FIELD]
    if "poison-nul" in dead:
        nul = dead["poison-nul"]
        assert nul["end_user"] == END_USER + "\x00"
        assert nul[ERROR_FIELD].startswith("DataError:") and "NUL" in nul[ERROR_FIELD]
    refusals = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    for rid in poison:
        assert any(rid in m and str(spill) in m for m in refusals), refusals
    assert not any(END_USER in r.getMessage() for r in caplog.records)

    later = [f"later-{i}" for i in range(3)]
    for rid in later:
        ledger.record(_event(rid, key.id, tenant.id))
    assert ledger.flush(timeout=10)
    assert _stored(db) == set(good) | set(later)
    assert set(_dead_letters(spill)) == set(poison)  # set aside once, never retried
    ledger.close()
    assert not list(spill.glob("usage-*.jsonl"))


def test_a_refused_event_in_a_spilled_segment_does_not_block_the_replay(db: Engine, db_url: str,
                                                                         tmp_path: Path) -> None:
    tenant = create_tenant(db, "acme")
    key = create_key(db, "acme")
    spill = tmp_path / "spill"
    poison = _poison(key.id, tenant.id, db_url.startswith("postgresql"))
    rows = [_event(f"spilled-{i}", key.id, tenant.id) for i in range(4)] + list(poison.values())
    columns = [c.name for c in UsageEvent.__table__.columns if c.name != "id"]
    dead_process = SpillDir(spill)  # a process that stopped during an outage left these on disk
    dead_process.append([(i, {c: getattr(e, c) for c in columns}) for i, e in enumerate(rows)])
    dead_process.close()

    ledger = Ledger(db, spill_dir=spill, max_batch=3).start()
    ledger.record(_event("new", key.id, tenant.id))
    assert ledger.flush(timeout=20)
    assert _stored(db) == {f"spilled-{i}" for i in range(4)} | {"new"}
    assert set(_dead_letters(spill)) == set(poison)
    assert not list(spill.glob("usage-*"))  # the segment is replayed and gone
    ledger.close()
