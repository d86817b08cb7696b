"""Builds the FastAPI app: the OpenAI routes over a set of model backends, with the ledger
started and stopped (flushed) by the app's lifespan."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from sqlalchemy import Engine

from billing.deployments import record_deployments
from billing.model_adapters import recorded_adapters
from billing.replica_intervals import IntervalRecorder
from gateway import errors
from gateway.access_log import redact_access_log
from gateway.adapter_routes import adapter_router
from gateway.adapters import served_adapters
from gateway.admin_routes import admin_router
from gateway.cache_feedback import cache_feedback_router
from gateway.answer_reuse import AnswerReuse
from gateway.auth_throttle import FailedAuthThrottle
from gateway.backends import LocalEngineBackend, ModelBackend
from gateway.body_limit import BodySizeLimit
from gateway.dashboard import install_dashboard, session_secret
from gateway.deployed import DeployedModels
from gateway.direct_routes import DirectRoutes
from gateway.drain import InFlightMiddleware
from gateway.recorded_adapters import load_recorded_adapters
from gateway.embedding_backend import LocalEmbeddingBackend
from gateway.embeddings import embeddings_router
from gateway.request_id import RequestIdMiddleware
from gateway.routes import COMPLETION_ROUTES, router
from gateway.service import Gateway
from gateway.settings import Settings
from gateway.specs import ModelSpec

log = logging.getLogger("tollgate.gateway")
LOCAL_BACKENDS = (LocalEngineBackend, LocalEmbeddingBackend)  # models that run in this process


def create_app(settings: Settings, db: Engine, backends: dict[str, ModelBackend], specs: list[ModelSpec], *,
               own_backends: bool = False, behind_serve: bool = False, freeze_after_start: bool = False,
               record_intervals: bool = True, follow_adapters_s: float | None = None,
               refused_specs: list[str] | None = None) -> FastAPI:
    """`own_backends`: start LocalEngineBackends at startup (a model that cannot load stays unavailable,
    with its reason, and the others serve) and stop them at shutdown, after in-flight requests drained; with
    `record_intervals` (one of several API processes over the same engines: only one) they write replica intervals.
    `behind_serve`: Ray Serve's proxy gives every response its x-request-id (and passes it in the request).
    `freeze_after_start`: for a server process (not tests that build many apps in one): gc.freeze() once started.
    `follow_adapters_s`: read the adapters added or removed at run time from the database this often (several API
    processes over the same engines: one of them changed the engine, the others learn of it here).
    `refused_specs`: the spec files of the models directory that could not be read (load_specs' errors, logged):
    /health names them and is degraded."""
    models = DeployedModels(dict(backends), {s.name: s for s in specs})
    gw = Gateway(db, models, key_cache_ttl_s=settings.key_cache_ttl_s, ledger_max_batch=settings.ledger_max_batch,
                 reuse=AnswerReuse(None), ledger_spill_dir=settings.ledger_spill_path,
                 ledger_max_buffer=settings.ledger_max_buffer, admission_db_timeout_s=settings.admission_db_timeout_s,
                 budget_alert_webhook=settings.budget_alert_webhook, budget_leases=settings.budget_leases)
    gw.models_dir = settings.models_dir  # where `platform adapters add` may read adapters from, besides the roots
    gw.refused_specs = sorted(refused_specs or [])
    in_flight = gw.in_flight

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        redact_access_log()
        record_deployments(db, [spec.model_dump(mode="json") for spec in specs])
        gw.ledger.start()
        gw.keeper.start()
        if settings.semantic_cache:
            gw.reuse.cache = await asyncio.to_thread(open_semantic_cache, settings)
        recorders: list[IntervalRecorder] = []
        if own_backends:
            await _start_local_models(backends)
            if record_intervals:
                recorders = _record_intervals(db, backends, settings.interval_flush_s)
        await _serve_recorded_adapters(gw, db, backends)
        follower = asyncio.create_task(_follow_recorded_adapters(gw, db, backends, follow_adapters_s)) \
            if follow_adapters_s else None
        # what startup built (tokenizers, the app, the models' Python objects) lives as long as the process: frozen,
        # the collector's full passes under load walk only what requests allocate
        if freeze_after_start:
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            if follower is not None:
                follower.cancel()
            left = await in_flight.drain(settings.drain_s)
            if left:
                log.warning("stopping with %d %s still in flight after %.0f s", left,
                            "request" if left == 1 else "requests", settings.drain_s)
            for recorder in recorders:
                recorder.close()
            if own_backends:
                for backend in backends.values():
                    if isinstance(backend, LOCAL_BACKENDS):
                        backend.stop()
            gw.ledger.close()
            gw.limiter.close()  # after the ledger's last write: what the budget leases did not use goes back
            if gw.budget_webhook is not None:
                gw.budget_webhook.close()
            gw.keeper.stop()
            if gw.reuse.cache is not None:
                gw.reuse.cache.close()

    app = FastAPI(title="Tollgate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw
    app.state.in_flight = in_flight
    app.state.admin_key = settings.admin_key.get_secret_value() if settings.admin_key else None
    app.state.session_secret = session_secret(settings)
    app.state.auth_throttle = FailedAuthThrottle(settings.auth_fail_limit, settings.auth_fail_window_s)
    errors.install(app)
    for path, endpoint in COMPLETION_ROUTES.items():
        app.router.add_route(path, endpoint, methods=["POST"])
    app.include_router(router)
    app.include_router(embeddings_router)
    app.include_router(admin_router)
    app.include_router(adapter_router)
    app.include_router(cache_feedback_router)
    install_dashboard(app)
    app.add_middleware(DirectRoutes, routes=COMPLETION_ROUTES)  # innermost: inside the limits, drain and request id
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(InFlightMiddleware, in_flight=in_flight)
    if not behind_serve:
        app.add_middleware(RequestIdMiddleware)
    return app


def _record_intervals(db: Engine, backends: dict[str, ModelBackend], flush_every_s: float) -> list[IntervalRecorder]:
    """The local models' alive / busy intervals and tenants' GPU shares, as Ray Serve replicas write them."""
    replica = f"local-{socket.gethostname()}-{os.getpid()}"
    out = []
    for name, backend in backends.items():
        if isinstance(backend, LOCAL_BACKENDS) and backend.info().state == "ready":
            out.append(IntervalRecorder(db, name, replica, backend.busy_totals, flush_every_s=flush_every_s).start())
    return out


async def _start_local_models(backends: dict[str, ModelBackend]) -> None:
    for name, backend in backends.items():
        if not isinstance(backend, LOCAL_BACKENDS) or backend.info().state == "unavailable":
            continue
        log.info("loading model %s", name)
        try:
            await backend.start()
        except Exception:
            log.error("model %s is unavailable: %s", name, backend.info().reason)


async def _serve_recorded_adapters(gw: Gateway, db: Engine, backends: dict[str, ModelBackend]) -> None:
    """The adapters added at run time to the local chat models, loaded again (another gateway, or this one before a
    restart, added them)."""
    version = gw.models.adapters.version
    added = []
    for backend in backends.values():
        if isinstance(backend, LocalEngineBackend) and backend.info().state == "ready":
            added += await load_recorded_adapters(backend, db)
    gw.models.adapters.replace(served_adapters(gw.models.specs, added), version)


async def _follow_recorded_adapters(gw: Gateway, db: Engine, backends: dict[str, ModelBackend], every_s: float) -> None:
    """The run-time adapters as the database has them now, every `every_s`: another API process over the same engine
    cores added or removed them there (and in the core)."""
    while True:
        await asyncio.sleep(every_s)
        version = gw.models.adapters.version
        try:
            records = []
            for backend in backends.values():
                if isinstance(backend, LocalEngineBackend) and backend.info().state == "ready":
                    found = await asyncio.to_thread(recorded_adapters, db, backend.spec.name)
                    backend.know_adapters({r.name: r.source for r in found})
                    records += found
        except Exception as e:  # the database away: the set stays as it was and is read again next time
            log.warning("cannot read the run-time adapters: %s", type(e).__name__)
            continue
        gw.models.adapters.replace(served_adapters(gw.models.specs, records), version)


def open_semantic_cache(settings: Settings) -> Any:
    """The semantic cache under home/cache, or None when it cannot start: then every request goes to a model."""
    try:
        from cache.embedder import shared_embedder
        from cache.semantic_cache import SemanticCache

        # torch_threads=None: leave the process's thread count to the engines running beside the cache
        return SemanticCache(settings.home / "cache", embedder=shared_embedder(torch_threads=None),
                             ttl_s=settings.cache_ttl_s, max_entries=settings.cache_max_entries,
                             explore=settings.cache_explore)
    except Exception:
        log.exception("semantic cache unavailable; serving without it")
        return None
