"""Operator endpoints for LoRA adapters at run time (`platform adapters add|list|remove`), behind the admin key: an
adapter added here is read by its model's engine while that engine keeps serving, and requests may name it as soon
as the call returns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from billing.deployments import record_adapters
from gateway.adapters import ServedAdapter
from gateway.admin_routes import require_admin
from gateway.errors import APIError, invalid_request
from gateway.model_roots import checked_source
from gateway.service import Gateway
from gateway.specs import AdapterSpec

adapter_router = APIRouter(prefix="/admin")


def _row(adapter: ServedAdapter) -> dict[str, Any]:
    return {"id": adapter.id, "model": adapter.model, "name": adapter.name, "source": adapter.source,
            "tenants": sorted(adapter.tenants) if adapter.tenants is not None else None}


@adapter_router.get("/adapters")
async def list_adapters(gw: Gateway = Depends(require_admin)) -> dict[str, Any]:
    return {"object": "list", "data": [_row(a) for a in gw.models.adapters.all()]}


def _spec_of(body: dict[str, Any], models_dir: Path) -> tuple[str, AdapterSpec]:
    """(model, adapter) from the request, each field checked: a 400 naming the first bad one."""
    if not isinstance(body, dict):
        raise invalid_request("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("model: the model to serve the adapter over is required", "model")
    try:
        adapter = AdapterSpec.model_validate({k: v for k, v in body.items() if k != "model"})
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        message = "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        raise invalid_request(f"{field}: {message}", field) from None
    try:
        source = checked_source("source", adapter.source, models_dir)
    except ValueError as e:
        raise invalid_request(str(e), "source") from None
    return model, adapter.model_copy(update={"source": source})


@adapter_router.post("/adapters")
async def add_adapter(body: dict[str, Any], gw: Gateway = Depends(require_admin)) -> dict[str, Any]:
    model, spec = _spec_of(body, gw.models_dir)
    backend = gw.backends.get(model)
    if backend is None or not hasattr(backend, "add_adapter"):
        raise APIError(404, f"model: no chat model `{model}` runs in this gateway's process (adapters are added at "
                       "run time to `platform serve --local` models)", "invalid_request_error", "model_not_found",
                       "model")
    try:
        await backend.add_adapter(spec.name, spec.source)
    except ValueError as e:
        message = str(e)
        field = message.partition(":")[0] if ":" in message else "source"
        raise invalid_request(message, "source" if field in ("lora_path", "lora_name") else field) from None
    served = ServedAdapter(model, spec.name, spec.source, frozenset(spec.tenants) if spec.tenants else None,
                           spec.pricing.prices() if spec.pricing else None)
    gw.models.adapters.put(served)
    await run_in_threadpool(_record, gw, model)
    return _row(served)


@adapter_router.delete("/adapters/{model}/{name}")
async def remove_adapter(model: str, name: str, gw: Gateway = Depends(require_admin)) -> dict[str, Any]:
    removed = gw.models.adapters.remove(f"{model}:{name}")
    if removed is None:
        raise APIError(404, f"No adapter `{name}` is served over `{model}`.", "invalid_request_error",
                       "adapter_not_found", "name")
    backend = gw.backends.get(model)
    if backend is not None and hasattr(backend, "remove_adapter"):
        await backend.remove_adapter(name)
    await run_in_threadpool(_record, gw, model)
    return {"id": removed.id, "deleted": True}


def _record(gw: Gateway, model: str) -> None:
    """The model's recorded spec lists its adapters now, with their prices (billing/invoice.py reads them)."""
    adapters = []
    for a in gw.models.adapters.all():
        if a.model == model:
            entry: dict[str, Any] = {"name": a.name, "source": a.source}
            if a.prices is not None:
                entry["pricing"] = {"input_per_1m": str(a.prices.input_per_1m),
                                    "output_per_1m": str(a.prices.output_per_1m),
                                    "gpu_hour": str(a.prices.gpu_hour)}
            adapters.append(entry)
    record_adapters(gw.db, model, adapters)
