"""Alive and busy time of one model replica, written as ReplicaInterval rows: one row per flush
covering [previous flush, now], so the rows of a replica tile its life without gaps or overlap.
busy_s is the engine's busy-time delta over the row; idle_s is the rest of the row's span."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

from sqlalchemy import Engine, insert

from billing.models import ReplicaInterval

log = logging.getLogger("tollgate.replica_intervals")


class IntervalRecorder:
    def __init__(self, db: Engine, model: str, replica: str, busy_seconds: Callable[[], float], *,
                 flush_every_s: float = 60.0, started_at: float | None = None) -> None:
        self._db = db
        self._model = model
        self._replica = replica
        self._busy_seconds = busy_seconds
        self._flush_every_s = flush_every_s
        self._lock = threading.Lock()
        self._last_t = time.time() if started_at is None else started_at
        self._last_busy = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rows_written = 0

    def start(self) -> "IntervalRecorder":
        self._thread = threading.Thread(target=self._run, name="tollgate-intervals", daemon=True)
        self._thread.start()
        return self

    def flush(self) -> None:
        with self._lock:
            now = time.time()
            busy_total = self._busy_seconds()
            span = max(0.0, now - self._last_t)
            busy = min(span, max(0.0, busy_total - self._last_busy))
            row = {"model": self._model, "replica": self._replica,
                   "start": datetime.fromtimestamp(self._last_t, timezone.utc),
                   "end": datetime.fromtimestamp(now, timezone.utc), "busy_s": busy, "idle_s": span - busy}
            try:
                with self._db.begin() as conn:
                    conn.execute(insert(ReplicaInterval), [row])
            except Exception:  # the span stays open and goes into the next row
                log.exception("could not write the replica interval of %s", self._model)
                return
            # busy time beyond the row's span (sampled a moment apart) carries into the next row
            self._last_t, self._last_busy = now, self._last_busy + busy
            self.rows_written += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self._flush_every_s):
            self.flush()
