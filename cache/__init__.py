"""Semantic cache: embedder, per-namespace FAISS index, same-question verifier, SQLite persistence.

Heavy modules (sentence-transformers, faiss) load only when SemanticCache is first used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cache.namespace import CacheDecision, Namespace, TenantCacheSettings, namespace_for_request
from cache.types import CacheStats, Hit

if TYPE_CHECKING:
    from cache.semantic_cache import SemanticCache

__all__ = [
    "CacheDecision",
    "CacheStats",
    "Hit",
    "Namespace",
    "SemanticCache",
    "TenantCacheSettings",
    "namespace_for_request",
]


def __getattr__(name: str) -> Any:
    if name == "SemanticCache":
        from cache.semantic_cache import SemanticCache

        return SemanticCache
    raise AttributeError(name)
