"""Model specs: the YAML files under platform/models/ (see DESIGN.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from billing.pricing import Prices


class Pricing(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_per_1m: float = Field(0.0, ge=0)
    output_per_1m: float = Field(0.0, ge=0)
    gpu_hour: float = Field(0.0, ge=0)

    def prices(self) -> Prices:
        return Prices(self.input_per_1m, self.output_per_1m, self.gpu_hour)


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    source: str = Field(min_length=1)
    size: Literal["small", "large"] = "small"
    tasks: list[str] = Field(default_factory=lambda: ["chat"])
    engine: dict[str, Any] = Field(default_factory=dict)
    resources: dict[str, Any] = Field(default_factory=dict)
    autoscaling: dict[str, Any] = Field(default_factory=dict)
    pricing: Pricing = Field(default_factory=Pricing)


def load_spec(path: str | Path) -> ModelSpec:
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a model spec must be a YAML mapping")
    return ModelSpec.model_validate(data)


def load_specs(directory: str | Path) -> list[ModelSpec]:
    specs = [load_spec(p) for p in sorted(Path(directory).glob("*.y*ml"))]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{directory}: model names used twice: {duplicates}")
    return specs
