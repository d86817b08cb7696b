"""GPU (replica) time per model and day from ReplicaInterval rows: alive hours (busy + idle + asleep), busy,
idle and asleep hours, and the idle rate (the share of the awake time, busy + idle, in which the engine had no
work) that `platform usage --gpu` shows; an asleep replica has given its GPU memory back, so its cost counts the
awake hours only;
per tenant from their GpuShare rows (`platform usage --gpu --by tenant`, the dashboard's GPU page)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

import pandas as pd
from sqlalchemy import Engine, Select, func, select

from billing.field_checks import text_field
from billing.charged_prices import interval_gpu_hour, join_list_prices
from billing.models import GpuShare, ReplicaInterval, Tenant
from billing.money import dollars
from billing.report_query import day_of, within

COLUMNS = ["day", "model", "replicas", "alive_h", "busy_h", "idle_h", "asleep_h", "idle_rate", "gpu_cost_usd"]


def _filtered(q: Select, model: str | None, since: datetime | None, until: datetime | None) -> Select:
    """Only `model`'s intervals, and those starting in [since, until)."""
    if model is not None:
        q = q.where(ReplicaInterval.model == text_field("model", model))
    return within(q, ReplicaInterval.start, since, until)


def gpu_usage_frame(engine: Engine, *, model: str | None = None, since: datetime | None = None,
                    until: datetime | None = None) -> pd.DataFrame:
    """One row per (day, model); an interval counts on the day it starts (rows span one flush period). Alive time
    is awake (busy + idle) plus asleep; the idle rate and the GPU cost are over the awake time only, the cost exact
    (Decimal dollars) at the gpu_hour each interval was charged (billing/charged_prices.py)."""
    ri = ReplicaInterval
    day = day_of(ri.start).label("day")
    price = interval_gpu_hour()
    q = (select(day, ri.model, price, func.coalesce(func.sum(ri.busy_s + ri.idle_s), 0),
                func.coalesce(func.sum(ri.busy_s), 0), func.coalesce(func.sum(ri.asleep_s), 0))
         .select_from(ri).group_by(day, ri.model, price))
    replicas = select(day, ri.model, func.count(func.distinct(ri.replica))).group_by(day, ri.model)
    sums: dict[tuple[str, str], list[Decimal]] = {}
    with engine.connect() as conn:
        for d, m, per_hour, awake, busy, asleep in conn.execute(_filtered(join_list_prices(q, ri.model), model,
                                                                          since, until)):
            row = sums.setdefault((d, m), [Decimal(0)] * 4)
            row[0] += awake
            row[1] += busy
            row[2] += asleep
            row[3] += awake * per_hour / HOUR
        counts = {(d, m): n for d, m, n in conn.execute(_filtered(replicas, model, since, until))}
    rows = []
    for (d, m), (awake, busy, asleep, cost) in sorted(sums.items()):
        rows.append({"day": d, "model": m, "replicas": int(counts.get((d, m), 0)),
                     "alive_h": float((awake + asleep) / HOUR), "busy_h": float(busy / HOUR),
                     "idle_h": float((awake - busy) / HOUR), "asleep_h": float(asleep / HOUR),
                     "idle_rate": float((awake - busy) / awake) if awake > 0 else 0.0, "gpu_cost_usd": dollars(cost)})
    out = pd.DataFrame(rows, columns=COLUMNS)
    out["replicas"] = out["replicas"].astype("int64")
    for c in ("alive_h", "busy_h", "idle_h", "asleep_h", "idle_rate"):
        out[c] = out[c].astype("float64")
    out["gpu_cost_usd"] = out["gpu_cost_usd"].astype("object")
    return out[COLUMNS]


TENANT_COLUMNS = ["day", "model", "tenant", "busy_h", "idle_h", "gpu_h", "share", "gpu_cost_usd"]
NO_TENANT = "(idle, no tenant)"
HOUR = Decimal(3600)


