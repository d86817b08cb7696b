"""Per-entry thresholds that learn from labels (after vCache, Schroeder et al., ICLR 2026).

Every entry starts at its tenant's threshold: the calibrated one (cache/bounds.py), or the one learned from the
tenant's labelled lookups (cache/pooled.py). Labels come from two places:
- a lookup whose best candidate scored between the learning floor and the entry's threshold is answered by the model
  anyway; the fresh answer agreeing with the cached one (the same text, or embeddings at ANSWER_AGREEMENT or closer)
  says the two prompts asked the same thing at that score, disagreeing says they did not;
- a client flagging a served answer as wrong (POST /v1/cache/feedback) says the entry was wrong at that score.
A same-question label at score s lets the entry serve from s up (never below the learning floor): a question closer
to the entry than one known to ask the same thing is taken to ask it too. A wrong label at score w stops the entry
from serving its neighbourhood at once: every score up to w + (1 - w) / 2 (half the way from w to certainty, so the
same prompt embedded on another thread count, a few 1e-7 apart, stays blocked), and same-question labels in it no
longer count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from cache.bounds import Bound

MAX_LABELS = 32  # the most recent labels an entry keeps
WRONG_NEIGHBOURHOOD = 0.5  # a wrong label at w blocks scores up to w + this share of the distance from w to 1
# Answers at temperature 0 to the same question from the same model are nearly always the same text; this cosine
# between two answers' embeddings counts as agreement too (a reworded but equal answer).
ANSWER_AGREEMENT = 0.95


@dataclass
class EntryLabels:
    labels: list[tuple[float, bool]] = field(default_factory=list)  # (score, asked the same question)

    @property
    def wrong_max(self) -> float | None:
        wrong = [s for s, same in self.labels if not same]
        return max(wrong) if wrong else None

    @property
    def flagged_exact(self) -> bool:
        """A wrong label at the top score: the answer itself is wrong, whoever asks."""
        w = self.wrong_max
        return w is not None and w >= 1.0

    @property
    def blocked_up_to(self) -> float | None:
        """Scores up to this one are never served (a wrong label's neighbourhood)."""
        wrong = self.wrong_max
        return None if wrong is None else wrong + (1.0 - wrong) * WRONG_NEIGHBOURHOOD

    def threshold(self, bound: Bound, start: float | None = None) -> float:
        """The score from which this entry serves at the bound's δ; `start`: where its tenant's lookups are served
        before this entry's own labels count (cache/pooled.py; default the bound's calibrated threshold)."""
        blocked = self.blocked_up_to
        same = [s for s, ok in self.labels if ok and (blocked is None or s > blocked)]
        t = bound.threshold if start is None else start
        if same:
            t = min(t, max(bound.learning_floor, min(same)))
        if blocked is not None:
            t = max(t, math.nextafter(blocked, math.inf))
        return t

    def add(self, score: float, same: bool) -> None:
        self.labels.append((float(score), bool(same)))
        del self.labels[:-MAX_LABELS]

    def to_json(self) -> list[list]:
        return [[s, ok] for s, ok in self.labels]

    @classmethod
    def from_json(cls, rows: list | None) -> "EntryLabels":
        return cls([(float(s), bool(ok)) for s, ok in rows or []])


def normalized(text: str) -> str:
    return " ".join(text.split()).lower()
