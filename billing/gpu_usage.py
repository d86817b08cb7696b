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
from billing.models import GpuShare, ModelDeployment, ReplicaInterval, Tenant
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
    """One row per (day, model); an interval counts on the day it starts (rows span one flush period)."""
    day = day_of(ReplicaInterval.start).label("day")
    awake = func.sum(ReplicaInterval.busy_s + ReplicaInterval.idle_s)
    q = (
        select(day, ReplicaInterval.model.label("model"),
               func.count(func.distinct(ReplicaInterval.replica)).label("replicas"),
               func.coalesce(awake, 0.0).label("awake_s"),
               func.coalesce(func.sum(ReplicaInterval.busy_s), 0.0).label("busy_s"),
               func.coalesce(func.sum(ReplicaInterval.asleep_s), 0.0).label("asleep_s"),
               func.max(ModelDeployment.gpu_hour).label("gpu_hour"))
        .select_from(ReplicaInterval)
        .outerjoin(ModelDeployment, ModelDeployment.name == ReplicaInterval.model)
        .group_by(day, ReplicaInterval.model)
        .order_by(day, ReplicaInterval.model)
    )
    with engine.connect() as conn:
        rows = conn.execute(_filtered(q, model, since, until)).mappings().all()
    frame = pd.DataFrame(rows, columns=["day", "model", "replicas", "awake_s", "busy_s", "asleep_s", "gpu_hour"])
    out = pd.DataFrame({"day": frame["day"], "model": frame["model"],
                        "replicas": frame["replicas"].astype("int64")})
    awake_h = frame["awake_s"].astype("float64") / 3600.0
    out["asleep_h"] = frame["asleep_s"].astype("float64") / 3600.0
    out["alive_h"] = awake_h + out["asleep_h"]
    out["busy_h"] = frame["busy_s"].astype("float64") / 3600.0
    out["idle_h"] = awake_h - out["busy_h"]
    out["idle_rate"] = (out["idle_h"] / awake_h).where(awake_h > 0, 0.0)
    out["gpu_cost_usd"] = awake_h * frame["gpu_hour"].fillna(0.0).astype("float64")
    return out[COLUMNS]


TENANT_COLUMNS = ["day", "model", "tenant", "busy_h", "idle_h", "gpu_h", "share", "gpu_cost_usd"]
NO_TENANT = "(idle, no tenant)"


def gpu_usage_by_tenant(engine: Engine, *, model: str | None = None, since: datetime | None = None,
                        until: datetime | None = None) -> pd.DataFrame:
    """One row per (day, model, tenant): the tenant's busy and idle replica hours (billing/gpu_shares.py),
    its share of the model's replica time that day and its cost at the model's gpu_hour price."""
    day = day_of(ReplicaInterval.start).label("day")
    q = (
        select(day, ReplicaInterval.model.label("model"), Tenant.name.label("tenant"),
               func.sum(GpuShare.busy_s).label("busy_s"), func.sum(GpuShare.idle_s).label("idle_s"),
               func.max(ModelDeployment.gpu_hour).label("gpu_hour"))
        .select_from(GpuShare)
        .join(ReplicaInterval, ReplicaInterval.id == GpuShare.interval_id)
        .outerjoin(Tenant, Tenant.uid == GpuShare.tenant_uid)
        .outerjoin(ModelDeployment, ModelDeployment.name == ReplicaInterval.model)
        .group_by(day, ReplicaInterval.model, Tenant.name)
        .order_by(day, ReplicaInterval.model, Tenant.name)
    )
    with engine.connect() as conn:
        rows = conn.execute(_filtered(q, model, since, until)).mappings().all()
    out = pd.DataFrame([{
        "day": r["day"], "model": r["model"], "tenant": r["tenant"] or NO_TENANT,
        "busy_h": float(r["busy_s"] / 3600), "idle_h": float(r["idle_s"] / 3600),
        "gpu_h": float((r["busy_s"] + r["idle_s"]) / 3600),
        "gpu_cost_usd": float((r["busy_s"] + r["idle_s"]) * (r["gpu_hour"] or 0) / 3600)} for r in rows],
        columns=[c for c in TENANT_COLUMNS if c != "share"])
    totals = out.groupby(["day", "model"])["gpu_h"].transform("sum")
    out["share"] = (out["gpu_h"] / totals).where(totals > 0, 0.0)
    return out[TENANT_COLUMNS]


@dataclass(frozen=True)
class TenantGpuTime:
    tenant: str  # NO_TENANT: idle time of intervals without any work
    busy_s: Decimal
    idle_s: Decimal
    cost_usd: Decimal  # (busy + idle) × each model's gpu_hour

    @property
    def total_s(self) -> Decimal:
        return self.busy_s + self.idle_s


def gpu_seconds_per_tenant(engine: Engine, *, model: str | None = None, tenant: str | None = None,
                           since: datetime | None = None, until: datetime | None = None) -> list[TenantGpuTime]:
    """Each tenant's busy and idle replica seconds (billing/gpu_shares.py), exact to the microsecond, over
    the intervals that start in [since, until); most time first. One GROUP BY (tenant, model)."""
    price = func.max(ModelDeployment.gpu_hour)
    q = (
        select(Tenant.name, ReplicaInterval.model, func.sum(GpuShare.busy_s), func.sum(GpuShare.idle_s), price)
        .select_from(GpuShare)
        .join(ReplicaInterval, ReplicaInterval.id == GpuShare.interval_id)
        .outerjoin(Tenant, Tenant.uid == GpuShare.tenant_uid)
        .outerjoin(ModelDeployment, ModelDeployment.name == ReplicaInterval.model)
        .group_by(Tenant.name, ReplicaInterval.model)
    )
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
