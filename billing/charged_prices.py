"""The prices a usage event or a replica interval was charged at. The gateway stores its list prices with each
event (UsageEvent.input_per_1m, ...) and the interval writer the model's gpu_hour with each replica interval,
so invoices and reports price past usage as it was charged: a spec's new prices apply from their deployment on
and never re-price last month. Rows that predate these columns (back-filled by migration 0007) and rows
written without them fall back to the model's list price (ModelDeployment)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, func

from billing.models import ModelDeployment, ReplicaInterval, UsageEvent
from billing.money import Money
from billing.pricing import Prices


def stored_prices(prices: Prices) -> dict[str, Any]:
    """The UsageEvent columns that keep `prices` with an event (the cached-input price resolved)."""
    return {"input_per_1m": prices.input_per_1m, "cached_input_per_1m": prices.cached_input,
            "output_per_1m": prices.output_per_1m}


def join_list_prices(q: Select, model_column: Any) -> Select:
    """`q` with the model's deployment row (outer-joined), which the fallbacks below read."""
    return q.outerjoin(ModelDeployment, ModelDeployment.name == model_column)


def event_input_price() -> Any:
    ev, d = UsageEvent, ModelDeployment
    return func.coalesce(ev.input_per_1m, d.input_per_1m, 0, type_=Money())


def event_cached_input_price() -> Any:
    ev, d = UsageEvent, ModelDeployment
    return func.coalesce(ev.cached_input_per_1m, ev.input_per_1m, d.cached_input_per_1m, d.input_per_1m, 0, type_=Money())


def event_output_price() -> Any:
    ev, d = UsageEvent, ModelDeployment
    return func.coalesce(ev.output_per_1m, d.output_per_1m, 0, type_=Money())


def interval_gpu_hour() -> Any:
    return func.coalesce(ReplicaInterval.gpu_hour, ModelDeployment.gpu_hour, 0, type_=Money())
