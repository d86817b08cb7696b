"""Budget leases: a gateway process reserves a slice of a key's limits in SQL once and admits that key's requests
from memory until the slice runs low, instead of a SQL reservation per request (billing/reservations.py).

A lease is a reservation row like a request's (endpoint `budget-lease`), taken with the same conditional
statements: a slice of what is left of the key's and its tenant's monthly budgets, and of this minute's rpm and
tpm. So everything leased is held in the counters every gateway reads: leases cannot spend past a limit any more
than requests can. A request admitted from a lease holds its worst case in the lease; when it finishes its hold
shrinks to its cost in memory, and the ledger's transaction that writes its usage event moves that cost from the
lease to the counters' spend (`settle_in`).

A slice is 1/`share` of what is left, and a lease is taken only when that slice holds at least `min_requests`
worst cases of the request asking: near a limit's edge (less than share × min_requests requests' worth left)
nothing is leased and every request reserves in SQL on its own, exactly as without leases, so the guarantees at
the edge (no overspend, a request refused only when its worst case does not fit) are the same. A lease lasts
`ttl_s`, or one minute's window where it holds rpm or tpm; it is renewed in the background when half used. A
retired lease gives back what it did not use once its requests' events are written. A gateway killed with its
leases held holds them no longer than a dead gateway's reservations (the sweeper releases them); its requests
leave records through its admission journal as before.

Not leased: requests with end-user or tag budgets (these reserve in SQL)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import ROUND_FLOOR, Decimal

from sqlalchemy import Connection, Engine, select
from sqlalchemy.exc import SQLAlchemyError

from billing.db import write_lock
from billing.models import RateWindow, SpendCounter
from billing.money import ZERO
from billing.periods import minute_of, month_of, seconds_to_next_minute
from billing.reservations import (LEASE_ENDPOINT, Admitted, Budgets, CounterChanges, Refusal, Worst, _sql,
                                  settle_in as settle_reservations_in)

log = logging.getLogger("tollgate.leases")

NANO = Decimal("1e-9")
Reserve = Callable[[str, Budgets, Worst, float, int], "Admitted | Refusal"]  # (lease id, budgets, worst, now, rpm)


def _limits(b: Budgets) -> tuple:
    return (b.tenant_id, b.key_budget_usd, b.tenant_budget_usd, b.rpm, b.tpm)


@dataclass
class Lease:
    lease_id: str
    api_key_id: int
    tenant_id: int
    limits: tuple  # the key's limits when it was taken: a lease serves only requests under the same ones
    period: str
    minute: int | None  # its rpm / tpm slice is of this minute's window (None: it holds none)
    usd: Decimal | None  # held on the key's and the tenant's budgets (None: neither has one)
    tokens: int | None  # of this minute's tpm (None: no tpm)
    requests: int | None  # of this minute's rpm (None: no rpm)
    expires: float
    on_key: bool  # usd is held on the key's budget
    on_tenant: bool  # and on the tenant's
    window_requests: int = 0  # the window's counts right after it was taken (rate-limit headers)
    window_tokens: int = 0
    used_usd: Decimal = ZERO  # held by its requests whose events are not written yet
    used_tokens: int = 0
    used_requests: int = 0  # admitted from it (as with rpm itself, a request counts once admitted)
    unsettled: int = 0  # its requests whose events are not written yet
    retired: bool = False  # admits no more
    closing: bool = False  # its row is being given back

    def fits(self, limits: tuple, worst: Worst, now: float) -> bool:
        return (not self.retired and now < self.expires and limits == self.limits and month_of(now) == self.period
                and (self.minute is None or minute_of(now) == self.minute)
                and (self.usd is None or self.used_usd + worst.cost_usd <= self.usd)
                and (self.tokens is None or self.used_tokens + worst.tokens <= self.tokens)
                and (self.requests is None or self.used_requests + 1 <= self.requests))

    def half_used(self) -> bool:
        return ((self.usd is not None and self.used_usd * 2 >= self.usd)
                or (self.tokens is not None and self.used_tokens * 2 >= self.tokens)
                or (self.requests is not None and self.used_requests * 2 >= self.requests))


@dataclass
class _Hold:
    lease: Lease
    usd: Decimal
    tokens: int
    settling: bool = False


@dataclass
class LeaseSettlement:
    """What one ledger transaction settled from leases (`BudgetLeases.settled` applies it once committed)."""

    holds: list[tuple[str, _Hold]] = field(default_factory=list)
    closing: list[Lease] = field(default_factory=list)

    @property
    def closing_ids(self) -> list[str]:
        return [lease.lease_id for lease in self.closing]


class BudgetLeases:
    def __init__(self, db: Engine, owner: str, reserve: Reserve, *, share: int = 16, min_requests: int = 8,
                 ttl_s: float = 5.0, edge_backoff_s: float = 1.0, tick_s: float = 0.2) -> None:
        """`reserve(lease_id, budgets, worst, now, requests)`: reservations.reserve() (or the admission writer's)."""
        self.db, self.owner, self._reserve = db, owner, reserve
        self.share, self.min_requests, self.ttl_s, self.edge_backoff_s = share, min_requests, ttl_s, edge_backoff_s
        self._tick_s = tick_s
        self._lock = threading.Lock()
        self._active: dict[int, Lease] = {}  # by api key id
        self._retired: list[Lease] = []
        self._holds: dict[str, _Hold] = {}
        self._no_lease_until: dict[int, float] = {}  # near a limit's edge: reserve per request until then
        self._key_locks: defaultdict[int, threading.Lock] = defaultdict(threading.Lock)
        self._refills: dict[int, tuple[Budgets, Worst]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.taken = 0  # leases taken (tests and benchmarks read these)
        self.closed = 0

    # ---- the request path (memory only) -------------------------------------------------------

    def admit(self, budgets: Budgets, request_id: str, worst: Worst, now: float) -> Admitted | None:
        """Admitted from this key's lease, or None when it has none that fits (then `take()` or reserve in SQL)."""
        if budgets.scoped:
            return None
        with self._lock:
            lease = self._active.get(budgets.api_key_id)
            if lease is None or not lease.fits(_limits(budgets), worst, now):
                return None
            lease.used_usd += worst.cost_usd
            lease.used_tokens += worst.tokens
            lease.used_requests += 1
            lease.unsettled += 1
            self._holds[request_id] = _Hold(lease, worst.cost_usd, worst.tokens)
            if lease.half_used() and budgets.api_key_id not in self._refills:
                self._refills[budgets.api_key_id] = (budgets, worst)
                self._wake.set()
            requests = lease.window_requests - (lease.requests or 0) + lease.used_requests
            tokens = lease.window_tokens - (lease.tokens or 0) + lease.used_tokens
        return Admitted(requests if budgets.rpm is not None else 0, tokens if budgets.tpm is not None else 0,
                        seconds_to_next_minute(now))

    def may_lease(self, budgets: Budgets, now: float) -> bool:
        return not budgets.scoped and now >= self._no_lease_until.get(budgets.api_key_id, 0.0)

    def shrink(self, request_id: str, cost_usd: Decimal, tokens: int) -> bool:
        """The request finished: its hold in its lease becomes what it used. False: it was not leased."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                return False
            kept_usd, kept_tokens = min(hold.usd, cost_usd), min(hold.tokens, max(tokens, 0))
            hold.lease.used_usd -= hold.usd - kept_usd
            hold.lease.used_tokens -= hold.tokens - kept_tokens
            hold.usd, hold.tokens = kept_usd, kept_tokens
        return True

    def release(self, request_id: str) -> bool:
        """Refused after admission (no event follows): its hold goes back to its lease. False: it was not leased."""
        with self._lock:
            hold = self._holds.pop(request_id, None)
            if hold is None:
                return False
            lease = hold.lease
            lease.used_usd -= hold.usd
            lease.used_tokens -= hold.tokens
            lease.unsettled -= 1
            if lease.retired and lease.unsettled == 0:
                self._wake.set()
        return True

    # ---- taking a lease (SQL; off the event loop) ---------------------------------------------

    def take(self, budgets: Budgets, worst: Worst, now: float | None = None, renew: bool = False) -> bool:
        """Lease a slice of this key's limits unless a lease that fits `worst` is active (`renew`: and is less than
        half used); False near an edge (nothing leased, and none tried again for edge_backoff_s). Raises the
        database's OperationalError when it is unreachable."""
        now = time.time() if now is None else now
        key = budgets.api_key_id
        with self._key_locks[key]:  # one take per key at a time; the others then find its lease
            with self._lock:
                active = self._active.get(key)
                if active is not None and active.fits(_limits(budgets), worst, now) and not (
                        renew and active.half_used()):
                    return True
            lease = self._take(budgets, worst, now)
            with self._lock:
                self._refills.pop(key, None)
                if lease is None:
                    self._no_lease_until[key] = now + self.edge_backoff_s
                    old = self._active.pop(key, None)
                else:
                    old = self._active.get(key)
                    self._active[key] = lease
                    self.taken += 1
                if old is not None:
                    self._retire(old)
            self._start()
            return lease is not None and lease.fits(_limits(budgets), worst, now)

    def _take(self, b: Budgets, worst: Worst, now: float) -> Lease | None:
        period, minute = month_of(now), minute_of(now)
        left_usd, left_tokens, left_requests = self._left(b, period, minute)
        usd = tokens = requests = None
        if left_usd is not None:
            usd = (left_usd / self.share).quantize(NANO, rounding=ROUND_FLOOR)
            if usd < self.min_requests * worst.cost_usd or usd <= 0:
                return None
        if left_tokens is not None:
            tokens = left_tokens // self.share
            if tokens < self.min_requests * max(worst.tokens, 1):
                return None
        if left_requests is not None:
            requests = left_requests // self.share
            if requests < self.min_requests:
                return None
        lease_id = f"lease:{uuid.uuid4().hex}"
        got = self._reserve(lease_id, b, Worst(usd or ZERO, tokens or 0), now, requests or 0)
        if isinstance(got, Refusal):  # another gateway took what was left meanwhile
            return None
        rated = b.rpm is not None or b.tpm is not None
        return Lease(lease_id, b.api_key_id, b.tenant_id, _limits(b), period, minute if rated else None, usd, tokens,
                     requests, now + self.ttl_s, b.key_budget_usd is not None, b.tenant_budget_usd is not None,
                     got.requests_used, got.tokens_used)

    def _left(self, b: Budgets, period: str, minute: int) -> tuple[Decimal | None, int | None, int | None]:
        """What is left now of the key's and tenant's budgets (the smaller), its rpm and its tpm (None: no limit)."""
        c, w = SpendCounter.__table__.c, RateWindow.__table__.c
        with self.db.connect() as conn:
            left_usd = None
            for scope, scope_id, budget in (("key", b.api_key_id, b.key_budget_usd),
                                            ("tenant", b.tenant_id, b.tenant_budget_usd)):
                if budget is None:
                    continue
                row = conn.execute(select(c.spent_usd, c.reserved_usd).where(
                    c.scope == scope, c.scope_id == scope_id, c.period == period)).first()
                left = budget - (row.spent_usd + row.reserved_usd if row else ZERO)
                left_usd = left if left_usd is None else min(left_usd, left)
            left_tokens = left_requests = None
            if b.rpm is not None or b.tpm is not None:
                row = conn.execute(select(w.requests, w.tokens).where(w.api_key_id == b.api_key_id,
                                                                      w.minute == minute)).first()
                used_requests, used_tokens = (row.requests, row.tokens) if row else (0, 0)
                left_requests = None if b.rpm is None else b.rpm - used_requests
                left_tokens = None if b.tpm is None else b.tpm - used_tokens
        return left_usd, left_tokens, left_requests

    # ---- settling (the ledger's transaction) --------------------------------------------------

    def settle_in(self, conn: Connection, db: Engine, request_ids: list[str], changes: CounterChanges,
                  settlement: LeaseSettlement) -> None:
        """Inside the ledger's transaction that writes these requests' events: each leased one's hold leaves its
        lease (and the counters' reserved); a retired lease whose last requests these are is given back whole
        instead (its id goes to `settlement.closing_ids`, for the caller's reservations.settle_in). `settled()` then
        applies `settlement` to the leases in memory, committed or not."""
        per_lease: dict[str, tuple[Lease, list[_Hold]]] = {}
        with self._lock:
            for request_id in request_ids:
                hold = self._holds.get(request_id)
                if hold is None or hold.settling:
                    continue
                hold.settling = True
                settlement.holds.append((request_id, hold))
                per_lease.setdefault(hold.lease.lease_id, (hold.lease, []))[1].append(hold)
            debits = []
            for lease_id in sorted(per_lease):
                lease, holds = per_lease[lease_id]
                if lease.retired and not lease.closing and lease.unsettled == len(holds):
                    lease.closing = True
                    settlement.closing.append(lease)
                else:
                    debits.append((lease, sum((h.usd for h in holds), ZERO), sum(h.tokens for h in holds)))
        sql = _sql(db)
        for lease, usd, tokens in debits:
            conn.execute(sql.debit_hold, {"lease_id": lease.lease_id, "usd": usd, "tokens": tokens})
            if lease.on_key:
                changes.reserved[("key", lease.api_key_id, lease.period)] -= usd
            if lease.on_tenant:
                changes.reserved[("tenant", lease.tenant_id, lease.period)] -= usd
            if lease.tokens is not None and lease.minute is not None:
                changes.tokens[(lease.api_key_id, lease.minute)] -= tokens
        for lease in settlement.closing:
            _unused_requests_back(lease, changes)

    def settled(self, settlement: LeaseSettlement, committed: bool) -> None:
        with self._lock:
            for request_id, hold in settlement.holds:
                if not committed:
                    hold.settling = False
                    continue
                self._holds.pop(request_id, None)
                lease = hold.lease
                lease.unsettled -= 1
                lease.used_usd -= hold.usd
                lease.used_tokens -= hold.tokens
                if lease.usd is not None:
                    lease.usd -= hold.usd
                if lease.tokens is not None:
                    lease.tokens -= hold.tokens
            for lease in settlement.closing:
                if committed:
                    self._forget(lease)
                else:
                    lease.closing = False

    # ---- retiring and giving back ---------------------------------------------------------------

    def _retire(self, lease: Lease) -> None:
        """Under the lock."""
        if not lease.retired:
            lease.retired = True
            self._retired.append(lease)
        self._wake.set()

    def _forget(self, lease: Lease) -> None:
        if lease in self._retired:
            self._retired.remove(lease)
        if self._active.get(lease.api_key_id) is lease:
            del self._active[lease.api_key_id]
        self.closed += 1

    def give_back_idle(self, now: float | None = None) -> None:
        """Retire expired leases (and those of a past minute or month), and give back the retired ones that have no
        request left unsettled."""
        now = time.time() if now is None else now
        with self._lock:
            for lease in list(self._active.values()):
                if (now >= lease.expires or month_of(now) != lease.period
                        or (lease.minute is not None and minute_of(now) != lease.minute)):
                    del self._active[lease.api_key_id]
                    self._retire(lease)
            idle = [lease for lease in self._retired if lease.unsettled == 0 and not lease.closing]
            for lease in idle:
                lease.closing = True
        if not idle:
            return
        try:
            changes = CounterChanges()
            for lease in idle:
                _unused_requests_back(lease, changes)
            with write_lock(self.db), self.db.begin() as conn:
                settle_reservations_in(conn, self.db, [lease.lease_id for lease in idle], changes)
        except SQLAlchemyError as e:  # the database is down: given back at a later tick (or by the sweeper)
            log.debug("giving back %d budget leases failed: %s", len(idle), type(e).__name__)
            with self._lock:
                for lease in idle:
                    lease.closing = False
            return
        with self._lock:
            for lease in idle:
                self._forget(lease)

    def close(self) -> None:
        """At shutdown, after the ledger's last write: every lease retired, those with nothing unsettled given back."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
        with self._lock:
            for lease in list(self._active.values()):
                self._retire(lease)
            self._active.clear()
        self.give_back_idle()

    def _start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._stop:
                    self._thread = threading.Thread(target=self._run, name="tollgate-leases", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self._tick_s)
            self._wake.clear()
            if self._stop:
                return
            with self._lock:
                refills, self._refills = dict(self._refills), {}
            for budgets, worst in refills.values():
                try:
                    self.take(budgets, worst, renew=True)
                except SQLAlchemyError as e:  # the request path takes one itself, or fails open, when it needs it
                    log.debug("renewing a budget lease failed: %s", type(e).__name__)
            self.give_back_idle()


def _unused_requests_back(lease: Lease, changes: CounterChanges) -> None:
    """A lease given back returns the rpm it did not use to its minute's window."""
    if lease.requests is not None and lease.minute is not None and lease.requests > lease.used_requests:
        changes.requests[(lease.api_key_id, lease.minute)] -= lease.requests - lease.used_requests
