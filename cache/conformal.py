"""Thresholds whose false-hit rate carries a finite-sample bound (Learn then Test, Angelopoulos et al. 2021).

A calibration set of non-duplicate pairs, scored by the verifier, stands for the questions a cache must not serve.
For each candidate threshold t (high to low) the hypothesis "the false-hit rate at t exceeds δ" is tested with the
exact binomial tail p-value P(Binomial(n, δ) ≤ k(t)), k(t) being the calibration negatives at or above t. The false-hit
rate only grows as t falls, so testing in that fixed order needs no multiplicity correction: the lowest t whose
hypothesis is rejected at level α has, with probability ≥ 1 - α over the draw of the calibration set, a false-hit rate
≤ δ on new pairs drawn like it (exchangeable with them). No threshold qualifies when n < log(α) / log(1 - δ):
2,301 negatives at δ = 0.2% and α = 1%.
"""
from __future__ import annotations

import math

import numpy as np


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k), summed in log space (n up to ~10^6)."""
    if k >= n:
        return 1.0
    i = np.arange(k + 1)
    log_terms = (math.lgamma(n + 1) - np.array([math.lgamma(x + 1) + math.lgamma(n - x + 1) for x in i])
                 + i * math.log(p) + (n - i) * math.log1p(-p))
    top = log_terms.max()
    return float(min(1.0, math.exp(top) * np.exp(log_terms - top).sum()))


def ltt_threshold(negative_scores: np.ndarray, delta: float, alpha: float = 0.05) -> float:
    """The lowest threshold (serve when score >= it) whose false-hit rate is <= delta with confidence 1 - alpha;
    +inf when the calibration set is too small to certify any."""
    s = np.sort(np.asarray(negative_scores, dtype=np.float64))[::-1]
    n = len(s)
    best = math.inf
    # candidate thresholds just above each distinct negative score, from the top down: at t just above s[j],
    # the negatives served are those strictly above s[j]
    j = 0
    while j < n:
        k = int(np.searchsorted(-s, -s[j], side="left"))  # negatives strictly above s[j]
        if binomial_cdf(k, n, delta) > alpha:
            break
        best = float(np.nextafter(s[j], math.inf))
        j = int(np.searchsorted(-s, -s[j], side="right"))
    return best


def min_negatives(delta: float, alpha: float = 0.05) -> int:
    """The fewest calibration negatives with which LTT can certify a threshold at delta (all of them below it)."""
    return math.ceil(math.log(alpha) / math.log1p(-delta))
