"""rpm, tpm and monthly budgets (the key's, the tenant's, and the tenant's budgets for end users and tags),
enforced before the model is called. Admission reserves the request's worst case in SQL
(billing/reservations.py): every gateway process sharing the database sees the same counters, and each
check-and-add is one conditional statement, so concurrent requests can never spend past a budget or a tpm
limit. A finished request's reservation shrinks to its exact cost before its response completes (so a request
sent right after it is admitted against what it really spent), and the ledger settles it when it writes the
request's usage event; a refusal after admission releases it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from billing.admission_writer import AdmissionWriter
from billing.budget_leases import BudgetLeases
from billing.ledger import Ledger
from billing.money import ZERO, usd
from billing.periods import seconds_to_next_minute
from billing.reservations import (LEASE_ENDPOINT, Admitted, Budgets, Refusal, Worst, process_id, release, reserve,
                                  shrink)
from billing.scoped_budgets import SCOPE_WORDS, ScopedLimit, applicable
from gateway.auth import Principal
from gateway.errors import APIError, insufficient_quota, rate_limited
from gateway.outage_log import warn_once


@dataclass(frozen=True)
class RateLimitHeaders:
    """OpenAI's x-ratelimit-* headers for a key with rpm / tpm limits: each limit, what is left of it in
    the current minute (reservations of requests in flight count as used), and when the minute resets."""

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


def asks_scoped(p: Principal, end_user: str | None, tags: Sequence[str]) -> bool:
    """Whether the tenant's end-user or tag budgets may apply (reading them takes SQL; they are never leased)."""
    return p.scoped_budgets and (end_user is not None or bool(tags))


def budgets_of(p: Principal, engine: Engine, end_user: str | None, tags: Sequence[str]) -> Budgets:
    """The limits that apply: the key's and the tenant's, and the tenant's budgets for this end user and tags
    (looked up only for a tenant that has such budgets)."""
    scoped: tuple[ScopedLimit, ...] = ()
    if asks_scoped(p, end_user, tags):
        with engine.connect() as conn:
            scoped = applicable(conn, p.tenant_id, end_user, tags)
    return Budgets(p.tenant_id, p.key_id, p.key_budget_usd, p.tenant_budget_usd, p.rpm, p.tpm, scoped)


