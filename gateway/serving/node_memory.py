"""The memory of the model replicas on one node, for waking sleepers (issue 36): a named Ray actor per node keeps a
record of each replica there (its device: a GPU or the host; what it needs awake: weights and KV pool; what it holds
now; its sleep level; when it last served), and a replica about to wake asks it for room first.

A wake fits when the waking replica's weights and KV pool fit in what its device has free: on a GPU what
torch.cuda.mem_get_info says (measured by the waking engine's core), less what other wakes on that GPU have been
promised and not yet taken; on a node without a GPU, TOLLGATE_NODE_MEMORY_BUDGET_GIB less what the other replicas hold
(awake: weights and KV pool; asleep at level 1: the weights' host copy; at level 2: nothing). While it does not fit,
the least recently used sleeper at level 1 on the same device that still holds memory there is pushed down to level
2 (its weights dropped, loaded again from the node's copy when it wakes), and the wake asks again. Awake replicas are
never pushed. When nothing is left to push the wake is refused, naming the shortfall: the gateway answers 503 with
Retry-After.

The record is kept current by the replicas themselves: each reports at once when it sleeps, wakes or is pushed
down, and with its engine stats every few seconds (gateway/serving/engine_stats_board.py's poster); a record not
refreshed for STALE_AFTER_S (a replica gone without closing) no longer counts."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import ray

log = logging.getLogger("tollgate.serve")

LEDGER_NAMESPACE = "tollgate"
STALE_AFTER_S = 30.0
PROMISE_S = 120.0  # a wake or a push-down in progress holds its mark at most this long (its replica may be gone)
CALL_TIMEOUT_S = 10.0  # each call to the ledger; past it the wake goes ahead without it (never a hang)
PUSH_TIMEOUT_S = 60.0  # a push-down: the sleeper drops its host copy (level 1 -> 2), quick unless it is busy
CPU = "cpu"
GIB = 2**30


@dataclass(frozen=True)
class ReplicaMemory:
    """One replica's line in its node's record. `held_bytes` counts the memory its device's bound is about (GPU memory
    on a GPU; host memory on a CPU node); `host_bytes` is shown, not bounded (a GPU replica's pinned host copy)."""

    model: str
    replica: str
    device: str  # "gpu:<id>" (Ray's GPU id: replicas with a fraction of one GPU share it) or "cpu"
    awake_bytes: int  # weights + KV pool
    held_bytes: int
    level: int  # 0 awake, else its sleep level
    last_used: float  # wall-clock time its last request ended (or it started)
    host_bytes: int = 0
    push_downs: int = 0  # times it was pushed from level 1 to level 2 to make room

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def replica_memory(model: str, replica: str, device: str, stats: dict[str, Any], last_used: float,
                   push_downs: int = 0) -> ReplicaMemory:
    """A replica's record from its engine's stats (engine/sleep.py's EngineSleep.memory)."""
    level = int(stats.get("sleep_level", 0))
    awake = int(stats.get("weights_bytes", 0)) + int(stats.get("kv_cache_bytes", 0))
    host = int(stats.get("host_copy_bytes", 0))
    if device == CPU:  # the host is the device: the live weights and KV pool while awake, the host copy asleep
        held = (awake if level == 0 else 0) + host
    else:
        held = int(stats.get("device_reserved_bytes", awake if level == 0 else 0))
    return ReplicaMemory(model, replica, device, awake, held, level, last_used, host, push_downs)


def _gib(n: int, up: bool) -> str:
    """Bytes in GiB to three decimals, rounded up (what is needed) or down (what is left), so a shortfall never
    reads as room."""
    thousandths = n * 1000 / GIB
    return f"{(math.ceil(thousandths) if up else math.floor(thousandths)) / 1000:.3f}"


def choose_push_down(records: list[ReplicaMemory], waker: str, device: str,
                     skip: set[str] | frozenset[str] = frozenset()) -> ReplicaMemory | None:
    """The sleeper to push down for `waker`'s wake: the least recently used at level 1 on the same device that holds
    memory there; never an awake one, never one at level 2 (nothing left to drop), never one in `skip`."""
    candidates = [r for r in records if r.device == device and r.replica != waker and r.level == 1
                  and r.held_bytes > 0 and r.replica not in skip]
    return min(candidates, key=lambda r: (r.last_used, r.replica), default=None)


@dataclass(frozen=True)
class Admission:
    fits: bool
    victim: ReplicaMemory | None = None  # fits False: the sleeper to push down first; None: nothing left
    message: str = ""


class NoRoomToWake(RuntimeError):
    """A wake that does not fit and has no sleeper left to push down."""


class NodeMemory:
    """The record itself (a Ray actor per node, NodeMemoryActor; a plain object in unit tests)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._records: dict[str, tuple[float, ReplicaMemory]] = {}
        self._waking: dict[str, float] = {}  # replica -> until when its wake is promised its awake bytes
        self._pushing: dict[str, float] = {}  # replica -> until when it is being pushed (no other wake picks it)

    def report(self, record: ReplicaMemory) -> None:
        self._records[record.replica] = (self._clock(), record)

    def drop(self, replica: str) -> None:
        self._records.pop(replica, None)
        self._waking.pop(replica, None)
        self._pushing.pop(replica, None)

    def records(self) -> list[ReplicaMemory]:
        """The fresh records (the stale ones are forgotten)."""
        now = self._clock()
        for replica in [r for r, (at, _) in self._records.items() if now - at > STALE_AFTER_S]:
            self.drop(replica)
        for marks in (self._waking, self._pushing):
            for replica in [r for r, until in marks.items() if until < now]:
                del marks[replica]
        return [record for _, record in self._records.values()]

    def admit(self, waker: ReplicaMemory, budget_bytes: int | None, free_bytes: int | None,
              skip: list[str] | tuple[str, ...] = ()) -> Admission:
        """One step of making room for `waker`'s wake. Fits: the waker is promised its awake bytes until
        done_waking. Else the sleeper to push down, marked so that no other wake picks it, until done_pushing; or
        none, with the shortfall."""
        self.report(waker)
        records = self.records()
        on_device = [r for r in records if r.device == waker.device and r.replica != waker.replica]
        promised = [r for r in on_device if r.replica in self._waking]
        if free_bytes is not None:  # a GPU: what it has free now, less the other wakes promised and not yet taken
            need = max(0, waker.awake_bytes - waker.held_bytes)
            room = free_bytes - sum(max(0, r.awake_bytes - r.held_bytes) for r in promised)
            where = f"free on {waker.device}"
        elif budget_bytes is not None:  # the node's budget, less what the others hold (or were promised)
            need = waker.awake_bytes
            room = budget_bytes - sum(r.awake_bytes if r.replica in self._waking else r.held_bytes for r in on_device)
            where = f"left of this node's memory budget ({budget_bytes / GIB:.2f} GiB)"
        else:
            need, room, where = 0, 0, ""
        if need <= room:
            self._waking[waker.replica] = self._clock() + PROMISE_S
            return Admission(True)
        passed_over = set(skip) | set(self._pushing) | set(self._waking)
        victim = choose_push_down(on_device, waker.replica, waker.device, passed_over)
        pushable = sum(r.held_bytes for r in on_device if r.level == 1 and r.replica not in passed_over)
        if victim is not None and need <= room + pushable:
            self._pushing[victim.replica] = self._clock() + PROMISE_S
            return Admission(False, victim)
        awake = sorted(r.model for r in on_device if r.level == 0)
        short = (f"pushing every sleeping model down would free only {_gib(pushable, up=False)} GiB" if victim else
                 "with no sleeping model left to push down")
        return Admission(False, None, f"it needs {_gib(need, up=True)} GiB and {_gib(max(0, room), up=False)} GiB "
                                      f"is {where}, {short}" + (f" (awake: {', '.join(awake)})" if awake else ""))

    def done_waking(self, replica: str) -> None:
        self._waking.pop(replica, None)

    def done_pushing(self, replica: str, gone: bool = False) -> None:
        self._pushing.pop(replica, None)
        if gone:
            self.drop(replica)


NodeMemoryActor = ray.remote(num_cpus=0)(NodeMemory)


def node_ledger(node_id: str | None = None) -> Any:
    """This node's record (a detached actor on the node, started by the first replica that asks)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = node_id or ray.get_runtime_context().get_node_id()
    return NodeMemoryActor.options(name=f"tollgate-node-memory-{node_id}", namespace=LEDGER_NAMESPACE, lifetime="detached",
                         get_if_exists=True,
                         scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()


Call = Callable[..., Awaitable[Any]]  # (method name, *args) -> the ledger's answer
Push = Callable[[ReplicaMemory], Awaitable[bool | None]]  # True pushed, False refused (it is busy), None gone


async def make_room(call: Call, me: ReplicaMemory, *, budget_bytes: int | None,
                    measure_free: Callable[[], Awaitable[int]] | None, push: Push,
                    max_pushes: int = 64) -> list[ReplicaMemory]:
    """Pushes sleepers down until `me`'s wake fits; the ones pushed, least recently used first. NoRoomToWake when
    nothing is left to push. The caller calls done_waking after its wake, whichever way it went."""
    pushed: list[ReplicaMemory] = []
    skip: list[str] = []
    for _ in range(max_pushes):
        free = await measure_free() if measure_free is not None else None
        verdict: Admission = await call("admit", me, budget_bytes, free, skip)
        if verdict.fits:
            return pushed
        victim = verdict.victim
        if victim is None:
            raise NoRoomToWake(verdict.message)
        outcome: bool | None = False
        try:
            outcome = await push(victim)
        finally:
            await call("done_pushing", victim.replica, outcome is None)
        if outcome:
            pushed.append(victim)
        else:  # busy now (a request came), or gone: not asked again by this wake
            skip.append(victim.replica)
    raise NoRoomToWake(f"still no room after pushing {max_pushes} sleepers down")


class ReplicaMemoryClient:
    """A ModelServer's side: its record reported to its node's ledger, and room made before its wakes."""

    def __init__(self, model: str, replica: str, device: str, budget_gib: float | None) -> None:
        self.model, self.replica, self.device = model, replica, device
        self.budget_bytes = int(budget_gib * GIB) if budget_gib is not None else None
        self.push_downs = 0
        try:
            self._ledger: Any = node_ledger()
        except Exception as e:  # noqa: BLE001 - without the record a replica still serves; its wakes make no room
            log.warning("replica %s of %s: no node memory record (%s); wakes will not push sleepers down", replica,
                        model, e)
            self._ledger = None

    @property
    def bounded(self) -> bool:
        """Whether its wakes check for room: on a GPU always, on the host only under a configured budget."""
        return self._ledger is not None and (self.device != CPU or self.budget_bytes is not None)

    def record(self, stats: dict[str, Any], last_used: float) -> ReplicaMemory:
        return replica_memory(self.model, self.replica, self.device, stats, last_used, self.push_downs)

    def report(self, stats: dict[str, Any], last_used: float) -> None:
        """Fire and forget (the stats poster's thread, and each change of level)."""
        if self._ledger is not None:
            try:
                self._ledger.report.remote(self.record(stats, last_used))
            except Exception as e:  # noqa: BLE001 - the record is gone (the platform stopping)
                log.debug("node memory report failed: %s", e)

    async def report_now(self, stats: dict[str, Any], last_used: float) -> None:
        """Reported and acknowledged: a push-down's new level is in the record before the waker asks again."""
        if self._ledger is not None:
            await self._call("report", self.record(stats, last_used))

    async def _call(self, method: str, *args: Any) -> Any:
        return await asyncio.wait_for(getattr(self._ledger, method).remote(*args), CALL_TIMEOUT_S)

    async def make_room(self, stats: dict[str, Any], last_used: float,
                        measure_free: Callable[[], Awaitable[int]] | None) -> list[ReplicaMemory]:
        """Room for this replica's wake (make_room above); the sleepers it pushed down. NoRoomToWake is raised;
        a ledger that does not answer lets the wake go ahead (logged)."""
        if not self.bounded:
            return []
        try:
            return await make_room(self._call, self.record(stats, last_used), budget_bytes=self.budget_bytes,
                                   measure_free=measure_free if self.device != CPU else None, push=self._push)
        except NoRoomToWake:
            raise
        except Exception as e:  # noqa: BLE001 - the ledger is unreachable: the wake is not held up by it
            log.warning("replica %s of %s: waking without room checked (%s: %s)", self.replica, self.model,
                        type(e).__name__, e)
            return []

    async def done_waking(self) -> None:
        if self._ledger is not None:
            try:
                await self._call("done_waking", self.replica)
            except Exception as e:  # noqa: BLE001 - its promise runs out by itself (PROMISE_S)
                log.debug("node memory done_waking failed: %s", e)

    async def _push(self, victim: ReplicaMemory) -> bool | None:
        """Asks the victim's replica to go down to level 2: a broadcast to its model's replicas, which only it
        answers (True / False); None when none of them is it (gone)."""
        from ray import serve
        from ray.serve.exceptions import DeploymentUnavailableError

        from gateway.serving.names import model_app_name

        try:
            handle = serve.get_app_handle(model_app_name(victim.model))
            answers = await handle.broadcast("push_down", victim.replica, self.model).results_async(
                timeout_s=PUSH_TIMEOUT_S, return_exceptions=True)
        except TimeoutError:
            return False
        except DeploymentUnavailableError:  # its model is at zero replicas
            return None
        except Exception as e:  # noqa: BLE001 - its model is gone (deleted), or Serve could not reach it
            log.warning("push-down of replica %s of %s: %s: %s", victim.replica, victim.model, type(e).__name__, e)
            return None
        mine = [a for a in answers if isinstance(a, bool)]
        return mine[0] if mine else None

    def close(self) -> None:
        if self._ledger is not None:
            try:
                self._ledger.drop.remote(self.replica)
            except Exception:  # noqa: BLE001
                pass
