"""Cost reports against hand-computed expectations, on a fresh database (SQLite, or PostgreSQL with
TOLLGATE_TEST_DATABASE_URL)."""

from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from billing.gpu_usage import NO_TENANT, gpu_usage_frame
from billing.models import GpuShare, ModelDeployment, ReplicaInterval, Tenant, UsageEvent
from billing.reports import (
    cost_report,
    gpu_by_model,
    gpu_cost_by_tenant,
    margin_by_tenant,
    usage_by_tenant_day_model,
)

EVIL = "o'brien\"; DROP TABLE tenants; --%_"
DAY1 = datetime(2026, 3, 1, 12, tzinfo=timezone.utc)
DAY2 = DAY1 + timedelta(days=1)


def _event(n: int, tenant: Tenant, model: str, when: datetime, status: str = "ok", prompt: int = 0,
           completion: int = 0, cached: int = 0, hit: bool = False, latency: float = 1.0) -> UsageEvent:
    return UsageEvent(request_id=f"r{n}", tenant_id=tenant.id, model=model, endpoint="chat.completions",
                      status=status, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
                      cache_hit=hit, latency_s=latency, created_at=when)


@pytest.fixture
def seeded(db):
    with Session(db) as s:
        acme, evil = Tenant(name="acme"), Tenant(name=EVIL)
        s.add_all([acme, evil,
                   ModelDeployment(name="small", spec={}, input_per_1m=0.5, output_per_1m=1.5, gpu_hour=2.0),
                   ModelDeployment(name="large", spec={}, input_per_1m=3.0, output_per_1m=15.0, gpu_hour=10.0)])
        s.flush()
        s.add_all([
            _event(1, acme, "small", DAY1, prompt=1_000_000, completion=200_000, cached=400_000, latency=3.0),
            _event(2, acme, "small", DAY1, status="failed", prompt=100, latency=1.0),
            _event(3, acme, "small", DAY1, prompt=2_000_000, completion=1_000_000, hit=True, latency=0.01),
            _event(4, evil, "small", DAY1, status="cancelled", prompt=10, completion=5, latency=4.0),
            _event(5, evil, "large", DAY2, prompt=100_000, completion=10_000, latency=2.0),
            _event(6, evil, "large", DAY1 - timedelta(days=5), prompt=7, latency=1.0),  # before the window
            # GPU: small on day 1 alive 3 h (1 h busy) over two replicas; large on day 2 alive 1 h (0.25 h busy)
        ])
        a, b, c = (
            ReplicaInterval(model="small", replica="a", start=DAY1, end=DAY1 + timedelta(hours=2),
                            busy_s=1800.0, idle_s=5400.0),
            ReplicaInterval(model="small", replica="b", start=DAY1, end=DAY1 + timedelta(hours=1),
                            busy_s=1800.0, idle_s=1800.0),
            ReplicaInterval(model="large", replica="c", start=DAY2, end=DAY2 + timedelta(hours=1),
                            busy_s=900.0, idle_s=2700.0),
        )
        s.add_all([a, b, c])
        s.flush()
        # as the replicas split them (billing/gpu_shares.py): a served acme and evil, b acme only, c nobody
        s.add_all([
            GpuShare(interval_id=a.id, tenant_uid=acme.uid, busy_s=1200.0, idle_s=3600.0),
            GpuShare(interval_id=a.id, tenant_uid=evil.uid, busy_s=600.0, idle_s=1800.0),
            GpuShare(interval_id=b.id, tenant_uid=acme.uid, busy_s=1800.0, idle_s=1800.0),
            GpuShare(interval_id=c.id, tenant_uid=evil.uid, busy_s=900.0, idle_s=0.0),
            GpuShare(interval_id=c.id, tenant_uid=None, busy_s=0.0, idle_s=2700.0),
        ])
        s.commit()
    return db


