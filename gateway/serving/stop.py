"""Stopping the platform this process started: the gateway stops taking API requests and lets the
in-flight ones finish (up to settings.drain_s; each is recorded in the ledger), then Serve and Ray
shut down."""

from __future__ import annotations

import logging

from gateway.serving.names import GATEWAY_APP
from gateway.settings import Settings

log = logging.getLogger("tollgate.platform")


def drain_gateway(settings: Settings) -> int:
    """How many requests were still in flight when the bound ran out (0: all finished)."""
    from ray import serve

    if GATEWAY_APP not in serve.status().applications:
        return 0
    handle = serve.get_app_handle(GATEWAY_APP)
    try:
        return int(handle.drain.remote(settings.drain_s).result(timeout_s=settings.drain_s + 30))
    except Exception as e:  # a gateway that cannot answer has nothing left to drain
        log.warning("gateway drain failed: %s", e)
        return 0


def stop_platform(settings: Settings) -> int:
    import ray
    from ray import serve

    from gateway.serving.deploy import forget_platform

    left = drain_gateway(settings)
    serve.shutdown()
    ray.shutdown()
    forget_platform(settings)
    return left
