"""Tollgate as Ray Serve applications: the gateway (FastAPI ingress, route "/") and one application
per model spec running a ModelServer deployment (an AsyncEngine per replica, autoscaled 0..N).
Deploying, updating or deleting a model touches only its own application.

Builders for config files (KubeRay serveConfigV2, `serve run`): `gateway.serve:gateway_builder` and
`gateway.serve:model_builder` with args {"spec": "path/to/model.yaml"}."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve import Application
from sqlalchemy import select

from billing.db import make_engine
from billing.models import ModelDeployment
from billing.replica_intervals import IntervalRecorder
from gateway.app import create_app
from gateway.backends import GenerationChunk, GenerationRequest, LocalEngineBackend, ModelBackend
from gateway.gpu_sampler import GpuSampler
from gateway.model_cache import prepared_source
from gateway.platform_settings import PlatformSettings
from gateway.ray_backend import PlatformHeaders, RayModelBackend, ReplicaAccepted
from gateway.serve_cache import SemanticCacheServer, ServeCacheClient
from gateway.specs import ModelSpec, load_spec, parse_spec

log = logging.getLogger("tollgate.serve")

GATEWAY_APP = "tollgate"
MODEL_APP_PREFIX = "model-"
MODEL_DEPLOYMENT = "ModelServer"


def model_app_name(model: str) -> str:
    return MODEL_APP_PREFIX + model


@serve.deployment(name=MODEL_DEPLOYMENT, health_check_period_s=2.0, graceful_shutdown_timeout_s=30.0,
                  graceful_shutdown_wait_loop_s=0.5)
class ModelServer:
    """One replica: loads the model once, streams GenerationChunks, records alive/busy intervals."""

    async def __init__(self, spec_data: dict[str, Any], db_url: str, interval_flush_s: float) -> None:
        started = self.started_at = time.time()
        self.spec = parse_spec(spec_data)
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        # a GGUF source is converted once per node; later cold starts load the converted directory
        source = await asyncio.to_thread(prepared_source, self.spec.source)
        self.backend = LocalEngineBackend(self.spec.model_copy(update={"source": source}))
        self.db = make_engine(db_url)
        self.recorder = IntervalRecorder(self.db, self.spec.name, self.replica, self._busy_seconds,
                                         flush_every_s=interval_flush_s, started_at=started)
        self.recorder.start()
        self.gpu = GpuSampler.maybe_start() if self.spec.resources.num_gpus > 0 else None
        self.ongoing = 0
        await self.backend.start()
        self.ready_at = time.time()
        self.load_s = self.ready_at - started
        log.info("replica %s of %s ready in %.2f s", self.replica, self.spec.name, self.load_s)

    def _busy_seconds(self) -> float:
        stats = self.backend.stats()
        return float(stats.get("busy_seconds", 0.0))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[ReplicaAccepted | GenerationChunk]:
        yield ReplicaAccepted(self.replica, self.ready_at, self.started_at)
        self.ongoing += 1
        try:
            async for chunk in self.backend.generate(request):
                yield chunk
        finally:
            self.ongoing -= 1

    def stats(self) -> dict[str, Any]:
        return {"replica": self.replica, "ongoing": self.ongoing, "load_s": self.load_s,
                "engine": self.backend.stats(), "gpu_util": self.gpu.mean() if self.gpu else None}

    def __del__(self) -> None:
        # graceful shutdown (downscale, redeploy, delete): close the last interval, free the engine
        if getattr(self, "gpu", None) is not None:
            self.gpu.stop()
        if hasattr(self, "recorder"):
            self.recorder.close()
        if hasattr(self, "backend"):
            self.backend.stop()


class _ModelRegistry:
    """Keeps the gateway's backends in step with the model applications on the cluster: a thread reads
    serve.status() and the ModelDeployment rows and swaps in new dicts (never mutates the live ones)."""

    def __init__(self, gw: Any, settings: PlatformSettings, db: Any) -> None:
        self.gw = gw
        self.settings = settings
        self.db = db
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tollgate-registry", daemon=True)

    def start(self) -> None:
        self.refresh()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.settings.registry_refresh_s):
            try:
                self.refresh()
            except Exception:
                log.exception("model registry refresh failed")

    def refresh(self) -> None:
        apps = {name[len(MODEL_APP_PREFIX):]: app for name, app in serve.status().applications.items()
                if name.startswith(MODEL_APP_PREFIX)}
        with self.db.connect() as conn:
            rows = dict(conn.execute(select(ModelDeployment.name, ModelDeployment.spec)).tuples().all())
        current: dict[str, ModelBackend] = self.gw.backends
        backends: dict[str, ModelBackend] = {}
        prices = dict(self.gw.prices)
        for name, app in apps.items():
            spec_data = rows.get(name)
            spec = parse_spec(spec_data) if spec_data else None
            backend = current.get(name)
            if not isinstance(backend, RayModelBackend):
                handle = serve.get_app_handle(model_app_name(name))
                max_len = spec.engine.get("max_model_len") if spec else None
                backend = RayModelBackend(name, handle, max_model_len=max_len,
                                          cold_start_timeout_s=self.settings.cold_start_timeout_s)
            backend.state = _state(str(app.status))
            deployment = app.deployments.get(MODEL_DEPLOYMENT)
            backend.replica_states = {} if deployment is None else {
                str(state).rsplit(".", 1)[-1].lower(): count for state, count in deployment.replica_states.items()}
            backends[name] = backend
            if spec is not None:
                prices[name] = spec.pricing.prices()
        self.gw.prices = prices
        self.gw.backends = backends  # one reference swap: requests see the old or the new dict


def _deployed_specs(db: Any) -> list[ModelSpec]:
    names = {n[len(MODEL_APP_PREFIX):] for n in serve.status().applications if n.startswith(MODEL_APP_PREFIX)}
    with db.connect() as conn:
        rows = conn.execute(select(ModelDeployment.name, ModelDeployment.spec)).tuples().all()
    return [parse_spec(spec) for name, spec in rows if name in names]


def _state(app_status: str) -> Any:
    status = app_status.rsplit(".", 1)[-1].upper()
    if status == "DEPLOY_FAILED":
        return "failed"
    if status == "DELETING":
        return "stopped"
    return "ready"  # RUNNING (at zero replicas too: a request starts one), DEPLOYING, UNHEALTHY (restarting)


# a replica being replaced or scaled down first finishes its in-flight requests (long streams included),
# then its app's lifespan closes the ledger, which writes (or spills) the usage events it still holds
@serve.deployment(name="Gateway", ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=120.0,
                  graceful_shutdown_wait_loop_s=0.5)
@serve.ingress()
class GatewayIngress:
    """The OpenAI API of gateway/app.py as the Serve ingress; model calls go through RayModelBackends."""

    async def __init__(self, settings: PlatformSettings, cache_handle: Any = None) -> None:
        self.settings = settings
        self.db = make_engine(self.settings.db_url)
        self.registry: _ModelRegistry | None = None
        self.cache_handle = cache_handle  # the shared SemanticCache deployment, when the cache is on

    async def __serve_build_asgi_app__(self) -> Any:
        # the specs deployed now, for what create_app derives from them (router sides, cache groups);
        # models deployed later reach the gateway through the registry (backends and prices)
        specs = await asyncio.to_thread(_deployed_specs, self.db)
        # the cache lives in its own deployment, shared by every gateway replica, not in this process
        app = create_app(self.settings.model_copy(update={"semantic_cache": False}), self.db, {}, specs)
        if self.cache_handle is not None:
            app.state.gateway.reuse.cache = ServeCacheClient(self.cache_handle)
        app.add_middleware(PlatformHeaders, retry_after_s=self.settings.retry_after_s)
        self.registry = _ModelRegistry(app.state.gateway, self.settings, self.db)
        await asyncio.to_thread(self.registry.start)
        self.gateway = app.state.gateway
        app.state.scale_model = self.scale_model  # the admin dashboard's scale hook
        return app

    def scale_model(self, name: str, min_replicas: int, max_replicas: int) -> None:
        """New replica bounds for a model, recorded and applied in place (the dashboard and handles call it)."""
        from gateway.platform_ops import scale_model

        scale_model(self.db, name, self.settings, min_replicas, max_replicas)

    def stats(self) -> dict[str, Any]:
        """What `platform status` shows from the gateway's side, per model."""
        return {name: b.counters.as_dict() for name, b in self.gateway.backends.items()
                if isinstance(b, RayModelBackend)}

    def __del__(self) -> None:
        if self.registry is not None:
            self.registry.stop()


