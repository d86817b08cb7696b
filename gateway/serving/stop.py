"""Stopping the platform this process started: the gateway stops taking API requests and lets the
in-flight ones finish (up to settings.drain_s; each is recorded in the ledger), then Serve and Ray
shut down."""

from __future__ import annotations

import logging
import socket
import time

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


def cluster_went_down(settle_s: float = 1.0) -> bool:
    """Whether the GCS of the Ray cluster this process joined stops answering within `settle_s`. A signal sent to the
    whole process group (`kill -TERM -- -PGID`, systemd's default stop) reaches the Ray processes this one started
    too: their GCS is gone within half a second, and anything asked of the cluster then waits 60 s and fails."""
    import ray

    host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
    deadline = time.monotonic() + settle_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
        except OSError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def stop_platform(settings: Settings) -> int:
    import ray
    from ray import serve

    from gateway.serving.deploy import forget_platform

    left = drain_gateway(settings)
    serve.shutdown()
    ray.shutdown()
    forget_platform(settings)
    return left
