"""GPU time per tenant: replica intervals tile a replica's life, busy + idle = alive exactly, and the
tenants' shares of each interval add up to it exactly (whole microseconds)."""

from __future__ import annotations

import time
from collections import defaultdict
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import select

from billing.accounts import create_tenant
from billing.deployments import record_deployments
from billing.gpu_shares import apportion, split_interval
from billing.gpu_usage import NO_TENANT, gpu_usage_by_tenant
from billing.invoice import build_invoice
from billing.models import GpuShare, ReplicaInterval
from billing.replica_intervals import IntervalRecorder


@given(st.integers(0, 10**12), st.dictionaries(st.text(max_size=3), st.floats(0, 1e6), max_size=8))
def test_apportioned_units_add_up_and_follow_the_weights(total: int, weights: dict[str, float]) -> None:
    parts = apportion(total, weights)
    positive = {k: w for k, w in weights.items() if w > 0}
    assert sum(parts.values()) == (total if positive else 0)
    weight_sum = sum(positive.values())
    for k, units in parts.items():
        assert abs(units - total * positive[k] / weight_sum) < 1 + 1e-6 * total


def test_idle_goes_to_the_tenants_that_kept_the_replica_busy_and_else_to_no_tenant() -> None:
    assert split_interval(600, 400, {"a": 3.0, "b": 1.0}) == {"a": (450, 300), "b": (150, 100)}
    assert split_interval(0, 1000, {}) == {None: (0, 1000)}
    assert split_interval(10, 0, {"a": 0.0}) == {None: (10, 0)}  # busy with nothing counted: no tenant


def _rows_and_shares(db):  # type: ignore[no-untyped-def]
    """The replica interval rows in time order, and every GpuShare row."""
    with db.connect() as conn:
        return (conn.execute(select(ReplicaInterval).order_by(ReplicaInterval.start)).all(),
                conn.execute(select(GpuShare)).all())


def test_busy_time_a_row_carries_into_the_next_stays_with_the_tenant_that_ran_it(db) -> None:
    a = create_tenant(db, "acme")
    record_deployments(db, [{"name": "m", "pricing": {"gpu_hour": 3.6}}])
    busy = {"total": 1.5, "by": {a.uid: 1.5}}  # a step longer than the first row's span, counted when it ended
    rec = IntervalRecorder(db, "m", "r1", lambda: (busy["total"], dict(busy["by"])), started_at=time.time() - 1.0)
    rec.flush()
    time.sleep(0.6)
    rec.flush()
    rows, shares = _rows_and_shares(db)
    assert len(rows) == 2 and rows[0].busy_s < Decimal("1.5") and sum(r.busy_s for r in rows) == Decimal("1.5")
    assert {s.tenant_uid for s in shares if s.busy_s} == {a.uid}
    assert sum(s.busy_s for s in shares) == Decimal("1.5")


def _micros(dt) -> int:  # type: ignore[no-untyped-def]
    return round(dt.timestamp() * 1_000_000)


def test_intervals_tile_the_replica_and_tenant_shares_add_up_exactly(db) -> None:
    a, b = create_tenant(db, "acme"), create_tenant(db, "beta")
    record_deployments(db, [{"name": "m", "pricing": {"gpu_hour": 3.6}}])
    busy = {"total": 0.0, "by": {}}
    started = time.time() - 5.0
    rec = IntervalRecorder(db, "m", "r1", lambda: (busy["total"], dict(busy["by"])), started_at=started)
    for total, by in ((1.0, {a.uid: 0.7, b.uid: 0.3}), (1.0, {a.uid: 0.7, b.uid: 0.3}),  # idle in between
                      (1.03, {a.uid: 0.71, b.uid: 0.32}), (1.04, {a.uid: 0.71, b.uid: 0.32, None: 0.01})):
        busy["total"], busy["by"] = total, by
        rec.flush()
        time.sleep(0.05)
    rec.close()
    rows, shares = _rows_and_shares(db)
    assert len(rows) == 5
    for first, second in zip(rows, rows[1:]):
        assert first.end == second.start
    per_interval = defaultdict(lambda: [0, 0])
    for s in shares:
        per_interval[s.interval_id][0] += s.busy_s
        per_interval[s.interval_id][1] += s.idle_s
    for r in rows:
        assert (r.busy_s + r.idle_s) * 1_000_000 == _micros(r.end) - _micros(r.start)  # exact, in microseconds
        assert per_interval[r.id] == [r.busy_s, r.idle_s]  # the tenants' shares add up to the row exactly
    alive = sum(r.busy_s + r.idle_s for r in rows)
    assert alive * 1_000_000 == _micros(rows[-1].end) - _micros(rows[0].start)
    assert sum(r.busy_s for r in rows) == Decimal("1.04")  # the engine's busy time, exact to the microsecond

    frame = gpu_usage_by_tenant(db, model="m").set_index("tenant")
    assert set(frame.index) == {"acme", "beta", NO_TENANT}
    assert frame.loc["acme", "busy_h"] * 3600 == pytest.approx(0.71, abs=1e-6)
    assert frame.loc["beta", "busy_h"] * 3600 == pytest.approx(0.32, abs=1e-6)
    assert frame["gpu_h"].sum() * 3600 == pytest.approx(float(alive), abs=1e-6)
    month = rows[0].start.strftime("%Y-%m")
    [line] = [line for line in build_invoice(db, "acme", month).lines if line.kind == "gpu_time"]
    acme_seconds = sum(s.busy_s + s.idle_s for s in shares if s.tenant_uid == a.uid)
    assert line.gpu_seconds == acme_seconds
    assert line.amount_cents == round(float(acme_seconds) * 3.6 / 3600 * 100)