def gpu_usage_by_tenant(engine: Engine, *, model: str | None = None, since: datetime | None = None,
                        until: datetime | None = None) -> pd.DataFrame:
    """One row per (day, model, tenant): the tenant's busy and idle replica hours (billing/gpu_shares.py),
    its share of the model's replica time that day and its exact cost (Decimal dollars) at the gpu_hour each
    interval was charged."""
    ri = ReplicaInterval
    day = day_of(ri.start).label("day")
    price = interval_gpu_hour()
    q = (
        select(day, ri.model, Tenant.name, price, func.sum(GpuShare.busy_s), func.sum(GpuShare.idle_s))
        .select_from(GpuShare)
        .join(ri, ri.id == GpuShare.interval_id)
        .outerjoin(Tenant, Tenant.uid == GpuShare.tenant_uid)
        .group_by(day, ri.model, Tenant.name, price)
    )
    sums: dict[tuple[str, str, str], list[Decimal]] = {}
    with engine.connect() as conn:
        for d, m, tenant, per_hour, busy, idle in conn.execute(_filtered(join_list_prices(q, ri.model), model, since,
                                                                         until)):
            row = sums.setdefault((d, m, tenant or NO_TENANT), [Decimal(0), Decimal(0), Decimal(0)])
            row[0] += busy or 0
            row[1] += idle or 0
            row[2] += ((busy or 0) + (idle or 0)) * per_hour / HOUR
    out = pd.DataFrame([{"day": d, "model": m, "tenant": t, "busy_h": float(b / HOUR), "idle_h": float(i / HOUR),
                         "gpu_h": float((b + i) / HOUR), "gpu_cost_usd": dollars(c)}
                        for (d, m, t), (b, i, c) in sorted(sums.items())],
                       columns=[c for c in TENANT_COLUMNS if c != "share"])
    for c in ("busy_h", "idle_h", "gpu_h"):
        out[c] = out[c].astype("float64")
    out["gpu_cost_usd"] = out["gpu_cost_usd"].astype("object")
    totals = out.groupby(["day", "model"])["gpu_h"].transform("sum")
    out["share"] = (out["gpu_h"] / totals).where(totals > 0, 0.0)
    return out[TENANT_COLUMNS]


@dataclass(frozen=True)
class TenantGpuTime:
    tenant: str  # NO_TENANT: idle time of intervals without any work
    busy_s: Decimal
    idle_s: Decimal
    cost_usd: Decimal  # (busy + idle) × the gpu_hour each interval was charged

    @property
    def total_s(self) -> Decimal:
        return self.busy_s + self.idle_s


def gpu_seconds_per_tenant(engine: Engine, *, model: str | None = None, tenant: str | None = None,
                           since: datetime | None = None, until: datetime | None = None) -> list[TenantGpuTime]:
    """Each tenant's busy and idle replica seconds (billing/gpu_shares.py), exact to the microsecond, over
    the intervals that start in [since, until); most time first. One GROUP BY (tenant, model)."""
    price = interval_gpu_hour()
    q = join_list_prices(
        select(Tenant.name, ReplicaInterval.model, func.sum(GpuShare.busy_s), func.sum(GpuShare.idle_s), price)
        .select_from(GpuShare)
        .join(ReplicaInterval, ReplicaInterval.id == GpuShare.interval_id)
        .outerjoin(Tenant, Tenant.uid == GpuShare.tenant_uid)
        .group_by(Tenant.name, ReplicaInterval.model, price), ReplicaInterval.model)
    if tenant is not None:
        q = q.where(Tenant.name == text_field("tenant", tenant))
    with engine.connect() as conn:
        rows = conn.execute(_filtered(q, model, since, until)).all()
    busy: dict[str, Decimal] = defaultdict(Decimal)
    idle: dict[str, Decimal] = defaultdict(Decimal)
    cost: dict[str, Decimal] = defaultdict(Decimal)
    for name, _, b, i, per_hour in rows:
        who = name or NO_TENANT
        busy[who] += b or 0
        idle[who] += i or 0
        cost[who] += dollars(((b or 0) + (i or 0)) * (per_hour or 0) / 3600)
    out = [TenantGpuTime(t, busy[t], idle[t], cost[t]) for t in busy]
    return sorted(out, key=lambda r: (-r.total_s, r.tenant == NO_TENANT, r.tenant))
