"""ReplicaInterval rows from IntervalRecorder and the `platform usage --gpu` query, without Ray."""

from __future__ import annotations

import time
from decimal import Decimal

import pytest

from billing.gpu_usage import gpu_usage_frame
from billing.models import ReplicaInterval
from billing.replica_intervals import IntervalRecorder
from billing.deployments import record_deployments
from gateway.specs import ModelSpec


def _rows(db):  # type: ignore[no-untyped-def]
    from sqlalchemy import select

    with db.connect() as conn:
        return conn.execute(select(ReplicaInterval).order_by(ReplicaInterval.start)).all()


def test_rows_tile_the_replica_life_and_split_busy_from_idle(db) -> None:  # type: ignore[no-untyped-def]
    busy = [0.0]
    started = time.time() - 2.0
    rec = IntervalRecorder(db, "m", "r1", lambda: (busy[0], {}), flush_every_s=0.05, started_at=started).start()
    busy[0] = 0.5
    time.sleep(0.3)
    busy[0] = 0.6  # the engine's busy time never grows faster than the clock
    time.sleep(0.15)
    closing = time.time()
    rec.close()  # its last row ends when close() takes the time, before it writes (a slow write is not a gap)
    ended = time.time()
    rows = _rows(db)
    assert len(rows) >= 2
    for a, b in zip(rows, rows[1:]):
        assert a.end == b.start
    assert rows[0].start.timestamp() == pytest.approx(started, abs=1e-6)
    assert closing <= rows[-1].end.timestamp() <= ended
    span = rows[-1].end.timestamp() - rows[0].start.timestamp()
    assert sum(r.busy_s for r in rows) == Decimal("0.6")  # whole microseconds: exact
    assert float(sum(r.busy_s + r.idle_s for r in rows)) == pytest.approx(span, abs=1e-6)


def test_gpu_usage_per_model_and_day(db) -> None:  # type: ignore[no-untyped-def]
    record_deployments(db, [ModelSpec(name="big", source="x", pricing={"gpu_hour": 2.0}).model_dump(mode="json")])
    for replica, busy in (("a", 0.0), ("b", 900.0)):
        t = [time.time() - 3600.0]
        rec = IntervalRecorder(db, "big", replica, lambda b=busy: (b, {}), started_at=t[0])
        rec.flush()
    frame = gpu_usage_frame(db, model="big")
    [row] = frame.to_dict("records")
    assert row["replicas"] == 2
    assert row["alive_h"] == pytest.approx(2.0, abs=1e-3)
    assert row["busy_h"] == pytest.approx(0.25, abs=1e-3)
    assert row["idle_rate"] == pytest.approx(0.875, abs=1e-3)
    assert isinstance(row["gpu_cost_usd"], Decimal) and abs(row["gpu_cost_usd"] - 4) <= Decimal("0.01")  # exact money
    assert gpu_usage_frame(db, model="nobody").empty
