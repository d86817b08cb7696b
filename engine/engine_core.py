"""The engine core: an LLMEngine stepped in a loop while it has work, taking new requests and aborts between steps
and handing each step's Deltas to a sink. AsyncEngine (the serving front) runs it in a thread of its own
process (ThreadCore, here) or in a process of its own (engine/core_process.py), as vLLM v1 runs its EngineCore."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from engine.config import EngineConfig, SamplingParams
from engine.errors import EngineAsleepError, EngineDeadError
from engine.llm_engine import LLMEngine
from engine.outputs import Delta
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreRequest:
    """A request as the front hands it to the core: already tokenized and checked."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    cache_salt: str | None
    account: str | None
    lora_name: str | None = None


@dataclass(frozen=True)
class ModelFacts:
    """What the front needs of the loaded model to tokenize and check requests itself."""

    tokenizer: Tokenizer | None
    vocab_size: int
    max_model_len: int


class CoreSink(Protocol):
    """Where a core's results go; called from the core's thread (or its reader thread), never the consumer's."""

    def deltas(self, deltas: list[Delta]) -> None: ...

    def refused(self, request_id: str, error: BaseException) -> None: ...

    def died(self, error: BaseException) -> None: ...


class EngineCore(Protocol):
    facts: ModelFacts

    def add(self, request: CoreRequest) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def add_lora(self, name: str, path: str) -> None:
        """Reads the adapter off the core's stepping thread, then serves it from the next step on; blocks until
        then. A bad adapter raises ValueError and changes nothing."""

    def remove_lora(self, name: str) -> bool: ...

    def list_loras(self) -> list[str]: ...

    def sleep(self, level: int) -> int: ...

    def wake(self) -> float: ...

    @property
    def sleep_level(self) -> int: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...


def wants_process(config: EngineConfig) -> bool:
    """engine_core "auto": a process of its own on a GPU, where one Python process cannot both keep the GPU fed
    and serve the HTTP streams; a thread on a CPU, where the model's own arithmetic dwarfs that and a process
    would only add its start-up."""
    if config.engine_core != "auto":
        return config.engine_core == "process"
    import torch

    return config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())


class CoreLoop:
    """The work between steps and of one step, shared by both cores."""

    def __init__(self, engine: LLMEngine, counters_lock: threading.Lock | None = None) -> None:
        """`counters_lock`: held while a step's time is added to the counters that stats() reads."""
        self.engine = engine
        self._counters_lock = counters_lock

    def add(self, request: CoreRequest) -> ValueError | None:
        """Queues the request (a sleeping engine queues it too: it runs after the wake); the ValueError that
        refused it, if any."""
        try:
            self.engine.add_request(request.request_id, request.prompt_token_ids, request.params, request.priority,
                                    request.arrival_time, cache_salt=request.cache_salt, account=request.account,
                                    lora_name=request.lora_name)
        except ValueError as e:
            return e
        return None

    def abort(self, request_id: str) -> Delta | None:
        return self.engine.abort_request(request_id, as_delta=True)  # type: ignore[return-value]

    @property
    def has_work(self) -> bool:
        """Requests to step: none while the engine sleeps (they wait for its wake)."""
        return self.engine.has_unfinished_requests() and not self.engine.sleep_level

    @property
    def asleep(self) -> bool:
        return bool(self.engine.sleep_level)

    def count_waiting(self, seconds: float) -> None:
        """Time spent with nothing to step: idle when awake, asleep (not billed as idle) when asleep."""
        if self.engine.sleep_level:
            self.engine.metrics.asleep_seconds += seconds
        else:
            self.engine.metrics.idle_seconds += seconds

    def sleep(self, level: int) -> int:
        self.engine.sleep(level)
        return self.engine.sleep_level

    def wake(self) -> float:
        return self.engine.wake()

    def serve_waiting(self) -> list[tuple[str, BaseException]]:
        """For a sleeping engine with requests: wakes it (wake_on_request) and lets them run; otherwise refuses
        the ones that waited past sleep_wait_timeout_s. A wake that fails refuses every waiting request with the
        reason. Returns the refusals (their requests already aborted)."""
        engine = self.engine
        if not engine.sleep_level or not engine.has_unfinished_requests():
            return []
        if engine.config.wake_on_request:
            try:
                engine.wake()
                return []
            except Exception as e:  # noqa: BLE001 - out of memory, a missing checkpoint: the callers hear it
                log.exception("waking the engine for a request failed")
                return self._refuse(list(engine.requests), EngineAsleepError(f"the model could not wake: {e}"))
        now = time.monotonic()
        late = [rid for rid, state in engine.requests.items()
                if now - state.metrics.arrival_time >= engine.config.sleep_wait_timeout_s]
        return self._refuse(late, EngineAsleepError(
            f"the model is asleep and did not wake within sleep_wait_timeout_s={engine.config.sleep_wait_timeout_s:g}"
            " s; retry later"))

    def _refuse(self, request_ids: list[str], error: BaseException) -> list[tuple[str, BaseException]]:
        for request_id in request_ids:
            self.engine.abort_request(request_id)
        return [(request_id, error) for request_id in request_ids]

    def seconds_to_next_deadline(self) -> float | None:
        """While asleep with waiting requests (and no wake on request): how long until the first of them has
        waited sleep_wait_timeout_s; None when nothing waits on a clock."""
        engine = self.engine
        if not engine.sleep_level or not engine.has_unfinished_requests():
            return None
        first = min(state.metrics.arrival_time for state in engine.requests.values())
        return max(0.0, first + engine.config.sleep_wait_timeout_s - time.monotonic())

    def step(self) -> list[Delta]:
        """One step, its wall time counted busy and split over the accounts in it."""
        started = time.monotonic()
        deltas = self.engine.step_deltas()
        busy = time.monotonic() - started
        if self._counters_lock is None:
            self.engine.metrics.add_busy(busy, self.engine.step_tokens_by_account)
        else:
            with self._counters_lock:
                self.engine.metrics.add_busy(busy, self.engine.step_tokens_by_account)
        return deltas

    def stats(self, idle_since: float | None) -> dict[str, Any]:
        snap = self.engine.stats()
        if idle_since is not None:  # the idle (or asleep) spell going on now counts too
            snap["asleep_seconds" if self.asleep else "idle_seconds"] += time.monotonic() - idle_since
        return snap


