"""RayModelBackend and the platform headers without a cluster: a fake deployment handle stands in
for Ray Serve (the real one is exercised in test_serve.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

pytest.importorskip("ray")

from engine.config import SamplingParams  # noqa: E402
from gateway import errors  # noqa: E402
from gateway.backends import BackendUnavailable, ChoiceDelta, GenerationChunk, GenerationRequest  # noqa: E402
from gateway.serving.ray_backend import (  # noqa: E402
    COLD_START_HEADER,
    REQUEST_ID_HEADER,
    PlatformHeaders,
    RayModelBackend,
    ReplicaAccepted,
)


class FakeResponse:
    def __init__(self, items: list[Any], delay_s: float) -> None:
        self.items = items
        self.delay_s = delay_s
        self.cancelled = False

    def __aiter__(self) -> "FakeResponse":
        return self

    async def __anext__(self) -> Any:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
            self.delay_s = 0
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """handle.options(stream=True).generate.remote(request) -> a FakeResponse."""

    def __init__(self, ready_in_s: float, replica_ready_at: float | None = None) -> None:
        self.ready_in_s = ready_in_s
        self.replica_ready_at = replica_ready_at
        self.responses: list[FakeResponse] = []

    def options(self, **_: Any) -> "FakeHandle":
        return self

    @property
    def generate(self) -> "FakeHandle":
        return self

    def remote(self, request: GenerationRequest) -> FakeResponse:
        ready_at = self.replica_ready_at if self.replica_ready_at is not None else time.time() + self.ready_in_s
        chunk = GenerationChunk(request.request_id, [ChoiceDelta(0, "hi", 1, "stop")], 3, 0, 1, True, 0.01)
        response = FakeResponse([ReplicaAccepted("r1", ready_at), chunk], self.ready_in_s)
        self.responses.append(response)
        return response


def _request() -> GenerationRequest:
    return GenerationRequest("req-1", SamplingParams(max_tokens=1), prompt="hello")


async def _collect(stream: AsyncIterator[GenerationChunk]) -> list[GenerationChunk]:
    return [c async for c in stream]


def test_cold_start_is_noted_and_counted() -> None:
    backend = RayModelBackend("m", FakeHandle(ready_in_s=0.2), max_model_len=512, cold_start_timeout_s=5)
    chunks = asyncio.run(_collect(backend.generate(_request())))
    assert [c.finished for c in chunks] == [True]
    c = backend.counters
    assert (c.cold_starts, c.ongoing, c.waiting_for_replica, c.failed) == (1, 0, 0, 0)
    assert c.last_cold_start_s is not None and c.last_cold_start_s >= 0.2


def test_warm_replica_is_not_a_cold_start() -> None:
    backend = RayModelBackend("m", FakeHandle(0.0, replica_ready_at=time.time() - 60), max_model_len=None,
                              cold_start_timeout_s=5)
    asyncio.run(_collect(backend.generate(_request())))
    assert backend.counters.cold_starts == 0


def test_no_replica_within_the_bound() -> None:
    handle = FakeHandle(ready_in_s=10.0)
    backend = RayModelBackend("m", handle, max_model_len=None, cold_start_timeout_s=0.2)
    t = time.monotonic()
    with pytest.raises(BackendUnavailable, match="no replica ready after 0.2 s"):
        asyncio.run(_collect(backend.generate(_request())))
    assert time.monotonic() - t < 2
    assert handle.responses[0].cancelled  # the queued request is withdrawn
    assert backend.counters.cold_start_timeouts == 1 and backend.counters.waiting_for_replica == 0


def test_closing_the_stream_cancels_the_call() -> None:
    handle = FakeHandle(0.0, replica_ready_at=0.0)
    backend = RayModelBackend("m", handle, max_model_len=None, cold_start_timeout_s=5)

    async def first_then_close() -> None:
        handle.remote = _unfinished(handle.remote)  # type: ignore[method-assign]
        stream = backend.generate(_request())
        await stream.__anext__()
        await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(first_then_close())
    assert handle.responses[0].cancelled and backend.counters.ongoing == 0


def _unfinished(remote: Any) -> Any:
    def wrapped(request: GenerationRequest) -> FakeResponse:
        response = remote(request)
        response.items[-1].finished = False
        response.items.append(response.items[-1])
        return response
    return wrapped


def _app(backend: RayModelBackend) -> FastAPI:
    app = FastAPI()
    errors.install(app)

    @app.get("/call")
    async def call() -> Any:
        try:
            async for _ in backend.generate(_request()):
                pass
        except BackendUnavailable as e:
            raise errors.unavailable(str(e)) from e
        from starlette.responses import JSONResponse

        return JSONResponse({"ok": True}, headers={"X-Request-Id": "chatcmpl-1"})

    app.add_middleware(PlatformHeaders, retry_after_s=7)
    return app


def test_headers_on_cold_start_and_on_503() -> None:
    cold = TestClient(_app(RayModelBackend("m", FakeHandle(0.1), max_model_len=None, cold_start_timeout_s=5)))
    r = cold.get("/call")
    assert r.status_code == 200 and float(r.headers[COLD_START_HEADER]) >= 0.1
    assert r.headers[REQUEST_ID_HEADER] == "chatcmpl-1"
    warm = TestClient(_app(RayModelBackend("m", FakeHandle(0.0, replica_ready_at=0.0), max_model_len=None,
                                           cold_start_timeout_s=5)))
    assert COLD_START_HEADER not in warm.get("/call").headers
    never = TestClient(_app(RayModelBackend("m", FakeHandle(5.0), max_model_len=None, cold_start_timeout_s=0.1)))
    r = never.get("/call")
    assert r.status_code == 503 and r.headers["retry-after"] == "7"
    assert r.json()["error"]["code"] == "model_unavailable"
