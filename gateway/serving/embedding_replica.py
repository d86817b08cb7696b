"""An embedding model's replica on Ray Serve: loads the model once (gateway/embedding_backend.py), tokenizes and
embeds requests (concurrent ones share forward passes), records its alive / busy intervals. Each call streams a
ReplicaAccepted marker first, so the gateway's backend sees a cold start as it does for chat, then the result or
a ReplicaError for a request it refuses."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from ray import serve

from billing.db import make_engine
from billing.replica_intervals import IntervalRecorder
from gateway.backends import BackendUnavailable
from gateway.embedding_backend import EmbedRequest, Inputs, LocalEmbeddingBackend
from gateway.serving.names import MODEL_DEPLOYMENT
from gateway.serving.ray_backend import ReplicaAccepted, ReplicaError
from gateway.specs import parse_spec

log = logging.getLogger("tollgate.serve")


# the same deployment name as ModelServer: a model's application and its status read the same either way
@serve.deployment(name=MODEL_DEPLOYMENT, health_check_period_s=2.0, graceful_shutdown_wait_loop_s=0.5)
class EmbeddingServer:
    async def __init__(self, spec_data: dict[str, Any], db_url: str, interval_flush_s: float) -> None:
        started = self.started_at = time.time()
        self.spec = parse_spec(spec_data)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.backend = LocalEmbeddingBackend(self.spec)
        self.db = make_engine(db_url)
        self.recorder = IntervalRecorder(self.db, self.spec.name, self.replica, self.backend.busy_totals,
                                         flush_every_s=interval_flush_s, started_at=started)
        self.recorder.start()
        await self.backend.start()
        self.ready_at = time.time()
        log.info("replica %s of %s ready in %.2f s", self.replica, self.spec.name, self.ready_at - started)

    async def tokenize(self, inputs: Inputs, dimensions: int | None
                       ) -> AsyncIterator[ReplicaAccepted | list[list[int]] | ReplicaError]:
        yield ReplicaAccepted(self.replica, self.ready_at, self.started_at)
        try:
            yield await self.backend.tokenize(inputs, dimensions)
        except (ValueError, BackendUnavailable) as e:
            yield ReplicaError.of(e)  # type: ignore[misc]

    async def embed(self, request: EmbedRequest) -> AsyncIterator[ReplicaAccepted | np.ndarray | ReplicaError]:
        yield ReplicaAccepted(self.replica, self.ready_at, self.started_at)
        try:
            yield await self.backend.embed(request)
        except (ValueError, BackendUnavailable) as e:
            yield ReplicaError.of(e)  # type: ignore[misc]

    def stats(self) -> dict[str, Any]:
        return {"replica": self.replica, "batches": self.backend.batch_stats()}

    def __del__(self) -> None:
        # graceful shutdown (downscale, redeploy, delete): close the last interval, free the model
        if hasattr(self, "recorder"):
            self.recorder.close()
        if hasattr(self, "backend"):
            self.backend.stop()
