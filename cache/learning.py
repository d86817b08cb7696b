"""Per-entry thresholds that learn from labels (after vCache, Schroeder et al., ICLR 2026).

Every entry starts at its tenant's calibrated threshold (cache/bounds.py). Labels come from two places:
- a lookup whose best candidate scored between the learning floor and the entry's threshold is answered by the model
  anyway; the fresh answer agreeing with the cached one (the same text, or embeddings at ANSWER_AGREEMENT or closer)
  says the two prompts asked the same thing at that score, disagreeing says they did not;
- a client flagging a served answer as wrong (POST /v1/cache/feedback) says the entry was wrong at that score.
A same-question label at score s lets the entry serve from s up (never below the learning floor): a question closer
to the entry than one known to ask the same thing is taken to ask it too. A wrong label at score w stops the entry
from serving at w or below at once, and same-question labels at or below w no longer count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from cache.bounds import Bound

MAX_LABELS = 32  # the most recent labels an entry keeps
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

    def threshold(self, bound: Bound) -> float:
        """The score from which this entry serves at the bound's δ."""
        wrong = self.wrong_max
        same = [s for s, ok in self.labels if ok and (wrong is None or s > wrong)]
        t = bound.threshold
        if same:
            t = min(t, max(bound.learning_floor, min(same)))
        if wrong is not None:
            t = max(t, math.nextafter(wrong, math.inf))
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
