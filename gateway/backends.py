"""How the HTTP layer reaches a model. It knows only `ModelBackend`; `LocalEngineBackend` runs an
AsyncEngine in this process (a Ray Serve handle is the other implementation). Chunks are plain
picklable dataclasses with token strings already decoded, so a remote backend can send them."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from engine.config import TOKENIZE_IN_THREAD_CHARS, EngineConfig, SamplingParams
from engine.errors import EngineAsleepError, EngineDeadError
from engine.outputs import RequestOutput, TokenLogprob
from gateway.specs import ModelKind, ModelSpec, engine_fields

# ready: serving; scaled_to_zero: no replica now, a request starts one; loading: starting, try again shortly;
# unavailable: cannot serve (BackendInfo.reason says why); stopped: shut down
BackendState = Literal["ready", "scaled_to_zero", "loading", "unavailable", "stopped"]
SERVING_STATES = ("ready", "scaled_to_zero")


@dataclass
class GenerationRequest:
    request_id: str
    params: SamplingParams
    messages: list[dict[str, Any]] | None = None  # chat: rendered with the model's chat template
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI function tools, rendered with the messages
    prompt: str | list[int] | None = None  # completions
    priority: int = 0
    # prefix-cache blocks are shared only among requests with the same salt (the gateway's: per tenant)
    cache_salt: str | None = None
    account: str | None = None  # the tenant (uid) whose GPU time this request's share of each step is
    lora_name: str | None = None  # the LoRA adapter served over the model that runs it (gateway/adapters.py)
    # where that adapter lies: an engine that does not serve it from there yet (a replica that started while it was
    # being added) loads it before the request runs
    lora_path: str | None = None


@dataclass
class TokenInfo:
    token: str  # its text; where its bytes are part of a character, the bytes escaped ("\\xe6"), not U+FFFD
    logprob: float
    bytes: bytes  # the token's own bytes
    top: list[TokenInfo] = field(default_factory=list)


MIN_LOGPROB = -9999.0  # what OpenAI (and vLLM's server) report for a token that cannot come: JSON has no -Infinity


def _finite(logprob: float) -> float:
    """A token a constraint rules out has logprob -inf, among a constrained request's top_logprobs."""
    return max(logprob, MIN_LOGPROB)


@dataclass
class ChoiceDelta:
    index: int
    text: str
    num_tokens: int
    finish_reason: str | None
    logprobs: list[TokenInfo] | None = None


@dataclass
class GenerationChunk:
    request_id: str
    choices: list[ChoiceDelta]  # only choices with new tokens or a finish reason
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # all choices, so far
    finished: bool
    ttft_s: float | None = None
    queue_s: float | None = None  # from reaching the engine to its first scheduled step


@dataclass(frozen=True)
class BackendInfo:
    name: str
    max_model_len: int | None
    state: BackendState
    replicas: int | None = None  # replicas serving now
    replica_states: dict[str, int] | None = None  # e.g. {"running": 2, "starting": 1}
    reason: str | None = None  # why the model is unavailable
    kind: ModelKind = "chat"  # which endpoints it serves (gateway/specs.py)
    # the most characters one of the model's tokens stands for (None: unknown until a replica reports it): a prompt
    # of max_model_len × this many characters or more cannot fit, which the gateway checks before tokenizing
    longest_token_chars: int | None = None

    @property
    def serving(self) -> bool:
        return self.state in SERVING_STATES


@runtime_checkable
class ModelBackend(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]: ...

    async def abort(self, request_id: str) -> None: ...

    def info(self) -> BackendInfo: ...


class BackendUnavailable(RuntimeError):
    """The model cannot take the request now; the message says why (a 503 for the client)."""


