"""Live gateways for tests: uvicorn on a free loopback port, in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from gateway.service import Gateway


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread
    url: str

    @property
    def gateway(self) -> Gateway:
        return self.app.state.gateway

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start(app: FastAPI) -> LiveServer:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("gateway did not start")
        time.sleep(0.02)
    return LiveServer(app, server, thread, f"http://127.0.0.1:{port}")
