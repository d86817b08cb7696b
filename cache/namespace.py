"""Which cache namespace an OpenAI-style chat request belongs to, and whether it may be cached.

The namespace holds everything that changes the answer except the last user turn, which is the
text the cache compares semantically: tenant, model group, an exact hash of the system prompt and
earlier turns, and the sampling settings that change the output.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

# Request fields that never change the answer's text: who asks, how it is delivered, labels and hints. Every other
# field is part of the namespace, so a field added to the request models later (tools, a new sampling parameter) can
# only split namespaces, never let an answer made under other constraints be served. Absent fields hash as absent, so
# a request that sets a field to its default lands in a different namespace than one that omits it: safe.
ANSWER_NEUTRAL_FIELDS = frozenset({
    "model",  # the model group is hashed instead
    "messages",  # the earlier turns are hashed; the last user turn is what the cache compares
    "stream",
    "stream_options",
    "user",
    "safety_identifier",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
})


@dataclass(frozen=True)
class Namespace:
    tenant: str
    key: str  # hex digest of model group, context and settings; never shared across tenants


@dataclass(frozen=True)
class TenantCacheSettings:
    enabled: bool = True
    cache_sampled: bool = False  # opt-in: cache requests with temperature > 0


@dataclass(frozen=True)
class CacheDecision:
    namespace: Namespace
    prompt: str  # the last user turn: what lookup() and store() compare
    cacheable: bool
    reason: str = ""
    settings: dict[str, Any] = field(default_factory=dict)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(
            p.get("text", "") if isinstance(p, Mapping) else str(p) for p in content
        )
    return str(content)


def _has_non_text_parts(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(p, Mapping) and p.get("type", "text") != "text" for p in content
    )


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def namespace_for_request(
    tenant: str,
    model_group: str,
    request: Mapping[str, Any],
    settings: TenantCacheSettings = TenantCacheSettings(),
) -> CacheDecision:
    """Pure function: the namespace of `request` and whether the cache may serve or store it."""
    messages = list(request.get("messages") or [])
    answer_settings = {k: v for k, v in request.items() if k not in ANSWER_NEUTRAL_FIELDS and v is not None}
    last = messages[-1] if messages else {}
    prompt = _content_text(last.get("content")) if isinstance(last, Mapping) else ""
    scope: dict[str, Any] = {"model_group": model_group, "context": messages[:-1], "settings": answer_settings}
    if isinstance(last, Mapping) and set(last) - {"role", "content"}:
        scope["last_turn"] = {k: v for k, v in last.items() if k != "content"}  # e.g. the speaker's name
    digest = hashlib.sha256(_canonical(scope).encode()).hexdigest()
    ns = Namespace(tenant=tenant, key=digest)

    def decide(ok: bool, reason: str = "") -> CacheDecision:
        return CacheDecision(ns, prompt, ok, reason, answer_settings)

    if not settings.enabled:
        return decide(False, "cache disabled for tenant")
    if not messages or not isinstance(last, Mapping) or last.get("role") != "user":
        return decide(False, "last message is not a user turn")
    if _has_non_text_parts(last.get("content")):
        return decide(False, "non-text content")
    if not prompt.strip():
        return decide(False, "empty prompt")
    if int(request.get("n") or 1) != 1:
        return decide(False, "n > 1")
    if request.get("logprobs") or request.get("top_logprobs") is not None:
        return decide(False, "logprobs asked (a cached answer has none)")
    temperature = request.get("temperature")
    # OpenAI's default temperature is 1.0: an absent temperature is a sampled request.
    sampled = temperature is None or float(temperature) > 0.0
    if sampled and not settings.cache_sampled:
        return decide(False, "temperature > 0 and tenant has not opted in")
    return decide(True)
