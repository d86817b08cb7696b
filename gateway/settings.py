"""The one settings object of the gateway, the Ray Serve platform and the `platform` command.

Each field is a variable of the registry (tollgate/envs.py: name, type, default, help): field `port`
is TOLLGATE_PORT, `ray_address` is RAY_ADDRESS. `Settings.load(**overrides)` reads the environment
through the registry, and CLI flags override it; `Settings(...)` alone takes the registry's defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from billing.ledger_spill import spill_dir_for
from tollgate import envs

# fields that are not environment variables (set by code or by tests only)
_NOT_IN_ENV = {"ledger_max_batch"}


def env_name(field: str) -> str:
    return "RAY_ADDRESS" if field == "ray_address" else f"TOLLGATE_{field.upper()}"


def _default(field: str) -> Any:
    return envs.variable(env_name(field)).default


class Settings(BaseModel):
    model_config = ConfigDict(validate_assignment=True)

    # ---- state ----
    home: Path = Field(default_factory=lambda: _default("home"))
    database_url: str | None = None  # None: SQLite file under home
    models_dir: Path = _default("models_dir")
    ledger_spill_dir: Path | None = None  # None: home/ledger-spill
    # ---- gateway ----
    host: str = _default("host")
    port: int = Field(_default("port"), ge=1, le=65535)
    admin_key: SecretStr | None = None
    log_level: str = _default("log_level")
    max_body_bytes: int = Field(_default("max_body_bytes"), ge=1)
    key_cache_ttl_s: float = Field(_default("key_cache_ttl_s"), ge=0)
    auth_fail_limit: int = Field(_default("auth_fail_limit"), ge=1)
    auth_fail_window_s: float = Field(_default("auth_fail_window_s"), gt=0)
    admission_db_timeout_s: float = Field(_default("admission_db_timeout_s"), gt=0)
    budget_leases: bool = _default("budget_leases")
    ledger_max_buffer: int = Field(_default("ledger_max_buffer"), ge=1)
    ledger_max_batch: int = Field(1000, ge=1)
    drain_s: float = Field(_default("drain_s"), ge=0)
    api_servers: int = _default("api_servers")  # checked by `serve --local` (gateway/cli/api_servers.py), not here
    budget_alert_webhook: str | None = None
    # ---- semantic cache ----
    semantic_cache: bool = _default("semantic_cache")
    cache_ttl_s: float = Field(_default("cache_ttl_s"), gt=0)
    cache_max_entries: int = Field(_default("cache_max_entries"), ge=1)
    cache_explore: float = Field(_default("cache_explore"), ge=0, le=1)
    # ---- Ray Serve platform ----
    ray_address: str | None = None
    cold_start_timeout_s: float = Field(_default("cold_start_timeout_s"), gt=0)
    retry_after_s: int = Field(_default("retry_after_s"), ge=1)
    interval_flush_s: float = Field(_default("interval_flush_s"), gt=0)
    registry_refresh_s: float = Field(_default("registry_refresh_s"), gt=0)
    node_memory_budget_gib: float | None = Field(_default("node_memory_budget_gib"), gt=0)

    @classmethod
    def load(cls, **overrides: object) -> "Settings":
        """The environment's values (through the registry), then the overrides that are not None."""
        values: dict[str, object] = {name: envs.get(env_name(name)) for name in cls.model_fields
                                     if name not in _NOT_IN_ENV and envs.is_set(env_name(name))}
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)
        settings.home = Path(settings.home).expanduser()
        return settings

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'tollgate.db'}"

    @property
    def ledger_spill_path(self) -> Path:
        return spill_dir_for(Path(self.ledger_spill_dir or self.home / "ledger-spill").expanduser(), self.db_url)
