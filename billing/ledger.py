"""The usage ledger: events are queued by the request path and written by one background thread in
batches. Each batch is one transaction that inserts the events (skipping request ids already
stored) and adds their cost and tokens to the counters budgets and tpm limits read.

While the database is unreachable the events wait: in memory up to `max_buffer`, and beyond that,
and whenever a batch fails, in JSONL segments under `spill_dir` (billing/ledger_spill.py). The
writer retries with backoff; once a write succeeds it replays the spilled segments (oldest first)
before newer events. Segments left by a process that died are replayed by the next one. Without a
spill dir the events wait in memory only.

A batch the database refuses for its data (a constraint, a value a column cannot hold) is no outage:
its events are written one by one, and those refused are set aside in the spill dir's dead-letter
file (logged by request id) so that one bad event never holds up the others."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, delete
from sqlalchemy.exc import DataError, IntegrityError

from billing.admission_journal import AdmissionJournal, events_of, orphaned_journals
from billing.budget_alerts import SoftBudgetCrossed, claim_crossings
from billing.db import dialect_insert, write_lock
from billing.ledger_spill import SpillDir, append_dead_letter, read_segment
from billing.models import RateWindow, UsageEvent, utcnow
from billing.money import ZERO, dollars, usd
from billing.periods import minute_of, month_of
from billing.budget_leases import BudgetLeases, LeaseSettlement
from billing.reservations import CounterChanges, settle_in
from billing.scoped_budgets import matching

log = logging.getLogger("tollgate.ledger")

_EVENT_COLUMNS = [c.name for c in UsageEvent.__table__.columns if c.name != "id"]
# columns an event may lack (interrupted events, segments spilled before they existed): one shape for every row
_OPTIONAL = {"input_per_1m": None, "cached_input_per_1m": None, "output_per_1m": None}

Row = dict[str, Any]
Queued = tuple[int, Row]  # (this process's sequence number, row)

# the database refuses the rows themselves: retrying cannot help (anything else may be an outage and is retried)
REFUSED_ROW_ERRORS = (IntegrityError, DataError)


class Ledger:
    def __init__(self, engine: Engine, *, max_batch: int = 1000, linger_s: float = 0.05, retry_delay_s: float = 0.5,
                 max_retry_delay_s: float = 5.0, cleanup_every_s: float = 60.0, spill_dir: Path | None = None,
                 max_buffer: int = 10_000, on_alert: Callable[[list[SoftBudgetCrossed]], None] | None = None) -> None:
        self._engine = engine
        self._on_alert = on_alert  # soft budgets reached (billing/budget_alerts.py), called by the writer thread
        self._max_batch = max_batch
        # how long the writer waits for more events before writing a batch; flush() and close() cut it short
        self._linger_s = linger_s
        self._flush_wanted = 0  # flush() waits for every event up to this sequence number
        self._retry_delay_s = retry_delay_s
        self._max_retry_delay_s = max_retry_delay_s
        self._cleanup_every_s = cleanup_every_s
        self._max_buffer = max_buffer
        self._cond = threading.Condition()
        self._queue: deque[Queued] = deque()
        self._seq = 0
        self._unwritten: set[int] = set()  # recorded and not yet in the database: queued, in flight or spilled
        self._stopping = False
        self._down = False  # the last write failed: the writer is backing off
        self._thread: threading.Thread | None = None
        self._spill = SpillDir(spill_dir) if spill_dir is not None else None
        self._spill_lock = threading.Lock()
        # every admitted request on disk before its model runs (billing/admission_journal.py)
        self._journal = AdmissionJournal(self._spill.path, self._spill.owner) if self._spill is not None else None
        self._journal_lock = threading.Lock()
        self._orphans_pending = self._spill is not None
        # what is recorded but not yet in the counters, so that limits see it without lag
        self._pending_spend: dict[tuple[str, int], Decimal] = defaultdict(Decimal)
        self._pending_tokens: dict[int, int] = defaultdict(int)
        self.inserted_total = 0
        self.failed_batches = 0
        self.spilled_total = 0  # events of this process moved to disk
        self.replayed_total = 0  # events of dead processes replayed from their segments
        self.leases: BudgetLeases | None = None  # the limiter's (billing/budget_leases.py): their holds settle here
        self.dead_lettered_total = 0  # events the database refused, set aside
        self._dead_lettered: set[str] = set()  # their request ids: a segment replayed again adds none twice

    def start(self) -> "Ledger":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tollgate-ledger", daemon=True)
            self._thread.start()
        return self

    def begin(self, request_id: str, *, tenant_id: int | None, api_key_id: int | None, model: str, endpoint: str,
              end_user: str | None = None, tags: list[str] | None = None, adapter: str | None = None) -> None:
        """A request was admitted and its model is about to run: journaled (with a spill dir), so that it
        leaves an event, `interrupted` at worst, whatever happens to this process. Raises OSError when the
        journal cannot be written: a request that could leave no record is not run."""
        if self._journal is None:
            return
        with self._journal_lock:
            self._journal.begin(request_id, {"tenant_id": tenant_id, "api_key_id": api_key_id, "model": model,
                                             "adapter": adapter, "endpoint": endpoint, "end_user": end_user,
                                             "tags": tags or [],
                                             "created_at": utcnow()})

    def refused(self, request_id: str) -> None:
        """A begun request was refused before it ran: it leaves no event."""
        if self._journal is None:
            return
        try:
            with self._journal_lock:
                self._journal.refused(request_id)
        except OSError:
            log.exception("ledger: could not journal the refusal of %s", request_id)

    def record(self, event: UsageEvent) -> None:
        self.record_row({c: getattr(event, c) for c in _EVENT_COLUMNS})

    def record_row(self, fields: Row) -> None:
        """record() of an event given as its columns (those missing take their defaults): the request path's way,
        without building an ORM object."""
        row = {c: fields.get(c) for c in _EVENT_COLUMNS}
        if row["created_at"] is None:
            row["created_at"] = utcnow()
        for column, default in (("tags", []), ("prompt_tokens", 0), ("completion_tokens", 0), ("cached_tokens", 0),
                                ("cache_hit", False), ("latency_s", 0.0), ("cost_usd", ZERO)):
            if row[column] is None:
                row[column] = default
        overflow: list[Queued] = []
        if self._journal is not None:
            try:
                with self._journal_lock:
                    self._journal.end(row)
            except OSError:
                log.exception("ledger: could not journal usage event %s", row["request_id"])
        with self._cond:
            if self._stopping:
                raise RuntimeError("ledger is closed")
            self._seq += 1
            self._queue.append((self._seq, row))
            self._unwritten.add(self._seq)
            self._add_pending(row, +1)
            if self._spill is not None and len(self._queue) > self._max_buffer:
                overflow = [self._queue.popleft() for _ in range(min(self._max_batch, len(self._queue)))]
            # the writer waits untimed only for a first event; while it lingers over more it wakes on its own,
            # early only for a full batch (a wake-up per event costs the request path a GIL hand-off)
            if len(self._queue) in (1, self._max_batch):
                self._cond.notify_all()
        if overflow:
            log.warning("ledger buffer over %d events; %d spilled to disk", self._max_buffer, len(overflow))
            self._set_aside(overflow)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event recorded before this call is in the database; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._seq
            self._flush_wanted = max(self._flush_wanted, target)
            self._cond.notify_all()
            while min(self._unwritten, default=target + 1) <= target:
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError("ledger writer is not running")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued; with the database down, spill it (when a spill dir is set) and stop."""
        if self._thread is None:
            if self._spill is not None:
                self._spill.close()
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("ledger writer did not finish within %ss; %d events unwritten", timeout, len(self._unwritten))
        self._thread = None

    def pending_spend(self, scope: str, scope_id: int) -> Decimal:
        return self._pending_spend.get((scope, scope_id), ZERO)

    def pending_tokens(self, api_key_id: int) -> int:
        return self._pending_tokens.get(api_key_id, 0)

    @property
    def backlog(self) -> int:
        """Events recorded by this process and not yet in the database (in memory or on disk)."""
        return len(self._unwritten)

    @property
    def buffered(self) -> int:
        """Events waiting in memory (the rest of the backlog is in flight or on disk)."""
        return len(self._queue)

    @property
    def database_down(self) -> bool:
        return self._down

    def _add_pending(self, row: Row, sign: int) -> None:
        cost = sign * dollars(row["cost_usd"])
        tokens = sign * (int(row["prompt_tokens"]) + int(row["completion_tokens"]))
        if row["api_key_id"] is not None:
            self._pending_spend[("key", row["api_key_id"])] += cost
            self._pending_tokens[row["api_key_id"]] += tokens
        if row["tenant_id"] is not None:
            self._pending_spend[("tenant", row["tenant_id"])] += cost

    def _written(self, rows: list[Queued]) -> None:
        with self._cond:
            for seq, row in rows:
                if seq in self._unwritten:
                    self._unwritten.discard(seq)
                    self._add_pending(row, -1)
            self._cond.notify_all()
        self._stored(rows)

    def _stored(self, rows: list[Queued]) -> None:
        """These events are in the database or a spill segment: the journal no longer needs them."""
        if self._journal is not None:
            with self._journal_lock:
                self._journal.stored([row["request_id"] for _, row in rows])

    # ---- the writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        last_cleanup = time.monotonic()
        delay = self._retry_delay_s
        while True:
            with self._cond:
                self._wait_for_work(delay)
                batch = [self._queue.popleft() for _ in range(min(self._max_batch, len(self._queue)))]
                stopping = self._stopping
            ok = self._replay_spilled()
            if batch:
                left = self._try_write(batch) if ok else batch
                ok = not left
                if left:
                    self._set_aside(left)
            if ok:
                if self._down:
                    log.warning("ledger: the database is back; spilled events replayed")
                self._down, delay = False, self._retry_delay_s
            else:
                if self._down:
                    delay = min(delay * 2, self._max_retry_delay_s)
                else:
                    log.error("ledger: the database is unreachable; events wait in %s",
                              "memory" if self._spill is None else f"memory and {self._spill.path}")
                self._down = True
            if stopping and self._finish(ok):
                return
            if ok and time.monotonic() - last_cleanup > self._cleanup_every_s:
                last_cleanup = time.monotonic()
                self._cleanup()

    def _finish(self, ok: bool) -> bool:
        """On close: True when the writer may stop, every event being in the database or on disk. With the
        database down and no spill dir it keeps retrying until close() stops waiting."""
        with self._cond:
            left = list(self._queue) if not ok and self._spill is not None else []
            if left:
                self._queue.clear()
            done = not self._queue
        if left:
            self._set_aside(left)
        if done and (ok or self._spill is not None):
            if self._spill is not None:
                with self._spill_lock:
                    self._spill.close()
            if self._journal is not None:
                with self._journal_lock:
                    self._journal.close()
            return True
        return False

    def _wait_for_work(self, delay: float) -> None:
        """Under self._cond: until there is something to write (or, when down, until the next retry)."""
        if self._down:
            retry_at = time.monotonic() + delay
            # closing with a spill dir: one more try, then the rest goes to disk (see _finish)
            while not (self._stopping and self._spill is not None) and time.monotonic() < retry_at:
                self._cond.wait(retry_at - time.monotonic())
            return
        while not self._queue and not self._stopping and not self._spill_waiting():
            self._cond.wait()
        linger_until = time.monotonic() + self._linger_s
        while (self._queue and not self._stopping and len(self._queue) < self._max_batch
               and self._queue[0][0] > self._flush_wanted and time.monotonic() < linger_until):
            self._cond.wait(linger_until - time.monotonic())

    def _spill_waiting(self) -> bool:
        return self._spill is not None and (self._orphans_pending or self._spill.has_segments)

    def _try_write(self, batch: list[Queued]) -> list[Queued]:
        """Writes a batch; returns the events left unwritten because the database failed."""
        left = self._store(batch, "ledger batch of %d events failed")
        self._written(batch[:len(batch) - len(left)])
        return left

    def _store(self, rows: list[Queued], failure: str) -> list[Queued]:
        """Writes rows in one transaction; returns those left unwritten (a tail of rows) because the database
        failed, logging `failure`. When it refuses the batch for its data, writes the rows one by one, each in
        its own transaction, and sets aside those it refuses."""
        try:
            self._write([row for _, row in rows])
            return []
        except REFUSED_ROW_ERRORS:
            log.warning("ledger: the database refused a batch of %d events for its data; writing them one by one",
                        len(rows))
        except Exception:
            self.failed_batches += 1
            # the first failure with its traceback; while the database stays down, one line per retry
            log.warning(failure, len(rows), exc_info=not self._down)
            return rows
        for i, queued in enumerate(rows):
            try:
                self._write([queued[1]])
            except REFUSED_ROW_ERRORS as e:
                self._dead_letter(queued[1], e)
            except Exception:
                self.failed_batches += 1
                log.warning(failure, len(rows) - i, exc_info=not self._down)
                return rows[i:]
        return []

    def _dead_letter(self, row: Row, error: IntegrityError | DataError) -> None:
        request_id = row["request_id"]
        if request_id in self._dead_lettered:
            return
        message = str(error.orig).splitlines()  # the first line only: PostgreSQL's DETAIL repeats the row's values
        reason = f"{type(error).__name__}: {message[0] if message else ''}"
        where = "nowhere (no spill dir): dropped"
        if self._spill is not None:
            try:
                where = str(append_dead_letter(self._spill.path, row, reason))
            except OSError as e:
                where = f"nowhere (dropped: {e})"
        self._dead_lettered.add(request_id)
        self.dead_lettered_total += 1
        log.error("ledger: the database refused usage event %s (%s); set aside in %s", request_id, reason, where)

    def _set_aside(self, rows: list[Queued]) -> None:
        """Events that cannot be written now: to disk when a spill dir is set, else back to the queue's front."""
        if self._spill is not None:
            try:
                with self._spill_lock:
                    self._spill.append(rows)
                    self.spilled_total += len(rows)
                self._stored(rows)
                return
            except OSError:
                log.exception("ledger: could not spill %d events to disk; keeping them in memory", len(rows))
        with self._cond:
            self._queue.extendleft(reversed(rows))

    def _replay_spilled(self) -> bool:
        """Writes this process's spilled segments, then dead processes' ones; False when the database fails."""
        if self._spill is None:
            return True
        with self._spill_lock:
            segments = self._spill.seal() if self._spill.has_segments else []
        for segment in segments:
            rows = read_segment(segment)
            if not self._write_all(rows):
                return False
            self._written(rows)
            with self._spill_lock:
                self._spill.remove(segment)
            log.info("ledger: replayed %d spilled events from %s", len(rows), segment.name)
        if self._orphans_pending:
            orphans = self._spill.orphans()
            try:
                for _lock, orphan_segments in orphans:
                    for segment in orphan_segments:
                        rows = read_segment(segment)
                        if not self._write_all(rows):
                            return False
                        segment.unlink()
                        self.replayed_total += len(rows)
                        log.warning("ledger: replayed %d events left by a stopped process (%s)", len(rows),
                                    segment.name)
            finally:
                orphans.close()  # releases the lock of the dead process being replayed
            if not self._replay_journals():
                return False
            self._orphans_pending = False
        return True

    def _replay_journals(self) -> bool:
        """Each dead process's journal (after its spill segments): its recorded events, and an `interrupted`
        event for each request it admitted and never recorded. Writes are idempotent (by request id)."""
        assert self._spill is not None
        journals = orphaned_journals(self._spill.path, exclude=self._journal.owner if self._journal else None)
        try:
            for lock_path, segments in journals:
                rows = [(0, row) for row in events_of(segments)]
                if rows and not self._write_all(rows):
                    return False
                for segment in segments:
                    segment.unlink()
                lock_path.unlink(missing_ok=True)
                interrupted = sum(1 for _, row in rows if row["status"] == "interrupted")
                if rows:
                    self.replayed_total += len(rows)
                    log.warning("ledger: replayed the journal of a stopped process: %d events, %d of them "
                                "interrupted (admitted, never finished)", len(rows), interrupted)
        finally:
            journals.close()
        return True

    def _write_all(self, rows: list[Queued]) -> bool:
        for i in range(0, len(rows), self._max_batch):
            if self._store(rows[i:i + self._max_batch],
                           "ledger: replay of %d spilled events failed (the database is still unreachable?)"):
                return False
        return True

    def _write(self, batch: list[Row]) -> None:
        unique = list({row["request_id"]: {**_OPTIONAL, **row} for row in batch}.values())
        insert = dialect_insert(self._engine, UsageEvent)
        # a request already stored is skipped, except one the sweeper recorded as interrupted while it ran on
        # (its gateway missed heartbeats): the real event replaces that placeholder
        stmt = insert.on_conflict_do_update(
            index_elements=["request_id"], set_={c: insert.excluded[c] for c in _EVENT_COLUMNS if c != "request_id"},
            where=UsageEvent.__table__.c.status == "interrupted",
        ).returning(UsageEvent.request_id)
        # requests admitted from this process's budget leases hold in their lease, not in rows of their own
        settlement = LeaseSettlement() if self.leases is not None else None
        try:
            with write_lock(self._engine), self._engine.begin() as conn:
                crossed = self._write_in(conn, unique, stmt, settlement)
        except BaseException:
            if settlement is not None:
                self.leases.settled(settlement, committed=False)  # type: ignore[union-attr]
            raise
        if settlement is not None:
            self.leases.settled(settlement, committed=True)  # type: ignore[union-attr]
        if crossed:
            self._alert(crossed)

    def _write_in(self, conn: Connection, unique: list[Row], stmt: Any,
                  settlement: LeaseSettlement | None) -> list[SoftBudgetCrossed]:
        inserted = set(conn.execute(stmt, unique).scalars())
        new_rows = [row for row in unique if row["request_id"] in inserted]
        changes = CounterChanges()
        # after the insert: a budget created meanwhile counted these events already (scoped_budgets.py)
        scoped = matching(conn, new_rows)
        for row, budgets in zip(new_rows, scoped):
            ts = row["created_at"].timestamp()
            period, cost = month_of(ts), dollars(row["cost_usd"])
            if row["api_key_id"] is not None:
                changes.spent[("key", row["api_key_id"], period)] += cost
                tokens = row["prompt_tokens"] + row["completion_tokens"]
                changes.tokens[(row["api_key_id"], minute_of(ts))] += tokens
            if row["tenant_id"] is not None:
                changes.spent[("tenant", row["tenant_id"], period)] += cost
            for scope, budget_id in budgets:
                changes.spent[(scope, budget_id, period)] += cost
        request_ids = [row["request_id"] for row in unique]
        closing: list[str] = []
        if settlement is not None:
            self.leases.settle_in(conn, self._engine, request_ids, changes, settlement)  # type: ignore[union-attr]
            closing = settlement.closing_ids
        settle_in(conn, self._engine, request_ids + closing, changes)
        crossed = claim_crossings(conn, self._engine, set(changes.spent)) if changes.spent else []
        self.inserted_total += len(new_rows)
        return crossed

    def _alert(self, crossed: list[SoftBudgetCrossed]) -> None:
        for c in crossed:
            log.warning("soft budget reached: %s %s spent %s of %s this month (alert at %g)", c.scope, c.name,
                        usd(c.spent_usd), usd(c.budget_usd), c.alert_at)
        if self._on_alert is not None:
            try:
                self._on_alert(crossed)
            except Exception:  # the alerts are claimed: a failing callback must not fail the batch
                log.exception("ledger: the budget alert callback failed")

    def _cleanup(self) -> None:
        try:
            with self._engine.begin() as conn:
                conn.execute(delete(RateWindow).where(RateWindow.minute < minute_of(time.time()) - 10))
        except Exception:
            log.exception("rate window cleanup failed")
