"""Values that cross the cache's boundary."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Hit:
    entry_id: int
    answer: str
    usage: dict[str, Any]  # the usage recorded when the answer was generated (may hold "cost_usd")
    similarity: float  # cosine of the two prompts' embeddings
    probability: float  # the verifier's belief that both prompts ask the same question
    cached_prompt: str
    threshold: float | None = None  # the entry's threshold at the bound asked (cache/learning.py)


@dataclass(frozen=True)
class Lookup:
    """A lookup's outcome: hit (served), learning (the best candidate scored near its entry's threshold, or a would-be
    hit picked to explore: the model answers and its answer teaches the entry and its tenant), or miss."""

    state: str  # hit | learning | miss
    hit: Hit | None = None
    entry_id: int | None = None  # the candidate served or learned from
    score: float | None = None  # its verifier score
    threshold: float | None = None  # its entry's threshold at the bound asked
    explored: bool = False  # a would-be hit sent to the model on purpose, to label the tenant's threshold


@dataclass(frozen=True)
class Flagged:
    """A served answer a client reported wrong: its entry no longer serves at that score or below."""

    response_id: str
    entry_id: int
    score: float
    removed: bool  # the flagged hit was the same prompt word for word: the entry is gone
    threshold: float | None  # the entry's threshold at the default bound now (None once removed)


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    saved_prompt_tokens: int = 0
    saved_completion_tokens: int = 0
    saved_dollars: float = 0.0
    entries: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def saved_tokens(self) -> int:
        return self.saved_prompt_tokens + self.saved_completion_tokens
