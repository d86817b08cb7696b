"""The gateway application (route "/"): the ingress and, when the semantic cache is on, the cache
deployment every gateway replica shares."""

from __future__ import annotations

from ray.serve import Application

from gateway.serving.cache_deployment import SemanticCacheServer
from gateway.serving.ingress import GatewayIngress
from gateway.serving.names import GATEWAY_APP
from gateway.serving.ray_env import SERVE_LOGGING
from gateway.settings import Settings


def gateway_application(settings: Settings) -> Application:
    cache = SemanticCacheServer.bind(settings) if settings.semantic_cache else None
    return GatewayIngress.options(graceful_shutdown_timeout_s=settings.drain_s).bind(settings, cache)


def deploy_gateway(settings: Settings) -> None:
    from ray import serve

    serve.run(gateway_application(settings), name=GATEWAY_APP, route_prefix="/", logging_config=SERVE_LOGGING)
