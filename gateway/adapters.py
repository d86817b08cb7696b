"""The LoRA adapters a gateway serves over its chat models, who may use each, and at what price.

Clients name one as `model: "<model>:<adapter>"`. An adapter restricted to some tenants is invisible to the others:
in /v1/models and on use it does not exist for them (404), exactly like an unknown one. The table starts from the
specs' `adapters:` lists and the adapters added at run time (`platform adapters add|remove`,
gateway/adapter_routes.py), which the database keeps (billing/model_adapters.py) so that every gateway on it serves
them."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from billing.asked_model import SEPARATOR
from billing.model_adapters import AdapterRecord
from billing.pricing import Prices
from gateway.errors import model_not_found
from gateway.specs import ModelSpec


@dataclass(frozen=True)
class ServedAdapter:
    model: str  # the base model's name
    name: str
    source: str
    tenants: frozenset[str] | None  # tenant names allowed; None: every tenant
    prices: Prices | None  # None: the base model's
    from_spec: bool = True  # listed in its model's spec (changed by deploying the spec), else added at run time

    @property
    def id(self) -> str:
        return f"{self.model}{SEPARATOR}{self.name}"

    def visible_to(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants


# the files of a PEFT adapter directory that decide its answers
_WEIGHT_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def weights_fingerprint(source: str) -> str:
    """Which weights an adapter's source holds now, cheaply: its resolved path and its files' sizes and modification
    times. A name added again over other weights, or files written again in place, get another fingerprint."""
    path = Path(source).resolve()
    parts = [str(path)]
    for name in _WEIGHT_FILES if path.is_dir() else ("",):
        try:
            st = (path / name if name else path).stat()
        except OSError:
            continue
        parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


@dataclass(frozen=True)
class ResolvedModel:
    base: str  # the deployed model that runs the request
    adapter: ServedAdapter | None

    @property
    def id(self) -> str:
        """What the client asked for: the model, or model:adapter."""
        return self.adapter.id if self.adapter is not None else self.base

    def cache_model(self) -> str:
        """The model as the semantic cache's namespace holds it: an adapter's answers are kept apart from its base's
        and other adapters', and from those of earlier weights served under the same name."""
        if self.adapter is None:
            return self.base
        return f"{self.adapter.id}@{weights_fingerprint(self.adapter.source)}"


class AdapterTable:
    """Thread-safe. `version` counts run-time changes, so that a refresh built from an older read of the database
    (the Ray registry's) never undoes an add or a remove made meanwhile."""

    def __init__(self, adapters: list[ServedAdapter] | None = None) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, ServedAdapter] = {a.id: a for a in adapters or []}
        self.version = 0

    @classmethod
    def from_specs(cls, specs: dict[str, ModelSpec]) -> "AdapterTable":
        return cls(served_adapters(specs, []))

    def resolve(self, model: str, tenant: str) -> ResolvedModel:
        """`model` or `model:adapter` for this tenant; 404 (model_not_found) for an adapter it may not use."""
        if SEPARATOR not in model:
            return ResolvedModel(model, None)
        with self._lock:
            adapter = self._by_id.get(model)
        if adapter is None or not adapter.visible_to(tenant):
            raise model_not_found(model)
        return ResolvedModel(adapter.model, adapter)

    def get(self, model: str, name: str) -> ServedAdapter | None:
        with self._lock:
            return self._by_id.get(f"{model}{SEPARATOR}{name}")

    def visible(self, tenant: str) -> list[ServedAdapter]:
        with self._lock:
            return sorted((a for a in self._by_id.values() if a.visible_to(tenant)), key=lambda a: a.id)

    def all(self) -> list[ServedAdapter]:
        with self._lock:
            return sorted(self._by_id.values(), key=lambda a: a.id)

    def put(self, adapter: ServedAdapter) -> None:
        with self._lock:
            self._by_id[adapter.id] = adapter
            self.version += 1

    def remove(self, adapter_id: str) -> ServedAdapter | None:
        with self._lock:
            self.version += 1
            return self._by_id.pop(adapter_id, None)

    def replace(self, adapters: list[ServedAdapter], read_at_version: int) -> bool:
        """The whole set, as read when `version` was read_at_version; refused (False) if it changed since."""
        with self._lock:
            if self.version != read_at_version:
                return False
            self._by_id = {a.id: a for a in adapters}
            return True


def served_adapters(specs: dict[str, ModelSpec], added: list[AdapterRecord]) -> list[ServedAdapter]:
    """The specs' adapters, then those added at run time over chat models with a spec (a spec's entry of the same
    name wins: deploying a spec that lists it takes it over)."""
    out = {a.id: a for a in (
        ServedAdapter(spec.name, a.name, a.source, frozenset(a.tenants) if a.tenants is not None else None,
                      a.pricing.prices() if a.pricing is not None else None)
        for spec in specs.values() for a in spec.adapters)}
    for r in added:
        spec = specs.get(r.model)
        adapter = ServedAdapter(r.model, r.name, r.source, frozenset(r.tenants) if r.tenants is not None else None,
                                r.prices, from_spec=False)
        if spec is not None and spec.kind == "chat" and adapter.id not in out:
            out[adapter.id] = adapter
    return list(out.values())
