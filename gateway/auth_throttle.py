"""Slows down clients that keep presenting bad keys: after `limit` failed authentications from one
client address within `window_s`, that address's further failures are answered 429 with Retry-After
(until its oldest failure in the window ages out) instead of 401. Only refused keys count (401, and
the admin API's 403 for a key that is no admin key): the 503 an unknown key gets while the key
database is unreachable says nothing about the key, so it is neither counted nor turned into a 429.

Only failures are throttled: a valid key always passes, even from a throttled address, because behind
a proxy or NAT many tenants share one address and one misconfigured client must not lock out the
rest. Keys are 256-bit random, so the throttle is about load and noise, not guessability. The counts
live in memory, per gateway process (each replica throttles on its own)."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from starlette.requests import Request

from gateway.errors import APIError

REFUSED_KEY_STATUSES = frozenset({401, 403})


def client_address(request: Request) -> str:
    """The TCP peer: behind a proxy, every client the proxy forwards shares its address."""
    return request.client.host if request.client else "unknown"


class FailedAuthThrottle:
    def __init__(self, limit: int = 20, window_s: float = 60.0, max_clients: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 1 or window_s <= 0:
            raise ValueError(f"auth throttle: limit must be >= 1 and window_s > 0, got {limit}, {window_s}")
        self.limit = limit
        self.window_s = window_s
        self._max_clients = max_clients
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()  # least recently failing first
        self._lock = threading.Lock()

    def failed(self, client: str) -> int | None:
        """Count one failed authentication; the Retry-After seconds when `client` is over the limit."""
        now = self._clock()
        with self._lock:
            times = self._failures.pop(client, None) or deque(maxlen=self.limit)
            self._expire(times, now)
            over = len(times) >= self.limit
            times.append(now)  # only the last `limit` failures are kept: they decide when it may retry
            self._failures[client] = times
            while len(self._failures) > self._max_clients:
                self._failures.popitem(last=False)
            if not over:
                return None
            return max(1, math.ceil(times[0] + self.window_s - now))

    def throttled(self, err: APIError, client: str) -> APIError:
        """`err` (a refused key) as it goes back to `client`: a 429 once the client is over the limit. Any other
        error goes back as it is, uncounted."""
        if err.status not in REFUSED_KEY_STATUSES:
            return err
        retry_after = self.failed(client)
        if retry_after is None:
            return err
        return APIError(429, f"Too many requests with invalid keys from this address; try again in {retry_after}s.",
                        "requests", "too_many_failed_authentications", None, {"Retry-After": str(retry_after)})

    def _expire(self, times: deque[float], now: float) -> None:
        while times and times[0] <= now - self.window_s:
            times.popleft()
