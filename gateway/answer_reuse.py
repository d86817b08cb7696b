"""The two levers before a model runs: the task router (`model: "auto"`) and the semantic cache.

A cache hit is served as a one-chunk generation stream, so it goes back to the client through the
same whole/streamed paths, in the same shape, as a live answer, and leaves its usage event the same way."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cache.namespace import CacheDecision, TenantCacheSettings, namespace_for_request
from cache.types import Hit
from gateway.backends import ChoiceDelta, GenerationChunk
from gateway.errors import model_not_found
from gateway.router import ModelSpec as RouteSpec
from gateway.router import RouteDecision, route

if TYPE_CHECKING:
    from cache.semantic_cache import SemanticCache

log = logging.getLogger("tollgate.gateway")

AUTO_MODEL = "auto"


@dataclass
class CacheOutcome:
    decision: CacheDecision | None  # None: no cache configured
    hit: Hit | None = None

    @property
    def header(self) -> str:
        if self.hit is not None:
            return "hit"
        return "miss" if self.decision is not None and self.decision.cacheable else "skip"


class AnswerReuse:
    def __init__(self, cache: SemanticCache | None) -> None:
        self.cache = cache
        self._pending: set[asyncio.Task[None]] = set()

    @staticmethod
    def route(messages: Sequence[Mapping[str, Any]], max_tokens: int | None,
              candidates: Sequence[RouteSpec]) -> RouteDecision:
        """The router's choice among `candidates`, the models deployed and serving now."""
        if not candidates:
            raise model_not_found(AUTO_MODEL)
        return route(messages, candidates, max_tokens)

    async def lookup(self, tenant_uid: str, model: str, body: Mapping[str, Any]) -> CacheOutcome:
        if self.cache is None:
            return CacheOutcome(None)
        decision = namespace_for_request(tenant_uid, model, body, TenantCacheSettings())
        if not decision.cacheable:
            return CacheOutcome(decision)
        try:  # embedding the prompt is CPU work: keep it off the event loop
            hit = await asyncio.to_thread(self.cache.lookup, decision.namespace, decision.prompt)
        except Exception:  # a broken cache must never fail a request: the model answers instead
            log.exception("semantic cache lookup failed")
            return CacheOutcome(None)
        return CacheOutcome(decision, hit)

    def store_later(self, decision: CacheDecision, answer: str, usage: dict[str, Any]) -> None:
        """Stores the answer in the background: the response never waits for the cache."""
        if self.cache is None or not answer:
            return
        task = asyncio.get_running_loop().create_task(self._store(decision, answer, usage))
        self._pending.add(task)  # a reference until it is done, so it is not collected mid-flight
        task.add_done_callback(self._pending.discard)

    @property
    def pending_stores(self) -> int:
        return len(self._pending)

    async def _store(self, decision: CacheDecision, answer: str, usage: dict[str, Any]) -> None:
        try:
            await asyncio.to_thread(self.cache.store, decision.namespace, decision.prompt, answer, usage)
        except Exception:
            log.exception("semantic cache store failed")


async def hit_stream(request_id: str, hit: Hit) -> AsyncIterator[GenerationChunk]:
    """The cached answer as a generation: one chunk carrying the whole text and its original usage."""
    prompt_tokens = int(hit.usage.get("prompt_tokens", 0))
    completion_tokens = int(hit.usage.get("completion_tokens", 0))
    yield GenerationChunk(
        request_id=request_id,
        choices=[ChoiceDelta(0, hit.answer, completion_tokens, str(hit.usage.get("finish_reason") or "stop"))],
        prompt_tokens=prompt_tokens,
        cached_tokens=0,
        completion_tokens=completion_tokens,
        finished=True,
        ttft_s=0.0,
    )