def model_application(spec: ModelSpec, settings: PlatformSettings, **deployment_options: Any) -> Application:
    actor_options: dict[str, Any] = {"num_cpus": spec.resources.num_cpus, "num_gpus": spec.resources.num_gpus}
    if spec.resources.memory_gib is not None:
        actor_options["memory"] = int(spec.resources.memory_gib * 2**30)
    # autoscaling and pricing stay out of the replicas' arguments, and the version names only what the
    # replicas are built from: changing the replica bounds or prices updates the running replicas in place
    replica_spec = spec.model_dump(mode="json", exclude={"autoscaling", "pricing"})
    args = (replica_spec, settings.db_url, settings.interval_flush_s)
    version = hashlib.sha256(json.dumps([args, actor_options, _package_version()], sort_keys=True).encode())
    version = version.hexdigest()[:16]
    deployment = ModelServer.options(
        autoscaling_config=spec.autoscaling.serve_config(),
        max_ongoing_requests=spec.autoscaling.max_ongoing_requests,
        ray_actor_options=actor_options,
        **deployment_options,
    )
    # Serve gives every imperative deploy a random code version (a full restart) unless one is set;
    # `options(version=)` is gone, so set the attribute serve.run reads
    deployment._version = version
    return deployment.bind(*args)


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("tollgate")
    except PackageNotFoundError:
        return "dev"


def gateway_application(settings: PlatformSettings) -> Application:
    cache = SemanticCacheServer.bind(settings) if settings.semantic_cache else None
    return GatewayIngress.bind(settings, cache)


# ---- builders for Serve config files (serveConfigV2 import_path) ---------------------------------


def gateway_builder(args: dict[str, Any]) -> Application:
    return gateway_application(PlatformSettings.load(**(args or {})))


def model_builder(args: dict[str, Any]) -> Application:
    args = dict(args or {})
    spec_arg = args.pop("spec")
    spec = parse_spec(spec_arg) if isinstance(spec_arg, dict) else load_spec(spec_arg)
    return model_application(spec, PlatformSettings.load(**args))
