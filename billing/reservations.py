"""Budget and tpm reservations: admission reserves a request's worst case before the model runs, in
one transaction of conditional updates, so concurrent requests on any number of gateways sharing the
database can never spend past a budget or a tpm limit.

- `reserve()` adds the worst-case cost to `spend_counters.reserved_usd` of every budget that applies
  (the key's, the tenant's, and the tenant's budgets for the request's end user and tags) and the worst-case
  tokens to the key's `rate_windows` row of this minute, each an upsert `... DO UPDATE ... WHERE spent +
  reserved + cost <= budget`: the database checks and adds in one statement (a row lock on PostgreSQL, the write lock on
  SQLite), so no read-then-write race. All or nothing: a budget without room rolls back the others. It
  writes a `reservations` row naming the request and the gateway process that holds it.
- The ledger settles a reservation in the transaction that writes the request's usage event
  (`settle_in()`): the exact cost goes to `spent_usd`, the reservation leaves `reserved_usd`. A
  refusal after admission (a prompt too long for the model, a model that is unavailable) releases it.
- A gateway process that dies holds its reservations no longer than its heartbeat's age limit: a
  live gateway's sweeper (`ReservationKeeper`) releases them and records each request as
  `interrupted` (what is known: who, which model; no tokens).

Every transaction that writes counters locks them in one order, spend counters by (scope, scope_id, period)
and then rate windows by (key, minute), so that admissions and ledgers on any number of gateways never wait
on each other in a cycle (a PostgreSQL deadlock would fail an admission, or a ledger batch).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

from sqlalchemy import Connection, Engine, and_, bindparam, delete, select, update

from billing.admission_journal import interrupted_event
from billing.db import dialect_insert, write_lock
from billing.models import GatewayProcess, RateWindow, Reservation, SpendCounter, UsageEvent
from billing.money import ZERO, Money
from billing.periods import minute_of, month_of, seconds_to_next_minute
from billing.scoped_budgets import ScopedLimit

log = logging.getLogger("tollgate.reservations")

LEASE_ENDPOINT = "budget-lease"  # the endpoint of a reservation that is a gateway's budget lease, not a request
HEARTBEAT_S = 5.0
DEAD_AFTER_S = 30.0  # a gateway whose heartbeat is older than this holds no reservation


def process_id() -> str:
    """This gateway process's id in the database: host, pid and a random part (pids are reused)."""
    return f"{socket.gethostname()[:40]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class Worst:
    """A request's worst case: what it may cost and how many tokens it may use."""

    cost_usd: Decimal
    tokens: int
    prompt_tokens: int | None = None  # of `tokens`, the prompt's (None: not told)
    prompt_counted: bool = True  # counted by the model's tokenizer; False: bounded by the prompt's UTF-8 bytes


@dataclass(frozen=True)
class Budgets:
    """The limits that apply to one request (None: no such limit)."""

    tenant_id: int
    api_key_id: int
    key_budget_usd: Decimal | None
    tenant_budget_usd: Decimal | None
    rpm: int | None
    tpm: int | None
    scoped: tuple[ScopedLimit, ...] = ()  # the tenant's budgets for this request's end user and tags


@dataclass(frozen=True)
class Refusal:
    """Why a request could not reserve: `kind` is "budget" (key, tenant, user or tag), "rpm" or "tpm"."""

    kind: str
    scope: str  # key | tenant | user | tag
    limit: Decimal | int  # dollars (budgets) or a count (rpm, tpm), as are the three below
    used: Decimal | int  # spent (budgets) or counted this minute (rpm, tpm)
    reserved: Decimal | int  # held by requests in flight (budgets)
    asked: Decimal | int
    retry_after_s: int
    name: str = ""  # the end user's or tag's name (user and tag budgets)


@dataclass(frozen=True)
class Admitted:
    requests_used: int  # this minute, this one included (0 without an rpm / tpm limit)
    tokens_used: int  # this minute, reservations included
    reset_s: int


class _Refused(Exception):
    def __init__(self, refusal: Refusal) -> None:
        self.refusal = refusal


