"""What caching saved tenants, exact to the nano-dollar at the prices the requests were charged
(billing/charged_prices.py):

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

from billing.charged_prices import event_cached_input_price, event_input_price, event_output_price, join_list_prices
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
    q = (select(Tenant.name, *[c for c in grouped.c if c.name != "tid"])
         .select_from(grouped).outerjoin(Tenant, Tenant.id == grouped.c.tid))
    totals: dict[tuple[str | None, str], Savings] = {}
    with engine.connect() as conn:
        for tenant, model, *sums in conn.execute(q):
            totals[(tenant, model)] = totals.get((tenant, model), NOTHING) + _priced(*sums)
    out = [TenantSavings(tenant, model, saved) for (tenant, model), saved in totals.items()]
    return sorted(out, key=lambda r: (-r.savings.total_usd, -r.savings.cache_hits, r.tenant or "", r.model))


def _sums(group, model, engine: Engine, events: EventFilter):  # type: ignore[no-untyped-def]
    """Token sums per group, model and the prices they were charged at (billing/charged_prices.py)."""
    ev = UsageEvent
    hit, miss = ev.cache_hit.is_(True), ev.cache_hit.is_(False)

    def sum_if(condition, column):  # type: ignore[no-untyped-def]
        return func.coalesce(func.sum(case((condition, column), else_=0)), 0)

    prices = (event_input_price().label("p_in"), event_cached_input_price().label("p_cached"),
              event_output_price().label("p_out"))
    q = select(group, model, *prices, func.count(), sum_if(hit, 1), sum_if(hit, ev.prompt_tokens),
               sum_if(hit, ev.completion_tokens), sum_if(miss, ev.prompt_tokens), sum_if(miss, ev.cached_tokens))
    q = join_list_prices(q.select_from(ev), ev.model)
    return events.apply(q, engine.dialect.name).group_by(group, model, *prices)


def _priced(input_price: Decimal, cached_price: Decimal, output_price: Decimal, requests: int, hits: int,
            hit_prompt: int, hit_completion: int, prompt: int, cached: int) -> Savings:
    cached = min(int(cached), int(prompt))  # as the invoice counts cached-input tokens
    semantic = dollars((hit_prompt * input_price + hit_completion * output_price) / MILLION)
    prefix = dollars(cached * (input_price - cached_price) / MILLION)
    return Savings(int(requests), int(hits), int(hit_prompt + hit_completion), semantic, cached, prefix)
