"""A tenant's own threshold, learned from its labelled lookups (after vCache, pooled over the tenant's entries).

The calibrated threshold (cache/bounds.py) bounds the share of QQP's non-duplicate pairs served; a tenant's traffic
is another mix (word-for-word repeats, paraphrases, unrelated questions), so that threshold usually spends a small part
of the tenant's error budget δ. This model spends the rest, with a margin for what it does not know yet:

- every lookup is counted: its best candidate's verifier score s, or none (a word-for-word repeat, no candidate);
- labelled lookups (the model answered and its answer was compared with the cached one: every `learning` lookup, and
  a share EXPLORE of would-be hits sent to the model on purpose) estimate P(wrong | s) in bins of logit(s) one unit
  wide, each a Beta posterior whose prior is the verifier's own belief (mean 1 - s at the bin's middle, PRIOR_LABELS
  labels' weight). Which lookups are labelled depends on s alone (all of them below the threshold, a share EXPLORE
  above it), so each label is weighted by the inverse of its chance of being labelled: a bin the threshold cuts
  through would otherwise be read as its labelled, riskier, lower part;
- the expected false hits per lookup at threshold t are the mean over the last HORIZON lookups of 1{s >= t} P(wrong |
  s); its upper confidence value adds Z standard deviations (the bins' posteriors, independent);
- the threshold is the lowest t (never below the bound's learning floor, never above its calibrated threshold) whose
  upper confidence value stays within the per-lookup budget: δ itself on average, or, so that the false hits of
  every window of ERROR_WINDOW lookups stay <= δ, the largest rate whose Poisson count over a window exceeds δ x
  ERROR_WINDOW with probability <= WINDOW_TAIL.

vCache (Schroeder et al., ICLR 2026) fits a sigmoid of P(correct | similarity) per cached entry. Here QQP-like traffic
has two or three wordings per question, so an entry rarely sees enough labels, and the fit is pooled per tenant; a
sigmoid in logit(s) was tried first and left: on the replay its tail stayed flat (P(wrong) ~4% even at s = 0.9999, which
the labels do not show) and its Newton steps diverged on one stream. Entries keep their own labels for blocking
(cache/learning.py): a flag stops an entry at once, whatever the pooled threshold says.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from cache.bounds import Bound

EXPLORE = 0.05  # share of would-be hits (not word-for-word repeats) the model answers anyway, to keep labels coming
HORIZON = 5000  # lookups the false-hit estimate is taken over (the latest ones)
MAX_LABELS = 4000  # labels kept (the latest)
MIN_LABELS = 50  # no learned threshold before this many labels
BIN_WIDTH = 1.0  # in logit(score)
PRIOR_LABELS = 2.0  # the verifier's belief counts as this many labels in each bin
Z = 2.326  # one-sided 99% normal quantile: the margin on the estimate
ERROR_WINDOW = 1000  # lookups over which the bound must hold (None: on average)
WINDOW_TAIL = 0.01  # the chance a window's Poisson count of false hits may exceed δ x ERROR_WINDOW
_EPS = 1e-6


def logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, _EPS, 1 - _EPS)
    return np.log(p / (1 - p))


@lru_cache(maxsize=64)
def per_lookup_budget(delta: float, window: int | None = ERROR_WINDOW) -> float:
    """The expected false hits per lookup that keep a window's count <= δ x window but with probability WINDOW_TAIL
    (Poisson counts), or δ itself when the bound is on average (window None)."""
    if window is None:
        return delta
    allowed = math.floor(delta * window)
    lo, hi = 0.0, float(allowed)
    for _ in range(50):  # the largest mean whose tail beyond `allowed` is <= WINDOW_TAIL
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if poisson_tail(allowed, mid) <= WINDOW_TAIL else (lo, mid)
    return lo / window


def poisson_tail(k: int, mean: float) -> float:
    """P(X > k) for X ~ Poisson(mean): one minus the first k + 1 terms, each from the last."""
    term = math.exp(-mean)
    total = term
    for i in range(1, int(k) + 1):
        term *= mean / i
        total += term
    return max(0.0, 1.0 - total)


def bin_of(scores: np.ndarray) -> np.ndarray:
    return np.floor(logit(scores) / BIN_WIDTH).astype(np.int64)


def wrong_posterior(labels: np.ndarray) -> dict[int, tuple[float, float]]:
    """bin -> (mean, variance) of P(wrong | score in the bin) from (score, same, weight) rows: Beta posteriors, the
    verifier's belief as prior, the labels' weighted share at their effective number (Kish's)."""
    out: dict[int, tuple[float, float]] = {}
    bins = bin_of(labels[:, 0]) if len(labels) else np.zeros(0, np.int64)
    lo, hi = int(bin_of(np.array([_EPS]))[0]), int(bin_of(np.array([1 - _EPS]))[0])
    for b in range(lo, hi + 1):
        middle = 1.0 / (1.0 + math.exp(-(b + 0.5) * BIN_WIDTH))
        here = labels[bins == b]
        w = here[:, 2]
        n_eff = float(w.sum() ** 2 / (w * w).sum()) if len(here) else 0.0
        share_wrong = float((w * (here[:, 1] == 0)).sum() / w.sum()) if len(here) else 0.0
        wrong = share_wrong * n_eff + PRIOR_LABELS * (1 - middle)
        same = (1 - share_wrong) * n_eff + PRIOR_LABELS * middle
        total = wrong + same
        out[b] = (wrong / total, wrong * same / (total * total * (total + 1)))
    return out


def learned_threshold(posterior: dict[int, tuple[float, float]], scores: np.ndarray, bound: Bound,
                      window: int | None = ERROR_WINDOW) -> float:
    """The lowest score t in [floor, calibrated threshold] whose upper confidence value of false hits per lookup is
    within the budget (the calibrated threshold when none is)."""
    budget = per_lookup_budget(bound.max_false_hit_rate, window)
    top = np.sort(scores[scores >= bound.learning_floor])[::-1]  # candidates, from the top down
    bins = bin_of(top)
    mean = np.array([posterior[b][0] for b in bins])
    risk = np.cumsum(mean) / len(scores)
    # the variance of sum_b count_b(t) p_b: count_b(t) grows by one per lookup of bin b, so the running sum of
    # (2 count - 1) var_b adds up count_b^2 var_b
    seen: dict[int, int] = {}
    steps = np.empty(len(top))
    for j, b in enumerate(bins):
        seen[b] = seen.get(b, 0) + 1
        steps[j] = (2 * seen[b] - 1) * posterior[b][1]
    ucb = risk + Z * np.sqrt(np.cumsum(steps)) / len(scores)
    best = bound.threshold
    for j in range(len(top)):
        if ucb[j] > budget:
            break
        if top[j] < best and (j + 1 == len(top) or top[j + 1] < top[j]):  # every lookup at this score counted
            best = float(top[j])
    return best


@dataclass
class TenantCalibration:
    """One tenant's lookups and labels, and the thresholds learned from them at the last refit."""

    scores: deque = field(default_factory=lambda: deque(maxlen=HORIZON))  # best score per lookup; -1: none
    labels: deque = field(default_factory=lambda: deque(maxlen=MAX_LABELS))  # (score, same question, weight)
    thresholds: dict[float, float] = field(default_factory=dict)  # δ -> learned threshold

    def observe(self, score: float | None) -> None:
        """A lookup: its best candidate's score, or None (a word-for-word repeat, no candidate): never a false hit."""
        self.scores.append(-1.0 if score is None else float(score))

    def add_label(self, score: float, same: bool, weight: float = 1.0) -> None:
        """`weight`: 1 / the chance this lookup had of being labelled (1 below the threshold, 1 / EXPLORE above)."""
        self.labels.append((float(score), bool(same), float(weight)))

    def threshold(self, bound: Bound) -> float:
        """Where this tenant's lookups are served at the bound: the learned threshold, else the calibrated one."""
        return min(bound.threshold, self.thresholds.get(bound.max_false_hit_rate, bound.threshold))

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return np.array(self.scores, dtype=np.float64), np.array(self.labels, dtype=np.float64).reshape(-1, 3)

    @staticmethod
    def refit(scores: np.ndarray, labels: np.ndarray, bounds: list[Bound],
              window: int | None = ERROR_WINDOW) -> dict[float, float]:
        """The thresholds learned from a snapshot, for each bound (none before MIN_LABELS labels). Pure: the cache
        calls it outside its lock."""
        if len(labels) < MIN_LABELS or not len(scores):
            return {}
        posterior = wrong_posterior(labels)
        return {b.max_false_hit_rate: learned_threshold(posterior, scores, b, window) for b in bounds}

    def to_json(self) -> dict:
        return {"scores": [round(s, 7) for s in self.scores], "labels": [[s, ok, w] for s, ok, w in self.labels],
                "thresholds": {str(d): t for d, t in self.thresholds.items()}}

    @classmethod
    def from_json(cls, data: dict | None) -> "TenantCalibration":
        data = data or {}
        out = cls()
        out.scores.extend(float(s) for s in data.get("scores", []))
        out.labels.extend((float(s), bool(ok), float(w)) for s, ok, w in data.get("labels", []))
        out.thresholds = {float(d): float(t) for d, t in data.get("thresholds", {}).items()}
        return out
