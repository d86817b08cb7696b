"""A model's replica on Ray Serve: loads the model once, streams GenerationChunks, records its
alive / busy intervals. Requests it refuses come back as ReplicaError items (gateway/serving/ray_backend.py)."""

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
from gateway.serving.ray_backend import ReplicaAccepted, ReplicaError
from gateway.specs import parse_spec

log = logging.getLogger("tollgate.serve")


@serve.deployment(name=MODEL_DEPLOYMENT, health_check_period_s=2.0, graceful_shutdown_wait_loop_s=0.5)
class ModelServer:
    async def __init__(self, spec_data: dict[str, Any], db_url: str, interval_flush_s: float) -> None:
        started = self.started_at = time.time()
        self.spec = parse_spec(spec_data)
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        # a GGUF source is converted once per node; later cold starts load the converted directory
        source = await asyncio.to_thread(prepared_source, self.spec.source)
        self.backend = LocalEngineBackend(self.spec.model_copy(update={"source": source}))
        self.db = make_engine(db_url)
        self.recorder = IntervalRecorder(self.db, self.spec.name, self.replica, self.backend.busy_totals,
                                         flush_every_s=interval_flush_s, started_at=started)
        self.recorder.start()
        self.gpu = GpuSampler.maybe_start() if self.spec.resources.num_gpus > 0 else None
        self.ongoing = 0
        await self.backend.start()
        self.poster = StatsPoster(self.spec.name, self.replica, self.backend.stats)
        self.ready_at = time.time()
        self.load_s = self.ready_at - started
        log.info("replica %s of %s ready in %.2f s", self.replica, self.spec.name, self.load_s)

    async def generate(self, request: GenerationRequest
                       ) -> AsyncIterator[ReplicaAccepted | GenerationChunk | ReplicaError]:
        yield ReplicaAccepted(self.replica, self.ready_at, self.started_at)
        self.ongoing += 1
        try:
            async for chunk in self.backend.generate(request):
                yield chunk
        except (ValueError, BackendUnavailable) as e:
            refusal = ReplicaError.of(e)
            assert refusal is not None
            yield refusal
        finally:
            self.ongoing -= 1

    def stats(self) -> dict[str, Any]:
        return {"replica": self.replica, "ongoing": self.ongoing, "load_s": self.load_s,
                "engine": self.backend.stats(), "gpu_util": self.gpu.mean() if self.gpu else None}

    def __del__(self) -> None:
        # graceful shutdown (downscale, redeploy, delete): close the last interval, free the engine
        if getattr(self, "gpu", None) is not None:
            self.gpu.stop()
        if hasattr(self, "poster"):
            self.poster.close()
        if hasattr(self, "recorder"):
            self.recorder.close()
        if hasattr(self, "backend"):
            self.backend.stop()
