"""Warnings about an unreachable dependency, logged at most once a minute per message: during an
outage every request would otherwise log the same line."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("tollgate.outage")

_EVERY_S = 60.0
_last: dict[str, float] = {}
_lock = threading.Lock()


def warn_once(message: str) -> None:
    now = time.monotonic()
    with _lock:
        if now - _last.get(message, -_EVERY_S) < _EVERY_S:
            return
        _last[message] = now
    log.warning(message)
