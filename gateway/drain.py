"""Graceful stop: count the API requests in flight (a streamed response counts until its last byte),
refuse new ones with a 503 once draining starts, wait for the rest up to a bound, then end the ones still
running cleanly (a 503, or an error event before a stream's end; recorded `cancelled` with the tokens they
generated) rather than leave them to be cut off with the process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TypeVar

import anyio
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError

API_PREFIX = "/v1/"
RETRY_AFTER_S = "5"
# after the drain window, how long the requests told to end have to write their clean end
END_GRACE_S = 10.0

T = TypeVar("T")


def shutting_down() -> APIError:
    return APIError(503, "The gateway is shutting down; send the request again in a moment.", "server_error",
                    "service_unavailable", None, {"Retry-After": RETRY_AFTER_S})


def ended_by_shutdown(drain_s: float) -> APIError:
    return APIError(503, f"The gateway is shutting down and ended this request after its drain window ({drain_s:g} s); "
                    "the tokens generated so far are billed. Send the request again in a moment.", "server_error",
                    "service_unavailable", None, {"Retry-After": RETRY_AFTER_S})


class EndedByShutdown(Exception):
    """The drain window ran out while this request was still running."""


class InFlight:
    def __init__(self) -> None:
        self.active = 0
        self.draining = False
        self.drain_s = 0.0
        self._end: asyncio.Event | None = None  # made by drain(), on the serving loop

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests from now on; wait until none is in flight or timeout_s passed; then tell the ones
        still running to end (next_chunk raises EndedByShutdown) and give them END_GRACE_S to answer. Returns how
        many were still running when the window ran out."""
        if self._end is None:
            self._end = asyncio.Event()
        self.draining, self.drain_s = True, timeout_s
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        left = self.active
        if left:
            self._end.set()
            deadline = time.monotonic() + END_GRACE_S
            while self.active and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        return left

    async def next_chunk(self, stream: AsyncIterator[T]) -> T:
        """The stream's next item; EndedByShutdown once the drain window has run out. Outside a drain it is a
        plain await (no task per item)."""
        end = self._end
        if end is None:
            return await stream.__anext__()
        if end.is_set():
            raise EndedByShutdown
        item = asyncio.ensure_future(stream.__anext__())
        ended = asyncio.ensure_future(end.wait())
        try:
            await asyncio.wait({item, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not item.done():
                item.cancel()
                with anyio.CancelScope(shield=True):  # the stream must be idle before it is closed
                    await asyncio.wait({item})
        if item.cancelled():
            raise EndedByShutdown
        return item.result()


class InFlightMiddleware:
    def __init__(self, app: ASGIApp, in_flight: InFlight) -> None:
        self.app = app
        self.in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        if self.in_flight.draining:
            await shutting_down().response()(scope, receive, send)
            return
        self.in_flight.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.active -= 1
