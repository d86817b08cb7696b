"""The engine core in a process of its own (vLLM v1's EngineCore process): the GPU is fed by a process that does
nothing else, while the serving process tokenizes, streams and answers HTTP without taking the core's interpreter
lock. One socket pair joins them; each step's deltas (engine/outputs.py's Delta tuples) cross it as one message.

Parent: `ProcessCore(config, sink)` starts `python -m engine.core_process FD`, waits until the model is loaded, then
sends requests, aborts and stats questions, and a reader thread hands each step's deltas to the sink. Child: loads
the model, then steps while it has work, reading its inbox between steps. The child ends when the parent sends
stop or goes away (its end of the pair reads EOF), so a killed server leaves no core behind."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
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

class ProcessCore:
    def __init__(self, config: EngineConfig, sink: CoreSink, start_timeout_s: float = 3600.0) -> None:
        """Starts the core process and waits until its model is loaded; a model that fails to load raises here
        (a ValueError for a bad config or source, as LLMEngine would)."""
        from engine.engine_core import ModelFacts
        from engine.loader import load_tokenizer

        self._sink = sink
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "engine.core_process", str(theirs.fileno())], pass_fds=(theirs.fileno(),),
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._send(config)
        try:
            tokenizer = load_tokenizer(config.model, config.tokenizer)  # while the child loads the weights
        except BaseException:
            self._process.kill()
            self._process.wait()
            self._conn.close()
            raise
        kind, payload = self._recv_start(start_timeout_s)
        if kind == "failed":
            self._process.wait(10)
            raise payload
        vocab_size, max_model_len = payload
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
            if self._process.poll() is not None:
                raise EngineDeadError(f"the engine core process exited with {self._process.returncode} while loading")
            if time.monotonic() > deadline:
                self._process.kill()
                raise EngineDeadError(f"the engine core process did not load its model within {timeout_s:.0f} s")
        return self._conn.recv()

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
        try:
            self._send(("stop", None))
        except OSError:
            pass
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
            self._sink.died(e if not isinstance(e, EOFError | OSError)
                            else EngineDeadError(f"the engine core process ended (exit code {self._process.poll()})"))


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
    registered between two steps; removing and listing answer at once."""

    def __init__(self, engine: Any, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self._lock = threading.Lock()
        self._loaded: list[tuple[int, Any, BaseException | None]] = []
        self.pending = 0

    def handle(self, token: int, op: str, args: Any) -> None:
        try:
            if op == "add_lora":
                self.pending += 1
                threading.Thread(target=self._load, args=(token, *args), daemon=True).start()
                return
            result = self.engine.remove_lora(args) if op == "remove_lora" else self.engine.list_loras()
            self.conn.send(("lora", (token, {"result": result})))
        except ValueError as e:
            self.conn.send(("lora", (token, {"error": e})))

    def _load(self, token: int, name: str, path: str) -> None:
        try:
            adapter, error = self.engine.load_lora(name, path), None
        except BaseException as e:  # noqa: BLE001 - sent back to the caller
            adapter, error = None, _picklable(e)
        with self._lock:
            self._loaded.append((token, adapter, error))

    def register_loaded(self) -> None:
        with self._lock:
            loaded, self._loaded = self._loaded, []
        for token, adapter, error in loaded:
            self.pending -= 1
            if error is None:
                self.engine.add_loaded_lora(adapter)
            self.conn.send(("lora", (token, {"error": error} if error is not None else {"result": None})))


def serve(conn: Connection) -> None:
    config: EngineConfig = conn.recv()
    prefetch_checkpoint(config.model)
    from engine.engine_core import CoreLoop
    from engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        conn.send(("failed", _picklable(e)))
        return
    conn.send(("ready", (engine.model_config.vocab_size, engine.max_model_len)))
    loop = CoreLoop(engine)
    loads = _AdapterLoads(engine, conn)
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
                    conn.poll(timeout)
                    loop.count_waiting(time.monotonic() - idle_from)
            aborted: list[Delta] = []
            refusals: list[tuple[str, BaseException]] = []
            while conn.poll():
                kind, payload = conn.recv()
                if kind == "add":
                    error = loop.add(payload)
                    if error is not None:
                        refusals.append((payload.request_id, _picklable(error)))
                elif kind == "abort":
                    out = loop.abort(payload)
                    if out is not None:
                        aborted.append(out)
                elif kind == "stats":
                    conn.send(("stats", (payload, loop.stats(None))))
                elif kind == "lora":
                    loads.handle(*payload)
                elif kind in ("sleep", "wake"):
                    token, arg = payload
                    try:
                        result = loop.sleep(arg) if kind == "sleep" else loop.wake()
                        conn.send(("reply", (token, None, result)))
                    except Exception as e:  # noqa: BLE001 - the caller raises it
                        conn.send(("reply", (token, _picklable(e), None)))
                elif kind == "stop":
                    conn.send(("stopped", loop.stats(None)))
                    return
            for request_id, error in loop.serve_waiting():
                refusals.append((request_id, _picklable(error)))
            deltas = aborted + (loop.step() if loop.has_work else [])
            if deltas or refusals:
                conn.send(("step", (deltas, refusals)))
    except EOFError:
        return  # the parent went away
    except BaseException as e:  # noqa: BLE001
        log.exception("engine core failed")
        try:
            conn.send(("died", _picklable(e)))
        except OSError:
            pass
    finally:
        engine.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    serve(Connection(int(sys.argv[1])))


if __name__ == "__main__":
    main()