def reserve(db: Engine, request_id: str, owner: str, budgets: Budgets, worst: Worst, *, model: str,
            endpoint: str, now: float | None = None, requests: int = 1) -> Admitted | Refusal:
    """Reserve `worst` against every limit in `budgets`, all or nothing (a refusal rolls back the rest).
    `requests`: how many of the key's rpm it takes (more than one for a budget lease, billing/budget_leases.py)."""
    try:
        return _reserve(db, request_id, owner, budgets, worst, model, endpoint, time.time() if now is None else now,
                        requests)
    except _Refused as e:
        return e.refusal


class _AdmissionSql:
    """The statements admission runs for every request, built once per dialect with bound parameters: building
    and caching a fresh SQLAlchemy statement cost several times what SQLite takes to run it."""

    def __init__(self, db: Engine) -> None:
        row, w = SpendCounter.__table__.c, RateWindow.__table__.c
        cost = bindparam("cost", type_=Money())
        # a counter is created or added to only while it has room: one statement, so each counter's lock is taken
        # once, in the order the caller runs them
        take = dialect_insert(db, SpendCounter).values(scope=bindparam("scope"), scope_id=bindparam("scope_id"),
                                                       period=bindparam("period"), spent_usd=0, reserved_usd=cost)
        self.take_counter = take.on_conflict_do_update(
            index_elements=["scope", "scope_id", "period"], set_={"reserved_usd": row.reserved_usd + cost},
            where=row.spent_usd + row.reserved_usd + cost <= bindparam("budget", type_=Money()),
        ).returning(row.scope)
        self.counter = select(row.spent_usd, row.reserved_usd).where(
            row.scope == bindparam("scope"), row.scope_id == bindparam("scope_id"), row.period == bindparam("period"))
        tokens, requests = bindparam("tokens"), bindparam("requests")
        rate = dialect_insert(db, RateWindow).values(api_key_id=bindparam("key"), minute=bindparam("minute"),
                                                     requests=requests, tokens=tokens)
        upsert = {"requests": w.requests + requests, "tokens": w.tokens + tokens}
        self.take_rate = {  # by which limits the key has: (rpm, tpm)
            (has_rpm, has_tpm): rate.on_conflict_do_update(
                index_elements=["api_key_id", "minute"], set_=upsert,
                where=and_(*([w.requests + requests <= bindparam("rpm")] if has_rpm else []),
                           *([w.tokens + tokens <= bindparam("tpm")] if has_tpm else [])),
            ).returning(w.requests, w.tokens)
            for has_rpm in (False, True) for has_tpm in (False, True) if has_rpm or has_tpm}
        self.window = select(w.requests, w.tokens).where(w.api_key_id == bindparam("key"),
                                                         w.minute == bindparam("minute"))
        self.hold = dialect_insert(db, Reservation)
        r = Reservation.__table__.c
        self.take_holds = delete(Reservation).where(r.request_id.in_(bindparam("ids", expanding=True))).returning(
            r.request_id, r.owner, r.tenant_id, r.api_key_id, r.period, r.tenant_usd, r.key_usd, r.scoped_usd,
            r.scoped_holds, r.minute, r.tokens, r.model, r.endpoint, r.created_at)
        add = dialect_insert(db, SpendCounter)
        self.add_to_counters = add.on_conflict_do_update(index_elements=["scope", "scope_id", "period"], set_={
            "spent_usd": SpendCounter.spent_usd + add.excluded.spent_usd,
            "reserved_usd": SpendCounter.reserved_usd + add.excluded.reserved_usd})
        add = dialect_insert(db, RateWindow)
        self.add_to_windows = add.on_conflict_do_update(index_elements=["api_key_id", "minute"], set_={
            "tokens": RateWindow.tokens + add.excluded.tokens, "requests": RateWindow.requests + add.excluded.requests})
        r = Reservation.__table__.c
        usd = bindparam("usd", type_=Money())
        self.debit_hold = update(Reservation).where(r.request_id == bindparam("lease_id")).values(
            tenant_usd=r.tenant_usd - usd, key_usd=r.key_usd - usd, tokens=r.tokens - bindparam("tokens"))


@functools.lru_cache(maxsize=8)
def _sql(db: Engine) -> _AdmissionSql:
    return _AdmissionSql(db)


