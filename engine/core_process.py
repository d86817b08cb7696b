"""The engine core in a process of its own (vLLM v1's EngineCore process): the GPU is fed by a process that does
nothing else, while the serving process tokenizes, streams and answers HTTP without taking the core's interpreter
lock. One socket pair joins them; each step's deltas (engine/outputs.py's Delta tuples) cross it as one message.

Parent: `ProcessCore(config, sink)` starts `python -m engine.core_process FD`, waits until the model is loaded, then
sends requests, aborts and stats questions, and a reader thread hands each step's deltas to the sink. Child: loads
the model, then steps while it has work, reading its inbox between steps. The child ends when the parent sends
stop or goes away (its end of the pair reads EOF), so a killed server leaves no core behind.

More than one API process (vLLM's `--api-server-count`): `spawn_core(config, fronts=N)` starts the child with N
more connections, which other processes take over with `ProcessCore.attach`. Each step's deltas go, one message per
front, to the front that sent each request; a front that goes away (or detaches) has its requests aborted and the
core serves the others on. The spawner's own connection is the core's lifeline: its end ends the core."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from engine.checkpoint_prefetch import prefetch_checkpoint
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.outputs import Delta

if TYPE_CHECKING:
    from engine.engine_core import CoreRequest, CoreSink

# The child imports engine.engine_core (torch, the model code: seconds) only once its checkpoint is being read ahead.

log = logging.getLogger(__name__)

STATS_TIMEOUT_S = 10.0
# ---- parent side --------------------------------------------------------------------------------------------

def spawn_core(config: EngineConfig, fronts: int = 0) -> tuple[subprocess.Popen, Connection, list[socket.socket]]:
    """Starts the core process on `config` without waiting for it to load: the process, the spawner's connection
    (the config is already sent on it) and `fronts` sockets, each the end of a connection another process may
    take over (`ProcessCore.attach`)."""
    pairs = [socket.socketpair() for _ in range(1 + fronts)]
    fds = [theirs.fileno() for _, theirs in pairs]
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.core_process", *map(str, fds)], pass_fds=fds,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    for _, theirs in pairs:
        theirs.close()
    control = Connection(pairs[0][0].detach())
    control.send(config)
    return process, control, [ours for ours, _ in pairs[1:]]


class ProcessCore:
    def __init__(self, config: EngineConfig, sink: CoreSink, start_timeout_s: float = 3600.0, *,
                 _attach: Connection | None = None) -> None:
        """Starts the core process and waits until its model is loaded; a model that fails to load raises here
        (a ValueError for a bad config or source, as LLMEngine would)."""
        from engine.loader import load_tokenizer

        self._sink = sink
        if _attach is None:
            self._process: subprocess.Popen | None
            self._process, self._conn, _ = spawn_core(config)
        else:
            self._process, self._conn = None, _attach
        self._send_lock = threading.Lock()
        try:
            tokenizer = load_tokenizer(config.model, config.tokenizer)  # while the child loads the weights
        except BaseException:
            if self._process is not None:
                self._process.kill()
                self._process.wait()
            self._conn.close()
            raise
        try:
            kind, payload = self._recv_start(start_timeout_s)
        except BaseException:
            self._conn.close()
            raise
        if kind == "failed":
            if self._process is not None:
                self._process.wait(10)
            self._conn.close()
            raise payload
        self._start(tokenizer, *payload)

    @classmethod
    def attach(cls, conn: Connection, config: EngineConfig, sink: CoreSink,
               start_timeout_s: float = 3600.0) -> "ProcessCore":
        """A front over a core another process spawned (`spawn_core`): `conn` is one of its fronts' connections.
        Waits until the model is loaded; raises the core's error if it failed to load. Shutting this front down
        detaches it; the core ends with its spawner."""
        return cls(config, sink, start_timeout_s, _attach=conn)

    def _start(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        from engine.engine_core import ModelFacts

        self.facts = ModelFacts(tokenizer, vocab_size, max_model_len)
        self._stats_lock = threading.Lock()
        self._stats_reply: dict[int, tuple[threading.Event, dict[str, Any]]] = {}
        self._stats_ids = itertools.count()
        self._calls: dict[int, Future] = {}  # sleep / wake commands waiting for the child's answer
        self._last_stats: dict[str, Any] = {}
        self._dead = False
        self._reader = threading.Thread(target=self._read, name="tollgate-engine-reader", daemon=True)
        self._reader.start()

    def _recv_start(self, timeout_s: float) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(1.0):
            if self._process is not None and self._process.poll() is not None:
                raise EngineDeadError(f"the engine core process exited with {self._process.returncode} while loading")
            if time.monotonic() > deadline:
                if self._process is not None:
                    self._process.kill()
                raise EngineDeadError(f"the engine core process did not load its model within {timeout_s:.0f} s")
        try:
            return self._conn.recv()
        except (EOFError, OSError) as e:
            raise EngineDeadError("the engine core process ended while loading its model") from e

    def _send(self, message: Any) -> None:
        with self._send_lock:
            self._conn.send(message)

    def add(self, request: CoreRequest) -> None:
        self._send(("add", request))

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except OSError:
            pass  # the core is gone; its requests went with it

    def sleep(self, level: int) -> int:
        """Puts the idle engine to sleep in the child (engine/sleep.py); its sleep level after."""
        return self._command("sleep", level)

    def wake(self) -> float:
        """Wakes the engine in the child; the seconds it took."""
        return self._command("wake", None)

    @property
    def sleep_level(self) -> int:
        return int(self.stats().get("sleep_level", 0))

    def _command(self, kind: str, arg: Any) -> Any:
        """Runs a sleep / wake command in the child between its steps and waits for its answer (or raises its
        error)."""
        if self._dead:
            raise EngineDeadError("the engine core process has ended")
        token, done = next(self._stats_ids), Future()
        with self._stats_lock:
            self._calls[token] = done
        try:
            self._send((kind, (token, arg)))
        except OSError as e:
            with self._stats_lock:
                self._calls.pop(token, None)
            raise EngineDeadError("the engine core process has ended") from e
        return done.result()

    def stats(self) -> dict[str, Any]:
        """The core's counters now (asked of the child; it answers between steps)."""
        if self._dead:
            return dict(self._last_stats)
        token, event = next(self._stats_ids), threading.Event()
        with self._stats_lock:
            self._stats_reply[token] = (event, {})
        try:
            self._send(("stats", token))
            event.wait(STATS_TIMEOUT_S)
        except OSError:
            pass
        with self._stats_lock:
            _, reply = self._stats_reply.pop(token)
        return reply or dict(self._last_stats)

    def add_lora(self, name: str, path: str) -> None:
        self._call("add_lora", (name, path))

    def remove_lora(self, name: str) -> bool:
        return self._call("remove_lora", name)

    def list_loras(self) -> list[str]:
        return self._call("list_loras", None)

    def _call(self, op: str, args: Any, timeout_s: float = 600.0) -> Any:
        """Runs an adapter operation in the child and returns its result (raising its error)."""
        if self._dead:
            raise EngineDeadError("the engine core process has ended")
        token, event = next(self._stats_ids), threading.Event()
        reply: dict[str, Any] = {}
        with self._stats_lock:
            self._stats_reply[token] = (event, reply)
        try:
            self._send(("lora", (token, op, args)))
            if not event.wait(timeout_s):
                raise EngineDeadError(f"the engine core did not answer {op} within {timeout_s:.0f} s")
        finally:
            with self._stats_lock:
                self._stats_reply.pop(token, None)
        if "error" in reply:
            raise reply["error"]
        return reply.get("result")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the core it spawned; an attached front only detaches (its requests end, the core serves on)."""
        try:
            self._send(("stop", None) if self._process is not None else ("detach", None))
        except OSError:
            pass
        if self._process is not None:
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._reader.join(timeout)
        self._conn.close()

    def _read(self) -> None:
        try:
            while True:
                kind, payload = self._conn.recv()
                if kind == "step":
                    deltas, refusals = payload
                    for request_id, error in refusals:
                        self._sink.refused(request_id, error)
                    if deltas:
                        self._sink.deltas(deltas)
                elif kind == "stats":
                    token, snap = payload
                    self._last_stats = snap
                    with self._stats_lock:
                        waiting = self._stats_reply.get(token)
                        if waiting is not None:
                            waiting[1].update(snap)
                            waiting[0].set()
                elif kind == "lora":
                    token, outcome = payload
                    with self._stats_lock:
                        waiting = self._stats_reply.get(token)
                        if waiting is not None:
                            waiting[1].update(outcome)
                            waiting[0].set()
                elif kind == "reply":
                    token, error, result = payload
                    with self._stats_lock:
                        done = self._calls.pop(token, None)
                    if done is not None and error is not None:
                        done.set_exception(error)
                    elif done is not None:
                        done.set_result(result)
                elif kind == "stopped":
                    self._last_stats = payload
                    self._dead = True
                    self._fail_calls()
                    return
                elif kind == "died":
                    raise payload
        except BaseException as e:  # noqa: BLE001 - EOF (the child died) or its own error: every stream hears
            self._dead = True
            self._fail_calls()
            if not isinstance(e, EOFError | OSError):
                log.error("engine core process failed: %r", e)
            code = self._process.poll() if self._process is not None else None
            self._sink.died(e if not isinstance(e, EOFError | OSError)
                            else EngineDeadError(f"the engine core process ended (exit code {code})"))


    def _fail_calls(self) -> None:
        with self._stats_lock:
            calls, self._calls = self._calls, {}
        for done in calls.values():
            done.set_exception(EngineDeadError("the engine core process has ended"))


# ---- child side ---------------------------------------------------------------------------------------------

def _picklable(error: BaseException) -> BaseException:
    import pickle

    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class _AdapterLoads:
    """The child's adapter operations: an adapter is read in a thread of its own while the core steps, and
    registered between two steps; removing and listing answer at once. Answers go to the front that asked."""

    def __init__(self, engine: Any, fronts: "_Fronts") -> None:
        self.engine = engine
        self.fronts = fronts
        self._lock = threading.Lock()
        self._loaded: list[tuple[Connection, int, Any, BaseException | None]] = []
        self.pending = 0

    def handle(self, conn: Connection, token: int, op: str, args: Any) -> None:
        try:
            if op == "add_lora":
                self.pending += 1
                threading.Thread(target=self._load, args=(conn, token, *args), daemon=True).start()
                return
            result = self.engine.remove_lora(args) if op == "remove_lora" else self.engine.list_loras()
            self.fronts.send(conn, ("lora", (token, {"result": result})))
        except ValueError as e:
            self.fronts.send(conn, ("lora", (token, {"error": e})))

    def _load(self, conn: Connection, token: int, name: str, path: str) -> None:
        try:
            adapter, error = self.engine.load_lora(name, path), None
        except BaseException as e:  # noqa: BLE001 - sent back to the caller
            adapter, error = None, _picklable(e)
        with self._lock:
            self._loaded.append((conn, token, adapter, error))

    def register_loaded(self) -> None:
        with self._lock:
            loaded, self._loaded = self._loaded, []
        for conn, token, adapter, error in loaded:
            self.pending -= 1
            if error is None:
                self.engine.add_loaded_lora(adapter)
            self.fronts.send(conn, ("lora", (token, {"error": error} if error is not None else {"result": None})))


class _Fronts:
    """The connections requests come from: the spawner's first, then the attached API processes'. Remembers which
    front sent each running request, so that its deltas and its refusal go back there."""

    def __init__(self, conns: list[Connection]) -> None:
        self.control = conns[0]
        self.open = list(conns)
        self.owner: dict[str, Connection] = {}

    def send(self, conn: Connection, message: Any) -> None:
        if conn not in self.open:
            return
        try:
            conn.send(message)
        except OSError:  # that front is gone: its end reads EOF in the inbox next
            pass

    def broadcast(self, message: Any) -> None:
        for conn in list(self.open):
            self.send(conn, message)

    def route(self, deltas: list[Delta], refusals: list[tuple[str, BaseException]]) -> None:
        """One message per front with each of its requests' deltas and refusals; finished requests are forgotten."""
        out: dict[Connection, tuple[list[Delta], list[tuple[str, BaseException]]]] = {}
        for delta in deltas:
            conn = self.owner.pop(delta[0], None) if delta[1] else self.owner.get(delta[0])
            if conn is not None:
                out.setdefault(conn, ([], []))[0].append(delta)
        for request_id, error in refusals:
            conn = self.owner.pop(request_id, None)
            if conn is not None:
                out.setdefault(conn, ([], []))[1].append((request_id, error))
        for conn, message in out.items():
            self.send(conn, ("step", message))

    def drop(self, conn: Connection) -> list[str]:
        """Forgets a front that went away or detached; the ids of its requests still running."""
        if conn in self.open:
            self.open.remove(conn)
        gone = [rid for rid, c in self.owner.items() if c is conn]
        for rid in gone:
            del self.owner[rid]
        conn.close()
        return gone


