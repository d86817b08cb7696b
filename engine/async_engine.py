"""AsyncEngine: an LLMEngine stepped by a background thread, streamed to asyncio consumers.

Requests and aborts reach the thread through a lock-protected inbox; outputs go back to each
consumer's asyncio queue on its own event loop. A consumer that stops iterating (closed generator,
cancelled task, dropped client) aborts its request, which frees its KV blocks at once."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence as SequenceOf
from dataclasses import dataclass
from typing import Any

from engine.config import TOKENIZE_IN_THREAD_CHARS, EngineConfig, SamplingParams
from engine.errors import EngineDeadError, PromptTooLongError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: a prompt of C characters has at least
    C / this many tokens, a bound that costs nothing to check before tokenizing."""
    if tokenizer is None:
        return 1
    return max((len(t) for t in tokenizer.hf.get_vocab()), default=1) or 1


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._longest_token = longest_token_chars(engine.tokenizer)
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: list[tuple[str, Any]] = []
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._idle_since: float | None = None  # set while the engine thread waits for work
        self._thread = threading.Thread(target=self._run, name="tollgate-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine(config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ---- consumer side --------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | SequenceOf[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        account: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per engine step with new text; the last has finished=True.
        Bad input raises ValueError before anything is yielded."""
        if self._error is not None:
            raise EngineDeadError(f"engine stopped: {self._error!r}")
        request_id = request_id or uuid.uuid4().hex
        params = params or SamplingParams()
        # validation runs here, in the caller, so errors surface before the first yield
        limit = self.engine.max_model_len
        if isinstance(prompt, str) and len(prompt) // self._longest_token >= limit:
            raise PromptTooLongError(len(prompt) // self._longest_token, limit, at_least=True)
        if isinstance(prompt, str) and len(prompt) > TOKENIZE_IN_THREAD_CHARS:
            _, token_ids = await asyncio.to_thread(self.engine.encode_prompt, prompt)
        else:
            _, token_ids = self.engine.encode_prompt(prompt)
        # a served request must fit whole: max_tokens beyond the context is an error, not silently capped
        if len(token_ids) >= limit:
            raise PromptTooLongError(len(token_ids), limit)
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > limit:
            raise PromptTooLongError(len(token_ids), limit, params.max_tokens)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        finished = False
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already running")
            self._streams[request_id] = stream
            self._inbox.append(("add", (request_id, prompt if isinstance(prompt, str) else token_ids, params, priority,
                                        time.monotonic(), cache_salt, account)))
            self._wakeup.notify()
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
                if not finished:
                    self._inbox.append(("abort", request_id))
                    self._wakeup.notify()

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._wakeup.notify()

    def stats(self) -> dict:
        with self._lock:
            snap = self.engine.stats()
            if self._idle_since is not None:  # the idle spell going on now counts too
                snap["idle_seconds"] += time.monotonic() - self._idle_since
            return snap

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
            self._wakeup.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()

    # ---- engine thread --------------------------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed
                pass

    def _drain_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        for kind, payload in inbox:
            if kind == "add":
                request_id, prompt, params, priority, arrival, cache_salt, account = payload
                if request_id not in self._streams:
                    continue  # the consumer left before the request reached the engine
                try:
                    self.engine.add_request(request_id, prompt, params, priority, arrival, cache_salt=cache_salt,
                                            account=account)
                except ValueError as exc:
                    self._deliver(request_id, exc)
            else:
                out = self.engine.abort_request(payload)
                if out is not None:
                    self._deliver(payload, out)

    def _run(self) -> None:
        metrics = self.engine.metrics
        try:
            while True:
                idle_from = time.monotonic()
                with self._lock:
                    self._idle_since = idle_from
                    while not self._stopped and not self._inbox and not self.engine.has_unfinished_requests():
                        self._wakeup.wait()
                    self._idle_since = None
                    metrics.idle_seconds += time.monotonic() - idle_from
                    if self._stopped:
                        return
                    self._drain_inbox()
                busy_from = time.monotonic()
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                with self._lock:
                    metrics.add_busy(time.monotonic() - busy_from, self.engine.step_tokens_by_account)
                    for out in outputs:
                        self._deliver(out.request_id, out)
        except BaseException as exc:  # noqa: BLE001 - every waiting consumer must hear about it
            log.exception("engine loop failed")
            with self._lock:
                self._error = exc
                for request_id in list(self._streams):
                    self._deliver(request_id, EngineDeadError(f"engine stopped: {exc!r}"))
