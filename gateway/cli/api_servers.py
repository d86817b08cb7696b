"""`platform serve --local --api-servers N`: N gateway processes on one port in front of one engine core per model,
as vLLM's `--api-server-count`. One event loop cannot both parse, admit and stream thousands of requests a second
and start new ones promptly; N loops share that work while the GPU is still fed by one core per model.

This process (the supervisor) migrates the database, binds N listening sockets to the port (SO_REUSEPORT: the
kernel spreads connections over them), starts each chat model's engine core with N front connections
(engine/core_process.py spawn_core) and then the N workers (`python -m gateway.cli.api_servers`), each given its
socket and its front of every core. A worker is the `serve --local` gateway over those cores; admission, limits and
the ledger are shared through the database as between any gateway processes, /metrics adds up all workers'
counts (prometheus_client's multiprocess files), and only worker 0 writes the replicas' GPU intervals.

SIGTERM or Ctrl-C here drains every worker (gateway/cli/draining_server.py), then the cores stop. A worker that
dies is logged and the others serve on; its requests end and its reservations are swept as any dead gateway's.
Workers end with the supervisor (PR_SET_PDEATHSIG), and the cores with it (their spawner's connection)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from gateway.cli.draining_server import DRAINED_SHUTDOWN_S
from gateway.settings import Settings
from gateway.specs import ModelSpec, engine_fields

log = logging.getLogger("tollgate.cli")
SETTING = "--api-servers (TOLLGATE_API_SERVERS)"
MAX_API_SERVERS = 64
_PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 10.0  # past the drain window and uvicorn's own bound, before a worker that has not ended is killed


def check_fronts(settings: Settings) -> None:
    """ValueError naming the setting for a combination several API processes cannot serve."""
    if not 1 <= settings.api_servers <= MAX_API_SERVERS:
        raise ValueError(f"{SETTING}: {settings.api_servers} is not between 1 and {MAX_API_SERVERS}")
    if settings.api_servers > 1 and settings.semantic_cache:
        raise ValueError(f"{SETTING}: more than one API process needs the semantic cache off "
                         "(TOLLGATE_SEMANTIC_CACHE=0): each process would keep its own cache, and an answer "
                         "flagged wrong in one would still be served by the others")


def _bind(host: str, port: int, count: int) -> list[socket.socket]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # first without SO_REUSEPORT: a port another server holds, even one that shares it the same way (another
    # `serve --local --api-servers` of this user), is refused instead of joined
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ValueError(f"port: cannot listen on {host}:{port}: {e.strerror}") from e
    out: list[socket.socket] = []
    for _ in range(count):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            for bound in out:
                bound.close()
            raise ValueError(f"port: cannot listen on {host}:{port}: {e.strerror}") from e
        sock.listen(2048)
        sock.set_inheritable(True)
        out.append(sock)
    return out


def _spawn_cores(specs: list[ModelSpec], fronts: int) -> dict[str, tuple[subprocess.Popen, Connection, list]]:
    """Each chat model's core, started loading at once; a spec whose config is refused is left to each worker,
    which finds the same error and serves the model as unavailable naming it."""
    from engine.config import EngineConfig
    from engine.core_process import spawn_core

    cores = {}
    for spec in specs:
        if spec.kind != "chat":
            continue
        try:
            config = EngineConfig.from_kwargs(spec.source, **{**engine_fields(spec), "engine_core": "process"})
        except ValueError:
            continue
        cores[spec.name] = spawn_core(config, fronts)
    return cores


def serve_fronts(settings: Settings) -> int:
    """The supervisor: returns once every worker has ended (0 when they all drained cleanly)."""
    from billing.migrate import open_database
    from gateway.specs import load_specs

    check_fronts(settings)
    open_database(settings.db_url).dispose()  # migrated once, before the workers open it
    specs = load_specs(settings.models_dir).specs
    sockets = _bind(settings.host, settings.port, settings.api_servers)
    metrics_dir = tempfile.mkdtemp(prefix="tollgate-metrics-")
    cores = _spawn_cores(specs, settings.api_servers)
    workers: list[subprocess.Popen] = []
    try:
        for i, sock in enumerate(sockets):
            core_socks = {name: fronts[i] for name, (_, _, fronts) in cores.items()}
            part = {"index": i, "listen_fd": sock.fileno(), "cores": {n: s.fileno() for n, s in core_socks.items()}}
            env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir,
                   "TOLLGATE_MODELS_DIR": str(settings.models_dir), "TOLLGATE_HOME": str(settings.home),
                   "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            argv = [sys.executable, "-m", "gateway.cli.api_servers", json.dumps(part)]  # its part, as JSON
            # a session of its own: Ctrl-C reaches only this process, which then asks each worker to drain once
            workers.append(subprocess.Popen(argv, env=env, pass_fds=(sock.fileno(), *part["cores"].values()),
                                            start_new_session=True))
            sock.close()
            for s in core_socks.values():
                s.close()
        log.info("starting %d API processes at http://%s:%d (each loads its models' tokenizers; /health answers "
                 "once one is up)", len(workers), settings.host, settings.port)
        return _supervise(workers, metrics_dir, settings.drain_s)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        for process, control, _ in cores.values():
            control.close()  # the core's lifeline: it stops
        for process, _, _ in cores.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _supervise(workers: list[subprocess.Popen], metrics_dir: str, drain_s: float) -> int:
    """Until every worker has ended. The first SIGTERM / Ctrl-C asks each to drain; a second one, or the drain
    window and uvicorn's shutdown bound passing, stops them at once (SIGTERM again, then SIGKILL)."""
    from prometheus_client import multiprocess

    stop = threading.Event()
    signals = 0
    deadline: float | None = None

    def on_signal(*_: Any) -> None:
        nonlocal signals, deadline
        signals += 1
        stop.set()
        if signals == 1:
            deadline = time.monotonic() + drain_s + DRAINED_SHUTDOWN_S + STOP_GRACE_S
        for worker in workers:
            if worker.poll() is None:
                # the first: each drains; the second: each stops at once (DrainingServer); a third: killed
                worker.send_signal(signal.SIGTERM if signals < 3 else signal.SIGKILL)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        running = set(range(len(workers)))
        failed = False
        while running:
            time.sleep(0.2)
            if deadline is not None and time.monotonic() > deadline:
                log.error("API processes still running %.0f s after the stop signal: killed", drain_s + STOP_GRACE_S)
                for i in running:
                    workers[i].kill()
                deadline = None
            for i in sorted(running):
                code = workers[i].poll()
                if code is None:
                    continue
                running.discard(i)
                multiprocess.mark_process_dead(workers[i].pid, metrics_dir)
                if code != 0 or not stop.is_set():
                    failed = True
                    log.error("API process %d (pid %d) exited with %s; %d serve on", i, workers[i].pid, code,
                              len(running))
        return 1 if failed else 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---- a worker ------------------------------------------------------------------------------------------------

def _end_with_parent() -> None:
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the supervisor is already gone
        sys.exit(1)


def run_worker() -> None:
    from gateway.cli.local_server import serve_local
    from gateway.specs import load_specs

    _end_with_parent()
    part = json.loads(sys.argv[1])
    settings = Settings.load()
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[api {part['index']}]: %(message)s")
    found = load_specs(settings.models_dir)  # the supervisor logged the specs it could not read
    serve_local(settings, found.specs, core_connections={name: Connection(fd) for name, fd in part["cores"].items()},
                listen=socket.socket(fileno=part["listen_fd"]), api_server=part["index"],
                refused_specs=[Path(p).name for p in found.errors])
    # drained and its ledger flushed: end without the interpreter's teardown, where native extensions loaded with the
    # engine's modules print reference-count warnings that read like a crash
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    run_worker()
