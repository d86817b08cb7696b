"""The cache benchmarks' yardsticks: plain cosine's hit rate at a given number of false hits (bench/calibrate_cache.py)
and the lowest threshold that keeps every window of a replay within δ when every label is known
(bench/cache_replay.py), each against a brute-force search over every threshold."""
import numpy as np

from bench.cache_replay import WINDOW, oracle_threshold, worst_window
from bench.calibrate_cache import hit_rate_at_false_hits


def brute_force_hit_rate(scores: np.ndarray, labels: np.ndarray, false_hits: int) -> float:
    best = 0.0
    for t in np.append(np.unique(scores), np.inf):
        served = scores >= t
        if served[labels == 0].sum() <= false_hits:
            best = max(best, float(served[labels == 1].mean()))
    return best


def test_hit_rate_at_false_hits_is_the_best_any_threshold_reaches():
    rng = np.random.default_rng(7)
    for _ in range(20):
        labels = rng.random(300) < 0.4
        scores = np.round(rng.random(300) * 0.5 + 0.5 * labels, 2)  # rounded: ties between both labels
        for k in (0, 1, 5, 30):
            assert hit_rate_at_false_hits(scores, labels.astype(int), k) == round(brute_force_hit_rate(scores, labels, k), 4)


def test_oracle_threshold_is_the_lowest_that_keeps_every_window_within_the_bound():
    rng = np.random.default_rng(11)
    n = 4 * WINDOW
    scores = rng.random(n)
    right = rng.random(n) < scores  # higher scores are more often right
    for delta in (0.01, 0.05, 0.2):
        t = oracle_threshold(scores, right, delta, calibrated=0.99, floor=0.3)
        assert 0.3 <= t <= 0.99
        assert worst_window((scores >= t) & ~right) <= delta
        lower = scores[(scores >= 0.3) & (scores < t)]
        if len(lower):  # the next score down breaks a window
            assert worst_window((scores >= lower.max()) & ~right) > delta


def test_the_calibrated_threshold_stands_when_nothing_lower_is_safe():
    scores = np.array([0.5, 0.6, 0.95] * WINDOW)
    right = np.array([False, False, True] * WINDOW)
    assert oracle_threshold(scores, right, 0.01, calibrated=0.9, floor=0.4) == 0.9
    assert oracle_threshold(scores, right, 0.34, calibrated=0.9, floor=0.4) == 0.6
