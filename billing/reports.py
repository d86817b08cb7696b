"""Cost reports as pandas DataFrames. Every query aggregates in the database (GROUP BY) and returns
one row per group; prices come from ModelDeployment (list prices per 1M tokens, `gpu_hour`).

Each function takes a database URL or an Engine and an optional [since, until) window (dates are
midnight UTC). Requests count on the UTC day they were recorded, replica intervals on the day they start.
"""

from __future__ import annotations

import pandas as pd
from sqlalchemy import Engine, case, func, select

from billing.gpu_usage import gpu_usage_by_tenant
from billing.models import ModelDeployment, ReplicaInterval, Tenant, UsageEvent
from billing.report_query import Db, When, as_datetime, connect_engine, day_of, within

USAGE_COLUMNS = ["day", "tenant", "model", "requests_ok", "requests_failed", "requests_cancelled",
                 "input_tokens", "output_tokens", "cached_tokens", "cache_hits", "revenue_usd",
                 "cache_savings_usd"]
GPU_COLUMNS = ["model", "replicas", "alive_h", "busy_h", "idle_rate", "gpu_hour_usd", "gpu_cost_usd"]
ATTRIBUTION_COLUMNS = ["day", "model", "tenant", "busy_h", "idle_h", "share", "gpu_cost_usd"]
MARGIN_COLUMNS = ["tenant", "revenue_usd", "gpu_cost_usd", "margin_usd"]
_KEYS = ["day", "tenant", "model"]


def _count_if(condition) -> object:  # type: ignore[no-untyped-def]
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


def _sum_if(condition, column) -> object:  # type: ignore[no-untyped-def]
    return func.coalesce(func.sum(case((condition, column), else_=0)), 0)


_PRICE_COLUMNS = ["input_per_1m", "cached_input_per_1m", "output_per_1m", "gpu_hour"]


def _prices(engine: Engine) -> pd.DataFrame:
    d = ModelDeployment
    q = select(d.name.label("model"), d.input_per_1m, func.coalesce(d.cached_input_per_1m, d.input_per_1m)
               .label("cached_input_per_1m"), d.output_per_1m, d.gpu_hour)
    with engine.connect() as conn:
        rows = conn.execute(q).mappings().all()
    return pd.DataFrame(rows, columns=["model", *_PRICE_COLUMNS])


def _with_prices(frame: pd.DataFrame, engine: Engine) -> pd.DataFrame:
    """Prices as float64 columns: report frames are for reading and charts; invoices (billing/invoice.py)
    are the exact account."""
    out = frame.merge(_prices(engine), on="model", how="left")
    for c in _PRICE_COLUMNS:
        out[c] = out[c].fillna(0).astype("float64")
    return out


def usage_by_tenant_day_model(db: Db, since: When = None, until: When = None) -> pd.DataFrame:
    """Per tenant × day × model: requests by status, tokens, cache hits, list-price revenue (tokens of
    requests not answered from the cache × the model's list prices) and the dollars the cache saved
    (cache-hit requests' tokens × the same list prices)."""
    ev = UsageEvent
    hit = ev.cache_hit.is_(True)
    miss = ev.cache_hit.is_(False)
    day = day_of(ev.created_at).label("day")
    q = (
        select(day, Tenant.name.label("tenant"), ev.model.label("model"),
               _count_if(ev.status == "ok").label("requests_ok"),
               _count_if(ev.status == "failed").label("requests_failed"),
               _count_if(ev.status == "cancelled").label("requests_cancelled"),
               func.coalesce(func.sum(ev.prompt_tokens), 0).label("input_tokens"),
               func.coalesce(func.sum(ev.completion_tokens), 0).label("output_tokens"),
               func.coalesce(func.sum(ev.cached_tokens), 0).label("cached_tokens"),
               _count_if(hit).label("cache_hits"),
               _sum_if(miss, ev.prompt_tokens).label("billed_input"),
               _sum_if(miss, ev.completion_tokens).label("billed_output"),
               _sum_if(miss, ev.cached_tokens).label("billed_cached"),
               _sum_if(hit, ev.prompt_tokens).label("hit_input"),
               _sum_if(hit, ev.completion_tokens).label("hit_output"))
        .select_from(ev)
        .outerjoin(Tenant, Tenant.id == ev.tenant_id)
        .group_by(day, Tenant.name, ev.model)
    )
    q = within(q, ev.created_at, since, until)
    with connect_engine(db) as engine:
        with engine.connect() as conn:
            rows = conn.execute(q).mappings().all()
        frame = pd.DataFrame(rows, columns=[c.name for c in q.selected_columns])
        ints = [c for c in frame.columns if c not in ("day", "tenant", "model")]
        frame[ints] = frame[ints].astype("int64")
        frame = _with_prices(frame, engine)
    per_1m = 1_000_000.0
    frame["revenue_usd"] = ((frame["billed_input"] - frame["billed_cached"]) * frame["input_per_1m"]
                            + frame["billed_cached"] * frame["cached_input_per_1m"]
                            + frame["billed_output"] * frame["output_per_1m"]) / per_1m
    frame["cache_savings_usd"] = (frame["hit_input"] * frame["input_per_1m"]
                                  + frame["hit_output"] * frame["output_per_1m"]) / per_1m
    return _sorted(frame[USAGE_COLUMNS], _KEYS)


