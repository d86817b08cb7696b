"""The models the gateway serves, as its backends describe them (info()) plus the autoscaling bounds
recorded with each deployment's spec."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import Engine

from billing.deployments import deployments
from billing.money import ZERO
from gateway.backends import ModelBackend


@dataclass(frozen=True)
class ModelRow:
    name: str
    state: str
    reason: str | None
    max_model_len: int | None
    live_replicas: int
    min_replicas: int | None
    max_replicas: int | None
    input_per_1m: Decimal
    cached_input_per_1m: Decimal | None  # prompt tokens read from the KV prefix cache; None: the input price
    output_per_1m: Decimal
    gpu_hour: Decimal


def live_replicas(backend: ModelBackend) -> int:
    """A backend's info() may report `replicas`; one that does not is a single in-process engine."""
    info = backend.info()
    reported = getattr(info, "replicas", None)
    if isinstance(reported, int):
        return reported
    return 1 if info.state == "ready" else 0


def model_rows(db: Engine, backends: dict[str, ModelBackend]) -> list[ModelRow]:
    recorded = deployments(db)
    rows = []
    for name, backend in sorted(backends.items()):
        info = backend.info()
        dep = recorded.get(name)
        scaling = dep.spec.get("autoscaling", {}) if dep is not None else {}
        rows.append(ModelRow(name, info.state, info.reason, info.max_model_len, live_replicas(backend),
                             scaling.get("min_replicas"), scaling.get("max_replicas"),
                             dep.input_per_1m if dep else ZERO, dep.cached_input_per_1m if dep else None,
                             dep.output_per_1m if dep else ZERO, dep.gpu_hour if dep else ZERO))
    return rows
