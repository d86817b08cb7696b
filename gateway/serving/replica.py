"""A model's replica on Ray Serve: loads the model once, streams GenerationChunks, records its
alive / busy / asleep intervals. Requests it refuses come back as ReplicaError items (gateway/serving/ray_backend.py).

With autoscaling.sleep_after_s, a replica idle that long puts its engine to sleep (level 1: the weights to host
memory, the GPU memory given back to the models sharing the GPU); the next request wakes it before the replica
accepts it, and the wake time goes back in ReplicaAccepted (the x-tollgate-cold-start header). Ray Serve still
ends an idle replica after downscale_delay_s (scale to zero).

Before a wake the replica asks its node's memory record (gateway/serving/node_memory.py) for room: while its weights
and KV pool do not fit (its GPU's free memory, or the node's memory budget on a CPU node), the least recently used
level-1 sleeper on the same device is pushed down to level 2 (push_down, reached through a broadcast to its model's
replicas); with nothing left to push, the request gets a 503 naming the shortfall."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from billing.db import make_engine
from billing.replica_intervals import IntervalRecorder
from gateway.backends import BackendUnavailable, GenerationChunk, GenerationRequest, LocalEngineBackend
from gateway.serving.engine_stats_board import StatsPoster
from gateway.serving.gpu_sampler import GpuSampler
from gateway.serving.model_cache import prepared_source
from gateway.serving.names import MODEL_DEPLOYMENT
from gateway.serving.node_memory import CPU, ReplicaMemoryClient
from gateway.recorded_adapters import load_recorded_adapters
from gateway.serving.ray_backend import ReplicaAccepted, ReplicaError
from gateway.specs import parse_spec
from tollgate import envs

log = logging.getLogger("tollgate.serve")


@serve.deployment(name=MODEL_DEPLOYMENT, health_check_period_s=2.0, graceful_shutdown_wait_loop_s=0.5)
class ModelServer:
    async def __init__(self, spec_data: dict[str, Any], db_url: str, interval_flush_s: float,
                       sleep_after_s: float | None = None, node_memory_budget_gib: float | None = None) -> None:
        started = self.started_at = time.time()
        self.spec = parse_spec(spec_data)
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        # a GGUF source is converted once per node; later cold starts load the converted directory
        source = await asyncio.to_thread(prepared_source, self.spec.source)
        self.backend = LocalEngineBackend(self.spec.model_copy(update={"source": source}))
        self.db = make_engine(db_url)
        self.recorder = IntervalRecorder(self.db, self.spec.name, self.replica, self.backend.busy_totals,
                                         flush_every_s=interval_flush_s, started_at=started,
                                         asleep=self.backend.asleep_seconds)
        self.recorder.start()
        self.gpu = GpuSampler.maybe_start() if self.spec.resources.num_gpus > 0 else None
        self.ongoing = 0
        self.last_active = time.monotonic()
        self.last_used = time.time()  # wall clock, compared across the node's replicas (least recently used first)
        self.sleep_after_s = sleep_after_s
        self.wakes = 0
        self._sleep_lock = asyncio.Lock()  # a sleep and a wake never run at once
        await self.backend.start()
        # the adapters added at run time while this replica did not run (or before the platform restarted)
        await load_recorded_adapters(self.backend, self.db)
        stats = self.backend.stats()
        if node_memory_budget_gib is None:  # the deploying process had none: the node's own (set for `platform up`)
            node_memory_budget_gib = envs.get("TOLLGATE_NODE_MEMORY_BUDGET_GIB")
        self.memory = ReplicaMemoryClient(self.spec.name, self.replica, _device(stats), node_memory_budget_gib)
        self.memory.report(stats, self.last_used)
        self.poster = StatsPoster(self.spec.name, self.replica, self._posted_stats,
                                  on_post=lambda posted: self.memory.report(posted, self.last_used))
        self.ready_at = time.time()
        self.load_s = self.ready_at - started
        log.info("replica %s of %s ready in %.2f s", self.replica, self.spec.name, self.load_s)
        self._sleeper = asyncio.create_task(self._sleep_when_idle()) if sleep_after_s else None

    async def generate(self, request: GenerationRequest
                       ) -> AsyncIterator[ReplicaAccepted | GenerationChunk | ReplicaError]:
        self.ongoing += 1
        try:
            try:
                woke_s = await self._awake()
            except Exception as e:  # noqa: BLE001 - out of GPU memory (others took it while asleep): a 503
                yield ReplicaAccepted(self.replica, self.ready_at, self.started_at)
                yield ReplicaError("unavailable", f"The model `{self.spec.name}` could not wake: {e}")
                return
            yield ReplicaAccepted(self.replica, self.ready_at, self.started_at, woke_s)
            async for chunk in self.backend.generate(request):
                yield chunk
        except (ValueError, BackendUnavailable) as e:
            refusal = ReplicaError.of(e)
            assert refusal is not None
            yield refusal
        finally:
            self.ongoing -= 1
            self.last_active = time.monotonic()
            self.last_used = time.time()

    async def _awake(self) -> float | None:
        """Wakes a sleeping engine, room made for it first; the seconds this request waited for it (None: it was
        awake). NoRoomToWake when its memory cannot be found."""
        if not self.backend.sleep_level:
            return None
        started = time.perf_counter()
        async with self._sleep_lock:
            if self.backend.sleep_level:
                try:
                    await self._make_room()
                    await self.backend.wake()
                finally:
                    await self.memory.done_waking()
                    self.memory.report(await self._stats(), self.last_used)
                self.wakes += 1
        return time.perf_counter() - started

    async def _make_room(self) -> None:
        if not self.memory.bounded:
            return

        async def free_bytes() -> int:
            return int((await self._stats()).get("device_free_bytes", 0))

        for victim in await self.memory.make_room(await self._stats(), self.last_used, free_bytes):
            log.info("replica %s of %s pushed replica %s of %s (idle %.0f s) down to sleep level 2 to make room for "
                     "its wake", self.replica, self.spec.name, victim.replica, victim.model,
                     time.time() - victim.last_used)

    async def push_down(self, replica: str, for_model: str) -> bool | None:
        """Sleep level 1 -> 2 (the weights' host copy dropped) for a wake on this node that needs the memory; called
        on every replica of the model (a broadcast), answered by the one named. False when it is not asleep at
        level 1 or a request is running or waiting for it."""
        if replica != self.replica:
            return None
        if self.ongoing or self.backend.sleep_level != 1:
            return False
        async with self._sleep_lock:
            if self.ongoing or self.backend.sleep_level != 1:
                return False
            try:
                await self.backend.sleep(2)
            except ValueError:  # a request slipped in
                return False
            self.memory.push_downs += 1
            log.warning("replica %s of %s pushed down to sleep level 2 (idle %.0f s) to make room for a wake of %s",
                        self.replica, self.spec.name, time.time() - self.last_used, for_model)
            try:
                await self.memory.report_now(await self._stats(), self.last_used)
            except Exception as e:  # noqa: BLE001 - the waker finds out from its next report
                log.warning("replica %s: the push-down was not recorded: %s", self.replica, e)
        return True

    async def _stats(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.backend.stats)

    def _posted_stats(self) -> dict[str, Any]:
        """The engine's stats with this replica's push-downs (tollgate_engine_sleep_push_downs on /metrics)."""
        return {**self.backend.stats(), "sleep_push_downs": self.memory.push_downs}

    async def _sleep_when_idle(self) -> None:
        assert self.sleep_after_s is not None
        every = min(1.0, self.sleep_after_s / 4)
        while True:
            await asyncio.sleep(every)
            if self.ongoing or self.backend.sleep_level or time.monotonic() - self.last_active < self.sleep_after_s:
                continue
            async with self._sleep_lock:
                if self.ongoing or self.backend.sleep_level:
                    continue
                try:
                    await self.backend.sleep(1)
                    self.memory.report(await self._stats(), self.last_used)
                    log.info("replica %s of %s asleep after %.0f s idle", self.replica, self.spec.name,
                             self.sleep_after_s)
                except ValueError:  # a request slipped in: try again after the next idle spell
                    self.last_active = time.monotonic()
                except Exception:  # noqa: BLE001 - a replica that cannot sleep keeps serving
                    log.exception("replica %s could not sleep", self.replica)
                    return

    async def add_adapter(self, name: str, source: str) -> ReplicaError | None:
        """Serves a LoRA adapter from now on (the gateway calls every running replica); its refusal comes back as a
        ReplicaError, not as a Ray exception."""
        try:
            await self.backend.add_adapter(name, source)
        except (ValueError, BackendUnavailable) as e:
            return ReplicaError.of(e)
        return None

    async def remove_adapter(self, name: str) -> bool:
        return await self.backend.remove_adapter(name)

    def adapters(self) -> dict[str, str]:
        """The adapters this replica's engine serves now: name -> source."""
        return self.backend.adapters()

    def stats(self) -> dict[str, Any]:
        return {"replica": self.replica, "ongoing": self.ongoing, "load_s": self.load_s,
                "sleep_level": self.backend.sleep_level, "wakes": self.wakes, "push_downs": self.memory.push_downs,
                "device": self.memory.device,
                "engine": self.backend.stats(), "gpu_util": self.gpu.mean() if self.gpu else None}

    def __del__(self) -> None:
        # graceful shutdown (downscale, redeploy, delete): close the last interval, free the engine
        if getattr(self, "_sleeper", None) is not None:
            self._sleeper.cancel()
        if getattr(self, "gpu", None) is not None:
            self.gpu.stop()
        if hasattr(self, "poster"):
            self.poster.close()
        if hasattr(self, "memory"):
            self.memory.close()
        if hasattr(self, "recorder"):
            self.recorder.close()
        if hasattr(self, "backend"):
            self.backend.stop()


def _device(stats: dict[str, Any]) -> str:
    """What the node's memory record files the replica under: its GPU (Ray's id: replicas given fractions of one GPU
    share it), or the host for a CPU engine."""
    if "device_free_bytes" not in stats:
        return CPU
    ids = ray.get_gpu_ids()
    return "gpu:" + ",".join(str(i) for i in ids) if ids else "gpu:0"
