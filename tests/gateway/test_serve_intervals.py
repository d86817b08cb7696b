"""ReplicaInterval rows from IntervalRecorder and the `platform usage --gpu` query, without Ray."""

from __future__ import annotations

import time
from datetime import timedelta
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


def test_asleep_time_is_its_own_column_billed_to_no_one_and_not_idle(db) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import select

    from billing.models import GpuShare

    record_deployments(db, [ModelSpec(name="sleepy", source="x", pricing={"gpu_hour": 2.0}).model_dump(mode="json")])
    started = time.time() - 3600.0
    totals = {"busy": 600.0, "asleep": 1800.0}
    rec = IntervalRecorder(db, "sleepy", "r", lambda: (totals["busy"], {"tenant-a": totals["busy"]}),
                           started_at=started, asleep=lambda: totals["asleep"])
    rec.flush()
    totals["asleep"] = 1800.0 + 10**6  # more than the next row's span: capped at what busy time leaves
    time.sleep(0.01)
    rec.flush()
    rows = _rows(db)
    for row in rows:
        span = Decimal((row.end - row.start) // timedelta(microseconds=1)).scaleb(-6)
        assert row.busy_s + row.idle_s + row.asleep_s == span
    assert rows[0].busy_s == Decimal(600) and rows[0].asleep_s == Decimal(1800)
    assert rows[1].idle_s == 0 and rows[1].asleep_s > 0
    with db.connect() as conn:
        shares = conn.execute(select(GpuShare).where(GpuShare.interval_id == rows[0].id)).all()
    assert sum(s.busy_s + s.idle_s for s in shares) == rows[0].busy_s + rows[0].idle_s  # the asleep part is no one's
    days = gpu_usage_frame(db, model="sleepy")  # two rows when the hour crossed midnight (UTC)
    day = {column: days[column].sum() for column in ("asleep_h", "alive_h", "busy_h", "idle_h", "gpu_cost_usd")}
    day["idle_rate"] = day["idle_h"] / (day["busy_h"] + day["idle_h"])  # of the awake time
    assert day["asleep_h"] == pytest.approx(0.5, abs=1e-3) and day["alive_h"] == pytest.approx(1.0, abs=1e-3)
    assert day["busy_h"] == pytest.approx(600 / 3600, abs=1e-6) and day["idle_h"] == pytest.approx(1200 / 3600, abs=1e-3)
    assert day["idle_rate"] == pytest.approx(2 / 3, abs=1e-3)
    assert abs(day["gpu_cost_usd"] - Decimal("1.00")) < Decimal("0.01")  # the awake half hour only (exact money)
