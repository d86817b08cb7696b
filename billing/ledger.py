"""The usage ledger: events are queued by the request path and written by one background thread in
batches. Each batch is one transaction that inserts the events (skipping request ids already
stored) and adds their cost and tokens to the counters budgets and tpm limits read."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Any

from sqlalchemy import Engine, delete

from billing.db import dialect_insert
from billing.models import RateWindow, SpendCounter, UsageEvent, utcnow
from billing.periods import minute_of, month_of

log = logging.getLogger("tollgate.ledger")

_EVENT_COLUMNS = [c.name for c in UsageEvent.__table__.columns if c.name != "id"]


class Ledger:
    def __init__(self, engine: Engine, *, max_batch: int = 1000, linger_s: float = 0.05, retry_delay_s: float = 0.5,
                 cleanup_every_s: float = 60.0) -> None:
        self._engine = engine
        self._max_batch = max_batch
        # how long the writer waits for more events before writing a batch; flush() and close() cut it short
        self._linger_s = linger_s
        self._flush_wanted = 0
        self._retry_delay_s = retry_delay_s
        self._cleanup_every_s = cleanup_every_s
        self._cond = threading.Condition()
        self._queue: list[dict[str, Any]] = []
        self._recorded = 0
        self._written = 0  # events handed to the database (inserted or already present)
        self._stopping = False
        self._thread: threading.Thread | None = None
        # what is queued but not yet in the counters, so that limits see it without lag
        self._pending_spend: dict[tuple[str, int], float] = defaultdict(float)
        self._pending_tokens: dict[int, int] = defaultdict(int)
        self.inserted_total = 0
        self.failed_batches = 0

    def start(self) -> "Ledger":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tollgate-ledger", daemon=True)
            self._thread.start()
        return self

    def record(self, event: UsageEvent) -> None:
        row = {c: getattr(event, c) for c in _EVENT_COLUMNS}
        if row["created_at"] is None:
            row["created_at"] = utcnow()
        for column, default in (("tags", []), ("prompt_tokens", 0), ("completion_tokens", 0), ("cached_tokens", 0),
                                ("cache_hit", False), ("latency_s", 0.0), ("cost_usd", 0.0)):
            if row[column] is None:
                row[column] = default
        with self._cond:
            if self._stopping:
                raise RuntimeError("ledger is closed")
            self._queue.append(row)
            self._recorded += 1
            self._add_pending(row, +1)
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event recorded before this call is written; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._recorded
            self._flush_wanted = max(self._flush_wanted, target)
            self._cond.notify_all()
            while self._written < target:
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError("ledger writer is not running")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = 30.0) -> None:
        if self._thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("ledger writer did not finish within %ss; %d events unwritten",
                      timeout, self._recorded - self._written)
        self._thread = None

    def pending_spend(self, scope: str, scope_id: int) -> float:
        return self._pending_spend.get((scope, scope_id), 0.0)

    def pending_tokens(self, api_key_id: int) -> int:
        return self._pending_tokens.get(api_key_id, 0)

    @property
    def backlog(self) -> int:
        return self._recorded - self._written

    def _add_pending(self, row: dict[str, Any], sign: int) -> None:
        cost = sign * float(row["cost_usd"])
        tokens = sign * (int(row["prompt_tokens"]) + int(row["completion_tokens"]))
        if row["api_key_id"] is not None:
            self._pending_spend[("key", row["api_key_id"])] += cost
            self._pending_tokens[row["api_key_id"]] += tokens
        if row["tenant_id"] is not None:
            self._pending_spend[("tenant", row["tenant_id"])] += cost

    def _run(self) -> None:
        last_cleanup = time.monotonic()
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue and self._stopping:
                    return
                linger_until = time.monotonic() + self._linger_s
                while (not self._stopping and len(self._queue) < self._max_batch
                       and self._flush_wanted <= self._written and time.monotonic() < linger_until):
                    self._cond.wait(linger_until - time.monotonic())
                batch = self._queue[: self._max_batch]
            try:
                self._write(batch)
            except Exception:
                self.failed_batches += 1
                log.exception("ledger batch of %d events failed; retrying", len(batch))
                time.sleep(self._retry_delay_s)
                continue
            with self._cond:
                del self._queue[: len(batch)]
                for row in batch:
                    self._add_pending(row, -1)
                self._written += len(batch)
                self._cond.notify_all()
            if time.monotonic() - last_cleanup > self._cleanup_every_s:
                last_cleanup = time.monotonic()
                self._cleanup()

    def _write(self, batch: list[dict[str, Any]]) -> None:
        unique = list({row["request_id"]: row for row in batch}.values())
        insert = dialect_insert(self._engine, UsageEvent)
        stmt = insert.on_conflict_do_nothing(index_elements=["request_id"]).returning(UsageEvent.request_id)
        with self._engine.begin() as conn:
            inserted = set(conn.execute(stmt, unique).scalars())
            new_rows = [row for row in unique if row["request_id"] in inserted]
            spend: dict[tuple[str, int, str], float] = defaultdict(float)
            tokens: dict[tuple[int, int], int] = defaultdict(int)
            for row in new_rows:
                ts = row["created_at"].timestamp()
                period = month_of(ts)
                if row["api_key_id"] is not None:
                    spend[("key", row["api_key_id"], period)] += float(row["cost_usd"])
                    tokens[(row["api_key_id"], minute_of(ts))] += row["prompt_tokens"] + row["completion_tokens"]
                if row["tenant_id"] is not None:
                    spend[("tenant", row["tenant_id"], period)] += float(row["cost_usd"])
            if spend:
                up = dialect_insert(self._engine, SpendCounter)
                up = up.on_conflict_do_update(
                    index_elements=["scope", "scope_id", "period"],
                    set_={"spent_usd": SpendCounter.spent_usd + up.excluded.spent_usd},
                )
                conn.execute(up, [{"scope": s, "scope_id": i, "period": p, "spent_usd": v}
                                  for (s, i, p), v in sorted(spend.items())])
            if tokens:
                up = dialect_insert(self._engine, RateWindow)
                up = up.on_conflict_do_update(
                    index_elements=["api_key_id", "minute"],
                    set_={"tokens": RateWindow.tokens + up.excluded.tokens},
                )
                conn.execute(up, [{"api_key_id": k, "minute": m, "requests": 0, "tokens": v}
                                  for (k, m), v in sorted(tokens.items())])
        self.inserted_total += len(new_rows)

    def _cleanup(self) -> None:
        try:
            with self._engine.begin() as conn:
                conn.execute(delete(RateWindow).where(RateWindow.minute < minute_of(time.time()) - 10))
        except Exception:
            log.exception("rate window cleanup failed")