class Limiter:
    def __init__(self, engine: Engine, ledger: Ledger | None = None, owner: str | None = None, *,
                 leases: bool = False) -> None:
        """`leases`: admit from budget leases where a key is far from its limits (billing/budget_leases.py)."""
        self._engine = engine
        self._ledger = ledger
        self.owner = owner or process_id()
        self._unreleased: set[str] = set()  # releases that failed (database down): retried by retry_releases()
        self._lock = threading.Lock()
        # SQLite: a burst's reservations and shrinks commit together (billing/admission_writer.py)
        self.writer = AdmissionWriter(engine) if AdmissionWriter.wanted(engine) else None
        self.leases = BudgetLeases(engine, self.owner, self._reserve_lease) if leases else None
        if self.leases is not None and ledger is not None:
            ledger.leases = self.leases

    def _reserve_lease(self, lease_id: str, budgets: Budgets, worst: Worst, now: float,
                       requests: int) -> Admitted | Refusal:
        if self.writer is not None:
            return self.writer.reserve(lease_id, self.owner, budgets, worst, model="", endpoint=LEASE_ENDPOINT,
                                       now=now, requests=requests).result()
        return reserve(self._engine, lease_id, self.owner, budgets, worst, model="", endpoint=LEASE_ENDPOINT,
                       now=now, requests=requests)

    def _from_lease(self, p: Principal, budgets: Budgets, request_id: str, worst: Worst,
                    now: float) -> RateLimitHeaders | None | bool:
        """Admitted from a lease in memory: its headers; False when no lease fits (then take one, or reserve)."""
        if self.leases is None:
            return False
        admitted = self.leases.admit(budgets, request_id, worst, now)
        return False if admitted is None else _headers(p, admitted)

    def admit_from_lease(self, p: Principal, request_id: str, worst: Worst, *, end_user: str | None = None,
                         tags: Sequence[str] = ()) -> RateLimitHeaders | None | bool:
        """admit() from a budget lease in memory, on the event loop (no SQL, no thread): the rate-limit headers, or
        False when no lease fits (then admit_async())."""
        if self.leases is None or asks_scoped(p, end_user, tags):
            return False
        return self._from_lease(p, budgets_of(p, self._engine, end_user, tags), request_id, worst, time.time())

    def close(self) -> None:
        """At shutdown, after the ledger's last write: the leases' unused parts go back."""
        if self.leases is not None:
            self.leases.close()

    def admit(self, p: Principal, request_id: str, worst: Worst, *, model: str, endpoint: str,
              end_user: str | None = None, tags: Sequence[str] = (), now: float | None = None
              ) -> RateLimitHeaders | None:
        """Reserve `worst` for this request against every limit that applies (the key's, the tenant's, the
        tenant's budgets for `end_user` and `tags`); a 429 APIError when they do not leave room. Returns the
        rate-limit headers (None without rpm / tpm, or with the database unreachable: then admission fails
        open on what this process knows)."""
        now = time.time() if now is None else now
        try:
            budgets = budgets_of(p, self._engine, end_user, tags)
            leased = self._from_lease(p, budgets, request_id, worst, now)
            if leased is False and self.leases is not None and self.leases.may_lease(budgets, now) \
                    and self.leases.take(budgets, worst, now):
                leased = self._from_lease(p, budgets, request_id, worst, now)
            if leased is not False:
                return leased
            result = reserve(self._engine, request_id, self.owner, budgets, worst, model=model,
                             endpoint=endpoint, now=now)
        except OperationalError:
            self._admit_without_database(p, now)
            return None
        return self._admitted(p, result, worst)

    async def admit_async(self, p: Principal, request_id: str, worst: Worst, *, model: str, endpoint: str,
                          end_user: str | None = None, tags: Sequence[str] = ()) -> RateLimitHeaders | None:
        """`admit()` from the event loop: through the admission writer where there is one (SQLite), else in a worker
        thread. A caller cancelled while its reservation is being written gets it released."""
        now = time.time()
        scoped = asks_scoped(p, end_user, tags)
        if self.leases is not None and not scoped:
            budgets = budgets_of(p, self._engine, end_user, tags)
            leased = self._from_lease(p, budgets, request_id, worst, now)
            if leased is not False:
                return leased
            try:
                if self.leases.may_lease(budgets, now) and await asyncio.to_thread(self.leases.take, budgets, worst,
                                                                                   now):
                    leased = self._from_lease(p, budgets, request_id, worst, now)
                    if leased is not False:
                        return leased
            except OperationalError:
                self._admit_without_database(p, now)
                return None
        if self.writer is None:
            return await asyncio.to_thread(self.admit, p, request_id, worst, model=model, endpoint=endpoint,
                                           end_user=end_user, tags=tags)
        try:
            if scoped:
                budgets = await asyncio.to_thread(budgets_of, p, self._engine, end_user, tags)
            else:
                budgets = budgets_of(p, self._engine, end_user, tags)
            pending = self.writer.reserve(request_id, self.owner, budgets, worst, model=model, endpoint=endpoint,
                                          now=now)
            try:
                result = await asyncio.shield(asyncio.wrap_future(pending))
            except asyncio.CancelledError:
                pending.add_done_callback(lambda f: self._release_if_admitted(f, request_id))
                raise
        except OperationalError:
            self._admit_without_database(p, now)
            return None
        return self._admitted(p, result, worst)

    def _release_if_admitted(self, done: "Future[Admitted | Refusal]", request_id: str) -> None:
        if not done.cancelled() and done.exception() is None and isinstance(done.result(), Admitted):
            self.release(request_id)

    def _admitted(self, p: Principal, result: Admitted | Refusal, worst: Worst) -> RateLimitHeaders | None:
        if isinstance(result, Refusal):
            raise refusal_error(p, result, worst)
        return _headers(p, result)

    def shrink(self, request_id: str, cost_usd: Decimal, tokens: int) -> None:
        """The request finished: its hold becomes what it used, so the next admission counts it at its real cost
        (billing/reservations.py). With the database unreachable the ledger settles it later, as before."""
        if self.leases is not None and self.leases.shrink(request_id, cost_usd, tokens):
            return
        try:
            shrink(self._engine, request_id, cost_usd, tokens)
        except OperationalError:
            _warn_unsettled()

    async def shrink_async(self, request_id: str, cost_usd: Decimal, tokens: int) -> None:
        """`shrink()` from the event loop (through the admission writer where there is one)."""
        if self.leases is not None and self.leases.shrink(request_id, cost_usd, tokens):
            return
        if self.writer is None:
            await asyncio.to_thread(self.shrink, request_id, cost_usd, tokens)
            return
        try:
            await asyncio.wrap_future(self.writer.shrink(request_id, cost_usd, tokens))
        except OperationalError:
            _warn_unsettled()

    def release(self, request_id: str) -> None:
        """The request was refused after admission (no usage event follows): give its reservation back."""
        if self.leases is not None and self.leases.release(request_id):
            return
        with self._lock:
            self._unreleased.add(request_id)
        self.retry_releases()

    def retry_releases(self) -> None:
        with self._lock:
            ids, self._unreleased = list(self._unreleased), set()
        if not ids:
            return
        try:
            release(self._engine, ids)
        except OperationalError:
            with self._lock:
                self._unreleased.update(ids)

    def _admit_without_database(self, p: Principal, now: float) -> None:
        """The database is unreachable: fail open (logged), enforcing only what this process knows, the
        spend and tokens it has recorded and not yet written (end-user and tag budgets, unknown without the
        database, are not enforced). Serving a tenant through an outage beats refusing it; the overshoot is
        bounded by the outage's length (RELIABILITY.md)."""
        warn_once("limits database unreachable; admitting requests on in-memory counts only")
        ledger = self._ledger
        pending_tokens = ledger.pending_tokens(p.key_id) if ledger else 0
        if p.tpm is not None and pending_tokens >= p.tpm:
            raise rate_limited(f"Rate limit reached for tokens per minute: limit {p.tpm}, used {pending_tokens}.",
                               seconds_to_next_minute(now), "tokens")
        for scope, scope_id, budget in (("key", p.key_id, p.key_budget_usd), ("tenant", p.tenant_id,
                                                                              p.tenant_budget_usd)):
            spent = ledger.pending_spend(scope, scope_id) if ledger else ZERO
            if budget is not None and spent >= budget:
                raise insufficient_quota(f"{_who(p, scope)} has spent its monthly budget of {usd(budget)}.")


