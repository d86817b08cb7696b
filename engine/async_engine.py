"""AsyncEngine: the serving front of an engine core, streamed to asyncio consumers.

The front tokenizes and checks each request in the caller (bad input raises before anything is yielded), hands it
to the core (engine/engine_core.py: a thread of this process, or engine/core_process.py: a process of its own) and
streams what each step adds back to the consumer's event loop: one `call_soon_threadsafe` per loop per step carries
every request's delta, and a consumer that falls behind takes the steps it missed as one output
(engine/output_stream.py). A consumer that stops iterating (closed generator, cancelled task, dropped client)
aborts its request, which frees its KV blocks at once."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence as SequenceOf
from typing import Any

from engine.config import TOKENIZE_IN_THREAD_CHARS, EngineConfig, SamplingParams
from engine.engine_core import CoreRequest, EngineCore, ThreadCore, wants_process
from engine.errors import EngineDeadError, PromptTooLongError
from engine.llm_engine import LLMEngine
from engine.output_stream import RequestStream
from engine.outputs import Delta, RequestMetrics, RequestOutput
from engine.tokenizer import encode_prompt


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: a prompt of C characters has at least
    C / this many tokens, a bound that costs nothing to check before tokenizing."""
    if tokenizer is None:
        return 1
    return max((len(t) for t in tokenizer.hf.get_vocab()), default=1) or 1


def _put_all(items: list[tuple[RequestStream, Delta]]) -> None:
    for stream, delta in items:
        stream.put(delta)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        """Serves `engine` from a thread of this process (the in-process core)."""
        self._setup()
        self.core: EngineCore = ThreadCore(engine, self)
        self._longest_token = longest_token_chars(self.core.facts.tokenizer)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        """The core runs where `config.engine_core` says (engine_core.wants_process)."""
        if not wants_process(config):
            return cls(LLMEngine(config))
        from engine.core_process import ProcessCore

        return cls._over(lambda sink: ProcessCore(config, sink))

    @classmethod
    def attach(cls, config: EngineConfig, conn: Any) -> "AsyncEngine":
        """A front over an engine core another process spawned (engine/core_process.py spawn_core), reached over
        `conn`, one of its front connections; `config` is the one the core was started with. Shutting it down
        detaches this front only."""
        from engine.core_process import ProcessCore

        return cls._over(lambda sink: ProcessCore.attach(conn, config, sink))

    @classmethod
    def _over(cls, make_core: Any) -> "AsyncEngine":
        self = cls.__new__(cls)
        self._setup()
        self.core = make_core(self)
        self._longest_token = longest_token_chars(self.core.facts.tokenizer)
        return self

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._error: BaseException | None = None

    @property
    def engine(self) -> LLMEngine:
        """The LLMEngine, when it runs in this process."""
        if not isinstance(self.core, ThreadCore):
            raise AttributeError("engine: the engine core runs in a process of its own")
        return self.core.engine

    @property
    def tokenizer(self):
        return self.core.facts.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.facts.max_model_len

    @property
    def longest_token_chars(self) -> int:
        """The most characters one token stands for (longest_token_chars())."""
        return self._longest_token

    def encode_prompt(self, prompt: str | SequenceOf[int]) -> tuple[str | None, list[int]]:
        return encode_prompt(self.core.facts.tokenizer, self.core.facts.vocab_size, prompt)

    # ---- consumer side --------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | SequenceOf[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        account: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields a RequestOutput whenever steps added output since the last one (deltas and totals); the last
        has finished=True. Bad input raises ValueError before anything is yielded (an unknown lora_name: at the
        first iteration, once the core has looked it up)."""
        if self._error is not None:
            raise EngineDeadError(f"engine stopped: {self._error!r}")
        request_id = request_id or uuid.uuid4().hex
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        # validation runs here, in the caller, so errors surface before the first yield
        params.check_vocab(self.core.facts.vocab_size)
        limit = self.max_model_len
        if isinstance(prompt, str) and len(prompt) // self._longest_token >= limit:
            raise PromptTooLongError(len(prompt) // self._longest_token, limit, at_least=True)
        if isinstance(prompt, str) and len(prompt) > TOKENIZE_IN_THREAD_CHARS:
            text, token_ids = await asyncio.to_thread(self.encode_prompt, prompt)
        else:
            text, token_ids = self.encode_prompt(prompt)
        # a served request must fit whole: max_tokens beyond the context is an error, not silently capped
        if len(token_ids) >= limit:
            raise PromptTooLongError(len(token_ids), limit)
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > limit:
            raise PromptTooLongError(len(token_ids), limit, params.max_tokens)
        arrival = time.monotonic()
        stream = RequestStream(request_id, text, token_ids, params.n, params.logprobs is not None,
                               RequestMetrics(arrival, num_prompt_tokens=len(token_ids)), asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already running")
            self._streams[request_id] = stream
        finished = False
        try:
            self.core.add(CoreRequest(request_id, token_ids, params, priority, arrival, cache_salt, account,
                                      lora_name))
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.core.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    async def add_lora(self, name: str, path: str) -> None:
        """Serves the PEFT adapter at `path` as `name` without pausing the requests running meanwhile (it is read
        off the core's stepping thread); ValueError for an adapter the engine cannot serve."""
        await asyncio.to_thread(self.core.add_lora, name, path)

    async def remove_lora(self, name: str) -> bool:
        return await asyncio.to_thread(self.core.remove_lora, name)

    def list_loras(self) -> list[str]:
        return self.core.list_loras()

    def stats(self) -> dict:
        return self.core.stats()

    async def sleep(self, level: int = 1) -> int:
        """Gives the device memory back (engine/sleep.py) once the engine is idle; its sleep level after. A
        ValueError while requests run. Requests that arrive while it sleeps wake it (wake_on_request) or wait for
        wake() up to sleep_wait_timeout_s."""
        return await asyncio.to_thread(self.core.sleep, level)

    async def wake(self) -> float:
        """The weights and the KV pool back; the seconds it took (0.0 when awake)."""
        return await asyncio.to_thread(self.core.wake)

    @property
    def sleep_level(self) -> int:
        """0 when awake, else the level the engine sleeps at."""
        return self.core.sleep_level

    def shutdown(self, timeout: float = 10.0) -> None:
        self.core.shutdown(timeout)

    # ---- the core's side (CoreSink): called from the core's thread ------------------------------

    def deltas(self, deltas: list[Delta]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Delta]]] = {}
        with self._lock:
            for delta in deltas:
                stream = self._streams.get(delta[0])
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, delta))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the consumer's loop is closed
                pass

    def refused(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            self._fail(stream, error)

    def died(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
            streams = list(self._streams.values())
        for stream in streams:
            self._fail(stream, EngineDeadError(f"engine stopped: {error!r}"))

    @staticmethod
    def _fail(stream: RequestStream, error: BaseException) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.fail, error)
        except RuntimeError:
            pass
