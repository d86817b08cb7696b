"""Alive and busy time of one model replica, written as ReplicaInterval rows with their GpuShare rows (per
tenant, billing/gpu_shares.py): one row per flush covering [previous flush, now] in whole microseconds, so
the rows of a replica tile its life without gaps or overlap. busy_s is the engine's busy-time delta over
the row (at most its span); asleep_s its asleep-time delta (engine/sleep.py: its GPU memory given back, billed
to no one), at most what busy time leaves; idle_s is the rest of the span."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from decimal import Decimal

from sqlalchemy import Engine, insert, select

from billing.gpu_shares import split_interval
from billing.models import GpuShare, ModelDeployment, ReplicaInterval

log = logging.getLogger("tollgate.replica_intervals")

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
# the engine's busy seconds in all, and per account (tenant uid; None: no tenant), since it started
BusyTotals = tuple[float, Mapping[str | None, float]]


def _micros(t: float) -> int:
    return round(t * 1_000_000)


def _seconds(us: int) -> Decimal:
    return Decimal(us).scaleb(-6)


def _at(us: int) -> datetime:
    return EPOCH + timedelta(microseconds=us)


class IntervalRecorder:
    def __init__(self, db: Engine, model: str, replica: str, busy: Callable[[], BusyTotals], *,
                 flush_every_s: float = 60.0, started_at: float | None = None,
                 asleep: Callable[[], float] | None = None) -> None:
        """`asleep`: the engine's asleep seconds since it started (none: it never sleeps)."""
        self._db = db
        self._model = model
        self._replica = replica
        self._busy = busy
        self._asleep = asleep
        self._last_asleep_us = 0
        self._flush_every_s = flush_every_s
        self._lock = threading.Lock()
        self._last_us = _micros(time.time() if started_at is None else started_at)
        self._last_busy_us = 0
        self._attributed: dict[str | None, float] = {}  # busy seconds written to each account's shares so far
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rows_written = 0

    def start(self) -> "IntervalRecorder":
        self._thread = threading.Thread(target=self._run, name="tollgate-intervals", daemon=True)
        self._thread.start()
        return self

    def flush(self) -> None:
        with self._lock:
            now_us = _micros(time.time())
            busy_total, by_account = self._busy()
            span = max(0, now_us - self._last_us)
            # busy time beyond the row's span (sampled a moment apart) carries into the next row
            busy = min(span, max(0, _micros(busy_total) - self._last_busy_us))
            asleep_total = _micros(self._asleep()) if self._asleep is not None else 0
            asleep = min(span - busy, max(0, asleep_total - self._last_asleep_us))
            idle = span - busy - asleep
            # a row's busy time goes to the accounts whose busy time has not been written yet, so what a full row
            # carries into the next goes to whoever ran it there too
            owed = {a: o for a, v in by_account.items() if (o := v - self._attributed.get(a, 0.0)) > 5e-7}
            shares = split_interval(busy, idle, owed)
            row = {"model": self._model, "replica": self._replica, "start": _at(self._last_us),
                   "end": _at(self._last_us + span), "busy_s": _seconds(busy), "idle_s": _seconds(idle),
                   "asleep_s": _seconds(asleep)}
            try:
                with self._db.begin() as conn:
                    # priced at the model's gpu_hour now, kept with the row (billing/charged_prices.py)
                    gpu_hour = select(ModelDeployment.gpu_hour).where(ModelDeployment.name == self._model)
                    interval_id = conn.execute(insert(ReplicaInterval).values(**row, gpu_hour=gpu_hour.scalar_subquery())
                                               .returning(ReplicaInterval.id)).scalar_one()
                    if shares:
                        conn.execute(insert(GpuShare), [
                            {"interval_id": interval_id, "tenant_uid": tenant, "busy_s": _seconds(b),
                             "idle_s": _seconds(i)} for tenant, (b, i) in shares.items()])
            except Exception:  # the span stays open and goes into the next row
                log.exception("could not write the replica interval of %s", self._model)
                return
            self._last_us += span
            self._last_busy_us += busy
            self._last_asleep_us += asleep
            for account, (account_busy, _) in shares.items():
                self._attributed[account] = self._attributed.get(account, 0.0) + account_busy / 1_000_000
            self.rows_written += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self._flush_every_s):
            self.flush()
