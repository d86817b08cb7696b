"""What caching saved tenants, exact to the nano-dollar at the models' current list prices:

- the semantic cache: an answer served from it is billed at $0 (its usage event keeps the tokens it would
  have used), so it saved those tokens at the model's input and output prices (the invoice's cache_hit
  line shows the same savings);
- the KV prefix cache: prompt tokens a model read from it are billed at `cached_input_per_1m`, so each
  saved the difference to the input price (none where the model prices them alike).

Token sums come from one GROUP BY (tenant, model); prices multiply the sums, never events."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import Engine, case, func, select

from billing.deployments import deployments
from billing.event_filter import EventFilter
from billing.models import Tenant, UsageEvent
from billing.money import ZERO, dollars
from billing.pricing import MILLION


@dataclass(frozen=True)
class Savings:
    requests: int
    cache_hits: int
    hit_tokens: int  # prompt + completion tokens of the answers served from the semantic cache
    semantic_usd: Decimal
    prefix_tokens: int  # prompt tokens models read from the KV prefix cache
    prefix_usd: Decimal

    @property
    def total_usd(self) -> Decimal:
        return self.semantic_usd + self.prefix_usd

    @property
    def hit_rate(self) -> float:
        return self.cache_hits / self.requests if self.requests else 0.0

    def __add__(self, other: Savings) -> Savings:
        return Savings(self.requests + other.requests, self.cache_hits + other.cache_hits,
                       self.hit_tokens + other.hit_tokens, self.semantic_usd + other.semantic_usd,
                       self.prefix_tokens + other.prefix_tokens, self.prefix_usd + other.prefix_usd)


NOTHING = Savings(0, 0, 0, ZERO, 0, ZERO)


@dataclass(frozen=True)
class TenantSavings:
    tenant: str | None
    model: str
    savings: Savings


def savings_by_tenant_model(engine: Engine, events: EventFilter) -> list[TenantSavings]:
    """Per tenant and model, most saved first."""
    ev = UsageEvent
    grouped = _sums(ev.tenant_id.label("tid"), ev.model.label("model"), engine, events).subquery()
    q = select(Tenant.name, *[c for c in grouped.c if c.name != "tid"]).outerjoin(Tenant, Tenant.id == grouped.c.tid)
    with engine.connect() as conn:
        rows = conn.execute(q).all()
    priced = _pricer(engine)
    out = [TenantSavings(tenant, model, priced(model, *sums)) for tenant, model, *sums in rows]
    return sorted(out, key=lambda r: (-r.savings.total_usd, -r.savings.cache_hits, r.tenant or "", r.model))


def _sums(group, model, engine: Engine, events: EventFilter):  # type: ignore[no-untyped-def]
    ev = UsageEvent
    hit, miss = ev.cache_hit.is_(True), ev.cache_hit.is_(False)

    def sum_if(condition, column):  # type: ignore[no-untyped-def]
        return func.coalesce(func.sum(case((condition, column), else_=0)), 0)

    q = select(group, model, func.count(), sum_if(hit, 1), sum_if(hit, ev.prompt_tokens),
               sum_if(hit, ev.completion_tokens), sum_if(miss, ev.prompt_tokens), sum_if(miss, ev.cached_tokens))
    return events.apply(q, engine.dialect.name).group_by(group, model)


def _pricer(engine: Engine):  # type: ignore[no-untyped-def]
    prices = deployments(engine)

    def priced(model: str, requests: int, hits: int, hit_prompt: int, hit_completion: int, prompt: int,
               cached: int) -> Savings:
        cached = min(int(cached), int(prompt))  # as the invoice counts cached-input tokens
        p = prices.get(model)
        if p is None:
            return Savings(int(requests), int(hits), int(hit_prompt + hit_completion), ZERO, cached, ZERO)
        cached_price = p.input_per_1m if p.cached_input_per_1m is None else p.cached_input_per_1m
        semantic = dollars((hit_prompt * p.input_per_1m + hit_completion * p.output_per_1m) / MILLION)
        prefix = dollars(cached * (p.input_per_1m - cached_price) / MILLION)
        return Savings(int(requests), int(hits), int(hit_prompt + hit_completion), semantic, cached, prefix)

    return priced
