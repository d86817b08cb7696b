"""The false-hit bounds δ a tenant may choose and the verifier thresholds calibrated for each.

cache/false_hit_bounds.json is written by bench/calibrate_cache.py: for each offered δ, `threshold` serves a share of
non-duplicate questions <= δ with 99% confidence (cache/conformal.py), and `learning_floor` is the lowest score an
entry's learned threshold may reach (the Learn-then-Test threshold at LEARNING_FLOOR_FACTOR x δ): lookups scoring
between the floor and the entry's threshold are answered by the model and teach the entry (cache/learning.py).
A requested δ between two offered ones uses the smaller (never a looser bound than asked).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tollgate.false_hit_bounds import DEFAULT as DEFAULT_MAX_FALSE_HIT_RATE
from tollgate.false_hit_bounds import OFFERED, is_offered, offered_text

TABLE = Path(__file__).with_name("false_hit_bounds.json")
LEARNING_FLOOR_FACTOR = 4
__all__ = ["DEFAULT_MAX_FALSE_HIT_RATE", "OFFERED", "TABLE", "Bound", "FalseHitBounds", "offered_text"]


@dataclass(frozen=True)
class Bound:
    max_false_hit_rate: float  # δ
    threshold: float  # serve a verifier score >= this with no learning
    learning_floor: float  # the lowest an entry's learned threshold goes


class FalseHitBounds:
    def __init__(self, bounds: list[Bound]) -> None:
        self._bounds = sorted(bounds, key=lambda b: b.max_false_hit_rate)

    @classmethod
    def load(cls, path: Path = TABLE) -> "FalseHitBounds":
        table = json.loads(path.read_text())
        return cls([Bound(float(b["max_false_hit_rate"]), float(b["threshold"]), float(b["learning_floor"]))
                    for b in table["bounds"]])

    @classmethod
    def single(cls, threshold: float) -> "FalseHitBounds":
        """One threshold whatever δ: for a verifier the table was not calibrated for."""
        return cls([Bound(d, threshold, threshold) for d in OFFERED])

    @property
    def all(self) -> list[Bound]:
        return list(self._bounds)

    @property
    def choices(self) -> tuple[float, ...]:
        return tuple(b.max_false_hit_rate for b in self._bounds)

    def at(self, max_false_hit_rate: float | None) -> Bound:
        """The bound for a requested δ: the largest offered one not above it (None: the default)."""
        delta = DEFAULT_MAX_FALSE_HIT_RATE if max_false_hit_rate is None else max_false_hit_rate
        fitting = [b for b in self._bounds if b.max_false_hit_rate <= delta + 1e-12]
        if not fitting:
            raise ValueError(f"max_false_hit_rate: {delta:g} is below the smallest offered bound "
                             f"{self._bounds[0].max_false_hit_rate:g} (offered: {offered_text()})")
        return fitting[-1]


def check_max_false_hit_rate(value: float | None) -> float | None:
    """A δ a tenant or key may store: an offered one (ValueError naming the field otherwise)."""
    if value is None:
        return None
    if not is_offered(value):
        raise ValueError(f"cache_max_false_hit_rate: one of {offered_text()} expected, got {value!r}")
    return float(value)


@lru_cache(maxsize=1)
def shipped_bounds() -> FalseHitBounds:
    return FalseHitBounds.load()