def test_usage_per_tenant_day_model(seeded):
    frame = usage_by_tenant_day_model(seeded, since=date(2026, 3, 1), until=date(2026, 3, 3))
    assert frame[["day", "tenant", "model"]].values.tolist() == [
        ["2026-03-01", "acme", "small"], ["2026-03-01", EVIL, "small"], ["2026-03-02", EVIL, "large"]]
    acme = frame.iloc[0]
    assert (acme.requests_ok, acme.requests_failed, acme.requests_cancelled) == (2, 1, 0)
    assert (acme.input_tokens, acme.output_tokens, acme.cached_tokens, acme.cache_hits) == (
        3_000_100, 1_200_000, 400_000, 1)
    # billed: 1_000_100 input × 0.5/M + 200_000 output × 1.5/M; the cache hit is not revenue
    assert acme.revenue_usd == Decimal("0.80005")  # exact Decimals, never floats
    assert acme.cache_savings_usd == Decimal("2.5")  # 2M input × 0.5/M + 1M output × 1.5/M
    evil = frame.iloc[1]
    assert (evil.requests_ok, evil.requests_failed, evil.requests_cancelled) == (0, 0, 1)
    assert frame.iloc[2].revenue_usd == Decimal("0.45")  # 0.1 × 3.0 + 0.01 × 15.0
    everything = usage_by_tenant_day_model(seeded.url.render_as_string(hide_password=False))
    assert len(everything) == 4  # the URL form works too, and no window keeps the old event


def test_gpu_per_model_idle_rate_and_cost(seeded):
    frame = gpu_by_model(seeded).set_index("model")
    small, large = frame.loc["small"], frame.loc["large"]
    assert (small.replicas, small.alive_h, small.busy_h) == (2, 3.0, 1.0)
    assert small.idle_rate == pytest.approx(2 / 3)
    assert small.gpu_cost_usd == pytest.approx(3.0 * 2.0)
    assert large.idle_rate == pytest.approx(0.75)
    assert large.gpu_cost_usd == pytest.approx(10.0)
    assert gpu_by_model(seeded, since=DAY2.date()).model.tolist() == ["large"]


def test_gpu_cost_follows_the_replicas_shares_and_margin(seeded):
    window = {"since": date(2026, 3, 1), "until": date(2026, 3, 3)}
    frame = gpu_cost_by_tenant(seeded, **window)
    small = frame[frame.model == "small"].set_index("tenant")
    # small, day 1 (3 h of replica time): acme 1200+3600 s on a and 1800+1800 s on b, evil 600+1800 s on a
    assert small.share.to_dict() == pytest.approx({"acme": 8400 / 10800, EVIL: 2400 / 10800})
    # 8400 / 3600 × 2.0 and 2400 / 3600 × 2.0, to the nano-dollar
    assert small.gpu_cost_usd.to_dict() == {"acme": Decimal("4.666666667"), EVIL: Decimal("1.333333333")}
    large = frame[frame.model == "large"].set_index("tenant")
    assert large.gpu_cost_usd.to_dict() == {EVIL: Decimal("2.5"), NO_TENANT: Decimal("7.5")}  # idle, no work: no tenant
    assert frame.gpu_cost_usd.sum() == Decimal("16")  # every GPU dollar is on a row

    margin = margin_by_tenant(seeded, **window).set_index("tenant")
    assert margin.loc["acme"].margin_usd == Decimal("0.80005") - Decimal("4.666666667")
    assert margin.loc[EVIL].revenue_usd == Decimal("0.4500125")  # 10 × 0.5e-6 + 5 × 1.5e-6 + 0.3 + 0.15
    assert margin.loc[EVIL].gpu_cost_usd == Decimal("1.333333333") + Decimal("2.5")

    assert cost_report(seeded, **window).margin_usd.sum() == margin.margin_usd.sum()


def test_cost_report_gpu_cost_adds_up_to_usage_gpu_including_idle_without_tenant(seeded):
    window = {"since": date(2026, 3, 1), "until": date(2026, 3, 3)}
    report = cost_report(seeded, **window)
    per_day = gpu_usage_frame(seeded, since=DAY1.replace(hour=0), until=DAY2.replace(hour=0) + timedelta(days=1))
    assert report.gpu_cost_usd.sum() == per_day.gpu_cost_usd.sum() == gpu_by_model(seeded, **window).gpu_cost_usd.sum()
    idle = report[report.tenant == NO_TENANT]
    assert idle[["day", "model"]].values.tolist() == [["2026-03-02", "large"]]
    assert (idle.gpu_cost_usd.tolist(), idle.revenue_usd.tolist(), idle.requests_ok.tolist()) == (
        [Decimal("7.5")], [Decimal(0)], [0])
    assert idle.margin_usd.tolist() == [Decimal("-7.5")]


def test_empty_database_gives_empty_frames(db):
    assert usage_by_tenant_day_model(db).empty
    assert gpu_by_model(db).empty
    assert gpu_cost_by_tenant(db).empty
    assert margin_by_tenant(db).empty


def test_metacharacters_in_tenant_names_are_data(seeded):
    margin_by_tenant(seeded)
    with Session(seeded) as s:
        assert s.scalar(select(func.count()).select_from(Tenant)) == 2
