"""An EmbeddingBackend that calls an embedding model's Ray Serve application (gateway/serving/embedding_replica.py)
through its deployment handle. Waiting for a replica, cold-start notes, counters and refusals work as for chat
models (gateway/serving/ray_backend.py): a refusal comes back as the same ValueError or BackendUnavailable the
in-process backend raises."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
from ray.exceptions import RayTaskError

from gateway.backends import BackendInfo, BackendUnavailable
from gateway.embedding_backend import EmbedRequest, Inputs
from gateway.serving.ray_backend import RayModelBackend, ReplicaAccepted, ReplicaError, _request_notes


class RayEmbeddingBackend(RayModelBackend):
    def info(self) -> BackendInfo:
        return dataclasses.replace(super().info(), kind="embedding")

    async def tokenize(self, inputs: Inputs, dimensions: int | None) -> list[list[int]]:
        return await self._call("tokenize", inputs, dimensions)

    async def embed(self, request: EmbedRequest) -> np.ndarray:
        return await self._call("embed", request)

    async def _call(self, method: str, *args: Any) -> Any:
        c = self.counters
        sent = time.time()
        response = getattr(self.handle.options(stream=True), method).remote(*args)
        c.ongoing += 1
        answered = False
        try:
            c.waiting_for_replica += 1
            try:
                accepted = await self._wait_for_replica(response)
            finally:
                c.waiting_for_replica -= 1
            if not isinstance(accepted, ReplicaAccepted):
                raise RuntimeError(f"model {self.name!r}: the replica answered without accepting")
            if accepted.ready_at > sent:
                c.cold_starts += 1
                c.last_cold_start_s = time.time() - sent
                notes = _request_notes.get()
                if notes is not None:
                    notes["cold_start_s"] = c.last_cold_start_s
            result = await response.__anext__()
            answered = True
        except RayTaskError as e:  # the replica's own exception
            c.failed += 1
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise
        except BackendUnavailable:
            raise
        except Exception:
            c.failed += 1
            raise
        finally:
            c.ongoing -= 1
            if not answered:
                response.cancel()
        if isinstance(result, ReplicaError):
            raise result.exception()
        return result
