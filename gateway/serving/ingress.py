"""The gateway as the Ray Serve ingress: the OpenAI API of gateway/app.py, with model calls going
through RayModelBackends that a registry thread keeps current, and the semantic cache in its own
shared deployment."""

from __future__ import annotations

import asyncio
from typing import Any

from ray import serve

from billing.db import make_engine
from gateway.app import create_app
from gateway.serving.cache_deployment import ServeCacheClient
from gateway.serving.deploy import scale_model
from gateway.serving.names import HEAD_NODE_ONLY
from gateway.serving.ray_backend import PlatformHeaders, RayModelBackend
from gateway.serving.registry import ModelRegistry
from gateway.settings import Settings

GATEWAY_MAX_ONGOING_REQUESTS = 10_000


# a replica being replaced, scaled down or stopped first finishes its in-flight requests (long streams
# included, up to settings.drain_s: gateway_app.py sets the graceful-shutdown bound), then its app's
# lifespan closes the ledger, which writes (or spills) the usage events it still holds
# max_ongoing_requests: Serve's default (5) would queue the sixth concurrent stream in Serve's proxy; the
# gateway is async and does its own admission, so a replica takes all it is sent
@serve.deployment(name="Gateway", ray_actor_options={"num_cpus": 0, "resources": HEAD_NODE_ONLY},
                  graceful_shutdown_wait_loop_s=0.5,
                  max_ongoing_requests=GATEWAY_MAX_ONGOING_REQUESTS)
@serve.ingress()
class GatewayIngress:
    async def __init__(self, settings: Settings, cache_handle: Any = None) -> None:
        self.settings = settings
        self.db = make_engine(settings.db_url)
        self.registry: ModelRegistry | None = None
        self.cache_handle = cache_handle  # the shared SemanticCache deployment, when the cache is on

    async def __serve_build_asgi_app__(self) -> Any:
        # models reach the gateway through the registry (backends, specs for prices and the router)
        app = create_app(self.settings.model_copy(update={"semantic_cache": False}), self.db, {}, [], behind_serve=True)
        if self.cache_handle is not None:
            app.state.gateway.reuse.cache = ServeCacheClient(self.cache_handle)
        app.add_middleware(PlatformHeaders, retry_after_s=self.settings.retry_after_s)
        self.registry = ModelRegistry(app.state.gateway, self.db, refresh_s=self.settings.registry_refresh_s,
                                      cold_start_timeout_s=self.settings.cold_start_timeout_s)
        await asyncio.to_thread(self.registry.start)  # its first refresh calls Serve's controller
        self.gateway = app.state.gateway
        self.in_flight = app.state.in_flight
        app.state.scale_model = self.scale_model  # the admin dashboard's scale hook
        return app

    def scale_model(self, name: str, min_replicas: int, max_replicas: int) -> None:
        """New replica bounds for a model, recorded and applied in place (the dashboard and handles call it)."""
        scale_model(self.db, name, self.settings, min_replicas, max_replicas)

    def stats(self) -> dict[str, Any]:
        """What `platform status` shows from the gateway's side, per model."""
        return {name: b.counters.as_dict() for name, b in self.gateway.backends.items()
                if isinstance(b, RayModelBackend)}

    async def drain(self, timeout_s: float) -> int:
        """Refuse new API requests; wait for the in-flight ones up to timeout_s; how many still run."""
        return await self.in_flight.drain(timeout_s)

    def __del__(self) -> None:
        if self.registry is not None:
            self.registry.stop()
