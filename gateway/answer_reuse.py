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
from cache.types import Hit, Lookup
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
    lookup: Lookup | None = None

    @property
    def hit(self) -> Hit | None:
        return None if self.lookup is None else self.lookup.hit

    @property
    def learning(self) -> bool:
        return self.lookup is not None and self.lookup.state == "learning"

    @property
    def header(self) -> str:
        """x-tollgate-cache: hit, learning (the model answers and its answer teaches the nearest entry), miss, or
        skip (not cacheable)."""
        if self.lookup is not None:
            return self.lookup.state
        return "miss" if self.decision is not None and self.decision.cacheable else "skip"

    def headers(self) -> dict[str, str]:
        out = {"x-tollgate-cache": self.header}
        found = self.lookup
        if found is not None and found.score is not None:
            out["x-tollgate-cache-score"] = f"{found.score:.6f}"
            out["x-tollgate-cache-threshold"] = f"{found.threshold:.6f}"
        if found is not None and found.hit is not None:
            out["x-tollgate-cache-similarity"] = f"{found.hit.similarity:.4f}"
        return out


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

    async def lookup(self, tenant_uid: str, model: str, body: Mapping[str, Any],
                     max_false_hit_rate: float | None = None) -> CacheOutcome:
        """`max_false_hit_rate`: the key's (else its tenant's) bound δ; None: the default."""
        if self.cache is None:
            return CacheOutcome(None)
        decision = namespace_for_request(tenant_uid, model, body, TenantCacheSettings())
        if not decision.cacheable:
            return CacheOutcome(decision)
        try:  # embedding the prompt is CPU work: keep it off the event loop
            found = await asyncio.to_thread(self.cache.consult, decision.namespace, decision.prompt, None,
                                            max_false_hit_rate)
        except ConnectionError as error:  # the cache deployment is stopping (or unreachable): the model answers
            log.warning("semantic cache lookup skipped: %s", error)
            return CacheOutcome(None)
        except Exception:  # a broken cache must never fail a request: the model answers instead
            log.exception("semantic cache lookup failed")
            return CacheOutcome(None)
        return CacheOutcome(decision, found)

    async def note_served(self, response_id: str, outcome: CacheOutcome) -> None:
        """Remembers which entry answered `response_id`, so its client can flag it (POST /v1/cache/feedback)."""
        if self.cache is None or outcome.decision is None or outcome.lookup is None:
            return
        try:
            await asyncio.to_thread(self.cache.note_served, response_id, outcome.decision.namespace, outcome.lookup)
        except Exception:
            log.exception("semantic cache could not note a served answer")

    async def flag(self, tenant_uid: str, response_id: str) -> Any:
        """The Flagged record, or None when no answer of this tenant was served as `response_id`."""
        if self.cache is None:
            return None
        return await asyncio.to_thread(self.cache.flag, tenant_uid, response_id)

    async def flagged(self, tenant_uid: str | None = None, limit: int = 100) -> list[Any]:
        """The flagged answers (cache.store.FlagRecord), the latest first; none without a cache."""
        if self.cache is None:
            return []
        return await asyncio.to_thread(self.cache.flagged, tenant_uid, limit)

    async def tenant_report(self) -> dict[str, dict[str, Any]]:
        """tenant uid -> entries, flagged answers, labels and learned thresholds (SemanticCache.tenant_report)."""
        if self.cache is None:
            return {}
        return await asyncio.to_thread(self.cache.tenant_report)

    def store_later(self, decision: CacheDecision, answer: str, usage: dict[str, Any],
                    learning: Lookup | None = None) -> None:
        """Stores the answer in the background: the response never waits for the cache. `learning`: the lookup
        that found a candidate near its threshold; the fresh answer labels that entry first."""
        if self.cache is None or not answer:
            return
        task = asyncio.get_running_loop().create_task(self._store(decision, answer, usage, learning))
        self._pending.add(task)  # a reference until it is done, so it is not collected mid-flight
        task.add_done_callback(self._pending.discard)

    @property
    def pending_stores(self) -> int:
        return len(self._pending)

    async def _store(self, decision: CacheDecision, answer: str, usage: dict[str, Any],
                     learning: Lookup | None) -> None:
        try:
            if learning is not None and learning.entry_id is not None and learning.score is not None:
                await asyncio.to_thread(self.cache.learn, decision.namespace, learning.entry_id, learning.score,
                                        answer, None, learning.explored)
            await asyncio.to_thread(self.cache.store, decision.namespace, decision.prompt, answer, usage)
        except ConnectionError as error:  # the cache deployment is stopping (or unreachable): the answer is not kept
            log.warning("semantic cache store skipped: %s", error)
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