class ThreadCore:
    """The core in a background thread of this process. Requests, aborts and sleep / wake commands reach it through
    a lock-protected inbox, taken between steps."""

    def __init__(self, engine: LLMEngine, sink: CoreSink) -> None:
        self.engine = engine
        self.facts = ModelFacts(engine.tokenizer, engine.model_config.vocab_size, engine.max_model_len)
        self._lock = threading.Lock()
        self._loop = CoreLoop(engine, self._lock)
        self._sink = sink
        self._wakeup = threading.Condition(self._lock)
        self._inbox: list[tuple[str, Any]] = []
        self._stopped = False
        self._idle_since: float | None = None  # set while the thread waits for work
        self._thread = threading.Thread(target=self._run, name="tollgate-engine", daemon=True)
        self._thread.start()

    def add(self, request: CoreRequest) -> None:
        self._post("add", request)

    def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    def add_lora(self, name: str, path: str) -> None:
        adapter = self.engine.load_lora(name, path)  # in the caller's thread: the steps go on meanwhile
        applied = threading.Event()
        self._post("call", (lambda: self.engine.add_loaded_lora(adapter), applied))
        applied.wait()

    def remove_lora(self, name: str) -> bool:
        with self._lock:  # between steps
            return self.engine.remove_lora(name)

    def list_loras(self) -> list[str]:
        with self._lock:
            return self.engine.list_loras()

    def sleep(self, level: int) -> int:
        """Puts the idle engine to sleep (engine/sleep.py) between steps; its sleep level after. ValueError when
        requests are unfinished."""
        return self._command("sleep", level)

    def wake(self) -> float:
        """Wakes the engine between steps; the seconds it took (0.0 when awake)."""
        return self._command("wake", None)

    @property
    def sleep_level(self) -> int:
        return self.engine.sleep_level

    def _command(self, kind: str, arg: Any) -> Any:
        done: Future = Future()
        self._post(kind, (arg, done))
        return done.result()

    def _post(self, kind: str, payload: Any) -> None:
        with self._lock:
            if self._stopped and kind in ("sleep", "wake"):
                raise EngineDeadError("the engine core has stopped")
            self._inbox.append((kind, payload))
            self._wakeup.notify()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self._loop.stats(self._idle_since)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
            self._wakeup.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()

    def _take_inbox(self) -> tuple[list[Delta], list[tuple[str, Any]]]:
        """Applies the inbox's requests and aborts (under the lock); returns the outputs of the aborted requests
        and the sleep / wake commands, which run outside the lock."""
        inbox, self._inbox = self._inbox, []
        aborted, commands = [], []
        for kind, payload in inbox:
            if kind == "add":
                error = self._loop.add(payload)
                if error is not None:
                    self._sink.refused(payload.request_id, error)
            elif kind == "call":
                call, done = payload
                try:
                    call()
                finally:
                    done.set()
            elif kind == "abort":
                out = self._loop.abort(payload)
                if out is not None:
                    aborted.append(out)
            else:
                commands.append((kind, payload))
        return aborted, commands

    def _run_command(self, kind: str, payload: Any) -> None:
        arg, done = payload
        try:
            done.set_result(self._loop.sleep(arg) if kind == "sleep" else self._loop.wake())
        except BaseException as e:  # noqa: BLE001 - the caller raises it
            done.set_exception(e)

    def _run(self) -> None:
        leftover: list[tuple[str, Any]] = []
        try:
            while True:
                idle_from = time.monotonic()
                with self._lock:
                    self._idle_since = idle_from
                    while not self._stopped and not self._inbox and not self._loop.has_work:
                        timeout = self._loop.seconds_to_next_deadline()
                        if timeout == 0.0 or (self._loop.asleep and self.engine.has_unfinished_requests()
                                              and self.engine.config.wake_on_request):
                            break
                        self._wakeup.wait(timeout)
                    self._idle_since = None
                    self._loop.count_waiting(time.monotonic() - idle_from)
                    if self._stopped:
                        leftover, self._inbox = self._inbox, []
                        break
                    deltas, commands = self._take_inbox()
                for kind, payload in commands:
                    self._run_command(kind, payload)
                for request_id, error in self._loop.serve_waiting():
                    self._sink.refused(request_id, error)
                if self._loop.has_work:
                    deltas += self._loop.step()
                if deltas:
                    self._sink.deltas(deltas)
        except BaseException as exc:  # noqa: BLE001 - every waiting consumer must hear about it
            log.exception("engine loop failed")
            with self._lock:
                self._stopped = True
                leftover, self._inbox = self._inbox, []
            self._sink.died(exc)
        for kind, payload in leftover:  # callers still waiting get an error (or their event) rather than a hang
            if kind in ("sleep", "wake"):
                payload[1].set_exception(EngineDeadError("the engine core has stopped"))
            elif kind == "call":
                payload[1].set()