def _reserve(db: Engine, request_id: str, owner: str, budgets: Budgets, worst: Worst, model: str, endpoint: str,
             now: float, requests: int) -> Admitted:
    with db.begin() as conn:
        result = reserve_in(conn, db, request_id, owner, budgets, worst, model=model, endpoint=endpoint, now=now,
                            requests=requests)
        if isinstance(result, Refusal):
            raise _Refused(result)  # rolls back, which leaves no counter row a refusal created
        return result


def reserve_in(conn: Connection, db: Engine, request_id: str, owner: str, budgets: Budgets, worst: Worst, *,
               model: str, endpoint: str, now: float, requests: int = 1) -> Admitted | Refusal:
    """`reserve()` on a transaction the caller owns (billing/admission_writer.py runs many in one): a refusal gives
    back what this request had taken before it returns, so the transaction's other work stands."""
    period, minute = month_of(now), minute_of(now)
    scopes = sorted([(s, i, b, "") for s, i, b in (("tenant", budgets.tenant_id, budgets.tenant_budget_usd),
                                                    ("key", budgets.api_key_id, budgets.key_budget_usd))
                     if b is not None] + [(s.scope, s.id, s.budget_usd, s.name) for s in budgets.scoped])
    sql = _sql(db)
    taken = CounterChanges()

    def refuse(refusal: Refusal) -> Refusal:
        apply_in(conn, db, taken)
        return refusal

    for scope, scope_id, budget, name in scopes:  # in the one lock order (see the module's docstring)
        where = {"scope": scope, "scope_id": scope_id, "period": period}
        if worst.cost_usd > budget or conn.execute(sql.take_counter, {
                **where, "cost": worst.cost_usd, "budget": budget}).first() is None:
            spent, reserved = conn.execute(sql.counter, where).first() or (ZERO, ZERO)
            return refuse(Refusal("budget", scope, budget, spent, reserved, worst.cost_usd, 0, name))
        taken.reserved[(scope, scope_id, period)] = -worst.cost_usd  # each counter once: assigned, not added
    admitted = Admitted(0, 0, seconds_to_next_minute(now))
    if budgets.rpm is not None or budgets.tpm is not None:
        result = _take_rate(conn, sql, budgets, worst.tokens if budgets.tpm is not None else 0, requests, minute, now)
        if isinstance(result, Refusal):
            return refuse(result)
        admitted = result
    held = [[s.scope, s.id] for s in budgets.scoped]
    conn.execute(sql.hold, {
        "request_id": request_id, "owner": owner, "tenant_id": budgets.tenant_id,
        "api_key_id": budgets.api_key_id, "period": period,
        "tenant_usd": worst.cost_usd if budgets.tenant_budget_usd is not None else None,
        "key_usd": worst.cost_usd if budgets.key_budget_usd is not None else None,
        "scoped_usd": worst.cost_usd if held else None, "scoped_holds": held or None,
        "minute": minute if budgets.tpm is not None else None,
        "tokens": worst.tokens if budgets.tpm is not None else None,
        "model": model, "endpoint": endpoint, "created_at": datetime.fromtimestamp(now, timezone.utc)})
    return admitted


def _take_rate(conn: Connection, sql: _AdmissionSql, b: Budgets, tokens: int, requests: int, minute: int,
               now: float) -> Admitted | Refusal:
    retry_after = seconds_to_next_minute(now)
    if b.rpm is not None and requests > b.rpm:
        return Refusal("rpm", "key", b.rpm, 0, 0, requests, retry_after)
    if b.tpm is not None and tokens > b.tpm:
        return Refusal("tpm", "key", b.tpm, 0, 0, tokens, retry_after)
    where = {"key": b.api_key_id, "minute": minute}
    got = conn.execute(sql.take_rate[(b.rpm is not None, b.tpm is not None)],
                       {**where, "tokens": tokens, "requests": requests, "rpm": b.rpm, "tpm": b.tpm}).first()
    if got is not None:
        return Admitted(got.requests, got.tokens, retry_after)
    used = conn.execute(sql.window, where).one()
    if b.rpm is not None and used.requests + requests > b.rpm:
        return Refusal("rpm", "key", b.rpm, used.requests, 0, requests, retry_after)
    return Refusal("tpm", "key", b.tpm or 0, used.tokens, 0, tokens, retry_after)


