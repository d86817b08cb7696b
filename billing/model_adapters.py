"""LoRA adapters added at run time, as the database records them (the `model_adapters` table): which model, where
the adapter lies, who may use it and at what prices. The gateways' registries, the model replicas and invoices read
them through these functions, which take and return plain data."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from billing.models import ModelAdapter
from billing.money import ZERO
from billing.pricing import Prices


class DuplicateAdapter(ValueError):
    """The model already has an adapter of that name."""


@dataclass(frozen=True)
class AdapterRecord:
    model: str
    name: str
    source: str
    tenants: tuple[str, ...] | None = None  # None: every tenant
    prices: Prices | None = None  # None: the base model's


def record_adapter(db: Engine, adapter: AdapterRecord) -> None:
    """Inserts the adapter; DuplicateAdapter when the model has one of that name (also one another gateway added)."""
    prices = adapter.prices
    row = ModelAdapter(model=adapter.model, name=adapter.name, source=adapter.source,
                       tenants=list(adapter.tenants) if adapter.tenants is not None else None)
    if prices is not None:
        row.input_per_1m, row.output_per_1m = prices.input_per_1m, prices.output_per_1m
        row.gpu_hour, row.cached_input_per_1m = prices.gpu_hour, prices.cached_input_per_1m
    try:
        with Session(db) as s, s.begin():
            s.add(row)
    except IntegrityError:
        raise DuplicateAdapter(f"name: model `{adapter.model}` already has an adapter `{adapter.name}`") from None


def delete_adapter(db: Engine, model: str, name: str) -> bool:
    """Deletes the adapter's row; False when there was none."""
    with db.begin() as conn:
        deleted = conn.execute(delete(ModelAdapter).where(ModelAdapter.model == model, ModelAdapter.name == name))
    return deleted.rowcount > 0


def recorded_adapters(db: Engine, model: str | None = None) -> list[AdapterRecord]:
    """The adapters added at run time (of one model, or all), oldest first."""
    q = select(ModelAdapter).order_by(ModelAdapter.id)
    if model is not None:
        q = q.where(ModelAdapter.model == model)
    with Session(db) as s:
        return [_plain(row) for row in s.scalars(q)]


def _plain(row: ModelAdapter) -> AdapterRecord:
    prices = None
    if row.input_per_1m is not None:
        prices = Prices(row.input_per_1m, row.output_per_1m or ZERO, row.gpu_hour or ZERO, row.cached_input_per_1m)
    tenants = tuple(row.tenants) if row.tenants is not None else None
    return AdapterRecord(row.model, row.name, row.source, tenants, prices)