class _HandOffTimes:
    """How long the core spends handing steps' outputs to its fronts: a front that reads slowly fills its socket and
    blocks the core's send, and with it every request's next step."""

    def __init__(self, attached: int) -> None:
        self.attached = attached  # fronts beside the spawner's connection: API processes (serve --api-servers)
        self.count = 0
        self.total_s = 0.0
        self.longest_s = 0.0
        self.over_1ms = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.longest_s = max(self.longest_s, seconds)
        self.over_1ms += seconds > 1e-3

    def __str__(self) -> str:
        mean_us = self.total_s / self.count * 1e6 if self.count else 0.0
        to = "its spawner" + (f" and {self.attached} API process{'es' if self.attached > 1 else ''}"
                              if self.attached else "")
        return (f"{self.count} steps' outputs handed to {to} in {self.total_s:.2f} s (mean {mean_us:.0f} us, longest "
                f"{self.longest_s * 1e3:.1f} ms, {self.over_1ms} over 1 ms)")


def serve(conns: list[Connection]) -> None:
    control = conns[0]
    config: EngineConfig = control.recv()
    prefetch_checkpoint(config.model)
    from engine.engine_core import CoreLoop
    from engine.llm_engine import LLMEngine

    fronts = _Fronts(conns)
    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        log.error("cannot load %s: %s", config.model, e)
        fronts.broadcast(("failed", _picklable(e)))
        return
    fronts.broadcast(("ready", (engine.model_config.vocab_size, engine.max_model_len)))
    loop = CoreLoop(engine)
    handed = _HandOffTimes(len(conns) - 1)
    loads = _AdapterLoads(engine, fronts)
    try:
        while True:
            loads.register_loaded()
            if not loop.has_work:
                # asleep with requests: wake for them now, or wait no longer than the first one may
                timeout = loop.seconds_to_next_deadline()
                if loads.pending:
                    timeout = 0.05 if timeout is None else min(timeout, 0.05)
                wake_now = loop.asleep and engine.has_unfinished_requests() and config.wake_on_request
                if not wake_now and timeout != 0.0:
                    idle_from = time.monotonic()
                    wait(fronts.open, timeout)
                    loop.count_waiting(time.monotonic() - idle_from)
            aborted: list[Delta] = []
            refusals: list[tuple[str, BaseException]] = []
            for conn in wait(fronts.open, 0) if len(fronts.open) > 1 else fronts.open:
                try:
                    while conn.poll():
                        kind, payload = conn.recv()
                        if kind == "add":
                            if payload.request_id in fronts.owner:  # another front's request of that id runs
                                error = ValueError(f"request_id: {payload.request_id!r} is already running")
                                fronts.send(conn, ("step", ([], [(payload.request_id, error)])))
                                continue
                            fronts.owner[payload.request_id] = conn
                            error = loop.add(payload)
                            if error is not None:
                                refusals.append((payload.request_id, _picklable(error)))
                        elif kind == "abort":
                            if fronts.owner.get(payload) is not conn:
                                continue  # finished, or another front's request of that id
                            out = loop.abort(payload)
                            if out is not None:
                                aborted.append(out)
                        elif kind == "stats":
                            fronts.send(conn, ("stats", (payload, loop.stats(None))))
                        elif kind == "lora":
                            loads.handle(conn, *payload)
                        elif kind in ("sleep", "wake"):
                            token, arg = payload
                            try:
                                result = loop.sleep(arg) if kind == "sleep" else loop.wake()
                                fronts.send(conn, ("reply", (token, None, result)))
                            except Exception as e:  # noqa: BLE001 - the caller raises it
                                fronts.send(conn, ("reply", (token, _picklable(e), None)))
                        elif kind == "detach":
                            fronts.send(conn, ("stopped", loop.stats(None)))
                            raise EOFError
                        elif kind == "stop":
                            fronts.broadcast(("stopped", loop.stats(None)))
                            return
                except (EOFError, OSError):  # that front went away: its requests end, the others run on
                    if conn is control:
                        return
                    for request_id in fronts.drop(conn):
                        loop.abort(request_id)
            for request_id, error in loop.serve_waiting():
                refusals.append((request_id, _picklable(error)))
            deltas = aborted + (loop.step() if loop.has_work else [])
            if deltas or refusals:
                handing = time.perf_counter()
                fronts.route(deltas, refusals)
                handed.add(time.perf_counter() - handing)
    except BaseException as e:  # noqa: BLE001
        log.exception("engine core failed")
        fronts.broadcast(("died", _picklable(e)))
    finally:
        log.info("engine core stopping: %s", handed)
        engine.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    # Ctrl-C in a terminal reaches the whole process group: the server drains its streams first, then ends the core
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve([Connection(int(fd)) for fd in sys.argv[1:]])


if __name__ == "__main__":
    main()
