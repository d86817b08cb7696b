"""The LoRA adapters a gateway serves over its chat models, who may use each, and at what price.

Clients name one as `model: "<model>:<adapter>"`. An adapter restricted to some tenants is invisible to the others:
in /v1/models and on use it does not exist for them (404), exactly like an unknown one. The table starts from the
specs' `adapters:` lists and changes at run time (`platform adapters add|remove`, gateway/adapter_routes.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from billing.pricing import Prices
from gateway.errors import model_not_found
from gateway.specs import ModelSpec

SEPARATOR = ":"


@dataclass(frozen=True)
class ServedAdapter:
    model: str  # the base model's name
    name: str
    source: str
    tenants: frozenset[str] | None  # tenant names allowed; None: every tenant
    prices: Prices | None  # None: the base model's

    @property
    def id(self) -> str:
        return f"{self.model}{SEPARATOR}{self.name}"

    def visible_to(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants


@dataclass(frozen=True)
class ResolvedModel:
    base: str  # the deployed model that runs the request
    adapter: ServedAdapter | None

    @property
    def id(self) -> str:
        """What the client asked for: the model, or model:adapter."""
        return self.adapter.id if self.adapter is not None else self.base


class AdapterTable:
    def __init__(self, adapters: list[ServedAdapter] | None = None) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, ServedAdapter] = {a.id: a for a in adapters or []}

    @classmethod
    def from_specs(cls, specs: dict[str, ModelSpec]) -> "AdapterTable":
        return cls([
            ServedAdapter(spec.name, a.name, a.source, frozenset(a.tenants) if a.tenants is not None else None,
                          a.pricing.prices() if a.pricing is not None else None)
            for spec in specs.values() for a in spec.adapters
        ])

    def resolve(self, model: str, tenant: str) -> ResolvedModel:
        """`model` or `model:adapter` for this tenant; 404 (model_not_found) for an adapter it may not use."""
        if SEPARATOR not in model:
            return ResolvedModel(model, None)
        with self._lock:
            adapter = self._by_id.get(model)
        if adapter is None or not adapter.visible_to(tenant):
            raise model_not_found(model)
        return ResolvedModel(adapter.model, adapter)

    def visible(self, tenant: str) -> list[ServedAdapter]:
        with self._lock:
            return sorted((a for a in self._by_id.values() if a.visible_to(tenant)), key=lambda a: a.id)

    def all(self) -> list[ServedAdapter]:
        with self._lock:
            return sorted(self._by_id.values(), key=lambda a: a.id)

    def put(self, adapter: ServedAdapter) -> None:
        with self._lock:
            self._by_id[adapter.id] = adapter

    def remove(self, adapter_id: str) -> ServedAdapter | None:
        with self._lock:
            return self._by_id.pop(adapter_id, None)
