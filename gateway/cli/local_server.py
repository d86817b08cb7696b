"""`platform serve --local`: the gateway and its models' engines in this process (or, as one of several API
processes, over engine cores another process started: gateway/cli/api_servers.py)."""

from __future__ import annotations

import signal
import socket
from typing import Any

from billing.migrate import open_database
from gateway.settings import Settings
from gateway.specs import ModelSpec


def serve_local(settings: Settings, specs: list[ModelSpec], *, core_connections: dict[str, Any] | None = None,
                listen: socket.socket | None = None, api_server: int = 0,
                refused_specs: list[str] | None = None) -> None:
    """The gateway and an in-process engine per spec. A model that cannot load is served as unavailable
    (503 naming the reason); SIGTERM / Ctrl-C drain in-flight requests for up to settings.drain_s.
    As one of several API processes (gateway/cli/api_servers.py): the chat models' engines are the cores behind
    `core_connections`, it serves on `listen`, and only api_server 0 writes the replicas' intervals."""
    import uvicorn

    from gateway.app import create_app
    from gateway.backends import LocalEngineBackend, ModelBackend
    from gateway.cli.draining_server import DRAINED_SHUTDOWN_S, DrainingServer
    from gateway.embedding_backend import LocalEmbeddingBackend

    connections = core_connections or {}
    db = open_database(settings.db_url)
    backends: dict[str, ModelBackend] = {
        s.name: LocalEmbeddingBackend(s) if s.kind == "embedding"  # type: ignore[misc]
        else LocalEngineBackend(s, core_connection=connections.get(s.name)) for s in specs}
    app = create_app(settings, db, backends, specs, own_backends=True, freeze_after_start=True,
                     record_intervals=api_server == 0,
                     follow_adapters_s=settings.registry_refresh_s if listen is not None else None,
                     refused_specs=refused_specs)
    # the access log prints paths and status codes only: never headers (keys) or bodies (prompts)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=DRAINED_SHUTDOWN_S)
    server = DrainingServer(config, app.state.in_flight, settings.drain_s)
    # uvicorn raises the stop signal again, with the handler it found installed, once it has stopped: with this
    # one, a drained stop exits with status 0 instead of dying by the signal
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[listen] if listen is not None else None)
    except KeyboardInterrupt:  # Ctrl-C, raised again by uvicorn once it has stopped (as uvicorn.run takes it)
        pass
