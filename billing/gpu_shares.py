"""GPU time per tenant. A replica's life is tiled by ReplicaInterval rows (busy + idle = the row's span,
in whole microseconds); each row is split among tenants into GpuShare rows that add up to it exactly:

- busy time: each engine step's wall time is split among the requests in the step by their tokens in it
  (prefill and decode tokens alike: each passes every weight matrix once), summed per tenant by the engine
  (EngineMetrics.busy_seconds_by_account) and apportioned here to the row's busy microseconds;
- idle time: spread over the tenants that used the replica within the same row, in proportion to their
  busy time (they kept it warm); a row without any work has its idle time on no tenant (tenant_uid
  NULL), the model owner's cost, shown as "(idle, no tenant)" in reports.

Whole microseconds are apportioned by largest remainder (ties to the smaller key), so shares add up to
their row exactly."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def apportion(total: int, weights: Mapping[K, float]) -> dict[K, int]:
    """`total` whole units split in proportion to `weights` (those > 0), adding up to `total` exactly."""
    positive = {k: float(w) for k, w in weights.items() if w > 0}
    if total <= 0 or not positive:
        return {}
    weight_sum = sum(positive.values())
    exact = {k: total * w / weight_sum for k, w in positive.items()}
    out = {k: int(v) for k, v in exact.items()}
    left = total - sum(out.values())
    by_remainder = sorted(positive, key=lambda k: (-(exact[k] - out[k]), str(k)))
    for k in by_remainder[:left]:
        out[k] += 1
    return {k: v for k, v in out.items() if v}


def split_interval(busy_us: int, idle_us: int, busy_by_tenant: Mapping[str | None, float]
                   ) -> dict[str | None, tuple[int, int]]:
    """(busy, idle) microseconds per tenant for one interval; None is time on no tenant."""
    busy = apportion(busy_us, busy_by_tenant)
    if busy_us and not busy:
        busy = {None: busy_us}
    idle = apportion(idle_us, busy) if busy else ({None: idle_us} if idle_us else {})
    return {t: (busy.get(t, 0), idle.get(t, 0)) for t in sorted(set(busy) | set(idle), key=lambda t: (t is None, t or ""))}
