"""Settings of the Ray Serve platform, on top of the gateway's Settings (same TOLLGATE_* scheme)."""

from __future__ import annotations

import os

from pydantic import Field

from gateway.settings import Settings

_ENV = {
    "cold_start_timeout_s": "TOLLGATE_COLD_START_TIMEOUT_S",
    "retry_after_s": "TOLLGATE_RETRY_AFTER_S",
    "interval_flush_s": "TOLLGATE_INTERVAL_FLUSH_S",
    "registry_refresh_s": "TOLLGATE_REGISTRY_REFRESH_S",
    "ray_address": "RAY_ADDRESS",
}


class PlatformSettings(Settings):
    # how long a request waits for a replica of a model at zero replicas before a 503
    cold_start_timeout_s: float = Field(120.0, gt=0)
    retry_after_s: int = Field(10, ge=1)  # the Retry-After of such a 503
    interval_flush_s: float = Field(60.0, gt=0)  # how often replicas write their ReplicaInterval rows
    registry_refresh_s: float = Field(1.0, gt=0)  # how often gateways look for deployed or deleted models
    ray_address: str | None = None

    @classmethod
    def load(cls, env: dict[str, str] | None = None, **overrides: object) -> "PlatformSettings":
        env = os.environ if env is None else env
        values: dict[str, object] = {name: env[var] for name, var in _ENV.items() if env.get(var)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = super().load(env, **values)
        assert isinstance(settings, PlatformSettings)
        return settings
