"""One settings object for the gateway and the `platform` command, read from TOLLGATE_* variables;
CLI flags override it through `Settings.load(**overrides)`."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr

_REPO_MODELS_DIR = Path(__file__).resolve().parent.parent / "platform" / "models"


_ENV = {
    "home": "TOLLGATE_HOME",
    "database_url": "TOLLGATE_DATABASE_URL",
    "admin_key": "TOLLGATE_ADMIN_KEY",
    "models_dir": "TOLLGATE_MODELS_DIR",
    "host": "TOLLGATE_HOST",
    "port": "TOLLGATE_PORT",
    "max_body_bytes": "TOLLGATE_MAX_BODY_BYTES",
    "key_cache_ttl_s": "TOLLGATE_KEY_CACHE_TTL_S",
    "log_level": "TOLLGATE_LOG_LEVEL",
    "semantic_cache": "TOLLGATE_SEMANTIC_CACHE",
    "cache_ttl_s": "TOLLGATE_CACHE_TTL_S",
    "cache_max_entries": "TOLLGATE_CACHE_MAX_ENTRIES",
    "auth_fail_limit": "TOLLGATE_AUTH_FAIL_LIMIT",
    "auth_fail_window_s": "TOLLGATE_AUTH_FAIL_WINDOW_S",
    "ledger_spill_dir": "TOLLGATE_LEDGER_SPILL_DIR",
    "ledger_max_buffer": "TOLLGATE_LEDGER_MAX_BUFFER",
    "admission_db_timeout_s": "TOLLGATE_ADMISSION_DB_TIMEOUT_S",
}


class Settings(BaseModel):
    model_config = ConfigDict(validate_assignment=True)

    home: Path = Field(default_factory=lambda: Path("~/.tollgate").expanduser())
    database_url: str | None = None  # None: sqlite file under home
    admin_key: SecretStr | None = None
    models_dir: Path = _REPO_MODELS_DIR
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 1024 * 1024
    key_cache_ttl_s: float = 1.0  # how long a revoked key may still pass in a process that saw it valid
    ledger_max_batch: int = 1000
    # usage events that cannot reach the database wait in memory up to ledger_max_buffer, then in
    # JSONL files under ledger_spill_dir (default home/ledger-spill), one subdirectory per database
    ledger_max_buffer: int = Field(10_000, ge=1)
    ledger_spill_dir: Path | None = None
    # how long key lookups and rate/budget checks wait for an unreachable database before failing open
    admission_db_timeout_s: float = Field(2.0, gt=0)
    log_level: str = "info"
    semantic_cache: bool = True  # answer repeated questions from the cache (kept under home/cache)
    cache_ttl_s: float = 7 * 24 * 3600
    cache_max_entries: int = 200_000
    # failed authentications one client address may make per window before the next ones get 429
    auth_fail_limit: int = Field(20, ge=1)
    auth_fail_window_s: float = Field(60.0, gt=0)


    @classmethod
    def load(cls, env: dict[str, str] | None = None, **overrides: object) -> "Settings":
        env = os.environ if env is None else env
        values: dict[str, object] = {name: env[var] for name, var in _ENV.items() if env.get(var)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)
        settings.home = Path(settings.home).expanduser()
        return settings

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'tollgate.db'}"

    @property
    def ledger_spill_path(self) -> Path:
        from billing.ledger_spill import spill_dir_for

        return spill_dir_for(Path(self.ledger_spill_dir or self.home / "ledger-spill").expanduser(), self.db_url)