class LocalEngineBackend:
    def __init__(self, spec: ModelSpec, *, core_connection: Any = None, **engine_overrides: Any) -> None:
        """`core_connection`: a front connection to an engine core another process started for this spec (`serve
        --local --api-servers N`, gateway/cli/api_servers.py); None: start the engine here."""
        self.spec = spec
        self._fields = {**engine_fields(spec), **engine_overrides}
        self._core_connection = core_connection
        self._engine: Any = None
        self._state: BackendState = "stopped"
        self._reason: str | None = None
        self._token_cache: dict[int, str] = {}
        self._adapters: dict[str, str] = dict(self._fields.get("lora_modules") or {})  # name -> source served
        self._adapter_lock = asyncio.Lock()

    async def start(self) -> None:
        """Load the model (blocking work runs in a thread). A model that cannot load is left unavailable,
        with the reason, and the error is raised."""
        from engine import AsyncEngine

        self._state = "loading"
        try:
            if self._core_connection is not None:
                config = EngineConfig.from_kwargs(self.spec.source, **{**self._fields, "engine_core": "process"})
                self._engine = await asyncio.to_thread(AsyncEngine.attach, config, self._core_connection)
            else:
                config = EngineConfig.from_kwargs(self.spec.source, **self._fields)
                self._engine = await asyncio.to_thread(AsyncEngine.from_config, config)
        except BaseException as e:
            self.mark_unavailable(str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
            raise
        self._state = "ready"

    def mark_unavailable(self, reason: str) -> None:
        self._state, self._reason = "unavailable", reason

    def stop(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._state != "unavailable":
            self._state = "stopped"

    @property
    def engine(self) -> Any:
        return self._engine

    def info(self) -> BackendInfo:
        max_len = self._engine.max_model_len if self._engine is not None else self._fields.get("max_model_len")
        ready = self._state == "ready"
        states = {"running": 1} if ready else {"starting": 1} if self._state == "loading" else {}
        longest = self._engine.longest_token_chars if self._engine is not None else None
        return BackendInfo(self.spec.name, max_len, self._state, 1 if ready else 0, states, self._reason,
                           longest_token_chars=longest)

    def stats(self) -> dict[str, Any]:
        return self._engine.stats() if self._engine is not None else {}

    def asleep_seconds(self) -> float:
        """The engine's time asleep since it started (replica interval rows)."""
        return float(self.stats().get("asleep_seconds", 0.0))

    @property
    def sleep_level(self) -> int:
        return self._engine.sleep_level if self._engine is not None else 0

    async def sleep(self, level: int = 1) -> int:
        """Puts the idle engine to sleep (engine/sleep.py); ValueError while requests run."""
        if self._engine is None:
            return 0
        return await self._engine.sleep(level)

    async def wake(self) -> float:
        """Wakes the engine; the seconds it took (0.0 when awake)."""
        if self._engine is None:
            return 0.0
        return await self._engine.wake()

    def busy_totals(self) -> tuple[float, dict[str | None, float]]:
        """The engine's busy seconds since it started, in all and per account (replica interval rows)."""
        stats = self.stats()
        return float(stats.get("busy_seconds", 0.0)), dict(stats.get("busy_seconds_by_account", {}))

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    async def add_adapter(self, name: str, source: str) -> None:
        """Serves a LoRA adapter from now on (replacing one of that name), without restarting the model; ValueError
        for one it cannot serve."""
        if self._engine is None:
            raise BackendUnavailable(f"The model `{self.spec.name}` is {self._state}")
        await self._engine.add_lora(name, source)
        self._adapters[name] = source

    async def remove_adapter(self, name: str) -> bool:
        self._adapters.pop(name, None)
        return await self._engine.remove_lora(name) if self._engine is not None else False

    def know_adapters(self, recorded: dict[str, str]) -> None:
        """The run-time adapters (name -> source) that another front of the same engine core added there: served
        without loading them again (the spec's own stay)."""
        self._adapters = {**recorded, **dict(self._fields.get("lora_modules") or {})}

    def adapters(self) -> dict[str, str]:
        """The adapters served now: name -> source."""
        return dict(self._adapters)

    async def _ensure_adapter(self, name: str, source: str) -> None:
        async with self._adapter_lock:  # concurrent first requests for it load it once
            if self._adapters.get(name) != source:
                await self.add_adapter(name, source)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if self._state != "ready":
            why = f": {self._reason}" if self._reason else ""
            raise BackendUnavailable(f"The model `{self.spec.name}` is {self._state}{why}")
        engine = self._engine
        if request.lora_name is not None and request.lora_path is not None:
            await self._ensure_adapter(request.lora_name, request.lora_path)
        if request.messages is not None:
            render = functools.partial(engine.tokenizer.apply_chat_template, request.messages, tools=request.tools)
            if sum(len(m.get("content") or "") for m in request.messages) > TOKENIZE_IN_THREAD_CHARS \
                    or request.tools or any(m.get("tool_calls") for m in request.messages):
                prompt: str | list[int] = await asyncio.to_thread(render)
            else:
                prompt = render()
        elif request.prompt is not None:
            prompt = request.prompt
        else:
            raise ValueError("prompt: missing")
        if request.params.logprobs is not None and engine.tokenizer is not None \
                and not engine.tokenizer.knows_token_bytes:
            await asyncio.to_thread(engine.tokenizer.token_bytes, [])  # built once, off the event loop
        finish_reported: set[int] = set()
        try:
            async for out in engine.generate(prompt, request.params, request.request_id, priority=request.priority,
                                             cache_salt=request.cache_salt, account=request.account,
                                             lora_name=request.lora_name):
                yield self._chunk(out, finish_reported)
        except EngineAsleepError as e:  # it slept and could not wake in time: a 503 to retry, not a 500
            raise BackendUnavailable(f"The model `{self.spec.name}` is asleep: {e}") from e
        except EngineDeadError as e:  # the engine (its core process) is gone: a 503 naming why, not a 500
            self.mark_unavailable(f"its engine stopped ({e})")
            raise BackendUnavailable(f"The model `{self.spec.name}` is unavailable: its engine stopped") from e

    def _chunk(self, out: RequestOutput, finish_reported: set[int]) -> GenerationChunk:
        choices = []
        for o in out.outputs:
            new_finish = o.finish_reason is not None and o.index not in finish_reported
            if o.delta_token_ids or o.delta_text or new_finish:
                logprobs = None if o.delta_logprobs is None else [self._token_info(lp) for lp in o.delta_logprobs]
                choices.append(ChoiceDelta(o.index, o.delta_text, len(o.delta_token_ids), o.finish_reason, logprobs))
                if new_finish:
                    finish_reported.add(o.index)
        m = out.metrics
        prompt_tokens = len(out.prompt_token_ids)
        ttft = queue = None
        if m.first_token_time is not None:
            ttft = max(0.0, m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            queue = max(0.0, m.first_scheduled_time - m.arrival_time)
        return GenerationChunk(
            request_id=out.request_id,
            choices=choices,
            prompt_tokens=prompt_tokens,
            cached_tokens=min(m.num_cached_tokens, prompt_tokens),
            completion_tokens=sum(len(o.token_ids) for o in out.outputs),
            finished=out.finished,
            ttft_s=ttft,
            queue_s=queue,
        )

    def _token_info(self, lp: TokenLogprob) -> TokenInfo:
        return self._token_entry(lp.token_id, lp.logprob, [self._token_entry(t, v) for t, v in lp.top])

    def _token_entry(self, token_id: int, logprob: float, top: list[TokenInfo] | None = None) -> TokenInfo:
        text, raw = self._token(token_id)
        return TokenInfo(text, _finite(logprob), raw, top or [])

    def _token(self, token_id: int) -> tuple[str, bytes]:
        """The token's text and bytes, as logprobs show them."""
        known = self._token_cache.get(token_id)
        if known is None:
            tokenizer = self._engine.tokenizer
            text = tokenizer.decode([token_id], skip_special_tokens=False)
            if "\ufffd" in text:  # part of a character, or U+FFFD itself
                raw = tokenizer.token_bytes([token_id])
                known = raw.decode("utf-8", "backslashreplace"), raw
            else:
                known = text, text.encode("utf-8")
            if len(self._token_cache) < 200_000:
                self._token_cache[token_id] = known
        return known