def gpu_by_model(db: Db, since: When = None, until: When = None) -> pd.DataFrame:
    """Per model: replica hours alive and busy, the idle rate (idle / alive) and the GPU cost
    (alive hours × the model's `gpu_hour`: an idle replica costs as much as a busy one)."""
    ri = ReplicaInterval
    q = (
        select(ri.model.label("model"), func.count(func.distinct(ri.replica)).label("replicas"),
               func.coalesce(func.sum(ri.busy_s + ri.idle_s), 0.0).label("alive_s"),
               func.coalesce(func.sum(ri.busy_s), 0.0).label("busy_s"))
        .group_by(ri.model)
    )
    q = within(q, ri.start, since, until)
    with connect_engine(db) as engine:
        with engine.connect() as conn:
            rows = conn.execute(q).mappings().all()
        frame = pd.DataFrame(rows, columns=["model", "replicas", "alive_s", "busy_s"])
        frame = _with_prices(frame, engine)
    frame["replicas"] = frame["replicas"].astype("int64")
    frame["alive_h"] = frame["alive_s"].astype("float64") / 3600.0
    frame["busy_h"] = frame["busy_s"].astype("float64") / 3600.0
    alive = frame["alive_h"]
    frame["idle_rate"] = ((alive - frame["busy_h"]) / alive.where(alive > 0)).fillna(0.0)
    frame["gpu_hour_usd"] = frame["gpu_hour"]
    frame["gpu_cost_usd"] = alive * frame["gpu_hour"]
    return _sorted(frame[GPU_COLUMNS], ["model"])


def gpu_cost_by_tenant(db: Db, since: When = None, until: When = None) -> pd.DataFrame:
    """GPU time and cost per model, day and tenant: each tenant's busy and idle share of the replicas' time
    as the replicas recorded it (billing/gpu_shares.py says how steps and idle time are split), priced at
    the model's gpu_hour. Idle time of intervals without any work is on "(idle, no tenant)"."""
    with connect_engine(db) as engine:
        frame = gpu_usage_by_tenant(engine, since=as_datetime(since), until=as_datetime(until))
    return _sorted(frame[ATTRIBUTION_COLUMNS], ["day", "model", "tenant"])


def margin_by_tenant(db: Db, since: When = None, until: When = None) -> pd.DataFrame:
    """Per tenant: list-price revenue − attributed GPU cost (see gpu_cost_by_tenant)."""
    with connect_engine(db) as engine:
        usage = usage_by_tenant_day_model(engine, since, until)
        gpu = gpu_cost_by_tenant(engine, since, until)
    revenue = usage.groupby("tenant", dropna=False)["revenue_usd"].sum()
    cost = gpu.groupby("tenant", dropna=False)["gpu_cost_usd"].sum()
    frame = pd.concat([revenue, cost], axis=1).fillna(0.0).reset_index().rename(columns={"index": "tenant"})
    frame["margin_usd"] = frame["revenue_usd"] - frame["gpu_cost_usd"]
    return _sorted(frame[MARGIN_COLUMNS], ["tenant"])


def cost_report(db: Db, since: When = None, until: When = None) -> pd.DataFrame:
    """The usage rows of usage_by_tenant_day_model with each row's attributed GPU cost and margin."""
    with connect_engine(db) as engine:
        usage = usage_by_tenant_day_model(engine, since, until)
        gpu = gpu_cost_by_tenant(engine, since, until)
    frame = usage.merge(gpu[["day", "model", "tenant", "gpu_cost_usd"]], on=_KEYS, how="left")
    frame["gpu_cost_usd"] = frame["gpu_cost_usd"].fillna(0.0)
    frame["margin_usd"] = frame["revenue_usd"] - frame["gpu_cost_usd"]
    return frame


def _sorted(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Sorted in Python's order (database collations differ), missing tenants last."""
    return frame.sort_values(keys, na_position="last", kind="mergesort").reset_index(drop=True)
