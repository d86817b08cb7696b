"""Bearer key → tenant. Keys are looked up by their SHA-256 hash and cached for a short TTL."""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import Engine, select
from sqlalchemy.exc import DBAPIError

from billing.accounts import hash_key
from billing.models import ApiKey, ScopedBudget, Tenant
from gateway.errors import database_unavailable, unauthorized
from gateway.key_db_outage import is_database_outage
from gateway.outage_log import warn_once as _warn_once


@dataclass(frozen=True)
class Principal:
    key_id: int
    key_prefix: str
    tenant_id: int
    tenant: str
    tenant_uid: str  # the tenant's identity for caches and KV salts (ids repeat across databases)
    project: str | None
    rpm: int | None
    tpm: int | None
    key_budget_usd: Decimal | None
    tenant_budget_usd: Decimal | None
    scoped_budgets: bool = False  # the tenant has end-user or tag budgets (admission looks up each request's)
    cache_max_false_hit_rate: float | None = None  # the key's semantic-cache bound, else its tenant's; None: default


class KeyStore:
    def __init__(self, engine: Engine, ttl_s: float = 1.0, max_entries: int = 10_000) -> None:
        self._engine = engine
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._cache: dict[str, tuple[float, Principal | None]] = {}
        self._lock = threading.Lock()
        self._query = (
            select(ApiKey.id, ApiKey.key_hash, ApiKey.prefix, ApiKey.revoked, ApiKey.project, ApiKey.rpm,
                   ApiKey.tpm, ApiKey.budget_usd, Tenant.id, Tenant.name, Tenant.budget_usd, Tenant.uid,
                   select(ScopedBudget.id).where(ScopedBudget.tenant_id == Tenant.id).exists(),
                   ApiKey.cache_max_false_hit_rate, Tenant.cache_max_false_hit_rate)
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
        )

    def cached(self, authorization: str | None) -> Principal | None:
        """The principal when this header's key is in the cache and fresh; no SQL, never raises."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        hit = self._cache.get(hash_key(authorization[7:].strip()))
        if hit is None or hit[1] is None or time.monotonic() - hit[0] >= self._ttl_s:
            return None
        return hit[1]

    def authenticate(self, authorization: str | None) -> Principal:
        if not authorization:
            raise unauthorized("You didn't provide an API key. Provide it as 'Authorization: Bearer YOUR_KEY'.")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise unauthorized("Malformed Authorization header; expected 'Bearer YOUR_KEY'.")
        digest = hash_key(key)
        principal = self._lookup(digest)
        if principal is None:
            raise unauthorized("Incorrect or revoked API key provided.")
        return principal

    def invalidate(self) -> None:
        with self._lock:
            self._cache.clear()

    def _lookup(self, digest: str) -> Principal | None:
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and now - hit[0] < self._ttl_s:
            return hit[1]
        try:
            principal = self._load(digest)
        except DBAPIError as error:
            if not is_database_outage(error):
                raise
            # the database is unreachable: a key seen before keeps its last known principal (fail open for
            # known tenants, logged); an unknown key cannot be checked, so it gets a 503, never a 500
            if hit is not None:
                _warn_once("key database unreachable; using the last known key record")
                return hit[1]
            raise database_unavailable() from None
        with self._lock:
            if len(self._cache) >= self._max_entries:
                self._cache.clear()
            self._cache[digest] = (now, principal)
        return principal

    def _load(self, digest: str) -> Principal | None:
        with self._engine.connect() as conn:
            row = conn.execute(self._query.where(ApiKey.key_hash == digest)).first()
        if row is None or not hmac.compare_digest(row[1], digest) or row[3]:
            return None
        return Principal(key_id=row[0], key_prefix=row[2], project=row[4], rpm=row[5], tpm=row[6],
                         key_budget_usd=row[7], tenant_id=row[8], tenant=row[9], tenant_budget_usd=row[10],
                         tenant_uid=row[11], scoped_budgets=bool(row[12]),
                         cache_max_false_hit_rate=row[13] if row[13] is not None else row[14])