CounterKey = tuple[str, int, str]  # a spend counter: (scope, scope_id, period)
WindowKey = tuple[int, int]  # a rate window: (api_key_id, minute)


@dataclass
class CounterChanges:
    """What one transaction adds to spend counters (spent, reserved: negative to release) and rate windows
    (tokens), written together by `apply_in` in the one lock order."""

    spent: defaultdict[CounterKey, Decimal] = field(default_factory=lambda: defaultdict(Decimal))
    reserved: defaultdict[CounterKey, Decimal] = field(default_factory=lambda: defaultdict(Decimal))
    tokens: defaultdict[WindowKey, int] = field(default_factory=lambda: defaultdict(int))
    requests: defaultdict[WindowKey, int] = field(default_factory=lambda: defaultdict(int))  # a lease's unused rpm


def shrink(db: Engine, request_id: str, cost_usd: Decimal, tokens: int) -> bool:
    """A finished request's hold shrinks to what it used (its exact cost and tokens, never more than it held)
    at once, before its response completes: the next request admitted sees the finished one at its real cost,
    not at its worst case until the ledger writes its event. The ledger then settles the shrunk hold as usual.
    The row is taken and put back (a write first, so a SQLite transaction never upgrades from a read) in the
    one lock order: the reservation, then counters. False when the request holds nothing (no budget or tpm,
    or already settled)."""
    with db.begin() as conn:
        return request_id in shrink_in(conn, db, {request_id: (cost_usd, tokens)})


def shrink_in(conn: Connection, db: Engine, used: dict[str, tuple[Decimal, int]]) -> set[str]:
    """`shrink()` of several finished requests (request id -> (cost, tokens)) on a transaction the caller owns, in
    one pass: their rows taken at once, put back at what each used, the counters changed once each. Returns the ids
    that held something."""
    rows = _take_rows(conn, list(used))
    if not rows:
        return set()
    changes = CounterChanges()
    _add_releases(rows, changes)  # all of the old holds go ...
    kept_rows = []
    for row in rows:
        cost_usd, tokens = used[row.request_id]
        kept = {name: None if held is None else min(held, cost_usd)
                for name, held in (("tenant_usd", row.tenant_usd), ("key_usd", row.key_usd),
                                   ("scoped_usd", row.scoped_usd))}
        kept_tokens = None if row.tokens is None else min(row.tokens, max(tokens, 0))
        _add_releases([SimpleNamespace(tenant_id=row.tenant_id, api_key_id=row.api_key_id, period=row.period,
                                       scoped_holds=row.scoped_holds, minute=row.minute, tokens=kept_tokens, **kept)],
                      changes, sign=+1)  # ... and what each used comes back
        kept_rows.append({
            "request_id": row.request_id, "owner": row.owner, "tenant_id": row.tenant_id,
            "api_key_id": row.api_key_id, "period": row.period, **kept, "scoped_holds": row.scoped_holds,
            "minute": row.minute, "tokens": kept_tokens, "model": row.model, "endpoint": row.endpoint,
            "created_at": row.created_at})
    conn.execute(_sql(db).hold, kept_rows)
    apply_in(conn, db, changes)
    return {row.request_id for row in rows}


def release(db: Engine, request_ids: list[str]) -> int:
    """Give back reservations whose requests were refused after admission (no usage event follows)."""
    with write_lock(db), db.begin() as conn:  # queued with the writers of this process
        return settle_in(conn, db, request_ids, CounterChanges())


def settle_in(conn: Connection, db: Engine, request_ids: list[str], changes: CounterChanges) -> int:
    """Inside the ledger's transaction that writes these requests' events: their reservations go, and the
    counters get `changes` (the events' spend and tokens) with the releases, in one pass. Returns how many."""
    rows = _take_rows(conn, request_ids)
    _add_releases(rows, changes)
    apply_in(conn, db, changes)
    return len(rows)


def _take_rows(conn: Connection, request_ids: list[str]) -> list[Any]:
    if not request_ids:
        return []
    return list(conn.execute(_sql(conn.engine).take_holds, {"ids": request_ids}))


