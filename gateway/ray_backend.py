"""A ModelBackend that calls a model's Ray Serve application through its deployment handle, so the
HTTP layer is the same as with the in-process engine. The first item of every stream is a
ReplicaAccepted marker sent by the replica: waiting for it is waiting for a replica (a cold start
when the replica became ready after the request was sent), bounded by cold_start_timeout_s."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

from ray.exceptions import RayTaskError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.backends import BackendInfo, BackendState, BackendUnavailable, GenerationChunk, GenerationRequest

log = logging.getLogger("tollgate.ray_backend")

COLD_START_HEADER = "x-tollgate-cold-start"
REQUEST_ID_HEADER = "x-tollgate-request-id"

# a per-request mutable holder the middleware installs and the backend fills in
_request_notes: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("tollgate_notes",
                                                                                        default=None)


@dataclass(frozen=True)
class ReplicaAccepted:
    replica: str
    ready_at: float  # wall-clock time at which the replica finished loading
    started_at: float = 0.0  # wall-clock time at which its constructor began


@dataclass
class ModelCounters:
    ongoing: int = 0  # requests between the call and their end
    waiting_for_replica: int = 0
    cold_starts: int = 0
    cold_start_timeouts: int = 0
    last_cold_start_s: float | None = None
    failed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RayModelBackend:
    def __init__(self, name: str, handle: Any, *, max_model_len: int | None, cold_start_timeout_s: float) -> None:
        self.name = name
        self.handle = handle
        self.max_model_len = max_model_len
        self.cold_start_timeout_s = cold_start_timeout_s
        self.state: BackendState = "ready"
        self.replica_states: dict[str, int] = {}  # kept current by the gateway's model registry
        self.counters = ModelCounters()
        self._live: dict[str, Any] = {}

    def info(self) -> BackendInfo:
        return BackendInfo(self.name, self.max_model_len, self.state, self.replica_states.get("running", 0),
                           dict(self.replica_states))

    async def abort(self, request_id: str) -> None:
        response = self._live.pop(request_id, None)
        if response is not None:
            response.cancel()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        c = self.counters
        sent = time.time()
        response = self.handle.options(stream=True).generate.remote(request)
        self._live[request.request_id] = response
        c.ongoing += 1
        finished = False
        try:
            c.waiting_for_replica += 1
            try:
                accepted = await asyncio.wait_for(response.__anext__(), self.cold_start_timeout_s)
            except asyncio.TimeoutError:
                c.cold_start_timeouts += 1
                raise BackendUnavailable(f"model {self.name!r} has no replica ready after "
                                         f"{self.cold_start_timeout_s:g} s; it is starting, try again shortly") from None
            finally:
                c.waiting_for_replica -= 1
            if not isinstance(accepted, ReplicaAccepted):
                raise RuntimeError(f"model {self.name!r}: the replica answered without accepting")
            if accepted.ready_at > sent:
                waited = time.time() - sent
                c.cold_starts += 1
                c.last_cold_start_s = waited
                notes = _request_notes.get()
                if notes is not None:
                    notes["cold_start_s"] = waited
            async for chunk in response:
                yield chunk
                finished = chunk.finished
        except RayTaskError as e:  # the replica's own exception (ValueError, PromptTooLongError, ...)
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
            self._live.pop(request.request_id, None)
            if not finished:
                response.cancel()


class PlatformHeaders:
    """ASGI middleware: `x-tollgate-cold-start: <seconds>` on responses that waited for a replica,
    `Retry-After` on 503s (a model starting or unavailable), and `x-tollgate-request-id`."""

    def __init__(self, app: ASGIApp, retry_after_s: int = 10) -> None:
        self.app = app
        self.retry_after = str(retry_after_s).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        notes: dict[str, float] = {}
        token = _request_notes.set(notes)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                # Serve's proxy replaces X-Request-Id with its own trace id; keep the gateway's under our name
                for k, v in message.get("headers", []):
                    if k.lower() == b"x-request-id":
                        headers.append((REQUEST_ID_HEADER.encode(), v))
                if "cold_start_s" in notes:
                    headers.append((COLD_START_HEADER.encode(), f"{notes['cold_start_s']:.3f}".encode()))
                if message["status"] == 503 and not any(k.lower() == b"retry-after" for k, _ in headers):
                    headers.append((b"retry-after", self.retry_after))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            _request_notes.reset(token)
