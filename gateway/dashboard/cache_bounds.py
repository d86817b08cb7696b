"""The semantic cache per tenant: the bound δ it chose, how often its questions were answered from the cache and what
that saved, the threshold its lookups are served from now (learned from its labels, cache/pooled.py, or the
calibrated one), and the answers its clients flagged as wrong."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

from sqlalchemy import Engine, func, select

from billing.cache_savings import TenantSavings
from billing.models import ApiKey, Tenant
from billing.money import ZERO, amount_text
from cache.bounds import DEFAULT_MAX_FALSE_HIT_RATE, shipped_bounds

BOUND_COLUMNS = ["tenant", "max_false_hit_rate", "keys_with_own_bound", "requests", "cache_hits", "hit_rate",
                 "semantic_savings_usd", "entries", "labels", "serving_threshold", "calibrated_threshold", "flagged"]
FLAG_COLUMNS = ["tenant", "flagged_at", "response_id", "cached_prompt", "score", "entry_removed"]


@dataclass(frozen=True)
class TenantBound:
    tenant: str
    uid: str
    max_false_hit_rate: float
    chosen: bool  # False: the default
    keys_with_own_bound: int
    requests: int
    cache_hits: int
    semantic_usd: Decimal
    entries: int
    labels: int
    serving_threshold: float
    calibrated_threshold: float
    flagged: int

    @property
    def hit_rate(self) -> float:
        return self.cache_hits / self.requests if self.requests else 0.0


def tenant_bounds(engine: Engine, savings: list[TenantSavings], report: dict[str, dict[str, Any]],
                  tenant: str | None = None) -> list[TenantBound]:
    """One row per tenant (or the one named): its bound from SQL, its hits and savings summed over `savings`' models,
    its cache state from `report` (SemanticCache.tenant_report, keyed by tenant uid)."""
    own = (select(ApiKey.tenant_id, func.count()).where(ApiKey.cache_max_false_hit_rate.is_not(None))
           .group_by(ApiKey.tenant_id).subquery())
    query = (select(Tenant.name, Tenant.uid, Tenant.cache_max_false_hit_rate, func.coalesce(own.c[1], 0))
             .outerjoin(own, own.c.tenant_id == Tenant.id).order_by(Tenant.name))
    if tenant is not None:
        query = query.where(Tenant.name == tenant)
    with engine.connect() as conn:
        tenants = conn.execute(query).all()
    by_name: dict[str | None, list[TenantSavings]] = {}
    for s in savings:
        by_name.setdefault(s.tenant, []).append(s)
    bounds = shipped_bounds()
    rows = []
    for name, uid, delta, keys in tenants:
        chosen = delta if delta is not None else DEFAULT_MAX_FALSE_HIT_RATE
        bound = bounds.at(chosen)
        cache = report.get(uid, {})
        mine = by_name.get(name, [])
        rows.append(TenantBound(
            name, uid, chosen, delta is not None, int(keys), sum(s.savings.requests for s in mine),
            sum(s.savings.cache_hits for s in mine), sum((s.savings.semantic_usd for s in mine), ZERO),
            int(cache.get("entries", 0)), int(cache.get("labels", 0)),
            float(cache.get("thresholds", {}).get(bound.max_false_hit_rate, bound.threshold)), bound.threshold,
            int(cache.get("flagged", 0))))
    return rows


def bound_row(r: TenantBound) -> dict[str, Any]:
    return {"tenant": r.tenant, "max_false_hit_rate": r.max_false_hit_rate,
            "keys_with_own_bound": r.keys_with_own_bound, "requests": r.requests, "cache_hits": r.cache_hits,
            "hit_rate": round(r.hit_rate, 6), "semantic_savings_usd": amount_text(r.semantic_usd),
            "entries": r.entries, "labels": r.labels, "serving_threshold": round(r.serving_threshold, 6),
            "calibrated_threshold": round(r.calibrated_threshold, 6), "flagged": r.flagged}


@dataclass(frozen=True)
class FlagRow:
    tenant: str
    flagged_at: datetime
    response_id: str
    cached_prompt: str
    score: float
    entry_removed: bool


def flag_rows(flags: list[Any], names: dict[str, str]) -> list[FlagRow]:
    """cache.store.FlagRecord rows with their tenant's name (`names`: uid -> name; a tenant gone shows its uid)."""
    return [FlagRow(names.get(f.tenant, f.tenant), datetime.fromtimestamp(f.created, timezone.utc), f.response_id,
                    f.prompt, f.score, f.removed) for f in flags]


def flag_row(r: FlagRow) -> dict[str, Any]:
    return {"tenant": r.tenant, "flagged_at": r.flagged_at, "response_id": r.response_id,
            "cached_prompt": r.cached_prompt, "score": round(r.score, 6), "entry_removed": r.entry_removed}