def _add_releases(rows: list[Any], changes: CounterChanges, sign: int = -1) -> None:
    """Each row's holds taken off the counters (sign=+1: put on)."""
    for row in rows:
        if row.tenant_usd is not None:
            changes.reserved[("tenant", row.tenant_id, row.period)] += sign * row.tenant_usd
        if row.key_usd is not None:
            changes.reserved[("key", row.api_key_id, row.period)] += sign * row.key_usd
        for scope, scope_id in row.scoped_holds or ():
            changes.reserved[(scope, scope_id, row.period)] += sign * row.scoped_usd
        if row.tokens is not None:
            changes.tokens[(row.api_key_id, row.minute)] += sign * row.tokens


def apply_in(conn: Connection, db: Engine, changes: CounterChanges) -> None:
    """Adds `changes` to the counters, creating missing ones, each counter once and in the one lock order."""
    counters = sorted(set(changes.spent) | set(changes.reserved))
    if counters:
        conn.execute(_sql(db).add_to_counters, [
            {"scope": s, "scope_id": i, "period": p, "spent_usd": changes.spent.get((s, i, p), 0),
             "reserved_usd": changes.reserved.get((s, i, p), 0)} for s, i, p in counters])
    windows = sorted({k for k, n in changes.tokens.items() if n} | {k for k, n in changes.requests.items() if n})
    if windows:
        conn.execute(_sql(db).add_to_windows, [
            {"api_key_id": k, "minute": m, "requests": changes.requests.get((k, m), 0),
             "tokens": changes.tokens.get((k, m), 0)} for k, m in windows])


def sweep_orphans(db: Engine, now: float | None = None) -> int:
    """Release the reservations of gateway processes that stopped beating and record each of their
    requests as `interrupted` (an event that is already there is left as it is). Returns how many."""
    now = time.time() if now is None else now
    cutoff = datetime.fromtimestamp(now - DEAD_AFTER_S, timezone.utc)
    r, g = Reservation.__table__.c, GatewayProcess.__table__.c
    with write_lock(db), db.begin() as conn:
        live = select(g.id).where(g.heartbeat_at >= cutoff)
        orphaned = [row.request_id for row in conn.execute(
            select(r.request_id).where(r.owner.not_in(live), r.created_at < cutoff))]
        conn.execute(delete(GatewayProcess).where(g.heartbeat_at < cutoff - timedelta(days=1)))
        rows = _take_rows(conn, orphaned)
        if not rows:
            return 0
        changes = CounterChanges()
        _add_releases(rows, changes)
        apply_in(conn, db, changes)
        # a budget lease is no request (its requests' records are in their gateway's journal)
        events = [interrupted_event(row.request_id, created_at=row.created_at, tenant_id=row.tenant_id,
                                    api_key_id=row.api_key_id, model=row.model, endpoint=row.endpoint)
                  for row in rows if row.endpoint != LEASE_ENDPOINT]
        if events:
            conn.execute(dialect_insert(db, UsageEvent).on_conflict_do_nothing(index_elements=["request_id"]), events)
    log.warning("released %d reservations of gateways that stopped; their requests are recorded as interrupted",
                len(rows))
    return len(rows)


def heartbeat(db: Engine, owner: str, now: float | None = None) -> None:
    at = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc)
    stmt = dialect_insert(db, GatewayProcess).values(id=owner, heartbeat_at=at)
    with write_lock(db), db.begin() as conn:
        conn.execute(stmt.on_conflict_do_update(index_elements=["id"], set_={"heartbeat_at": at}))


class ReservationKeeper:
    """This gateway's heartbeat, and the sweep of dead gateways' reservations, every HEARTBEAT_S."""

    def __init__(self, db: Engine, owner: str, every_s: float = HEARTBEAT_S,
                 also: Callable[[], None] | None = None) -> None:
        """`also`: more work for each beat (the limiter's releases that failed while the database was down)."""
        self.db, self.owner, self.every_s, self.also = db, owner, every_s, also
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tollgate-reservations", daemon=True)

    def start(self) -> "ReservationKeeper":
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        try:
            heartbeat(self.db, self.owner)
            sweep_orphans(self.db)
            if self.also is not None:
                self.also()
        except Exception as e:  # the database down: beat again later; nothing else depends on it
            log.debug("reservation heartbeat failed: %s", type(e).__name__)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._beat()
