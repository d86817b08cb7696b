"""The deployed models as the database records them: each one's spec (as plain JSON data) and list
prices. The gateway's HTTP, dashboard and platform code reach the `model_deployments` table only
through these functions, which take and return plain data."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from billing.db import dialect_insert
from billing.models import ModelDeployment, utcnow
from billing.money import dollars


@dataclass(frozen=True)
class Deployment:
    name: str
    spec: dict[str, Any]
    input_per_1m: Decimal
    output_per_1m: Decimal
    gpu_hour: Decimal
    cached_input_per_1m: Decimal | None  # None: the input price
    updated_at: datetime | None


def record_deployments(db: Engine, specs: list[dict[str, Any]]) -> None:
    """Insert or update one row per spec (a spec's `pricing` block sets the row's prices), in one transaction. An
    upsert: gateways that start together (API processes, Serve replicas) record the same new specs at once."""
    table = ModelDeployment.__table__
    with db.begin() as conn:
        for spec in specs:
            pricing = spec.get("pricing") or {}
            cached = pricing.get("cached_input_per_1m")
            values = {"spec": spec, "input_per_1m": dollars(pricing.get("input_per_1m", 0)),
                      "output_per_1m": dollars(pricing.get("output_per_1m", 0)),
                      "gpu_hour": dollars(pricing.get("gpu_hour", 0)),
                      "cached_input_per_1m": None if cached is None else dollars(cached), "updated_at": utcnow()}
            insert = dialect_insert(db, table).values(name=spec["name"], **values)
            conn.execute(insert.on_conflict_do_update(index_elements=[table.c.name], set_=values))


def deployment(db: Engine, name: str) -> Deployment | None:
    with Session(db) as s:
        row = s.scalar(select(ModelDeployment).where(ModelDeployment.name == name))
        return None if row is None else _plain(row)


def deployments(db: Engine) -> dict[str, Deployment]:
    with Session(db) as s:
        return {row.name: _plain(row) for row in s.scalars(select(ModelDeployment))}


def deployed_specs(db: Engine) -> dict[str, dict[str, Any]]:
    """Each recorded model's spec, by name (one query, for the gateways' registry refresh)."""
    with db.connect() as conn:
        return dict(conn.execute(select(ModelDeployment.name, ModelDeployment.spec)).tuples().all())


def _plain(row: ModelDeployment) -> Deployment:
    return Deployment(row.name, dict(row.spec or {}), row.input_per_1m, row.output_per_1m, row.gpu_hour,
                      row.cached_input_per_1m, row.updated_at)

