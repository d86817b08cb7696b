"""rpm, tpm and monthly budgets, enforced before the model is called. The counters live in SQL so
that every gateway process sharing the database sees the same numbers: the rpm check is one atomic
upsert that only increments while under the limit."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import Engine, and_, or_, select
from sqlalchemy.exc import OperationalError

from billing.db import dialect_insert
from billing.ledger import Ledger
from billing.models import RateWindow, SpendCounter
from billing.periods import minute_of, month_of, seconds_to_next_minute
from gateway.auth import Principal
from gateway.errors import insufficient_quota, rate_limited
from gateway.outage_log import warn_once


@dataclass(frozen=True)
class RateLimitHeaders:
    """OpenAI's x-ratelimit-* headers for a key with rpm / tpm limits: each limit, what is left of it in
    the current minute, and when the minute resets."""

    rpm: int | None
    tpm: int | None
    requests_used: int
    tokens_used: int
    reset_s: int

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.rpm is not None:
            out["x-ratelimit-limit-requests"] = str(self.rpm)
            out["x-ratelimit-remaining-requests"] = str(max(0, self.rpm - self.requests_used))
            out["x-ratelimit-reset-requests"] = f"{self.reset_s}s"
        if self.tpm is not None:
            out["x-ratelimit-limit-tokens"] = str(self.tpm)
            out["x-ratelimit-remaining-tokens"] = str(max(0, self.tpm - self.tokens_used))
            out["x-ratelimit-reset-tokens"] = f"{self.reset_s}s"
        return out


class Limiter:
    def __init__(self, engine: Engine, ledger: Ledger | None = None) -> None:
        self._engine = engine
        self._ledger = ledger

    def admit(self, p: Principal, now: float | None = None) -> RateLimitHeaders | None:
        """Raise a 429 APIError when the key may not make a request now; otherwise count it and return
        the rate-limit headers (None for a key without rpm / tpm, or while the database is unreachable)."""
        now = time.time() if now is None else now
        try:
            if p.key_budget_usd is not None or p.tenant_budget_usd is not None:
                self._check_budget(p, now)
            if p.rpm is not None or p.tpm is not None:
                return self._take_request(p, now)
        except OperationalError:
            self._admit_without_database(p, now)
        return None

    def _admit_without_database(self, p: Principal, now: float) -> None:
        """The database is unreachable: fail open (logged), enforcing only what this process knows, the
        spend and tokens it has recorded and not yet written. Serving a tenant through an outage beats
        refusing it; the overshoot is bounded by the outage's length."""
        warn_once("limits database unreachable; admitting requests on in-memory counts only")
        pending_tokens = self._ledger.pending_tokens(p.key_id) if self._ledger else 0
        if p.tpm is not None and pending_tokens >= p.tpm:
            raise self._tpm_error(p, pending_tokens, seconds_to_next_minute(now))
        if p.key_budget_usd is not None and self._pending_spend("key", p.key_id) >= p.key_budget_usd:
            raise insufficient_quota(f"This API key has spent its monthly budget of ${p.key_budget_usd:.2f}.")
        if p.tenant_budget_usd is not None and self._pending_spend("tenant", p.tenant_id) >= p.tenant_budget_usd:
            raise insufficient_quota(f"Tenant {p.tenant!r} has spent its monthly budget of "
                                     f"${p.tenant_budget_usd:.2f}.")

    def _check_budget(self, p: Principal, now: float) -> None:
        period = month_of(now)
        scopes = []
        if p.key_budget_usd is not None:
            scopes.append(and_(SpendCounter.scope == "key", SpendCounter.scope_id == p.key_id))
        if p.tenant_budget_usd is not None:
            scopes.append(and_(SpendCounter.scope == "tenant", SpendCounter.scope_id == p.tenant_id))
        q = select(SpendCounter.scope, SpendCounter.spent_usd).where(SpendCounter.period == period, or_(*scopes))
        with self._engine.connect() as conn:
            spent = {scope: usd for scope, usd in conn.execute(q)}
        key_spent = spent.get("key", 0.0) + self._pending_spend("key", p.key_id)
        tenant_spent = spent.get("tenant", 0.0) + self._pending_spend("tenant", p.tenant_id)
        if p.key_budget_usd is not None and key_spent >= p.key_budget_usd:
            raise insufficient_quota(f"This API key has spent its monthly budget of ${p.key_budget_usd:.2f} "
                                     f"(spent ${key_spent:.6f} in {period}).")
        if p.tenant_budget_usd is not None and tenant_spent >= p.tenant_budget_usd:
            raise insufficient_quota(f"Tenant {p.tenant!r} has spent its monthly budget of "
                                     f"${p.tenant_budget_usd:.2f} (spent ${tenant_spent:.6f} in {period}).")

    def _take_request(self, p: Principal, now: float) -> RateLimitHeaders:
        minute = minute_of(now)
        retry_after = seconds_to_next_minute(now)
        if p.rpm == 0:
            raise rate_limited("This API key may not make requests (rpm limit 0).", retry_after)
        pending_tokens = self._ledger.pending_tokens(p.key_id) if self._ledger else 0
        if p.tpm is not None and pending_tokens >= p.tpm:
            raise self._tpm_error(p, pending_tokens, retry_after)
        conditions = []
        if p.rpm is not None:
            conditions.append(RateWindow.requests < p.rpm)
        if p.tpm is not None:
            conditions.append(RateWindow.tokens < p.tpm - pending_tokens)
        stmt = dialect_insert(self._engine, RateWindow).values(api_key_id=p.key_id, minute=minute, requests=1,
                                                              tokens=0)
        stmt = stmt.on_conflict_do_update(
            index_elements=["api_key_id", "minute"],
            set_={"requests": RateWindow.requests + 1},
            where=and_(*conditions),
        ).returning(RateWindow.requests, RateWindow.tokens)
        with self._engine.begin() as conn:
            admitted = conn.execute(stmt).first()
            if admitted is not None:
                return RateLimitHeaders(p.rpm, p.tpm, admitted.requests, admitted.tokens + pending_tokens,
                                        retry_after)
            used = conn.execute(select(RateWindow.requests, RateWindow.tokens).where(
                RateWindow.api_key_id == p.key_id, RateWindow.minute == minute)).one()
        if p.rpm is not None and used.requests >= p.rpm:
            err = rate_limited(f"Rate limit reached for requests per minute: limit {p.rpm}, used {used.requests}. "
                               f"Try again in {retry_after}s.", retry_after)
        else:
            err = self._tpm_error(p, used.tokens + pending_tokens, retry_after)
        err.headers.update(RateLimitHeaders(p.rpm, p.tpm, used.requests, used.tokens + pending_tokens,
                                            retry_after).headers())
        raise err

    @staticmethod
    def _tpm_error(p: Principal, used: int, retry_after: int):  # type: ignore[no-untyped-def]
        return rate_limited(f"Rate limit reached for tokens per minute: limit {p.tpm}, used {used}. "
                            f"Try again in {retry_after}s.", retry_after)

    def _pending_spend(self, scope: str, scope_id: int) -> float:
        return self._ledger.pending_spend(scope, scope_id) if self._ledger else 0.0
