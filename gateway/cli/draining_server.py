"""uvicorn for `serve --local`, stopped the way the Ray Serve gateway stops: on SIGTERM / Ctrl-C it keeps accepting
connections and answers new API requests 503, lets the in-flight ones finish for up to the drain window, ends the
rest cleanly (gateway/drain.py), and only then lets uvicorn shut down (whose own bound would cancel a request
mid-flight: a plain-text 500 and a traceback). A second Ctrl-C stops at once."""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn

from gateway.drain import InFlight

log = logging.getLogger("tollgate.cli")

# uvicorn's own bound at its shutdown, which begins only once the drain has ended every API request: what is left
# then are idle keep-alive connections and non-API requests
DRAINED_SHUTDOWN_S = 5


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, in_flight: InFlight, drain_s: float) -> None:
        super().__init__(config)
        self.in_flight = in_flight
        self.drain_s = drain_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or not self.started or self.in_flight.draining:
            super().handle_exit(sig, frame)  # before serving, or a second signal: uvicorn's own stop
            return
        self._captured_signals.append(sig)
        self.in_flight.draining = True  # at once: a request arriving from now on is answered 503
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        assert self._loop is not None
        self._drain_task = self._loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            log.info("stopping: new requests get 503; in-flight ones may finish for up to %g s", self.drain_s)
            left = await self.in_flight.drain(self.drain_s)
            if left:
                log.warning("ended %d %s still running after the %g s drain window (recorded cancelled)",
                            left, "request" if left == 1 else "requests", self.drain_s)
        finally:
            self.should_exit = True
