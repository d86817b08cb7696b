"""Builds the FastAPI app: the OpenAI routes over a set of model backends, with the ledger
started and stopped (flushed) by the app's lifespan."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from billing.models import ModelDeployment
from gateway import errors
from gateway.access_log import drop_query_strings
from gateway.admin_routes import admin_router
from gateway.answer_reuse import AnswerReuse
from gateway.auth_throttle import FailedAuthThrottle
from gateway.backends import LocalEngineBackend, ModelBackend
from gateway.body_limit import BodySizeLimit
from gateway.dashboard import install_dashboard, session_secret
from gateway.routes import router
from gateway.service import Gateway
from gateway.settings import Settings
from gateway.specs import ModelSpec

log = logging.getLogger("tollgate.gateway")


def create_app(settings: Settings, db: Engine, backends: dict[str, ModelBackend], specs: list[ModelSpec], *,
               own_backends: bool = False) -> FastAPI:
    """`own_backends`: start LocalEngineBackends at startup and stop them at shutdown."""
    prices = {s.name: s.pricing.prices() for s in specs}
    reuse = AnswerReuse(None, [s.model_dump(mode="json") for s in specs])
    gw = Gateway(db, backends, prices, key_cache_ttl_s=settings.key_cache_ttl_s,
                 ledger_max_batch=settings.ledger_max_batch, reuse=reuse,
                 ledger_spill_dir=settings.ledger_spill_path, ledger_max_buffer=settings.ledger_max_buffer,
                 admission_db_timeout_s=settings.admission_db_timeout_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        drop_query_strings()
        register_deployments(db, specs)
        gw.ledger.start()
        if settings.semantic_cache:
            reuse.cache = await asyncio.to_thread(open_semantic_cache, settings)
        if own_backends:
            for backend in backends.values():
                if isinstance(backend, LocalEngineBackend):
                    log.info("loading model %s", backend.spec.name)
                    await backend.start()
        try:
            yield
        finally:
            if own_backends:
                for backend in backends.values():
                    if isinstance(backend, LocalEngineBackend):
                        backend.stop()
            gw.ledger.close()
            if reuse.cache is not None:
                reuse.cache.close()

    app = FastAPI(title="Tollgate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw
    app.state.admin_key = settings.admin_key.get_secret_value() if settings.admin_key else None
    app.state.session_secret = session_secret(settings)
    app.state.auth_throttle = FailedAuthThrottle(settings.auth_fail_limit, settings.auth_fail_window_s)
    errors.install(app)
    app.include_router(router)
    app.include_router(admin_router)
    install_dashboard(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    return app


def register_deployments(db: Engine, specs: list[ModelSpec]) -> None:
    with Session(db) as s, s.begin():
        for spec in specs:
            row = s.scalar(select(ModelDeployment).where(ModelDeployment.name == spec.name))
            if row is None:
                row = ModelDeployment(name=spec.name)
                s.add(row)
            row.spec = spec.model_dump(mode="json")
            row.input_per_1m = spec.pricing.input_per_1m
            row.output_per_1m = spec.pricing.output_per_1m
            row.gpu_hour = spec.pricing.gpu_hour


def open_semantic_cache(settings: Settings) -> Any:
    """The semantic cache under home/cache, or None when it cannot start: then every request goes to a model."""
    try:
        from cache.embedder import shared_embedder
        from cache.semantic_cache import SemanticCache

        # torch_threads=None: leave the process's thread count to the engines running beside the cache
        return SemanticCache(settings.home / "cache", embedder=shared_embedder(torch_threads=None),
                             ttl_s=settings.cache_ttl_s, max_entries=settings.cache_max_entries)
    except Exception:
        log.exception("semantic cache unavailable; serving without it")
        return None
