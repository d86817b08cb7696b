"""Graceful stop: count the API requests in flight (a streamed response counts until its last byte),
refuse new ones with a 503 once draining starts, and wait for the rest up to a bound."""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError

API_PREFIX = "/v1/"


def shutting_down() -> APIError:
    return APIError(503, "The gateway is shutting down; send the request again in a moment.", "server_error",
                    "service_unavailable", None, {"Retry-After": "5"})


class InFlight:
    def __init__(self) -> None:
        self.active = 0
        self.draining = False

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests from now on; wait until none is in flight or timeout_s passed. Returns how
        many are still running."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return self.active


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
