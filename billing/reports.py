"""Cost reports as pandas DataFrames. Every query aggregates in the database (GROUP BY) and returns
one row per group; usage is priced as it was charged (billing/charged_prices.py: the prices stored with each
event and replica interval), so a price change never alters a past report. Money columns (`*_usd`) hold
exact Decimal dollars (object dtype), never floats.

Each function takes a database URL or an Engine and an optional [since, until) window (dates are
midnight UTC). Requests count on the UTC day they were recorded, replica intervals on the day they start.
"""

from __future__ import annotations

from decimal import Decimal

import pandas as pd
from sqlalchemy import case, func, select

from billing.asked_model import asked_model
from billing.charged_prices import (event_cached_input_price, event_input_price, event_output_price,
                                    interval_gpu_hour, join_list_prices)

from billing.gpu_usage import gpu_usage_by_tenant
from billing.models import ReplicaInterval, Tenant, UsageEvent
from billing.money import dollars
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


MILLION = Decimal(1_000_000)
HOUR = Decimal(3600)


def _money(frame: pd.DataFrame, column: str, values: object) -> None:
    """A money column of exact Decimal dollars (object dtype), never float64."""
    frame[column] = pd.Series(values, index=frame.index, dtype="object")


def usage_by_tenant_day_model(db: Db, since: When = None, until: When = None) -> pd.DataFrame:
    """Per tenant × day × model: requests by status, tokens, cache hits, revenue (tokens of requests not
    answered from the cache at the prices they were charged, billing/charged_prices.py) and the dollars the
    cache saved (cache-hit requests' tokens at the same prices). Money columns hold exact Decimals."""
    ev = UsageEvent
    hit = ev.cache_hit.is_(True)
    miss = ev.cache_hit.is_(False)
    day = day_of(ev.created_at).label("day")
    model = asked_model()  # an adapter's requests are a model of their own, as on invoices
    prices = (event_input_price().label("p_in"), event_cached_input_price().label("p_cached"),
              event_output_price().label("p_out"))
    q = (
        select(day, Tenant.name.label("tenant"), model.label("model"), *prices,
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
        .group_by(day, Tenant.name, model, *prices)
    )
    q = within(join_list_prices(q, ev.model), ev.created_at, since, until)
    counts = USAGE_COLUMNS[3:10]  # requests by status, tokens, cache hits
    groups: dict[tuple, dict] = {}
    with connect_engine(db) as engine:
        with engine.connect() as conn:
            for r in conn.execute(q).mappings():
                g = groups.setdefault((r["day"], r["tenant"], r["model"]), {
                    **{c: 0 for c in counts}, "revenue_usd": Decimal(0), "cache_savings_usd": Decimal(0)})
                for c in counts:
                    g[c] += int(r[c])
                billed_cached = min(int(r["billed_cached"]), int(r["billed_input"]))
                g["revenue_usd"] += ((int(r["billed_input"]) - billed_cached) * r["p_in"]
                                     + billed_cached * r["p_cached"] + int(r["billed_output"]) * r["p_out"]) / MILLION
                g["cache_savings_usd"] += (int(r["hit_input"]) * r["p_in"] + int(r["hit_output"]) * r["p_out"]) / MILLION
    rows = [{"day": d, "tenant": t, "model": m, **{k: dollars(v) if k.endswith("_usd") else v for k, v in g.items()}}
            for (d, t, m), g in groups.items()]
    frame = pd.DataFrame(rows, columns=USAGE_COLUMNS)
    for c in counts:
        frame[c] = frame[c].astype("int64")
    for c in ("revenue_usd", "cache_savings_usd"):
        _money(frame, c, frame[c])
    return _sorted(frame[USAGE_COLUMNS], _KEYS)


def gpu_by_model(db: Db, since: When = None, until: When = None) -> pd.DataFrame:
    """Per model: replica hours alive and busy, the idle rate (idle / alive) and the GPU cost (alive
    hours × the gpu_hour each interval was charged at: an idle replica costs as much as a busy one);
    gpu_hour_usd is what an hour was charged over the window (the price then, or the average of the prices
    in force where it changed)."""
    ri = ReplicaInterval
    price = interval_gpu_hour()
    q = (
        select(ri.model, price, func.sum(ri.busy_s + ri.idle_s), func.sum(ri.busy_s))
        .select_from(ri)
        .group_by(ri.model, price)
    )
    q = within(join_list_prices(q, ri.model), ri.start, since, until)
    replicas = within(select(ri.model, func.count(func.distinct(ri.replica))).group_by(ri.model), ri.start, since, until)
    per_model: dict[str, list] = {}
    with connect_engine(db) as engine:
        with engine.connect() as conn:
            for model, per_hour, alive_s, busy_s in conn.execute(q):
                m = per_model.setdefault(model, [Decimal(0), Decimal(0), Decimal(0)])
                m[0] += alive_s or 0
                m[1] += busy_s or 0
                m[2] += (alive_s or 0) * per_hour / HOUR
            counts = dict(conn.execute(replicas).all())
    rows = [{"model": model, "replicas": int(counts.get(model, 0)), "alive_h": float(alive / HOUR),
             "busy_h": float(busy / HOUR), "idle_rate": float((alive - busy) / alive) if alive > 0 else 0.0,
             "gpu_hour_usd": dollars(cost * HOUR / alive) if alive > 0 else Decimal(0), "gpu_cost_usd": dollars(cost)}
            for model, (alive, busy, cost) in per_model.items()]
    frame = pd.DataFrame(rows, columns=GPU_COLUMNS)
    frame["replicas"] = frame["replicas"].astype("int64")
    for c in ("alive_h", "busy_h", "idle_rate"):
        frame[c] = frame[c].astype("float64")
    for c in ("gpu_hour_usd", "gpu_cost_usd"):
        _money(frame, c, frame[c])
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
    totals: dict[str | None, list[Decimal]] = {}
    for tenant, revenue in zip(usage["tenant"], usage["revenue_usd"]):
        totals.setdefault(None if pd.isna(tenant) else tenant, [Decimal(0), Decimal(0)])[0] += revenue
    for tenant, cost in zip(gpu["tenant"], gpu["gpu_cost_usd"]):
        totals.setdefault(None if pd.isna(tenant) else tenant, [Decimal(0), Decimal(0)])[1] += cost
    frame = pd.DataFrame([{"tenant": t, "revenue_usd": r, "gpu_cost_usd": c, "margin_usd": r - c}
                          for t, (r, c) in totals.items()], columns=MARGIN_COLUMNS)
    for c in MARGIN_COLUMNS[1:]:
        _money(frame, c, frame[c])
    return _sorted(frame[MARGIN_COLUMNS], ["tenant"])


def cost_report(db: Db, since: When = None, until: When = None) -> pd.DataFrame:
    """The usage rows of usage_by_tenant_day_model with each row's attributed GPU cost and margin, plus a row
    for GPU time without usage on that day and model (the idle time on "(idle, no tenant)" among them), so
    its GPU cost adds up to `platform usage --gpu`'s."""
    with connect_engine(db) as engine:
        usage = usage_by_tenant_day_model(engine, since, until)
        gpu = gpu_cost_by_tenant(engine, since, until)
    frame = usage.merge(gpu[["day", "model", "tenant", "gpu_cost_usd"]], on=_KEYS, how="outer")
    for c in USAGE_COLUMNS[3:10]:  # counts of GPU-only rows: none
        frame[c] = frame[c].fillna(0).astype("int64")
    for c in ("revenue_usd", "cache_savings_usd", "gpu_cost_usd"):
        _money(frame, c, [Decimal(0) if pd.isna(v) else v for v in frame[c]])
    _money(frame, "margin_usd", [r - c for r, c in zip(frame["revenue_usd"], frame["gpu_cost_usd"])])
    return _sorted(frame, _KEYS)


def _sorted(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Sorted in Python's order (database collations differ), missing tenants last."""
    return frame.sort_values(keys, na_position="last", kind="mergesort").reset_index(drop=True)
