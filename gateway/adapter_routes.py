"""Operator endpoints for LoRA adapters at run time (`platform adapters add|list|remove`), behind the admin key.

An adapter added here is checked whole (its model, its source under the model roots, its weights against the model),
recorded in the database (billing/model_adapters.py), then loaded by the model's engine while it keeps serving: the
one in this process (`serve --local`), or every running replica on Ray Serve; replicas started later load the
recorded set. Requests may name it as soon as the call returns; other gateways on the database serve it from their
next registry refresh. A refusal leaves nothing recorded."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import ValidationError
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from billing.model_adapters import AdapterRecord, DuplicateAdapter, delete_adapter, record_adapter
from billing.models import Tenant
from gateway.adapter_checks import AdapterRefused, check_adapter
from gateway.adapters import ServedAdapter
from gateway.admin_routes import require_admin
from gateway.backends import BackendUnavailable
from gateway.errors import APIError, invalid_request, unavailable
from gateway.model_roots import checked_source
from gateway.service import Gateway
from gateway.specs import AdapterSpec, ModelSpec

log = logging.getLogger("tollgate.adapters")
adapter_router = APIRouter(prefix="/admin")


def _row(adapter: ServedAdapter) -> dict[str, Any]:
    prices = adapter.prices
    return {"id": adapter.id, "model": adapter.model, "name": adapter.name, "source": adapter.source,
            "tenants": sorted(adapter.tenants) if adapter.tenants is not None else None,
            "input_per_1m": str(prices.input_per_1m) if prices is not None else None,  # None: its base model's
            "output_per_1m": str(prices.output_per_1m) if prices is not None else None,
            "added": "spec" if adapter.from_spec else "run time"}


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


def _chat_model(gw: Gateway, model: str) -> ModelSpec:
    spec = gw.models.specs.get(model)
    if spec is None or model not in gw.backends:
        raise APIError(404, f"model: no model `{model}` is deployed", "invalid_request_error", "model_not_found",
                       "model")
    if spec.kind != "chat":
        raise invalid_request(f"model: `{model}` is an {spec.kind} model; LoRA adapters are served over chat models",
                              "model")
    return spec


def _unknown_tenants(gw: Gateway, tenants: list[str]) -> list[str]:
    with gw.db.connect() as conn:
        known = set(conn.scalars(select(Tenant.name).where(Tenant.name.in_(tenants))))
    return [t for t in tenants if t not in known]


@adapter_router.post("/adapters")
async def add_adapter(body: dict[str, Any], gw: Gateway = Depends(require_admin)) -> dict[str, Any]:
    model, spec = _spec_of(body, gw.models_dir)
    model_spec = _chat_model(gw, model)
    if gw.models.adapters.get(model, spec.name) is not None:
        raise invalid_request(f"name: model `{model}` already serves an adapter `{spec.name}` (remove it first)",
                              "name")
    if spec.tenants and (unknown := await run_in_threadpool(_unknown_tenants, gw, spec.tenants)):
        raise invalid_request(f"tenants: no tenant `{unknown[0]}` (create it with `platform tenants create`)",
                              "tenants")
    try:
        await run_in_threadpool(check_adapter, model_spec, spec.name, spec.source)
    except AdapterRefused as e:
        raise invalid_request(str(e), e.field) from None
    prices = spec.pricing.prices() if spec.pricing else None
    record = AdapterRecord(model, spec.name, spec.source, tuple(spec.tenants) if spec.tenants else None, prices)
    try:
        await run_in_threadpool(record_adapter, gw.db, record)
    except DuplicateAdapter as e:  # another gateway added it meanwhile
        raise invalid_request(str(e), "name") from None
    backend = gw.backends[model]
    try:
        await backend.add_adapter(spec.name, spec.source)  # type: ignore[attr-defined]
    except (ValueError, BackendUnavailable) as e:
        await run_in_threadpool(delete_adapter, gw.db, model, spec.name)
        gw.models.adapters.remove(f"{model}:{spec.name}")  # a registry refresh may have read the row meanwhile
        if hasattr(backend, "remove_adapter"):  # replicas that did load it let it go again
            await backend.remove_adapter(spec.name)
        if isinstance(e, BackendUnavailable):
            raise unavailable(str(e)) from None
        raise invalid_request(f"source: {e}", "source") from None
    served = ServedAdapter(model, spec.name, spec.source, frozenset(spec.tenants) if spec.tenants else None, prices,
                           from_spec=False)
    gw.models.adapters.put(served)
    return _row(served)


@adapter_router.delete("/adapters/{model}/{name}")
async def remove_adapter(model: str, name: str, gw: Gateway = Depends(require_admin)) -> dict[str, Any]:
    adapter = gw.models.adapters.get(model, name)
    if adapter is None:
        raise APIError(404, f"name: no adapter `{name}` is served over `{model}`", "invalid_request_error",
                       "adapter_not_found", "name")
    if adapter.from_spec:
        raise invalid_request(f"name: `{adapter.id}` is listed in the spec of `{model}`: take it out of the spec and "
                              "deploy the spec again (`platform deploy` on `platform up`; under `serve --local`, "
                              "restart it)", "name")
    await run_in_threadpool(delete_adapter, gw.db, model, name)
    gw.models.adapters.remove(adapter.id)
    backend = gw.backends.get(model)
    if backend is not None and hasattr(backend, "remove_adapter"):
        try:
            await backend.remove_adapter(name)
        except BackendUnavailable as e:  # its replicas are gone or unreachable: none serves it anyway
            log.warning("adapter %s removed; its model could not be told: %s", adapter.id, e)
    return {"id": adapter.id, "deleted": True}
