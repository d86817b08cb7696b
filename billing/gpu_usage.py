"""GPU (replica) time per model and day from ReplicaInterval rows: alive hours, busy hours and the
idle rate (the share of alive time in which the engine had no work) that `platform usage --gpu` shows."""

from __future__ import annotations

from datetime import datetime

import pandas as pd
from sqlalchemy import Engine, String, cast, func, select

from billing.field_checks import text_field
from billing.models import ModelDeployment, ReplicaInterval

COLUMNS = ["day", "model", "replicas", "alive_h", "busy_h", "idle_h", "idle_rate", "gpu_cost_usd"]


def gpu_usage_frame(engine: Engine, *, model: str | None = None, since: datetime | None = None,
                    until: datetime | None = None) -> pd.DataFrame:
    """One row per (day, model); an interval counts on the day it starts (rows span one flush period)."""
    start = ReplicaInterval.start
    day = func.substr(cast(start, String), 1, 10).label("day")
    alive = func.sum(ReplicaInterval.busy_s + ReplicaInterval.idle_s)
    q = (
        select(day, ReplicaInterval.model.label("model"),
               func.count(func.distinct(ReplicaInterval.replica)).label("replicas"),
               func.coalesce(alive, 0.0).label("alive_s"),
               func.coalesce(func.sum(ReplicaInterval.busy_s), 0.0).label("busy_s"),
               func.max(ModelDeployment.gpu_hour).label("gpu_hour"))
        .select_from(ReplicaInterval)
        .outerjoin(ModelDeployment, ModelDeployment.name == ReplicaInterval.model)
        .group_by(day, ReplicaInterval.model)
        .order_by(day, ReplicaInterval.model)
    )
    if model is not None:
        q = q.where(ReplicaInterval.model == text_field("model", model))
    if since is not None:
        q = q.where(start >= since)
    if until is not None:
        q = q.where(start < until)
    with engine.connect() as conn:
        rows = conn.execute(q).mappings().all()
    frame = pd.DataFrame(rows, columns=["day", "model", "replicas", "alive_s", "busy_s", "gpu_hour"])
    out = pd.DataFrame({"day": frame["day"], "model": frame["model"],
                        "replicas": frame["replicas"].astype("int64")})
    out["alive_h"] = frame["alive_s"].astype("float64") / 3600.0
    out["busy_h"] = frame["busy_s"].astype("float64") / 3600.0
    out["idle_h"] = out["alive_h"] - out["busy_h"]
    out["idle_rate"] = (out["idle_h"] / out["alive_h"]).where(out["alive_h"] > 0, 0.0)
    out["gpu_cost_usd"] = out["alive_h"] * frame["gpu_hour"].fillna(0.0).astype("float64")
    return out[COLUMNS]
