"""Group commit of admission's writes on SQLite. SQLite lets one connection write at a time, and a connection that
finds the file locked sleeps in growing steps before it tries again: a burst of requests, each reserving in its own
transaction from its own thread, queues behind those sleeps (256 at once took a second on the 2-core box, p99 0.8 s
for one reservation). One thread here takes every reservation and shrink that has arrived, runs them in order in one
transaction (each reservation still checks its limits with the ones before it in the batch counted) and commits once.

If the batch's transaction fails on the database (down, or locked past the busy timeout), every caller in it gets
that error at once, as each would have alone (the limiter then fails open); if it fails on one operation (a
constraint), each operation is run again alone in a transaction of its own, so each caller gets its own outcome.
PostgreSQL locks rows, not the file, so concurrent admissions there run side by side and do not use this."""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from decimal import Decimal

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from billing.db import write_lock
from billing.reservations import Admitted, Budgets, Refusal, Worst, reserve, reserve_in, shrink, shrink_in

log = logging.getLogger("tollgate.admission")

MAX_BATCH = 512


@dataclass
class _Reserve:
    request_id: str
    owner: str
    budgets: Budgets
    worst: Worst
    model: str
    endpoint: str
    now: float
    requests: int = 1
    done: Future = field(default_factory=Future)


@dataclass
class _Shrink:
    request_id: str
    cost_usd: Decimal
    tokens: int
    done: Future = field(default_factory=Future)


class AdmissionWriter:
    def __init__(self, db: Engine, max_batch: int = MAX_BATCH) -> None:
        self.db, self.max_batch = db, max_batch
        self._queue: queue.SimpleQueue[_Reserve | _Shrink | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.batches = 0  # transactions committed (tests and benchmarks read it)

    @staticmethod
    def wanted(db: Engine) -> bool:
        return db.dialect.name == "sqlite"

    def reserve(self, request_id: str, owner: str, budgets: Budgets, worst: Worst, *, model: str, endpoint: str,
                now: float, requests: int = 1) -> Future:
        """A future of `reservations.reserve()`'s result (Admitted or Refusal), or of its error."""
        return self._submit(_Reserve(request_id, owner, budgets, worst, model, endpoint, now, requests))

    def shrink(self, request_id: str, cost_usd: Decimal, tokens: int) -> Future:
        """A future of `reservations.shrink()`'s result, or of its error."""
        return self._submit(_Shrink(request_id, cost_usd, tokens))

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(10)

    def _submit(self, op: _Reserve | _Shrink) -> Future:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="tollgate-admission", daemon=True)
                    self._thread.start()
        self._queue.put(op)
        return op.done

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            batch = [op]
            while len(batch) < self.max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._write(batch)
                    return
                batch.append(more)
            self._write(batch)

    def _write(self, batch: list[_Reserve | _Shrink]) -> None:
        reserves = [op for op in batch if isinstance(op, _Reserve)]
        shrinks = [op for op in batch if isinstance(op, _Shrink)]
        try:
            with write_lock(self.db), self.db.begin() as conn:
                outcomes: list[Admitted | Refusal] = [
                    reserve_in(conn, self.db, op.request_id, op.owner, op.budgets, op.worst, model=op.model,
                               endpoint=op.endpoint, now=op.now, requests=op.requests) for op in reserves]
                held = shrink_in(conn, self.db, {op.request_id: (op.cost_usd, op.tokens) for op in shrinks})
        except OperationalError as e:  # the database is unreachable or stays locked: every caller hears it now
            for op in batch:
                op.done.set_exception(e)
            return
        except Exception as e:  # noqa: BLE001 - each operation gets its own outcome below
            log.debug("admission batch of %d failed (%s): each runs alone", len(batch), type(e).__name__)
            for op in batch:
                self._write_alone(op)
            return
        self.batches += 1
        for op, outcome in zip(reserves, outcomes):
            op.done.set_result(outcome)
        for op in shrinks:
            op.done.set_result(op.request_id in held)

    def _write_alone(self, op: _Reserve | _Shrink) -> None:
        try:
            with write_lock(self.db):
                result = self._run_alone(op)
        except BaseException as e:  # noqa: BLE001 - the caller raises it
            op.done.set_exception(e)
        else:
            op.done.set_result(result)

    def _run_alone(self, op: _Reserve | _Shrink) -> Admitted | Refusal | bool:
        if isinstance(op, _Reserve):
            return reserve(self.db, op.request_id, op.owner, op.budgets, op.worst, model=op.model,
                           endpoint=op.endpoint, now=op.now, requests=op.requests)
        return shrink(self.db, op.request_id, op.cost_usd, op.tokens)