def _exact(amount: Decimal | float | int) -> Decimal:
    return amount if isinstance(amount, Decimal) else Decimal(str(amount))


def _warn_unsettled() -> None:
    warn_once("limits database unreachable; finished requests hold their worst case until the ledger settles them")


def _headers(p: Principal, admitted: Admitted) -> RateLimitHeaders | None:
    if p.rpm is None and p.tpm is None:
        return None
    return RateLimitHeaders(p.rpm, p.tpm, admitted.requests_used, admitted.tokens_used, admitted.reset_s)


def _who(p: Principal, scope: str, name: str = "") -> str:
    if scope in SCOPE_WORDS:
        return f"{SCOPE_WORDS[scope].capitalize()} {name!r}"
    return "This API key" if scope == "key" else f"Tenant {p.tenant!r}"


def held_tokens(worst: Worst | None) -> str:
    """What the request holds, in tokens: its prompt's (counted with the model's tokenizer, or bounded by its UTF-8
    bytes where the gateway cannot load that) and max_tokens × n (the whole context per choice without max_tokens)."""
    if worst is None or worst.prompt_tokens is None:
        return "its prompt and max_tokens × n"
    kind = "tokens" if worst.prompt_counted else "tokens at most (its UTF-8 bytes)"
    return f"its prompt's {worst.prompt_tokens} {kind} and {worst.tokens - worst.prompt_tokens} for max_tokens × n"


def refusal_error(p: Principal, r: Refusal, worst: Worst | None = None) -> APIError:
    if r.kind == "budget":
        left = max(ZERO, r.limit - r.used - r.reserved)
        never_fits = _exact(r.used) + _exact(r.asked) > _exact(r.limit)  # not even with every hold settled
        advice = "Lower max_tokens." if never_fits else "Lower max_tokens, or wait for requests in flight to finish."
        err = insufficient_quota(
            f"{_who(p, r.scope, r.name)} has {usd(left)} left of its monthly budget of {usd(r.limit)} ({usd(r.used)} "
            f"spent, {usd(r.reserved)} held by requests in flight); this request may cost up to {usd(r.asked)} "
            f"({held_tokens(worst)} at the model's prices). {advice}")
        if never_fits:  # not retried by the official clients
            err.headers["x-should-retry"] = "false"
        return err
    if r.kind == "rpm":
        err = rate_limited(f"Rate limit reached for requests per minute: limit {int(r.limit)}, used {int(r.used)}. "
                           f"Try again in {r.retry_after_s}s.", r.retry_after_s)
        err.headers.update(RateLimitHeaders(p.rpm, p.tpm, int(r.used), 0, r.retry_after_s).headers())
        return err
    if r.asked > r.limit:  # not in any minute: waiting cannot help, and the official clients are told not to retry
        err = rate_limited(f"Request too large for tokens per minute: limit {int(r.limit)}, this request needs up to "
                           f"{int(r.asked)} ({held_tokens(worst)}). Lower max_tokens or shorten the prompt.",
                           r.retry_after_s, "tokens")
        err.headers.pop("Retry-After")
        err.headers["x-should-retry"] = "false"
    else:
        err = rate_limited(f"Rate limit reached for tokens per minute: limit {int(r.limit)}, used {int(r.used)} "
                           f"(requests in flight count with their prompt and max_tokens × n), this request needs up "
                           f"to {int(r.asked)} ({held_tokens(worst)}). Try again in {r.retry_after_s}s, or lower "
                           "max_tokens.", r.retry_after_s, "tokens")
    err.headers.update(RateLimitHeaders(p.rpm, p.tpm, 0, int(r.used), r.retry_after_s).headers())
    return err
