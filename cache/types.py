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
