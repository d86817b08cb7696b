"""A model's replica on Ray Serve: loads the model once, streams GenerationChunks, records its
alive / busy / asleep intervals. Requests it refuses come back as ReplicaError items (gateway/serving/ray_backend.py).

With autoscaling.sleep_after_s, a replica idle that long puts its engine to sleep (level 1: the weights to host
memory, the GPU memory given back to the models sharing the GPU); the next request wakes it before the replica
accepts it, and the wake time goes back in ReplicaAccepted (the x-tollgate-cold-start header). Ray Serve still
ends an idle replica after downscale_delay_s (scale to zero)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from billing.db import make_engine
from billing.replica_intervals import IntervalRecorder
from gateway.backends import BackendUnavailable, GenerationChunk, GenerationRequest, LocalEngineBackend
from gateway.serving.engine_stats_board import StatsPoster
from gateway.serving.gpu_sampler import GpuSampler
from gateway.serving.model_cache import prepared_source
from gateway.serving.names import MODEL_DEPLOYMENT
from gateway.recorded_adapters import load_recorded_adapters
from gateway.serving.ray_backend import ReplicaAccepted, ReplicaError
from gateway.specs import parse_spec

log = logging.getLogger("tollgate.serve")


@serve.deployment(name=MODEL_DEPLOYMENT, health_check_period_s=2.0, graceful_shutdown_wait_loop_s=0.5)
class ModelServer:
    async def __init__(self, spec_data: dict[str, Any], db_url: str, interval_flush_s: float,
                       sleep_after_s: float | None = None) -> None:
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
        self.sleep_after_s = sleep_after_s
        self.wakes = 0
        self._sleep_lock = asyncio.Lock()  # a sleep and a wake never run at once
        await self.backend.start()
        # the adapters added at run time while this replica did not run (or before the platform restarted)
        await load_recorded_adapters(self.backend, self.db)
        self.poster = StatsPoster(self.spec.name, self.replica, self.backend.stats)
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

    async def _awake(self) -> float | None:
        """Wakes a sleeping engine; the seconds this request waited for it (None: it was awake)."""
        if not self.backend.sleep_level:
            return None
        started = time.perf_counter()
        async with self._sleep_lock:
            if self.backend.sleep_level:
                await self.backend.wake()
                self.wakes += 1
        return time.perf_counter() - started

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
                "sleep_level": self.backend.sleep_level, "wakes": self.wakes,
                "engine": self.backend.stats(), "gpu_util": self.gpu.mean() if self.gpu else None}

    def __del__(self) -> None:
        # graceful shutdown (downscale, redeploy, delete): close the last interval, free the engine
        if getattr(self, "_sleeper", None) is not None:
            self._sleeper.cancel()
        if getattr(self, "gpu", None) is not None:
            self.gpu.stop()
        if hasattr(self, "poster"):
            self.poster.close()
        if hasattr(self, "recorder"):
            self.recorder.close()
        if hasattr(self, "backend"):
            self.backend.stop()
