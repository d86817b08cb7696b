"""The models one gateway serves now, as one value: the registry (Ray) or the CLI (local) builds a new
one when deployments change and swaps it in with a single assignment, so a request sees either the
old set or the new one, never half of each."""

from __future__ import annotations

from dataclasses import dataclass, field

from billing.pricing import Prices
from gateway.adapters import AdapterTable, ResolvedModel
from gateway.backends import ModelBackend
from gateway.router import ModelSpec as RouteSpec
from gateway.specs import ModelSpec

DEFAULT_MAX_MODEL_LEN = 2048  # what the router assumes of a model whose context it does not know


@dataclass(frozen=True)
class DeployedModels:
    backends: dict[str, ModelBackend] = field(default_factory=dict)
    specs: dict[str, ModelSpec] = field(default_factory=dict)
    adapters: AdapterTable = None  # type: ignore[assignment]  # from the specs unless given

    def __post_init__(self) -> None:
        if self.adapters is None:
            object.__setattr__(self, "adapters", AdapterTable.from_specs(self.specs))

    def prices(self, model: str | ResolvedModel) -> Prices:
        """A model's list prices; an adapter's own where its spec sets them, else its base model's."""
        if isinstance(model, ResolvedModel):
            if model.adapter is not None and model.adapter.prices is not None:
                return model.adapter.prices
            model = model.base
        spec = self.specs.get(model)
        return spec.pricing.prices() if spec is not None else Prices()

    def route_candidates(self) -> list[RouteSpec]:
        """The models `"auto"` may pick: chat models deployed with a known spec, and serving (or able to start)."""
        out = []
        for name, spec in self.specs.items():
            backend = self.backends.get(name)
            if backend is None or spec.kind != "chat" or backend.info().kind != "chat":
                continue
            info = backend.info()
            if info.serving:
                out.append(RouteSpec(name, spec.size, tuple(spec.tasks),
                                     info.max_model_len or spec.max_model_len or DEFAULT_MAX_MODEL_LEN))
        return out
