"""Stopping the platform this process started: the gateway stops taking API requests and lets the
in-flight ones finish (up to settings.drain_s; each is recorded in the ledger), then Serve and Ray
shut down."""

from __future__ import annotations

import logging
import socket
import threading
import time

from gateway.serving.names import GATEWAY_APP
from gateway.settings import Settings

log = logging.getLogger("tollgate.platform")


def drain_gateway(settings: Settings) -> int:
    """How many requests were still in flight when the bound ran out (0: all finished)."""
    from ray import serve

    try:
        if GATEWAY_APP not in serve.status().applications:
            return 0
        handle = serve.get_app_handle(GATEWAY_APP)
        return int(handle.drain.remote(settings.drain_s).result(timeout_s=settings.drain_s + 30))
    except Exception as e:  # a gateway (or a Serve controller) that cannot answer has nothing left to drain
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


class ClusterGone(RuntimeError):
    """Ray's own processes went down with the signal that stops the platform: nothing is left to drain or stop."""


def stop_platform(settings: Settings) -> int:
    """Drains the gateway, then stops Serve and Ray; how many requests the drain window ended. The gateway starts
    refusing new requests at once, while the cluster's GCS is checked: ClusterGone where it went down too (then
    nothing of Ray may be called here: each call would wait 60 s for it)."""
    import ray
    from ray import serve

    from gateway.serving.deploy import forget_platform

    left: list[int] = []
    draining = threading.Thread(target=lambda: left.append(drain_gateway(settings)), daemon=True)
    draining.start()
    if cluster_went_down():
        forget_platform(settings)
        raise ClusterGone
    draining.join()
    serve.shutdown()
    ray.shutdown()
    forget_platform(settings)
    return left[0] if left else 0
